/* The prefill top-k's k-th key searches in CUDA: `buffer_topk` (the buffer select) and `sample_kth` (the sampled
   quantile's threshold); compiled at first use by NVRTC from cand_cuda.py, which says what they do and why. One
   block a row; lane L of the row lives in thread L % blockDim.x, slot L / blockDim.x of the block's keys in dynamic
   shared memory (skey[slot * blockDim.x + thread]), so one slot's loads are coalesced across a warp and the lanes'
   order is (slot, warp, lane). */

#ifndef LPT
#define LPT 16   /* slots a thread: a row of up to LPT x blockDim.x keys */
#endif
#define NB 2048  /* the histogram's bins: the 11 key bits below the highest one where the row's keys differ */
#define CM 32    /* a bin of at most this many keys is ranked in one warp; more take bit steps first */
#define MAXW 32  /* warps a block, at most */
#define KEY(j) skey[(j) * blockDim.x + threadIdx.x]

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

struct Shared {
    int hist[NB];
    int wsum[2][MAXW];
    unsigned mn[MAXW], mx[MAXW];
    unsigned list[CM];
    int nlist;
    unsigned res[3];
    int cells[LPT * MAXW];
};

/* The K-th largest of the block's n live keys (skey, dead lanes 0; n > K), given each thread's smallest and largest
   live key: tau and the live keys above it (n_gt) and equal to it (n_eq). Every thread of the block calls it. */
__device__ void kth_key(const unsigned* skey, unsigned lo, unsigned hi, int n, int K, Shared& s, unsigned& tau,
                        int& n_gt, int& n_eq) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x, nw = T >> 5;
    for (int i = tid; i < NB; i += T) s.hist[i] = 0;
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    if (lane == 0) { s.mn[warp] = lo; s.mx[warp] = hi; }
    if (tid == 0) s.nlist = 0;
    __syncthreads();
    for (int w = 0; w < nw; ++w) { lo = min(lo, s.mn[w]); hi = max(hi, s.mx[w]); }
    /* [tau, tau | low] holds the K-th largest key and `open` keys; c_up keys are above it (< K) */
    unsigned smear = lo ^ hi;
    smear |= smear >> 1; smear |= smear >> 2; smear |= smear >> 4; smear |= smear >> 8; smear |= smear >> 16;
    unsigned low = smear;
    int c_up = 0, open = n;
    tau = lo & ~smear;
    if (smear) {
        /* one histogram of the next 11 bits (every live key shares the bits above them), then the bin holding the
           K-th: each thread sums its run of NB / T bins, a block suffix scan over the runs */
        const int sh = max(0, 31 - __clz(smear) - 10);
#pragma unroll
        for (int j = 0; j < LPT; ++j) {
            const unsigned k = KEY(j);
            if (k) atomicAdd(&s.hist[(k & smear) >> sh], 1);
        }
        __syncthreads();
        const int per = NB / T, b0 = NB - (tid + 1) * per; /* thread 0 the top run */
        int sum = 0;
        for (int i = 0; i < per; ++i) sum += s.hist[b0 + i];
        const int x = warp_incl(sum, lane);
        if (lane == 31) s.wsum[0][warp] = x;
        __syncthreads();
        int before = x - sum; /* keys in the runs above this thread's */
        for (int w = 0; w < warp; ++w) before += s.wsum[0][w];
        if (before < K && K <= before + sum) { /* this run holds the K-th: its bin, from the top */
            int acc = before, bin = b0 + per - 1;
            while (acc + s.hist[bin] < K) acc += s.hist[bin--];
            s.res[0] = (unsigned)bin; s.res[1] = (unsigned)acc; s.res[2] = (unsigned)s.hist[bin];
        }
        __syncthreads();
        tau |= s.res[0] << sh;
        c_up = (int)s.res[1];
        open = (int)s.res[2];
        low = sh ? (1u << sh) - 1u : 0u;
    }
    /* a bin of more than CM keys (exact ties, a far outlier's spread): one bit a step over its keys */
    int rb = 1;
    for (unsigned bit = (low + 1u) >> 1; bit && open > CM; bit >>= 1) {
        const unsigned cand = tau | bit;
        int c = 0;
#pragma unroll
        for (int j = 0; j < LPT; ++j) c += KEY(j) >= cand;
        c = (int)__reduce_add_sync(0xffffffffu, (unsigned)c);
        if (lane == 0) s.wsum[rb][warp] = c;
        __syncthreads();
        int tot = 0;
        for (int w = 0; w < nw; ++w) tot += s.wsum[rb][w];
        rb ^= 1;
        if (tot >= K) { open = tot - c_up; tau = cand; } else { open = c_up + open - tot; c_up = tot; }
        low = bit - 1u;
    }
    n_gt = c_up;
    n_eq = open; /* the bits ran out: the open keys all equal tau */
    if (open <= CM) { /* rank the open keys in one warp */
#pragma unroll
        for (int j = 0; j < LPT; ++j) {
            const unsigned k = KEY(j);
            if (k && (k & ~low) == tau) s.list[atomicAdd(&s.nlist, 1)] = k;
        }
        __syncthreads();
        if (warp == 0) {
            const int m = s.nlist, want = K - c_up; /* the want-th largest of the m open keys */
            const unsigned v = lane < m ? s.list[lane] : 0u;
            int gt = 0, ge = 0;
            for (int i = 0; i < m; ++i) {
                const unsigned u = __shfl_sync(0xffffffffu, v, i);
                gt += u > v;
                ge += u >= v;
            }
            if (lane < m && gt < want && want <= ge) { s.res[0] = v; s.res[1] = c_up + gt; s.res[2] = ge - gt; }
        }
        __syncthreads();
        tau = s.res[0]; n_gt = (int)s.res[1]; n_eq = (int)s.res[2];
    }
}

