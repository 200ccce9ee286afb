"""The decode select after the score pass as a CUDA block, or a thread-block cluster, per row
(`indexer_topk_decode(impl="cuda")`, the rollout engine's default since session 27).

Why CUDA C++ here, where the rest of the ops are Triton: after the score pass the select is a chain of small
block-wide steps over one row (histogram, find the bin holding the k-th key, resolve it; then write the kept
positions in order). Each step is a reduction or a scan across the block. Triton has no block-wide primitive
cheaper than a `tl.sum` / `tl.cumsum` through shared memory, measured at ~1 us each on the H200 (session 10's bit
search: 32 steps, 65 us at 16K), so the Triton forms either split the row over many programs and pay launches or
in-kernel barriers between the levels (fine, sync: ~30 us of chain a layer at 32 x 16K on top of a ~16 us score
pass) or walk it in one program and pay the reductions (row, bsearch). In CUDA a level is shared-memory atomics
and a 32-warp scan. vLLM, SGLang and TensorRT-LLM run the DSA decode top-k the same way (a logits kernel, then
one CTA per row); this kernel is written from the algorithm, not from theirs.

`row_select(sc [B, S] fp32, pos [B] int32, topk, span=, chunk=)` -> `[B, topk]` int32 ascending, -1 padded. The
scores are the score pass's (`decode._score_max`: +inf forced, -inf not visible, only columns <= pos written), so
the kept keys are the reference's (`naive.indexer_topk_decode_naive`): every +inf key, then the highest finite
scores, ties between equal scores to the later key (-0.0 equals +0.0). span: the same pass's per-chunk largest /
smallest finite score, so the select needs no pass of its own for the row's extremes.

A row is split over a cluster of C blocks of 1024 threads (`auto_cluster`: 2-4 on sm_90+ where a block keeps
>= 8K keys, else 1); block rank r holds the row's r-th part, its warp w a contiguous segment, 32 keys a step.
Three passes over a block's keys:
1. the keys as order-preserving uint32 into dynamic shared memory (parts of at most `CACHE_KEYS` keys; longer
   ones are re-read from L2 each pass), the visible and forced counts per warp, and the first level's
   histogram: 2046 bins linear in the score between the row's extremes plus two slots at the bin holding 0.0
   (its negatives / the exact zeros, counted by warp ballot / its positives). Linear bins spread a Gaussian-like
   row (the key's top bits put a row of similar magnitudes in a handful of bins and serialize the atomics:
   session 26's first form); the zeros' slot keeps a threshold at an exact ReLU zero (rows whose head weights
   are mostly negative) from listing ~1,000 equal keys (session 27, call 1). The blocks exchange their counts
   (distributed shared memory, one cluster barrier) and each sums the others' histograms to find the slot
   holding the k-th largest key;
2. one pass counts, per warp, the keys above that slot (forced or a higher slot) and either the zeros (the
   zeros' slot: T = 0 at once) or appends the slot's keys to every block's list (place from rank 0's counter,
   tagged with rank and warp), which each block ranks: one key a thread up to 128, a bitonic sort up to 1024.
   A slot of more keys (a span set by far outliers, exact ties) takes three radix levels of the key's bits and
   a counting pass instead;
3. the write: one scan over the warps (plus the lower ranks' counts) gives every warp its offsets, and the warp
   walks its segment again, placing each kept key at (keys above before it) + (ties before it past the first
   `ties - rem`, the earlier ties being the dropped ones).

Compiled at first use by NVRTC (`torch.cuda._compile_kernel`: no C++ toolchain needed, only the NVRTC library
of PyTorch's CUDA build), cached per device; launched through the driver's `cuLaunchKernelEx` with the cluster
dimension and, where the caller's `pdl` asks for it, programmatic dependent launch (the kernel waits for the
previous kernel, then lets the next one launch, as `pdl.pdl_enter` at level 2). CUDA-graph capturable: `pos` is
read on the device, the grid depends on B only. There is no CPU form: on a CPU `indexer_topk_decode` runs the
reference, and the tests check this kernel against the reference on a GPU (tests/sparse/test_decode_cuda.py).
"""

from __future__ import annotations

import ctypes
import functools

import torch

