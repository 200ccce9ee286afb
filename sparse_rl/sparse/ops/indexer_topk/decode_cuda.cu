/* The decode select's CUDA kernel (`row_topk`): compiled at first use by NVRTC from decode_cuda.py, which says
   what it does and why. */

#define NT 1024
#define NW 32
#define NB 2048   /* the first level's slots: NL linear bins and two slots at the bin holding 0 (xbin) */
#define NL (NB - 2)
#define CMAX 1024 /* candidates ranked in shared memory; more take the radix levels */
#define RANK_DIRECT 128 /* lists of at most this many: each key ranked by one thread; longer: a bitonic sort */
#define MAXC 8    /* the most blocks a row (a portable cluster) */
#define UNEG 0x007FFFFFu /* okey(-inf): keys at or below it are not visible */
#define UPOS 0xFF800000u /* okey(+inf): the forced keys */
#define UZERO 0x80000000u /* okey(0.0) */

__device__ __forceinline__ unsigned okey(float x) {
    unsigned u = __float_as_uint(x == 0.0f ? 0.0f : x);  /* -0.0 equals +0.0 */
    return (u >> 31) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float okey_inv(unsigned u) {
    return __uint_as_float((u >> 31) ? (u & 0x7FFFFFFFu) : ~u);
}

/* inclusive scan over the 32 lanes */
__device__ __forceinline__ int warp_incl(int x, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

/* exclusive block scan of one int per thread, in thread order */
__device__ __forceinline__ int block_excl(int v, int* wsum) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int x = warp_incl(v, lane);
    if (lane == 31) wsum[wid] = x;
    __syncthreads();
    if (wid == 0) {
        int s = wsum[lane];
        wsum[lane] = warp_incl(s, lane) - s;
    }
    __syncthreads();
    int r = x - v + wsum[wid];
    __syncthreads();  /* wsum may be reused */
    return r;
}

__device__ __forceinline__ unsigned key_at(const float* row, const unsigned* cache, bool cached, int i, int n) {
    if (i >= n) return 0u;  /* past the part: below every visible key */
    return cached ? cache[i] : okey(row[i]);
}

/* the linear bin of a finite key: linear in the score over [mn, mn + NL / scale] (monotone: a larger score
   never takes a lower bin) */
__device__ __forceinline__ int lin_bin(unsigned u, float mn, float scale) {
    float t = (okey_inv(u) - mn) * scale;
    return t >= (float)(NL - 1) ? NL - 1 : (int)t;
}

/* the first level's slot of a finite key: its linear bin, past two slots inserted at the bin z0 holding 0.0
   (z0: that bin's negative keys, z0 + 1: the exact zeros, z0 + 2: its positive keys); monotone. Why: ~6% of a
   ReLU row's scores are exact zeros, and when the k-th largest is one of them (rows whose head weights are
   mostly negative) a bin holding them would make a list of ~1,000 equal keys to rank (session 27, call 1);
   their own slot is resolved at once. */
__device__ __forceinline__ int xbin(unsigned u, float mn, float scale, int z0) {
    int b = lin_bin(u, mn, scale);
    return b < z0 ? b : (b > z0 ? b + 2 : (u > UZERO ? z0 + 2 : (u == UZERO ? z0 + 1 : z0)));
}

/* ---- the cluster: the blocks of one row exchange through distributed shared memory (sm_90+); below sm_90 every
   row is a cluster of one block and these are the block's own shared memory and barrier ---- */
__device__ __forceinline__ void cl_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

/* the split form of the first barrier: arrive at the kernel's start, wait before the first remote access (every
   block of the cluster has then started) */
__device__ __forceinline__ void cl_arrive_early() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

/* the address of the shared variable p in the block of cluster rank q */
__device__ __forceinline__ unsigned cl_addr(const void* p, unsigned q) {
    unsigned r;
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .u64 g;\n\t.reg .u32 l;\n\tcvta.to.shared.u64 g, %1;\n\tcvt.u32.u64 l, g;\n\t"
                 "mapa.shared::cluster.u32 %0, l, %2;\n\t}" : "=r"(r) : "l"(p), "r"(q));
#else
    asm volatile("{\n\t.reg .u64 g;\n\tcvta.to.shared.u64 g, %1;\n\tcvt.u32.u64 %0, g;\n\t}" : "=r"(r) : "l"(p));
#endif
    return r;
}

