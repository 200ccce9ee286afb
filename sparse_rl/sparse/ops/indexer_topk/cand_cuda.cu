/* The prefill top-k's buffer select (`buffer_topk`): compiled at first use by NVRTC from cand_cuda.py, which says
   what it does and why. One block a row; lane L of the row's buffer lives in thread L % blockDim.x, register slot
   L / blockDim.x, so one slot's loads are coalesced across a warp and the lanes' order is (slot, warp, lane). */

#ifndef LPT
#define LPT 16   /* register slots a thread: a row of up to LPT x blockDim.x buffer entries */
#endif
#define NB 2048  /* the histogram's bins: the 11 key bits below the highest one where the row's keys differ */
#define CM 32    /* a bin of at most this many keys is ranked in one warp; more take bit steps first */
#define MAXW 32  /* warps a block, at most */
#ifdef KEYS_SMEM /* the keys in dynamic shared memory (LPT x blockDim.x words): fewer registers, more blocks an SM */
#define KEY(j) skey[(j) * T + tid]
#define MINB 2   /* 32 registers a thread: 2048 threads an SM */
#else
#define KEY(j) key[j]
#define MINB 1
#endif

__device__ __forceinline__ unsigned okey_bits(unsigned u) {
    if (u == 0x80000000u) u = 0u; /* -0.0 equals +0.0 */
    return (u >> 31) ? ~u : (u | 0x80000000u);
}