THREADS = 1024
# rows of at most this many keys keep their keys in shared memory between the passes (4 bytes a key, plus the
# 8 KB histogram, within the 227 KB a block may have on sm_90); longer rows re-read the scores from L2 each pass
CACHE_KEYS = 53248

SOURCE = r"""
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
"""


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"decode_cuda: {what} failed with CUDA driver error {rc}")


@functools.lru_cache(maxsize=None)
def _kernel(device: int):
    """The compiled `row_topk` for cuda:`device` (its func handle), with the dynamic shared memory limit raised
    to what `CACHE_KEYS` needs."""
    if not hasattr(torch.cuda, "_compile_kernel"):
        raise RuntimeError("impl='cuda' needs torch.cuda._compile_kernel (PyTorch >= 2.8 with CUDA)")
    with torch.cuda.device(device):
        k = torch.cuda._compile_kernel(SOURCE, "row_topk", nvcc_options=["-std=c++17"])
    _check(_libcuda().cuFuncSetAttribute(k.func, _MAX_DYNAMIC_SHARED, CACHE_KEYS * 4), "cuFuncSetAttribute")
    return k


@functools.lru_cache(maxsize=None)
def available(device: int) -> bool:
    """Whether `row_topk` compiles and loads on cuda:`device` (NVRTC present, a GPU of compute capability 8.0+
    for the warp reductions); the reason is logged once where not."""
    try:
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise RuntimeError("compute capability below 8.0")
        _kernel(device)
        return True
    except Exception as e:  # noqa: BLE001 - any failure to build means the Triton selects run instead
        _warn_once(f"decode select 'cuda' unavailable on cuda:{device} ({e}); the fine select runs instead")
        return False


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    import warnings

    warnings.warn(msg, RuntimeWarning, stacklevel=3)


CLUSTERS = (0, 1, 2, 4, 8)  # 0: auto_cluster's choice; at most 8, the portable cluster size
CLUSTER_MIN_KEYS = 8192  # auto_cluster: a cluster's blocks hold at least this many keys each


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_cluster(B: int, S: int, sms: int, capability: tuple[int, int]) -> int:
    """The blocks a row of `row_select`'s cluster form on a GPU of `sms` SMs: the most (up to 4) that keep the B
    rows' clusters in one wave (one 1024-thread block an SM) with at least CLUSTER_MIN_KEYS keys a block; 1 (the
    one-block kernel) below compute capability 9.0, where there are no clusters. Measured on the H100 (session 27,
    the select alone, us): 16 x 32K 27.1 / 20.3 / 15.4 / 32.3 at 1 / 2 / 4 / 8 blocks a row, 32 x 8192 16.9 /
    19.2 / 22.6 / 43.8, 32 x 2304 6.7 / 10.0 / 15.0 / 28.1: a cluster's exchanges cost ~3 us, so it pays only where
    a block keeps ~8K keys; 8 blocks a row lose even there (16 clusters of 8 need more than one wave of the H100's
    GPCs)."""
    if tuple(capability) < (9, 0):
        return 1
    c = 4
    while c > 1 and (B * c > sms or S < c * CLUSTER_MIN_KEYS):
        c //= 2
    return c


def _attr(id_: int, *values: int) -> _LaunchAttr:
    a = _LaunchAttr()
    a.id = id_
    vals = (ctypes.c_uint * len(values))(*values)
    # into the struct's own bytes: `a.value` would be a bytes copy (ctypes turns a c_char array field into bytes)
    ctypes.memmove(ctypes.addressof(a) + _LaunchAttr.value.offset, vals, ctypes.sizeof(vals))
    return a


def score_span(sc: torch.Tensor) -> torch.Tensor:
    """`[B, 1, 2]` fp32: each row's largest and smallest finite score, the score pass's per-chunk `span` for one
    chunk of the whole row (+-inf where a row has none), for callers of `row_select` without a score pass."""
    fin = torch.isfinite(sc)
    mx = torch.where(fin, sc, float("-inf")).amax(1)
    mn = torch.where(fin, sc, float("inf")).amin(1)
    return torch.stack([mx, mn], -1)[:, None].contiguous()


