/* The prefill top-k's buffer select (`buffer_topk`): compiled at first use by NVRTC from cand_cuda.py, which says
   what it does and why. One block a row; lane L of the row's buffer lives in thread L % blockDim.x, register slot
   L / blockDim.x, so one slot's loads are coalesced across a warp and the lanes' order is (slot, warp, lane). */

#ifndef LPT
#define LPT 16  /* register slots a thread: a row of up to LPT x blockDim.x buffer entries */
#endif
#define DB 4    /* bits of the key a search step decides */
#define CM 32   /* the bit search stops once at most this many keys are open; one warp ranks them */
#define MAXW 32 /* warps a block, at most */

__device__ __forceinline__ unsigned okey_bits(unsigned u) {
    if (u == 0x80000000u) u = 0u; /* -0.0 equals +0.0 */
    return (u >> 31) ? ~u : (u | 0x80000000u);
}

/* buf [B, *, C] int64 entries in key order (high word: the score's fp32 bits when raw, else its order-preserving
   key; low word: the key's position), nrow [B, *] entries a row (-1: not served, skipped) -> out [B, Tc, K] int32:
   the positions of the row's K largest entries (later lanes win ties), ascending, or every entry and -1 after
   them where a row holds at most K. Strides in elements. */
extern "C" __global__ void __launch_bounds__(1024) buffer_topk(
        const unsigned* __restrict__ buf, const int* __restrict__ nrow, int* __restrict__ out, int Tc, int svb,
        int svt, int snb, int sob, int sot, int K, int raw) {
    __shared__ unsigned hred[2][MAXW][8];
    __shared__ unsigned mn[MAXW], mx[MAXW];
    __shared__ unsigned list[CM];
    __shared__ int nlist;
    __shared__ unsigned res[3];
    __shared__ int cells[LPT * MAXW];
    const int row = blockIdx.x;
    const int b = row / Tc, t = row % Tc;
    const int n = nrow[(long long)b * snb + t];
    if (n < 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x, nw = T >> 5;
    const unsigned* base = buf + 2 * ((long long)b * svb + (long long)t * svt); /* 32-bit words: lo, hi */
    int* obase = out + (long long)b * sob + (long long)t * sot;
    if (n <= K) { /* every entry kept, in lane order */
        for (int L = tid; L < n; L += T) obase[L] = (int)base[2 * L];
        for (int L = n + tid; L < K; L += T) obase[L] = -1;
        return;
    }
    unsigned key[LPT];
    unsigned lo = 0xFFFFFFFFu, hi = 0u;
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const int L = j * T + tid;
        key[j] = 0u; /* a dead lane: below every live key (okey of a score is > 0) */
        if (L < n) {
            const unsigned h = base[2 * L + 1];
            key[j] = raw ? okey_bits(h) : h;
            lo = min(lo, key[j]);
            hi = max(hi, key[j]);
        }
    }
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    if (lane == 0) { mn[warp] = lo; mx[warp] = hi; }
    if (tid == 0) nlist = 0;
    __syncthreads();
    for (int w = 0; w < nw; ++w) { lo = min(lo, mn[w]); hi = max(hi, mx[w]); }
    /* the K-th largest key, DB bits a step from the highest bit where the live keys differ: [tau, tau | low]
       holds it and `open` keys, c_up keys are above it (< K); each step counts the open keys' next digit in
       per-thread byte counters (two 64-bit words, 16 bins), sums them as 16-bit pairs over the warp and the block,
       and keeps the digit holding the K-th */
    unsigned smear = lo ^ hi;
    smear |= smear >> 1; smear |= smear >> 2; smear |= smear >> 4; smear |= smear >> 8; smear |= smear >> 16;
    unsigned tau = lo & ~smear, low = smear;
    int c_up = 0, open = n, rb = 0;
    while (low && open > CM) {
        const int sh = max(0, 31 - __clz(low) - (DB - 1)); /* the digit: bits sh.. of the undecided ones */
        const unsigned dm = low >> sh;
        unsigned long long c0 = 0ull, c1 = 0ull;
#pragma unroll
        for (int j = 0; j < LPT; ++j) {
            const unsigned d = (key[j] >> sh) & dm;
            const unsigned long long inc = (key[j] && (key[j] & ~low) == tau) ? 1ull << ((d & 7u) * 8u) : 0ull;
            c0 += d < 8u ? inc : 0ull;
            c1 += d < 8u ? 0ull : inc;
        }
        unsigned wv[8];
        wv[0] = (unsigned)c0 & 0x00FF00FFu; wv[1] = ((unsigned)c0 >> 8) & 0x00FF00FFu;
        wv[2] = (unsigned)(c0 >> 32) & 0x00FF00FFu; wv[3] = ((unsigned)(c0 >> 32) >> 8) & 0x00FF00FFu;
        wv[4] = (unsigned)c1 & 0x00FF00FFu; wv[5] = ((unsigned)c1 >> 8) & 0x00FF00FFu;
        wv[6] = (unsigned)(c1 >> 32) & 0x00FF00FFu; wv[7] = ((unsigned)(c1 >> 32) >> 8) & 0x00FF00FFu;
#pragma unroll
        for (int i = 0; i < 8; ++i) wv[i] = __reduce_add_sync(0xffffffffu, wv[i]);
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) hred[rb][warp][i] = wv[i];
        }
        __syncthreads();
        unsigned sw[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        for (int w = 0; w < nw; ++w) {
#pragma unroll
            for (int i = 0; i < 8; ++i) sw[i] += hred[rb][w][i];
        }
        rb ^= 1;
        int acc = c_up, dstar = -1, cnt = 0;
#pragma unroll
        for (int bb = 15; bb >= 0; --bb) { /* bin bb: word (bb / 8) * 4 + (bb % 8 / 4) * 2 + bb % 2, half bb / 2 % 2 */
            const int c = (int)((sw[(bb >> 3) * 4 + ((bb & 7) >> 2) * 2 + (bb & 1)] >> (16 * ((bb >> 1) & 1))) & 0xFFFFu);
            if (dstar < 0) {
                if (acc + c >= K) { dstar = bb; cnt = c; } else { acc += c; }
            }
        }
        c_up = acc;
        open = cnt;
        tau |= (unsigned)dstar << sh;
        low = sh ? (1u << sh) - 1u : 0u;
    }
    int n_gt = c_up, n_eq = open; /* the search ran to its last bit: the open keys all equal tau */
    if (open <= CM) { /* rank the open keys in one warp */
#pragma unroll
        for (int j = 0; j < LPT; ++j)
            if (key[j] && (key[j] & ~low) == tau) list[atomicAdd(&nlist, 1)] = key[j];
        __syncthreads();
        if (warp == 0) {
            const int m = nlist, want = K - c_up; /* the want-th largest of the m open keys */
            const unsigned v = lane < m ? list[lane] : 0u;
            int gt = 0, ge = 0;
            for (int i = 0; i < m; ++i) {
                const unsigned u = __shfl_sync(0xffffffffu, v, i);
                gt += u > v;
                ge += u >= v;
            }
            if (lane < m && gt < want && want <= ge) { res[0] = v; res[1] = c_up + gt; res[2] = ge - gt; }
        }
        __syncthreads();
        tau = res[0]; n_gt = (int)res[1]; n_eq = (int)res[2];
    }
    /* the write: keys above tau, and the last K - n_gt of the n_eq keys equal to it (the first `drop` dropped);
       each (slot, warp) cell's counts packed as (above << 16) | equal, scanned once in lane order */
    const int drop = n_eq - (K - n_gt);
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const unsigned bg = __ballot_sync(0xffffffffu, key[j] > tau), be = __ballot_sync(0xffffffffu, key[j] == tau);
        if (lane == 0) cells[j * nw + warp] = (__popc(bg) << 16) | __popc(be);
    }
    __syncthreads();
    if (warp == 0) { /* exclusive scan of the LPT * nw cells: each lane a run of consecutive cells */
        const int nc = LPT * nw, per = (nc + 31) / 32, c0 = lane * per;
        int s = 0;
        for (int c = c0; c < min(nc, c0 + per); ++c) s += cells[c];
        int x = s;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        x -= s;
        for (int c = c0; c < min(nc, c0 + per); ++c) { const int v = cells[c]; cells[c] = x; x += v; }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const bool g = key[j] > tau, e = key[j] == tau;
        const unsigned bg = __ballot_sync(0xffffffffu, g), be = __ballot_sync(0xffffffffu, e);
        const int off = cells[j * nw + warp];
        const int above = (off >> 16) + __popc(bg & lt), eq = (off & 0xFFFF) + __popc(be & lt);
        if (g || (e && eq >= drop)) obase[above + max(0, eq - drop)] = (int)base[2 * (j * T + tid)];
    }
}