#if __CUDA_ARCH__ >= 900
#define CL_SPACE "shared::cluster"
#else
#define CL_SPACE "shared"
#endif

__device__ __forceinline__ unsigned cl_ld(unsigned a) {
    unsigned v;
    asm volatile("ld." CL_SPACE ".u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}

__device__ __forceinline__ void cl_st(unsigned a, unsigned v) {
    asm volatile("st." CL_SPACE ".u32 [%0], %1;" :: "r"(a), "r"(v) : "memory");
}

__device__ __forceinline__ void cl_st64(unsigned a, unsigned long long v) {
    asm volatile("st." CL_SPACE ".u64 [%0], %1;" :: "r"(a), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned cl_add(unsigned a, unsigned v) {
    unsigned old;
    asm volatile("atom." CL_SPACE ".add.u32 %0, [%1], %2;" : "=r"(old) : "r"(a), "r"(v) : "memory");
    return old;
}

/* Find the slot (of nb, thread t holding slots nb-1-2t and nb-2-2t with counts chi, clo) holding the rem-th
   largest counted key: sh[0] = the slot, sh[1] = the rank left inside it, sh[2] = its count. */
__device__ __forceinline__ void pick_bin_counts(int chi, int clo, int nb, int rem, int* wsum, int* sh) {
    const int tid = threadIdx.x;
    int hi = nb - 1 - 2 * tid, lo = nb - 2 - 2 * tid;
    int above = block_excl(chi + clo, wsum);
    if (hi >= 0 && above < rem && rem <= above + chi) {
        sh[0] = hi; sh[1] = rem - above; sh[2] = chi;
    } else if (lo >= 0 && above + chi < rem && rem <= above + chi + clo) {
        sh[0] = lo; sh[1] = rem - above - chi; sh[2] = clo;
    }
    __syncthreads();
}

/* pick_bin_counts over every rank's hist summed (read from their shared memory) */
__device__ __forceinline__ void cl_pick(const int* hist, int nb, int rem, unsigned C, int* wsum, int* sh) {
    int hi = nb - 1 - 2 * (int)threadIdx.x, lo = hi - 1, chi = 0, clo = 0;
    for (unsigned q = 0; q < C; q++) {
        if (hi >= 0) chi += (int)cl_ld(cl_addr(&hist[hi], q));
        if (lo >= 0) clo += (int)cl_ld(cl_addr(&hist[lo], q));
    }
    pick_bin_counts(chi, clo, nb, rem, wsum, sh);
}

/* the rem-th largest key of the c entries of cand (key << 32 | tag; c <= CMAX): sh[5] = that key T,
   sh[6] = rem - (keys above T), sh[7] = keys equal to T. Every thread calls it. */
__device__ __forceinline__ void rank_list(unsigned long long* cand, int c, int rem, int* sh) {
    const int tid = threadIdx.x;
    if (c <= RANK_DIRECT) {
        if (tid < c) {
            unsigned me = (unsigned)(cand[tid] >> 32);
            int gt = 0, eq = 0;
            for (int i = 0; i < c; i++) {
                unsigned v = (unsigned)(cand[i] >> 32);
                gt += v > me;
                eq += v == me;
            }
            if (gt < rem && rem <= gt + eq) { sh[5] = (int)me; sh[6] = rem - gt; sh[7] = eq; }
        }
        __syncthreads();
        return;
    }
    int P = RANK_DIRECT;
    while (P < c) P <<= 1;
    for (int i = c + tid; i < P; i += NT) cand[i] = 0ull;  /* below every visible key */
    __syncthreads();
    for (int k = 2; k <= P; k <<= 1) {  /* bitonic sort, descending */
        for (int j = k >> 1; j > 0; j >>= 1) {
            int x = tid ^ j;
            if (tid < P && x > tid) {
                unsigned long long a = cand[tid], b = cand[x];
                if ((tid & k) == 0 ? a < b : a > b) { cand[tid] = b; cand[x] = a; }
            }
            __syncthreads();
        }
    }
    const unsigned T = (unsigned)(cand[rem - 1] >> 32);
    if (tid < c && (unsigned)(cand[tid] >> 32) == T) {
        if (tid == 0 || (unsigned)(cand[tid - 1] >> 32) != T) sh[3] = tid;      /* the first key equal to T */
        if (tid == c - 1 || (unsigned)(cand[tid + 1] >> 32) != T) sh[4] = tid;  /* the last */
    }
    __syncthreads();
    if (tid == 0) { sh[5] = (int)T; sh[6] = rem - sh[3]; sh[7] = sh[4] - sh[3] + 1; }
    __syncthreads();
}

/* warp 0: the block's totals of a and q (one int a warp) to slot xa[r] / xq[r] of every rank */
__device__ __forceinline__ void publish2(const int* a, const int* q, int* xa, int* xq, unsigned r, unsigned C) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        int sa = __reduce_add_sync(0xffffffffu, (unsigned)a[lane]);
        int sq = __reduce_add_sync(0xffffffffu, (unsigned)q[lane]);
        if ((unsigned)lane < C) {
            cl_st(cl_addr(&xa[r], lane), (unsigned)sa);
            cl_st(cl_addr(&xq[r], lane), (unsigned)sq);
        }
    }
}

/* The select of one row's top K keys by a cluster of C blocks (C = 1: a plain launch). Block rank r holds the
   row's r-th part (32-key multiples) in shared memory as order-preserving keys. Modes: every visible key kept
   (all), only forced keys (rem <= 0), the k-th key in the zeros' slot, in a slot of at most CMAX keys (listed and
   ranked), or in a larger slot (three radix levels, then a counting pass). */
extern "C" __global__ void __launch_bounds__(NT, 1)
row_topk(const float* __restrict__ sc, const float* __restrict__ span, const int* __restrict__ pos_p,
         int* __restrict__ out, int S, int K, int sob, int cache_keys, int chunk, int nchunks, int pdl) {
    extern __shared__ unsigned cache[];
    __shared__ int hist[NB];
    __shared__ unsigned long long cand[CMAX];
    __shared__ int wsum[NW], wv[NW], wf[NW], wa[NW], wq[NW];
    __shared__ int xv[MAXC], xf[MAXC], xa[MAXC], xq[MAXC];
    __shared__ int sh[8], low[2];
    __shared__ unsigned ccount;
    __shared__ float fsp[2];
    cl_arrive_early();
#if __CUDA_ARCH__ >= 900
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    unsigned C, r;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(C));
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#else
    const unsigned C = 1, r = 0;
#endif
    const int b = blockIdx.x / C, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int pos = pos_p[b];
    const int nrow = min(pos + 1, S);
    const int part = ((nrow + (int)C * 32 - 1) / ((int)C * 32)) * 32;  /* rank r holds [b0, b0 + n) */
    const int b0 = (int)r * part, n = max(0, min(part, nrow - b0));
    const float* row = sc + (size_t)b * S + b0;
    int* orow = out + (size_t)b * sob;
    const bool cached = n <= cache_keys;
    const int seg = ((n + NT - 1) / NT) * 32;  /* warp wid walks [seg0, seg0 + seg), 32 keys a step */
    const int seg0 = wid * seg;
    const unsigned lt = (1u << lane) - 1u;
    for (int j = tid; j < NB; j += NT) hist[j] = 0;
    if (tid == 0) { ccount = 0u; low[0] = 0; low[1] = 0; }
    if (wid == 0) {  /* the row's largest and smallest finite unforced score, from the score pass's chunks */
        float mx = __int_as_float(0xff800000), mn = __int_as_float(0x7f800000);
        for (int p = lane; p < nchunks && p * chunk <= pos; p += 32) {
            mx = fmaxf(mx, span[((size_t)b * nchunks + p) * 2]);
            mn = fminf(mn, span[((size_t)b * nchunks + p) * 2 + 1]);
        }
        for (int o = 16; o > 0; o >>= 1) {
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        }
        if (lane == 0) { fsp[0] = mn; fsp[1] = mx; }
    }
    __syncthreads();
    const float mn = fsp[0], mx = fsp[1];
    float scale = mx > mn ? (float)NL / (mx - mn) : 0.0f;
    if (!(scale < 3.0e38f)) scale = 0.0f;  /* a span too narrow or too wide for fp32 (or no finite key): one bin */
    const int z0 = mx >= mn ? lin_bin(UZERO, mn, scale) : 0;  /* in [0, NL) wherever the row holds a zero */

    /* 1. this part's keys to the cache, its visible and forced counts (per warp), the first level's histogram */
    unsigned nv = 0, nf = 0;
    int zc = 0;
    for (int j = 0; j < seg; j += 256) {
        float x[8];
#pragma unroll
        for (int q = 0; q < 8; q++) {
            int i = seg0 + j + q * 32 + lane;
            x[q] = (j + q * 32 < seg && i < n) ? row[i] : __int_as_float(0xff800000);
        }
#pragma unroll
        for (int q = 0; q < 8; q++) {
            int i = seg0 + j + q * 32 + lane;
            unsigned u = okey(x[q]);
            if (cached && j + q * 32 < seg && i < n) cache[i] = u;
            bool vis = u > UNEG, forced = u >= UPOS, fin = vis && !forced;
            nv += vis;
            nf += forced;
            if (fin && u != UZERO) atomicAdd(&hist[xbin(u, mn, scale, z0)], 1);
            zc += __popc(__ballot_sync(0xffffffffu, fin && u == UZERO));  /* one hot word: by ballot */
        }
    }
    nv = __reduce_add_sync(0xffffffffu, nv);
    nf = __reduce_add_sync(0xffffffffu, nf);
    if (lane == 0) {
        wv[wid] = (int)nv;
        wf[wid] = (int)nf;
        if (zc) atomicAdd(&hist[z0 + 1], zc);
    }
    __syncthreads();
    cl_wait();  /* every block of the cluster has started: remote accesses from here */
    publish2(wv, wf, xv, xf, r, C);
    cl_sync();
    int nvis = 0, nforced = 0;
    for (unsigned q = 0; q < C; q++) { nvis += xv[q]; nforced += xf[q]; }

    /* 2. the threshold key T: every visible key above it is kept, and of the cnteq keys equal to it the latest
       remT; a_lo / q_lo: the kept keys above T / the keys equal to T in the lower ranks' parts */
    const bool all = nvis <= K;
    const int rem = K - nforced;
    unsigned T = UPOS;
    int remT = K, cnteq = nforced, a_lo = 0, q_lo = 0;
    if (all) {  /* every visible key */
        if (lane == 0) { wa[wid] = wv[wid]; wq[wid] = 0; }
        for (unsigned q = 0; q < r; q++) a_lo += xv[q];
    } else if (rem <= 0) {  /* the latest K forced keys */
        if (lane == 0) { wa[wid] = 0; wq[wid] = wf[wid]; }
        for (unsigned q = 0; q < r; q++) q_lo += xf[q];
    } else {
        cl_pick(hist, NB, rem, C, wsum, sh);
        const int dstar = sh[0], rem2 = sh[1], c = sh[2];
        const bool zslot = dstar == z0 + 1, list = !zslot && c <= CMAX;
        if (zslot || list) {
            /* one pass: the keys above the slot (forced or a higher slot) and, in the zeros' slot, the zeros,
               counted per warp; a listed slot's keys appended to every rank's list at a place taken from rank
               0's counter, tagged with their rank and warp */
            const unsigned cc = cl_addr(&ccount, 0);
            int ca = 0, cq = 0;
            for (int j = 0; j < seg; j += 32) {
                unsigned u = key_at(row, cache, cached, seg0 + j + lane, n);
                bool fin = u > UNEG && u < UPOS;
                int s = fin ? xbin(u, mn, scale, z0) : -1;
                ca += __popc(__ballot_sync(0xffffffffu, u >= UPOS || s > dstar));
                unsigned m = __ballot_sync(0xffffffffu, s == dstar);
                if (zslot) {
                    cq += __popc(m);
                } else if (m) {
                    unsigned at = 0;
                    if (lane == 0) at = cl_add(cc, __popc(m));
                    at = __shfl_sync(0xffffffffu, at, 0);
                    if (s == dstar) {
                        unsigned long long v = ((unsigned long long)u << 32) | (r << 5) | (unsigned)wid;
                        unsigned k = at + __popc(m & lt);
                        for (unsigned q = 0; q < C; q++) cl_st64(cl_addr(&cand[k], q), v);
                    }
                }
            }
            if (lane == 0) { wa[wid] = ca; wq[wid] = cq; }
            __syncthreads();
            publish2(wa, wq, xa, xq, r, C);
            cl_sync();  /* the last remote access of these modes: a block may exit after it */
            for (unsigned q = 0; q < r; q++) { a_lo += xa[q]; q_lo += xq[q]; }
            if (zslot) {
                T = UZERO; remT = rem2; cnteq = c;
            } else {
                rank_list(cand, c, rem2, sh);
                T = (unsigned)sh[5]; remT = sh[6]; cnteq = sh[7];
                for (int i = tid; i < c; i += NT) {  /* the listed keys above / equal to T, to their warps */
                    unsigned long long v = cand[i];
                    unsigned key = (unsigned)(v >> 32), q = ((unsigned)v >> 5) & 7u, w = (unsigned)v & 31u;
                    if (key >= T) {
                        if (q == r) atomicAdd(key > T ? &wa[w] : &wq[w], 1);
                        else if (q < r) atomicAdd(key > T ? &low[0] : &low[1], 1);
                    }
                }
                __syncthreads();
                a_lo += low[0];
                q_lo += low[1];
            }
        } else {  /* three radix levels (11 / 11 / 10 bits of the key) over the slot's keys, then a counting pass */
            unsigned pfx = 0u;
            int rr = rem2, s = 32;
            for (int lv = 0; lv < 3; lv++) {
                const int shift = lv == 0 ? 21 : (lv == 1 ? 10 : 0), nb = lv == 2 ? 1024 : 2048;
                cl_sync();  /* no rank still reads this block's previous histogram */
                for (int j = tid; j < NB; j += NT) hist[j] = 0;
                __syncthreads();
                for (int j = 0; j < seg; j += 32) {
                    unsigned u = key_at(row, cache, cached, seg0 + j + lane, n);
                    bool m = u > UNEG && u < UPOS && xbin(u, mn, scale, z0) == dstar && (s == 32 || (u >> s) == (pfx >> s));
                    if (m) atomicAdd(&hist[(u >> shift) & (unsigned)(nb - 1)], 1);
                }
                cl_sync();
                cl_pick(hist, nb, rr, C, wsum, sh);
                pfx |= (unsigned)sh[0] << shift;
                rr = sh[1];
                s = shift;
                if (tid == 0) { sh[5] = (int)pfx; sh[6] = rr; sh[7] = sh[2]; }
                __syncthreads();
            }
            T = (unsigned)sh[5]; remT = sh[6]; cnteq = sh[7];
            int ca = 0, cq = 0;
            for (int j = 0; j < seg; j += 32) {
                unsigned u = key_at(row, cache, cached, seg0 + j + lane, n);
                ca += __popc(__ballot_sync(0xffffffffu, u > UNEG && u > T));
                cq += __popc(__ballot_sync(0xffffffffu, u > UNEG && u == T));
            }
            if (lane == 0) { wa[wid] = ca; wq[wid] = cq; }
            __syncthreads();
            publish2(wa, wq, xa, xq, r, C);
            cl_sync();  /* the last remote access of this mode */
            for (unsigned q = 0; q < r; q++) { a_lo += xa[q]; q_lo += xq[q]; }
        }
    }

    /* 3. the write: every warp's offsets by one scan over the warps; the earliest cnteq - remT ties are dropped */
    __syncthreads();
    if (wid == 0) {
        int a = wa[lane], q = wq[lane];
        wa[lane] = warp_incl(a, lane) - a + a_lo;
        wq[lane] = warp_incl(q, lane) - q + q_lo;
    }
    __syncthreads();
    int a_before = wa[wid], q_before = wq[wid];
    const int drop = all ? 0 : cnteq - remT;
    for (int j = 0; j < seg; j += 32) {
        const int i = seg0 + j + lane;
        unsigned u = key_at(row, cache, cached, i, n);
        bool vis = u > UNEG;
        bool ab = vis && (all || u > T);
        bool eq = vis && !all && u == T;
        unsigned mab = __ballot_sync(0xffffffffu, ab), meq = __ballot_sync(0xffffffffu, eq);
        int qa = q_before + __popc(meq & lt);
        if (ab || (eq && qa >= drop)) {
            int qk = qa - drop;
            orow[a_before + __popc(mab & lt) + (qk > 0 ? qk : 0)] = b0 + i;
        }
        a_before += __popc(mab);
        q_before += __popc(meq);
    }
    const int kept = all ? nvis : K;
    for (int j = kept + (int)r * NT + tid; j < K; j += (int)C * NT) orow[j] = -1;
}