def row_select(sc: torch.Tensor, pos: torch.Tensor, topk: int, *, span: torch.Tensor | None = None, chunk: int = 0,
               pdl: int = 0, cache_keys: int = CACHE_KEYS, cluster: int = 0) -> torch.Tensor:
    """sc `[B, S]` fp32 scores of the score pass (+inf forced, -inf not visible; columns past pos unread),
    pos `[B]` int32 on sc's device -> `[B, topk]` int32 ascending, -1 padded. span `[B, P, 2]` fp32: the largest
    and smallest finite score of each `chunk`-key chunk (the score pass's `PER_CHUNK` output; chunks past a row's
    pos are not read); None: `score_span(sc)`. pdl: launched with programmatic dependent launch (any nonzero
    level). cache_keys: a block holds its keys in shared memory between the passes when they are at most this
    many (at most `CACHE_KEYS`; 0 re-reads every pass, for tests of that path). cluster: the blocks a row (a
    thread-block cluster exchanging through distributed shared memory, compute capability 9.0+; 1 a plain
    launch); 0 `auto_cluster`'s choice."""
    if not sc.is_cuda or sc.dtype != torch.float32 or sc.dim() != 2 or sc.stride(1) != 1:
        raise ValueError("decode_cuda.row_select: sc must be a CUDA [B, S] fp32 tensor with contiguous rows")
    if not 0 <= cache_keys <= CACHE_KEYS:
        raise ValueError(f"cache_keys {cache_keys}: must be within 0-{CACHE_KEYS}")
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster {cluster}: expected one of {', '.join(map(str, CLUSTERS))}")
    B, S = sc.shape
    if span is None:
        span, chunk = score_span(sc), S
    if span.dtype != torch.float32 or span.dim() != 3 or span.shape[0] != B or span.shape[2] != 2 or chunk < 1:
        raise ValueError("decode_cuda.row_select: span must be [B, P, 2] fp32 with a chunk of at least 1 key")
    span = span.contiguous()
    dev = sc.device.index if sc.device.index is not None else torch.cuda.current_device()
    C = cluster or auto_cluster(B, S, _sm_count(dev), torch.cuda.get_device_capability(dev))
    if C > 1 and torch.cuda.get_device_capability(dev) < (9, 0):
        raise ValueError(f"cluster {C}: thread-block clusters need compute capability 9.0+")
    pos = pos.to(device=sc.device, dtype=torch.int32).contiguous()
    out = torch.empty(B, topk, device=sc.device, dtype=torch.int32)
    if sc.stride(0) != S:
        sc = sc.contiguous()
    k = _kernel(dev)
    part = -(-S // (C * 32)) * 32  # a block's most keys (the kernel's part of a row of S keys)
    keys = min(cache_keys, part)
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (sc, span, pos, out)]
    ints = [ctypes.c_int(v) for v in (S, topk, out.stride(0), keys, chunk, span.shape[1], 1 if pdl else 0)]
    params = (ctypes.c_void_p * 11)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in ptrs + ints])
    # on sm_90+ even one block a row launches as a cluster (of one): the kernel's cluster barriers and
    # distributed-shared-memory accesses then address a launch of the kind they were written for
    clusters = torch.cuda.get_device_capability(dev) >= (9, 0)
    attrs = ([_attr(_PROGRAMMATIC_STREAM_SERIALIZATION, 1)] if pdl else []) + (
        [_attr(_CLUSTER_DIMENSION, C, 1, 1)] if clusters else [])
    arr = (_LaunchAttr * max(1, len(attrs)))(*attrs)
    cfg = _LaunchConfig(B * C, 1, 1, THREADS, 1, 1, keys * 4, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                        arr if attrs else None, len(attrs))
    _check(_libcuda().cuLaunchKernelEx(ctypes.byref(cfg), k.func, params, None), "cuLaunchKernelEx")
    return out



def row_select_naive(sc: torch.Tensor, pos: torch.Tensor, topk: int) -> torch.Tensor:
    """`row_select` in PyTorch (any device), by the reference's own rule (`naive.select_topk`): each row's columns
    0..pos, +inf keys forced, -inf never kept, ties to the later key; `[B, topk]` int32 ascending, -1 padded."""
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk

    cols = torch.arange(sc.shape[1], device=sc.device)
    visible = (cols[None, :] <= pos.to(sc.device).long()[:, None]) & (sc > float("-inf"))
    return select_topk(sc[:, None], visible[:, None], (sc == float("inf"))[:, None], topk)[:, 0]