/* inclusive scan over the 32 lanes */
__device__ __forceinline__ int warp_incl(int x, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

/* buf [B, *, C] int64 entries in key order (high word: the score's fp32 bits when raw, else its order-preserving
   key; low word: the key's position), nrow [B, *] entries a row (-1: not served, skipped) -> out [B, Tc, K] int32:
   the positions of the row's K largest entries (later lanes win ties), ascending, or every entry and -1 after
   them where a row holds at most K. Strides in elements. */
extern "C" __global__ void __launch_bounds__(1024, MINB) buffer_topk(
        const unsigned* __restrict__ buf, const int* __restrict__ nrow, int* __restrict__ out, int Tc, int svb,
        int svt, int snb, int sob, int sot, int K, int raw) {
    __shared__ int hist[NB];
    __shared__ int wsum[2][MAXW];
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
    /* 1. the keys into registers (or shared memory), the row's smallest and largest */
#ifdef KEYS_SMEM
    extern __shared__ unsigned skey[];
#else
    unsigned key[LPT];
#endif
    unsigned lo = 0xFFFFFFFFu, hi = 0u;
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const int L = j * T + tid;
        KEY(j) = 0u; /* a dead lane: below every live key (okey of a score is > 0) */
        if (L < n) {
            const unsigned h = base[2 * L + 1];
            KEY(j) = raw ? okey_bits(h) : h;
            lo = min(lo, KEY(j));
            hi = max(hi, KEY(j));
        }
    }
    for (int i = tid; i < NB; i += T) hist[i] = 0;
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    if (lane == 0) { mn[warp] = lo; mx[warp] = hi; }
    if (tid == 0) nlist = 0;
    __syncthreads();
    for (int w = 0; w < nw; ++w) { lo = min(lo, mn[w]); hi = max(hi, mx[w]); }
    /* [tau, tau | low] holds the K-th largest key and `open` keys; c_up keys are above it (< K) */
    unsigned smear = lo ^ hi;
    smear |= smear >> 1; smear |= smear >> 2; smear |= smear >> 4; smear |= smear >> 8; smear |= smear >> 16;
    unsigned tau = lo & ~smear, low = smear;
    int c_up = 0, open = n;
    if (smear) {
        /* 2. one histogram of the next 11 bits (every live key shares the bits above them), then the bin holding
           the K-th: each thread sums its run of NB / T bins, a block suffix scan over the runs */
        const int sh = max(0, 31 - __clz(smear) - 10);
#pragma unroll
        for (int j = 0; j < LPT; ++j)
            if (KEY(j)) atomicAdd(&hist[(KEY(j) & smear) >> sh], 1);
        __syncthreads();
        const int per = NB / T, b0 = NB - (tid + 1) * per; /* thread 0 the top run */
        int s = 0;
        for (int i = 0; i < per; ++i) s += hist[b0 + i];
        const int x = warp_incl(s, lane);
        if (lane == 31) wsum[0][warp] = x;
        __syncthreads();
        int before = x - s; /* keys in the runs above this thread's */
        for (int w = 0; w < warp; ++w) before += wsum[0][w];
        if (before < K && K <= before + s) { /* this run holds the K-th: find its bin, from the top */
            int acc = before, bin = b0 + per - 1;
            while (acc + hist[bin] < K) acc += hist[bin--];
            res[0] = (unsigned)bin; res[1] = (unsigned)acc; res[2] = (unsigned)hist[bin];
        }
        __syncthreads();
        tau |= res[0] << sh;
        c_up = (int)res[1];
        open = (int)res[2];
        low = sh ? (1u << sh) - 1u : 0u;
    }
    /* 3. a bin of more than CM keys (exact ties, a dense bin): one bit a step over its keys */
    int rb = 1;
    for (unsigned bit = (low + 1u) >> 1; bit && open > CM; bit >>= 1) {
        const unsigned cand = tau | bit;
        int c = 0;
#pragma unroll
        for (int j = 0; j < LPT; ++j) c += KEY(j) >= cand;
        c = (int)__reduce_add_sync(0xffffffffu, (unsigned)c);
        if (lane == 0) wsum[rb][warp] = c;
        __syncthreads();
        int tot = 0;
        for (int w = 0; w < nw; ++w) tot += wsum[rb][w];
        rb ^= 1;
        if (tot >= K) { open = tot - c_up; tau = cand; } else { open = c_up + open - tot; c_up = tot; }
        low = bit - 1u;
    }
    int n_gt = c_up, n_eq = open; /* the bits ran out: the open keys all equal tau */
    if (open <= CM) { /* 4. rank the open keys in one warp */
#pragma unroll
        for (int j = 0; j < LPT; ++j)
            if (KEY(j) && (KEY(j) & ~low) == tau) list[atomicAdd(&nlist, 1)] = KEY(j);
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
    /* 5. the write: keys above tau, and the last K - n_gt of the n_eq keys equal to it (the first `drop` dropped);
       each (slot, warp) cell's counts packed as (above << 16) | equal, scanned once in lane order */
    const int drop = n_eq - (K - n_gt);
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const unsigned bg = __ballot_sync(0xffffffffu, KEY(j) > tau), be = __ballot_sync(0xffffffffu, KEY(j) == tau);
        if (lane == 0) cells[j * nw + warp] = (__popc(bg) << 16) | __popc(be);
    }
    __syncthreads();
    if (warp == 0) { /* exclusive scan of the LPT * nw cells: each lane a run of consecutive cells */
        const int nc = LPT * nw, per = (nc + 31) / 32, c0 = lane * per;
        int s = 0;
        for (int c = c0; c < min(nc, c0 + per); ++c) s += cells[c];
        int x = warp_incl(s, lane) - s;
        for (int c = c0; c < min(nc, c0 + per); ++c) { const int v = cells[c]; cells[c] = x; x += v; }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const bool g = KEY(j) > tau, e = KEY(j) == tau;
        const unsigned bg = __ballot_sync(0xffffffffu, g), be = __ballot_sync(0xffffffffu, e);
        const int off = cells[j * nw + warp];
        const int above = (off >> 16) + __popc(bg & lt), eq = (off & 0xFFFF) + __popc(be & lt);
        if (g || (e && eq >= drop)) obase[above + max(0, eq - drop)] = (int)base[2 * (j * T + tid)];
    }
}