/* buf [B, *, C] int64 entries in key order (high word: the score's fp32 bits when raw, else its order-preserving
   key; low word: the key's position), nrow [B, *] entries a row (-1: not served, skipped) -> out [B, Tc, K] int32:
   the positions of the row's K largest entries (later lanes win ties), ascending, or every entry and -1 after
   them where a row holds at most K. Strides in elements. */
extern "C" __global__ void __launch_bounds__(1024, 2) buffer_topk(
        const unsigned* __restrict__ buf, const int* __restrict__ nrow, int* __restrict__ out, int Tc, int svb,
        int svt, int snb, int sob, int sot, int K, int raw) {
    __shared__ Shared s;
    extern __shared__ unsigned skey[];
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
    unsigned lo = 0xFFFFFFFFu, hi = 0u;
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const int L = j * T + tid;
        unsigned k = 0u; /* a dead lane: below every live key (okey of a score is > 0) */
        if (L < n) {
            const unsigned h = base[2 * L + 1];
            k = raw ? okey_bits(h) : h;
            lo = min(lo, k);
            hi = max(hi, k);
        }
        KEY(j) = k;
    }
    unsigned tau;
    int n_gt, n_eq;
    kth_key(skey, lo, hi, n, K, s, tau, n_gt, n_eq);
    /* the write: keys above tau, and the last K - n_gt of the n_eq keys equal to it (the first `drop` dropped);
       each (slot, warp) cell's counts packed as (above << 16) | equal, scanned once in lane order */
    const int drop = n_eq - (K - n_gt);
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const unsigned k = KEY(j);
        const unsigned bg = __ballot_sync(0xffffffffu, k > tau), be = __ballot_sync(0xffffffffu, k == tau);
        if (lane == 0) s.cells[j * nw + warp] = (__popc(bg) << 16) | __popc(be);
    }
    __syncthreads();
    if (warp == 0) { /* exclusive scan of the LPT * nw cells: each lane a run of consecutive cells */
        const int nc = LPT * nw, per = (nc + 31) / 32, c0 = lane * per;
        int sum = 0;
        for (int c = c0; c < min(nc, c0 + per); ++c) sum += s.cells[c];
        int x = warp_incl(sum, lane) - sum;
        for (int c = c0; c < min(nc, c0 + per); ++c) { const int v = s.cells[c]; s.cells[c] = x; x += v; }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < LPT; ++j) {
        const unsigned k = KEY(j);
        const bool g = k > tau, e = k == tau;
        const unsigned bg = __ballot_sync(0xffffffffu, g), be = __ballot_sync(0xffffffffu, e);
        const int off = s.cells[j * nw + warp];
        const int above = (off >> 16) + __popc(bg & lt), eq = (off & 0xFFFF) + __popc(be & lt);
        if (g || (e && eq >= drop)) obase[above + max(0, eq - drop)] = (int)base[2 * (j * T + tid)];
    }
}

/* `cand_topk._quantile_kernel` in CUDA: th [B, Tc] fp32, each row's threshold: the m-th largest of its sampled
   scores smp [B, *, SW] (-inf where a key is forced or not visible; columns past pos / R not read),
   m = max(1, ceil(E * (K - forced) * sampled / (visible - forced))) in the Triton kernel's fp32 arithmetic (its
   division is PTX div.full.f32); -inf for rows of <= C visible keys or with at most m samples, +inf where the
   forced keys fill K. */
extern "C" __global__ void __launch_bounds__(1024, 2) sample_kth(
        const float* __restrict__ smp, const int* __restrict__ kvs, float* __restrict__ th, int spb, int spt,
        int stb, int Tc, int S, int t0, int q_offset, int sink, int window, int K, int C, double E, int SW, int R) {
    __shared__ Shared s;
    extern __shared__ unsigned skey[];
    const int row = blockIdx.x;
    const int b = row / Tc, t = row % Tc;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = blockDim.x, nw = T >> 5;
    const int start = kvs[b], pos = q_offset + t0 + t;
    const int nvis = max(min(pos, S - 1) - start + 1, 0), nf = min(nvis, sink + window), kk = K - nf;
    float out = -__int_as_float(0x7f800000); /* -inf */
    if (nvis > C) {
        if (kk <= 0) {
            out = __int_as_float(0x7f800000);
        } else {
            const float* base = smp + (long long)b * spb + (long long)t * spt;
            const int lim = min(pos / R + 1, SW);
            unsigned lo = 0xFFFFFFFFu, hi = 0u;
            int ns = 0;
#pragma unroll
            for (int j = 0; j < LPT; ++j) {
                const int L = j * T + tid;
                unsigned k = 0u;
                if (L < lim) {
                    const float x = base[L];
                    if (x > -__int_as_float(0x7f800000)) {
                        k = okey_bits(__float_as_uint(x));
                        lo = min(lo, k);
                        hi = max(hi, k);
                        ++ns;
                    }
                }
                KEY(j) = k;
            }
            ns = (int)__reduce_add_sync(0xffffffffu, (unsigned)ns);
            if (lane == 0) s.wsum[1][warp] = ns;
            __syncthreads();
            ns = 0;
            for (int w = 0; w < nw; ++w) ns += s.wsum[1][w];
            const float num = ((float)E * (float)kk) * (float)ns;
            float q;
            asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(num), "f"((float)(nvis - nf)));
            const int m = max((int)ceilf(q), 1);
            if (ns > m) {
                unsigned tau;
                int n_gt, n_eq;
                kth_key(skey, lo, hi, ns, m, s, tau, n_gt, n_eq);
                out = __uint_as_float((tau >> 31) ? (tau & 0x7FFFFFFFu) : ~tau);
            }
        }
    }
    if (tid == 0) th[(long long)b * stb + t] = out;
}
