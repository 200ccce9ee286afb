"""A lean forward pass over the loaded HF model's own modules, against the slot KV cache.

No copy of the weights: embeddings, norms, q/k/v/o projections (qwen2 biases, qwen3 q_norm/k_norm
included, since they are the model's modules), MLPs, lm_head, the rotary table and, in sparse mode,
each layer's indexer are called directly. So a trainer that updates the model's parameters in place
is seen by the next step, and peft LoRA layers (if the model is wrapped) simply run as part of
the projections (the fused projections below read the parameters' own storage, concatenated).

Two passes:
- `prefill`: a batch of prompts, right-padded to a common length (causal attention never lets a
  real token see the padding behind it), writes K/V (and index keys) into the prompts' slots and
  returns the last real position's logits; with `start` > 0, a chunk continuing prompts whose first
  `start` rows are cached (chunked prefill: it attends to, and selects over, those rows too).
- `decode`: one token for every slot at once (inactive slots compute on dummies: a fixed batch
  keeps shapes static for CUDA graphs). Keys are read from `cache[:, :S]`, S a bucket of the
  longest live sequence, and masked per slot by its own position.

Sparse semantics are those of the HF path: the attention mode, each layer's config and the selector
itself come from `sparse_rl.sparse.layer` (`layer.select`, the one selector dispatch; layers in
`dense_layers` dense). In decode every row sits at its own position: `select` is given the positions
(the indexer's `ops.indexer_topk_decode`, the block selector per row).

The eager decode step fuses the per-token elementwise work: `ops.add_rmsnorm` (each residual add with
the RMSNorm after it, the residual stream carried alongside) and `ops.qk_norm_rope_cache` (Qwen3's q/k
norms, RoPE and the K/V cache write), one Triton launch each on a GPU where the modules' ops take
8-20, the references (the HF modules' own arithmetic) on a CPU. On an H200 at Qwen3-4B's shape this
took the batch-32 step at 2K context from 10.1 to 6.1 ms (benchmarks/results/2026-12-01-h200-rollout-
qwen3-4b.md). On CUDA it also runs each layer's q/k/v (+ the indexer's wq/wk/ww) and gate/up
projections as one GEMM each, SiLU(gate) * up in `ops.silu_mul` (`fused_weights.py`; the modules'
parameters become views of the concatenated weights): 6.13 -> 5.63 ms dense at 2K, 10.37 -> 9.18 ms
sparse at 16K (benchmarks/results/2026-12-01-h200-rollout-session5.md). `runner.fused = False` runs
the modules instead (for A/B), `runner.fused_layers = None` the separate projections,
`runner.set_qkv_pad(n)` pads the fused q/k/v(+indexer) weight with zero rows to a multiple of n output
columns (default `QKV_PAD` = 64: 16-byte aligned output rows, -0.24 ms a sparse step at 16K on the H200),
`runner.qkv_weight_left = True` the fused q/k/v GEMM as W @ xᵀ (opt-in; drop the graphs after a
switch); the compiled
step keeps the modules, whose elementwise ops inductor fuses itself.

Dense decode attention: PyTorch SDPA with a per-slot mask on CPU; on CUDA the split-K Triton
decode kernel (`ops.sparse_decode`) given every visible position as its index list, so it reads
only the slot's live keys (SDPA would read the whole bucket and has no split-K for one query).

Compilation (`compile=True`; opt-in, see `default_compile`): the decode step is compiled once with torch.compile
(S dynamic, see compiled.py) and the compiled step is what the CUDA graphs capture. Parameters are
graph inputs (never constants), so in-place updates stay live there too. A compilation that fails
falls back to the eager step and leaves its reason in `compile_error` (`SPARSE_RL_COMPILE=0|1`
sets the default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sparse_rl.errors import SparseRLError
from sparse_rl.rl.rollout.cache import KVCache
from sparse_rl.rl.rollout import compiled as C
from sparse_rl.sparse.layer import DecodeOps, attend, layer_states, select, select_rows
from sparse_rl.rl.rollout.fused_weights import FusedLayer
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect
from sparse_rl.sparse.ops._backend import resolve_pdl
from sparse_rl.sparse.ops import (SKINNY_ROWS, add_rmsnorm, indexer_decode, qk_norm_rope_cache, qk_rope_indexer_decode,
                                  quantize_index_keys, silu_mul, skinny_linear, skinny_silu_mul, sparse_decode)


# `ModelRunner.qkv_pad`'s default: zero rows after the fused q/k/v(+indexer) weight up to 64 output columns.
# On the H200 (Qwen3-4B shape, batch 32; benchmarks/results/2026-12-02-h200-rollout-session8.md) the GEMM
# at M = 32 took 9.4 us padded against 18.7 (N = 6468: cuBLAS's sm80 align2 kernel), the sparse step
# 0.22-0.28 ms less at every context (9.76 -> 9.52 ms at 16K); dense steps multiply by the first 6144 rows
# only, unchanged
QKV_PAD = 64

# `ModelRunner(pdl=None)`'s choice where PDL is possible (`_backend.pdl_supported`: CUDA sm_90+, a Triton with
# `launch_pdl`, not the interpreter): the eager step's Triton kernels (add + RMSNorm, q/k norm + RoPE + cache,
# SiLU * up, the indexer's per-token kernel, its score and fine-select passes, the decode attention and its
# merge) launched with programmatic dependent launch, each waiting in `griddepcontrol.wait` before its first
# load. Level 1 (wait first, no explicit trigger): on the H200 (Qwen3-4B shape, graph replay, the three levels
# interleaved in one engine; benchmarks/results/2026-12-02-h200-pdl-session11.md) the batch-32 step took 6.366 /
# 8.449 ms sparse at 2304 / 16384 against 6.420 / 8.557 plain, dense 5.762 / 20.531 against 5.808 / 20.586, batch 1
# 0.00-0.13 ms less in all four rows; logits bitwise equal, eager and graphed; whole 16K batch-32 generation 4,350
# vs 4,327 tok/s sparse, 2,620 vs 2,599 dense. Level 2 (trigger after the wait) is opt-in: +0.13 ms sparse at 16K
# (waiting programs hold SM slots: busy 8.24 -> 8.56 ms in the profile)
PDL_DEFAULT = 1  # a level of `_backend.PDL_LEVELS`


SKINNY = ("o_proj", "down_proj", "qkv", "gate_up")  # the decode GEMMs `skinny_gemm` may name


# The decode GEMMs' default (session 12, helper gap12; benchmarks/results/2026-12-02-h200-gap12-session12.md,
# call 2, H200, Qwen3-4B shape, interleaved pairs on one engine): on sm_90+ all four as the swap-AB wgmma kernel
# (`ops.skinny_linear(impl="swapab")`) with the step at PDL level 2, so the kernel before each GEMM lets it launch
# early and its first weight tile loads before `gdc_wait`: batch 32 dense 2K 5.64 -> 5.56 ms, sparse 16K 8.92 ->
# 8.66, sparse 2304 6.61 -> 6.40; batch 1 dense 2K 3.43 -> 3.07. Alone at M = 32 the split-K shapes still lose to
# cuBLAS (o_proj 9.6 vs 7.6 us); the prefetch under level 2 is what wins in the step (swapab at level 1: +0.6 ms;
# level 2 alone, cuBLAS GEMMs: -0.07 to +0.06). Not measured with it: dense 16K, sparse batch 1, whole runs.
SKINNY_IMPL = "swapab"  # `ModelRunner.skinny_impl`'s default: ops.SKINNY_IMPLS
_SW64 = {"bw": 64, "bk": 128, "programs": 264, "num_stages": 3}  # the split-K sites' faster tile alone (call 2)
SKINNY_TILES = {"qkv": _SW64, "o_proj": _SW64, "down_proj": _SW64}  # swapab's per site (gate_up: its defaults)
SKINNY_MAX_ROWS = 32  # the engine's skinny GEMMs up to this batch (measured at 1 and 32; the op takes up to 64)
PDL_SWAPAB = 2  # the PDL level when `pdl` is None and swapab GEMMs run (PDL_DEFAULT otherwise)


def skinny_default(device, dtype=torch.bfloat16) -> frozenset:
    """The GEMMs run as `ops.skinny_linear` when `skinny_gemm` is None: all four for a bf16 / fp16 model on a CUDA
    device of compute capability >= 9.0 with PDL (where it was measured: bf16), none elsewhere (F.linear; fp32
    operands would leave wgmma for full-precision FMA dots)."""
    from sparse_rl.sparse.ops._backend import pdl_supported

    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cuda" or not pdl_supported(device):
        return frozenset()
    return frozenset(SKINNY) if torch.cuda.get_device_capability(device) >= (9, 0) else frozenset()


def _skinny_impl(impl: str) -> str:
    from sparse_rl.sparse.ops import SKINNY_IMPLS

    if impl not in SKINNY_IMPLS:
        raise ValueError(f"skinny_impl {impl!r}: expected one of {SKINNY_IMPLS}")
    return impl


def _skinny_tiles(tiles) -> dict:
    """`ModelRunner.skinny_tiles`: {site among SKINNY: swapab_linear's tile keywords}, from a dict or pairs."""
    out = {k: dict(v) for k, v in dict(tiles or {}).items()}
    if set(out) - set(SKINNY):
        raise ValueError(f"skinny_tiles: {sorted(set(out) - set(SKINNY))} not among {', '.join(SKINNY)}")
    bad = {k for v in out.values() for k in v} - {"bw", "bk", "programs", "num_warps", "num_stages", "prefetch",
                                                     "loads"}
    if bad:
        raise ValueError(f"skinny_tiles: unknown keywords {sorted(bad)}")
    return out


def _skinny_set(names) -> frozenset:
    """`ModelRunner.skinny_gemm` from True (all), False / None / () (none) or names among SKINNY."""
    if names is True:
        return frozenset(SKINNY)
    out = frozenset(names or ())
    if out - set(SKINNY):
        raise ValueError(f"skinny_gemm: {sorted(out - set(SKINNY))} not among {', '.join(SKINNY)}")
    return out


BLAS = (None, "cublas", "cublaslt")  # `ModelRunner.blas`: None leaves torch's own choice


@contextlib.contextmanager
def _blas_library(name: str | None, cuda: bool):
    """torch's preferred BLAS library set to `name` for the block (the GEMMs a CUDA graph captures there
    keep it), then restored: a runner argument, not a process-wide setting."""
    if name is None or not cuda:
        yield
        return
    old = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE as the llama/qwen2/qwen3/mistral modules apply it (rotate_half, cos/sin layout cat(f, f)):
    q `[B, T, H, D]`, k `[B, T, H_kv, D]`, cos/sin `[B, T, D]` -> rotated (q, k)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _check_blas(name):
    if name not in BLAS:
        raise ValueError(f"blas {name!r}: expected one of {BLAS}")
    return name


def _rms_norms(*mods) -> bool:
    """Whether every module is an RMSNorm the fused ops compute exactly: a weight, no bias, an eps
    (`variance_epsilon`: llama/qwen2/qwen3/mistral)."""
    return all(isinstance(getattr(m, "variance_epsilon", None), float) and getattr(m, "weight", None) is not None
               and getattr(m, "bias", None) is None for m in mods)


def default_compile(device) -> bool:
    """Whether to compile the decode step when the caller does not say: `SPARSE_RL_COMPILE=1|0`, else off.

    Off by default, on CUDA too: on an H200 (benchmarks/results/2026-11-29-h200-rollout-long.md) the
    compiled step is 1.15-1.6x faster than the eager one at batch 64-128, dense and sparse, but each
    compiled variant costs 23-36 s on first use (sparse mode has two: contexts up to top-k and
    beyond), which a short `generate` job does not win back, and no compiled GRPO run has been made
    on a GPU yet. Long jobs opt in (`--compile`, `rollout.compile: true`, SPARSE_RL_COMPILE=1)."""
    env = os.environ.get("SPARSE_RL_COMPILE", "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    return False


class _Resid(NamedTuple):
    """A sublayer GEMM's output already added to the residual stream in its epilogue (`fuse_norm`): h `[B, hidden]`,
    ps, each output tile's per-row sum of h^2 (`ops.skinny_linear(residual=)`), and hn = h * the next RMSNorm's
    weight (None where the epilogue was given none): the next GEMM's input, its 1 / rms applied in its epilogue."""

    h: torch.Tensor
    ps: torch.Tensor
    hn: torch.Tensor | None


class _NormIn(NamedTuple):
    """A GEMM input given as RMSNorm(h) = hn * rstd (`ops.skinny_linear(norm=)`): hn = h * the norm's weight, the
    partial sums of h^2, the norm's eps."""

    hn: torch.Tensor
    ps: torch.Tensor
    eps: float


class ModelRunner:
    """Prefill/decode over `model`'s modules. `mode` is "dense" or "sparse".

    use_graphs: CUDA graphs of the decode step (default on CUDA). compile: torch.compile the decode
    step (default `default_compile(device)`); compile_backend: the dynamo backend, a name
    ("inductor"; "aot_eager" traces without generating code) or a backend callable.
    fuse_projections: the eager step's concatenated q/k/v(+indexer) and gate/up GEMMs (default on
    CUDA; the modules' parameters become views of the concatenated weights, see fused_weights.py).
    qkv_pad: zero rows after the fused q/k/v(+indexer) weight up to a multiple of this (`set_qkv_pad`).
    decode_select: the indexer's decode select after the score pass (`DecodeSelect`; None: `ENGINE_SELECT`,
    the CUDA select after a 64-key score step; `set_decode_select` changes it later). skinny_gemm: which of the eager step's GEMMs run as
    `ops.skinny_linear` (split-K in one launch; at most SKINNY_MAX_ROWS = 32 rows, no bias) instead of F.linear
    (cuBLAS: split-K + a reduce kernel for o_proj / down_proj at M = 32): names among SKINNY ("o_proj",
    "down_proj", "qkv", "gate_up"), True for all, () for none; None: `skinny_default(device, dtype)`, all four
    for a bf16 / fp16 model on sm_90+ (measured, session 12), none elsewhere (`set_skinny_gemm`). skinny_impl: the kernel behind it
    (`ops.SKINNY_IMPLS`: "splitk", session 9's, or "swapab", yᵀ = W xᵀ with wgmma on sm_90a, which also takes
    the step's PDL level; None: SKINNY_IMPL, swapab). skinny_tiles: swapab's tiles per site ({"gate_up":
    {"bw": 128, "bk": 64, "programs": 264}}, keywords of `swapab_linear`; a site not named gets its defaults;
    None: SKINNY_TILES). blas: the BLAS library of the eager decode
    step's GEMMs (None: torch's default; "cublaslt" / "cublas": `torch.backends.cuda.preferred_blas_library`
    for the step only, `set_blas`). pdl: the eager step's Triton kernels launched with programmatic dependent
    launch at a level of `_backend.PDL_LEVELS` (True = 1: each kernel waits first; 2: also triggers its
    dependents after the wait; None: `PDL_DEFAULT`, level 1 (measured), or PDL_SWAPAB, level 2, while swapab
    GEMMs run (measured with them, session 12); resolved to 0 wherever
    `_backend.pdl_supported` is not, so True on a CPU, an A100 or under the interpreter is no error; the compiled
    step gets inductor's `triton.enable_pdl` instead, only when pdl is given (never timed); `set_pdl`). The runner
    owns it: the decode select it passes down carries it (`DecodeSelect.pdl`). select_streams: the eager step's
    indexer layers split the batch's rows into this many groups, each group's select and sparse attention on its
    own CUDA stream (1: one stream, the whole batch; `set_select_streams`, `_grouped_select_attend`), so one
    group's latency-bound select chain could run while another's attention streams its K/V rows. Opt-in: on the
    H200 (Qwen3-4B shape, 32 x 2304-16384, 16 x 32K; benchmarks/results/2026-12-04-h200-session20.md) 2 and 4 groups
    were 0.05-0.16 ms a step slower than one, bitwise the same logits: the groups run each phase at the same time
    and the chain's latency does not shrink with fewer rows. fuse_silu: where the gate/up GEMM runs as swapab,
    SiLU(gate) * up in its epilogue (`ops.skinny_silu_mul`: one launch a layer fewer, bitwise the two launches'
    values; default on, measured 0.02-0.14 ms a step faster on the H200; `set_fuse_silu`). fuse_norm: with it, the
    residual adds + RMSNorms inside the swap-AB GEMMs instead of `add_rmsnorm`, which then runs for layer 0's input
    and the final norm only: o_proj's / down's epilogue writes h = residual + y, its per-tile sums of h^2 and hn = h *
    the next norm's weight; gate/up and the next layer's q/k/v multiply hn and scale their fp32 sums by 1 / rms(h)
    (`_fused_post_norm`, `_pre_norm_ok`, `set_fuse_norm`; values within bf16 rounding of the unfused ones). Opt-in:
    its first form (each x tile normalized inside the GEMM loop) measured +2.0 ms a step at batch 32 on the H200
    (session 21, results/2026-12-04-h200-session21.md); this form +0.01 to +1.0 ms on an H100 at batch 16 (session
    25, results/2026-12-07-h100-session25.md). fuse_merge: where the decode
    attention splits a row's index list (small batches: about one program an SM), the last program of each (row, kv
    head) merges the partials (`ops.sparse_decode(merge="fused")`) instead of a `_merge_kernel` launch a layer (36 a
    step at batch 1); the same values up to the fp32 order over the splits; opt-in: +0.05 to +0.23 ms a step at
    batch 1 on an H100 (session 25: the last program's serial merge outlasts the merge launch); `set_fuse_merge`."""

    def __init__(self, model, device, use_graphs: bool | None = None, compile: bool | None = None,
                 compile_backend="inductor", fuse_projections: bool | None = None, qkv_pad: int = QKV_PAD,
                 decode_select: DecodeSelect | None = None, skinny_gemm=None, blas: str | None = None,
                 skinny_impl: str | None = None, skinny_tiles=None,
                 pdl: bool | int | None = None, fuse_indexer: bool = True, select_streams: int = 1,
                 fuse_silu: bool = True, fuse_norm: bool = False, fuse_merge: bool = False):
        base = _base(model)
        dec = base.get_decoder()
        self.model, self.base = model, base
        self.embed, self.norm, self.rotary = dec.embed_tokens, dec.norm, dec.rotary_emb
        self.lm_head = base.get_output_embeddings()
        self.layers = list(dec.layers)
        cfg = base.config
        self.config = cfg
        self.n_layers = len(self.layers)
        self.H, self.H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        attn0 = self.layers[0].self_attn
        self.D = attn0.head_dim
        self.vocab = self.lm_head.out_features
        self.states = layer_states(model)
        self.index_dim = next((layer.self_attn.indexer.index_dim for layer in self.layers
                               if getattr(layer.self_attn, "indexer", None) is not None), None)
        # how the decode cache stores index keys (SparseConfig.index_dtype: one value for the model)
        self.index_dtype = next((st.cfg.index_dtype for st in self.states
                                 if st is not None and st.cfg.selector == "indexer"), "bf16")
        self.device = torch.device(device)
        self.dtype = next(base.parameters()).dtype
        self.is_cuda = self.device.type == "cuda"
        self.use_graphs = self.is_cuda if use_graphs is None else (use_graphs and self.is_cuda)
        self.dense_impl = "index" if self.is_cuda else "sdpa"
        # the eager step's fused ops (add + RMSNorm; q/k norm + RoPE + cache write) assume HF's RMSNorm
        # (`weight`, `variance_epsilon`) with one eps for q_norm and k_norm; other norms run as modules
        self.fused = _rms_norms(dec.norm, *(m for layer in self.layers for m in (
            layer.input_layernorm, layer.post_attention_layernorm, getattr(layer.self_attn, "q_norm", None),
            getattr(layer.self_attn, "k_norm", None)) if m is not None)) and all(
            getattr(layer.self_attn, "q_norm", None) is None
            or layer.self_attn.q_norm.variance_epsilon == layer.self_attn.k_norm.variance_epsilon
            for layer in self.layers)
        # one GEMM for q/k/v (+ the indexer's projections) and one for gate/up (fused_weights.py); the
        # modules' parameters become views of the concatenated buffers. Default: on CUDA, for the eager
        # fused step
        self.fuse_projections = self.fused and (self.is_cuda if fuse_projections is None else bool(fuse_projections))
        # zero rows after the fused q/k/v(+indexer) weight up to a multiple of this (`set_qkv_pad`)
        self.qkv_pad = int(qkv_pad)
        self.decode_select = ENGINE_SELECT if decode_select is None else decode_select
        self.skinny_gemm, self.skinny_impl, self.skinny_tiles = self._skinny_choice(skinny_gemm, skinny_impl,
                                                                                     skinny_tiles)
        self.blas = _check_blas(blas)
        self.pdl = resolve_pdl(pdl, self.device, self._pdl_default())  # the step's launches (resolved once)
        # a sparse layer's q/k norm + RoPE + cache write and its indexer's per-token work in one launch
        # (`ops.qk_rope_indexer_decode`, the same values as the two launches; needs the fused projections)
        self.fuse_indexer = bool(fuse_indexer)
        # SiLU(gate) * up in the swap-AB gate/up GEMM's epilogue (`ops.skinny_silu_mul`: one launch for two, bitwise
        # the two), where gate/up runs as swapab. H200, Qwen3-4B shape, three interleaved reps
        # (benchmarks/results/2026-12-04-h200-session20.md): dense b32 2K 5.38-5.42 -> 5.31-5.33 ms, sparse b32 16K
        # 8.10-8.12 -> 8.02-8.10, 2304 6.24-6.31 -> 6.15-6.17, batch 1 dense 2K 3.05-3.16 -> 3.02-3.05; logits bitwise
        self.fuse_silu = bool(fuse_silu)
        # the residual adds + RMSNorms inside the swap-AB GEMMs: o_proj / down epilogues (h, sums of h^2, hn), gate/up /
        # next q/k/v epilogues (1 / rms) (`_fused_post_norm`, `_Resid`, `_pre_norm_ok`; opt-in, see the docstring)
        self.fuse_norm = bool(fuse_norm)
        self.fuse_merge = bool(fuse_merge)  # the split decode attention's merge inside its kernel (opt-in, slower)
        self.select_streams = 1
        self._side_streams: list = []  # the CUDA streams beside the current one (`set_select_streams`)
        self._pdl_asked = pdl  # the request: the compiled step's inductor PDL only when asked for (never timed)
        self._skinny_cnt: dict = {}  # id(module or fused weight) -> its tile counters (ops.skinny_linear)
        self.fused_layers = ([FusedLayer.build(layer, self.qkv_pad) for layer in self.layers]
                             if self.fuse_projections else None)
        # the fused q/k/v(+indexer) GEMM as W @ xᵀ (`FusedLinear(weight_left=True)`), opt-in: in the engine
        # step on the H200 (session 8) it lost to the padded weight (qkv_pad): with its transpose copy the
        # GEMM takes 12.6 us against 9.4 padded, and the unpadded sparse step at 16K gained nothing from it
        self.qkv_weight_left = False
        self._graphs: dict = {}
        self._pool = None
        self._static: dict = {}
        self._arange: dict = {}
        self.graph_error: str | None = None
        self.compile = default_compile(self.device) if compile is None else bool(compile)
        self.compile_backend = compile_backend
        self.compile_error: str | None = None
        # graphs compiled; seconds of first compiled calls; symbolic sizes of the last graph (1: S alone)
        self.compile_stats = {"graphs": 0, "seconds": 0.0, "symbols": 0}
        self._compiled: dict = {}
        self.set_select_streams(select_streams)

    # ---------------------------------------------------------------- helpers
    def _qkv(self, attn, x, cos, sin):
        """x `[B, T, hidden]` -> q `[B, T, H, D]`, k/v `[B, T, H_kv, D]` (RoPE applied)."""
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, -1, self.D)
        k = attn.k_proj(x).view(B, T, -1, self.D)
        v = attn.v_proj(x).view(B, T, -1, self.D)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)
        return q, k, v

    def _sparse(self, i: int, mode: str) -> bool:
        st = self.states[i]
        return mode == "sparse" and st is not None and not st.dense_layer  # st.sparse, for the mode asked

    def _mlp_out(self, layer, h):
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _logits(self, h):
        return self.lm_head(self.norm(h)).float()

    # ---------------------------------------------------------------- prefill
    def prefill(self, cache: KVCache, tokens: torch.Tensor, lengths: list[int], slots: list[int],
                mode: str, start: int = 0) -> torch.Tensor:
        """tokens `[P, T]` right-padded, lengths `[P]` -> logits `[P, V]` float32 at each row's last
        real token. Writes rows start..start+T-1 of each slot (rows past a prompt's length are
        overwritten by decoding before they become visible). start > 0 (chunked prefill): the tokens
        continue sequences whose rows 0..start-1 are already in the cache; they attend to those too."""
        P, T = tokens.shape
        pos = torch.arange(start, start + T, device=tokens.device)[None].expand(P, T)
        slot_t = torch.tensor(slots, device=tokens.device)
        rows = slice(start, start + T)
        h = self.embed(tokens)
        cos, sin = self.rotary(h, pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, cos, sin)
            cache.k[i][slot_t, rows] = k
            cache.v[i][slot_t, rows] = v
            if start:  # the keys of the earlier chunks, from the cache
                k, v = cache.k[i][slot_t, :start + T], cache.v[i][slot_t, :start + T]
            if self._sparse(i, mode):
                st = self.states[i]
                index = None
                if st.cfg.selector == "indexer":
                    q_i, w, k_i = attn.indexer(x, cos, sin)
                    if cache.idx_scale is not None:  # fp8 index keys
                        k8, sc = quantize_index_keys(k_i)
                        cache.idx[i][slot_t, rows], cache.idx_scale[i][slot_t, rows] = k8, sc
                    else:
                        cache.idx[i][slot_t, rows] = k_i
                    if start:
                        k_i = self._cached_index_keys(cache, i, slot_t, start, k_i)
                    index = (q_i, w, k_i)
                    if st.cfg.query_group > 1:
                        self._store_groups(cache, i, slot_t, q_i, w, lengths, st.cfg.query_group)
                # a later chunk's queries sit at start.. (query groups prefill whole prompts: start = 0)
                o, _ = attend(st, select_rows(st, q, k, index, q_offset=start), q, k, v, attn.scaling)
            else:
                mask = None if not start else (torch.arange(start + T, device=q.device)[None]
                                               <= pos[0][:, None])  # [T, start + T]
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   attn_mask=mask, is_causal=not start, scale=attn.scaling,
                                                   enable_gqa=self.H != self.H_kv).transpose(1, 2)
            h = h + attn.o_proj(o.reshape(P, T, -1))
            h = self._mlp_out(layer, h)
        last = torch.tensor([n - 1 for n in lengths], device=tokens.device)
        return self._logits(h[torch.arange(P, device=tokens.device), last])

    @staticmethod
    def _cached_index_keys(cache, i, slot_t, start, k_i):
        """A chunk's index keys after those of the earlier chunks: `[P, start + T, d_I]` (earlier fp8 keys
        dequantized: the unchunked prefill would have scored them unquantized)."""
        prev = cache.idx[i][slot_t, :start]
        if cache.idx_scale is not None:
            prev = (prev.float() * cache.idx_scale[i][slot_t, :start, None]).to(k_i.dtype)
        return torch.cat([prev, k_i], 1)

    @staticmethod
    def _store_groups(cache, i, slot_t, q_i, w, lengths, G):
        """Query groups: each prompt's last token's group representative (its index query and weights)
        into the slot's group buffers, for the decode steps of the same group (`layer.update_group`)."""
        cache.ensure_groups(q_i.shape[2], q_i.shape[3])
        rows = torch.arange(len(lengths), device=q_i.device)
        rep = torch.tensor([(n - 1) // G * G for n in lengths], device=q_i.device)
        cache.rep_q[i][slot_t] = q_i[rows, rep]
        cache.rep_w[i][slot_t] = w[rows, rep]

    # ---------------------------------------------------------------- decode
    def _decode_core(self, tokens, pos, keys, k_all, v_all, idx_all, scale_all, mode: str, short: bool,
                     compiled: bool, cache=None):
        """The decode step shared by the eager and the compiled path.

        tokens `[B]`, pos `[B]`, keys `[S]` = arange(S) (S, the bucket, is read from its shape so
        that one compilation serves every bucket), k_all/v_all `[L, B, S_max, H_kv, D]`, idx_all
        `[L, B, S_max, d_I]` or None, scale_all `[L, B, S_max]` its fp8 scales or None -> logits `[B, V]` float32. short: S <= top-k, so the indexer
        keeps every visible key (decided outside, so the compiled graph holds no guard on S).
        compiled: call our sparse ops through their opaque custom ops, and write the cache with
        `index_put_` on the whole cache tensor, which inductor does in place (through a per-layer
        view, functionalization would copy the layer's whole cache every step).
        cache: the KVCache, for its query-group buffers (eager only: granular selection is never compiled,
        its eager step is graph-captured).
        """
        B = tokens.shape[0]
        S = keys.shape[0]
        dev = tokens.device
        ar = torch.arange(B, device=dev)
        vis = keys[None] <= pos[:, None]  # [B, S]
        all_idx = torch.where(vis, keys[None], -1).to(torch.int32)
        if compiled and self.dense_impl == "sdpa":
            vis_full = torch.arange(k_all.shape[2], device=dev)[None] <= pos[:, None]  # [B, S_max]
        pos_list = None
        pos32 = None
        pdl = 0 if compiled else self.pdl  # the compiled step's custom ops launch plainly (inductor has its own)
        dsel = self.decode_select
        if dsel.pdl != pdl:  # the runner's pdl reaches the select's kernels through the select it passes
            dsel = dataclasses.replace(dsel, pdl=pdl)

        def write(buf, i, val):
            if compiled:
                buf.index_put_((torch.full_like(ar, i), ar, pos), val)
            else:
                buf[i][ar, pos] = val

        h = self.embed(tokens)  # [B, hidden]
        cos, sin = self.rotary(h, pos[:, None])  # [B, 1, D]
        res, pending = None, h  # the residual stream, and the sublayer output not yet added to it
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            fl = None if compiled or not self.fused or self.fused_layers is None else self.fused_layers[i]
            indexed = self._sparse(i, mode) and self.states[i].cfg.selector == "indexer"
            if isinstance(pending, _Resid):  # the previous down GEMM added the residual (fuse_norm)
                res = pending.h
                if pending.hn is not None and self._pre_norm_ok(fl, indexed, B):  # the q/k/v GEMM normalizes
                    x = _NormIn(pending.hn, pending.ps, layer.input_layernorm.variance_epsilon)
                else:
                    x, _ = self._add_norm(pending.h, None, layer.input_layernorm, compiled)
            else:
                x, res = self._add_norm(pending, res, layer.input_layernorm, compiled)
            q, k, v, z = self._projections(attn, fl, x, indexed)
            early = None  # the indexer's (q_I, w), when the q/k launch computed them
            if compiled or not self.fused:  # the modules (inductor fuses their elementwise ops itself)
                if getattr(attn, "q_norm", None) is not None:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = apply_rotary(q[:, None], k[:, None], cos, sin)
                q, k = q[:, 0], k[:, 0]
                write(k_all, i, k)
                write(v_all, i, v)
            else:  # one launch: Qwen3's q/k norms, RoPE and the K/V cache write (+ the indexer's work, `early`)
                qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                qk = (q, k, v, None if qn is None else qn.weight, None if kn is None else kn.weight,
                      1e-6 if qn is None else qn.variance_epsilon, cos[:, 0], sin[:, 0], pos, k_all[i], v_all[i])
                if indexed and z is not None and self.fuse_indexer:
                    ix = attn.indexer
                    q, *early = qk_rope_indexer_decode(*qk, *z, ix.k_norm.weight, ix.k_norm.bias, ix.k_norm.eps,
                                                       ix.rope_dim, idx_all[i],
                                                       None if scale_all is None else scale_all[i],
                                                       backend=self.states[i].backend, pdl=pdl)
                else:
                    q = qk_norm_rope_cache(*qk, pdl=pdl)
            if self._sparse(i, mode):
                st = self.states[i]
                index = None
                if st.cfg.selector == "indexer":
                    if early is not None:
                        q_i, w = early
                    elif compiled:
                        q_i, w, k_i = attn.indexer(x[:, None], cos, sin)
                        if scale_all is not None:
                            k8, sc = quantize_index_keys(k_i[:, 0])
                            write(idx_all, i, k8)
                            write(scale_all, i, sc)
                        else:
                            write(idx_all, i, k_i[:, 0])
                        q_i, w = q_i[:, 0], w[:, 0]
                    else:
                        q_i, w = self._indexer_step(attn.indexer, x, cos, sin, pos, idx_all[i], st.backend, z,
                                                    None if scale_all is None else scale_all[i], pdl)
                    index = (q_i, w, idx_all[i]) if scale_all is None else (q_i, w, idx_all[i], scale_all[i])
                elif not compiled:  # the eager block selector reads positions on the host, once per step
                    pos_list = pos.tolist() if pos_list is None else pos_list
                if index is not None and not st.cfg.granular:  # the decode select's int32 positions, once a step
                    pos32 = pos.to(torch.int32) if pos32 is None else pos32  # (not one copy kernel a layer)
                    sel_pos = pos32
                else:
                    sel_pos = pos if compiled or index is not None else pos_list
                if self._grouped(st, index, short, compiled, B):
                    o = self._grouped_select_attend(st, q, k_all[i], v_all[i], index, sel_pos, S, dsel, attn.scaling,
                                                    pdl)
                else:  # with no more visible keys than top-k the indexer keeps them all (`short`)
                    sel = select(st, q, k_all[i], index, pos=sel_pos,
                                 S=S, visible=all_idx if short else None, ops=C if compiled else DecodeOps,
                                 group=cache.group(i) if cache is not None else None, decode_select=dsel)
                    o = self._attend(q, k_all[i], v_all[i], sel, attn.scaling, st.backend, compiled, pdl)
            elif self.dense_impl == "index":
                o = self._attend(q, k_all[i], v_all[i], all_idx, attn.scaling, "auto", compiled, pdl)
            else:
                if compiled:  # the whole cache, masked: a view cut at S would make dynamo specialize S
                    kc, vc, mask = k_all[i], v_all[i], vis_full
                else:
                    kc, vc, mask = k_all[i][:, :S], v_all[i][:, :S], vis
                o = F.scaled_dot_product_attention(q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2),
                                                   attn_mask=mask[:, None, None, :], scale=attn.scaling,
                                                   enable_gqa=self.H != self.H_kv)[:, :, 0]
            # the next layer may take a _Resid: its input norm's weight for the down GEMM's hn
            chain = (self.layers[i + 1].input_layernorm.weight
                     if self.fuse_norm and not compiled and i + 1 < self.n_layers else None)
            fused = None if compiled else self._fused_post_norm(layer, fl, o.reshape(B, -1), res, chain)
            if fused is not None:
                res, pending = fused
            else:
                x, res = self._add_norm(self._out(attn.o_proj, o.reshape(B, -1), compiled), res,
                                        layer.post_attention_layernorm, compiled)
                pending = self._mlp(layer.mlp, fl, x, compiled, residual=None if chain is None else res, scale=chain)
        y, _ = self._add_norm(pending, res, self.norm, compiled)
        return self.lm_head(y).float()

    def _add_norm(self, x, res, norm, compiled: bool):
        """(norm(res + x), res + x), res None at the first layer: one launch on a GPU (`ops.add_rmsnorm`,
        the HF RMSNorm's arithmetic) in the eager step, the module in the compiled one."""
        if compiled or not self.fused:
            h = x if res is None else res + x
            return norm(h), h
        return add_rmsnorm(x, res, norm.weight, norm.variance_epsilon, pdl=self.pdl)

    def _projections(self, attn, fl, x, indexed: bool):
        """x `[B, hidden]` -> q `[B, H, D]`, k/v `[B, H_kv, D]` and z, the indexer's (wq, wk, ww) outputs
        when the fused GEMM computed them too (indexed: the layer selects with its indexer this step),
        else None. fl: the layer's `FusedLayer` (None: the modules, one GEMM each)."""
        if isinstance(x, _NormIn):  # RMSNorm(h) = rstd * hn inside the fused GEMM (`_pre_norm_ok` chose it)
            x, norm = x.hn, (x.ps, x.eps)
        else:
            norm = None
        B = x.shape[0]
        if fl is None or fl.qkv is None:
            return (*(p(x).view(B, -1, self.D) for p in (attn.q_proj, attn.k_proj, attn.v_proj)), None)
        with_ix = indexed and len(fl.qkv.sizes) == 6
        y = fl.qkv(x, None if with_ix else fl.qkv_rows, weight_left=self.qkv_weight_left,
                   skinny=self._skinny("qkv", fl.qkv, x), skinny_kw=self._skinny_kw("qkv"), norm=norm)
        parts = y.split(fl.qkv.sizes[:len(fl.qkv.sizes) if with_ix else 3], dim=1)
        q, k, v = (t.view(B, -1, self.D) for t in parts[:3])
        return q, k, v, (parts[3:] if with_ix else None)

    def _counters(self, key, n: int, device):
        cnt = self._skinny_cnt.get(id(key))
        if cnt is None:
            from sparse_rl.sparse.ops.skinny_gemm.triton import counters

            cnt = self._skinny_cnt[id(key)] = counters(n, device)
        return cnt

    def _skinny_kw(self, name: str) -> dict:
        """`ops.skinny_linear`'s keywords at call site `name`: the kernel, and for swapab the step's PDL level and
        the site's tiles (`skinny_tiles`)."""
        if self.skinny_impl != "swapab":
            return {"impl": self.skinny_impl}
        return {"impl": "swapab", "pdl": self.pdl, **self.skinny_tiles.get(name, {})}

    def _skinny(self, name: str, fused, x):
        """The tile counters of a fused GEMM (`FusedLinear`) when `skinny_gemm` names it, else None."""
        if name not in self.skinny_gemm or fused is None or x.shape[0] > SKINNY_MAX_ROWS:
            return None
        return self._counters(fused, fused.weight.shape[0], x.device)

    def _out_skinny(self, mod, x, compiled: bool, name: str) -> bool:
        """Whether a layer's o_proj / down_proj runs as `ops.skinny_linear`: `skinny_gemm` names it, eager, a plain
        bias-free Linear, at most 32 rows."""
        return (name in self.skinny_gemm and not compiled
                and x.shape[0] <= min(SKINNY_ROWS[self.skinny_impl], SKINNY_MAX_ROWS)
                and type(mod) is torch.nn.Linear and mod.bias is None)

    def _swapab_kw(self, name: str) -> dict:
        """The swap-AB kernel's own keywords at call site `name` (`_skinny_kw` without the impl choice)."""
        return {k: v for k, v in self._skinny_kw(name).items() if k != "impl"}

    def _silu_kw(self, fl, x) -> dict | None:
        """`ops.skinny_silu_mul`'s keywords where the layer's gate/up runs SiLU(gate) * up in its epilogue
        (`fuse_silu`: the fused gate/up as swapab, no bias, a SiLU MLP), else None."""
        if (fl is None or fl.gate_up is None or not (fl.silu and self.fuse_silu) or self.skinny_impl != "swapab"
                or fl.gate_up.bias is not None or self._skinny("gate_up", fl.gate_up, x) is None):
            return None
        return self._swapab_kw("gate_up")

    def _out(self, mod, x, compiled: bool, name: str = "o_proj", residual: torch.Tensor | None = None,
             scale: torch.Tensor | None = None):
        """mod(x) for a layer's o_proj / down_proj: `ops.skinny_linear` where it applies (`_out_skinny`), else the
        module (peft wrappers included). residual: where the swap-AB kernel runs, a `_Resid` (residual + mod(x),
        added in its epilogue; scale: the next norm's weight, for its hn), else mod(x)."""
        if not self._out_skinny(mod, x, compiled, name):
            return mod(x)
        cnt = self._counters(mod, mod.out_features, x.device)
        if residual is not None and self.skinny_impl == "swapab":
            return _Resid(*skinny_linear(x, mod.weight, cnt, residual=residual, scale=scale, **self._skinny_kw(name)))
        return skinny_linear(x, mod.weight, cnt, **self._skinny_kw(name))

    def _pre_norm_ok(self, fl, indexed: bool, B: int) -> bool:
        """Whether a layer's input RMSNorm can run in its fused q/k/v GEMM's prologue (`fuse_norm`): the swap-AB
        q/k/v GEMM computes every projection the layer reads from x (an indexer layer's too, its per-token work in
        the q/k launch)."""
        return (fl is not None and fl.qkv is not None and fl.qkv.bias is None and self.skinny_impl == "swapab"
                and "qkv" in self.skinny_gemm and B <= SKINNY_MAX_ROWS and not self.qkv_weight_left
                and (not indexed or (len(fl.qkv.sizes) == 6 and self.fuse_indexer)))

    def set_blas(self, name: str | None) -> None:
        """The eager decode step's BLAS library from the next step (see the class docstring)."""
        self.blas = _check_blas(name)
        self.drop_graphs()

    def _skinny_choice(self, names, impl, tiles) -> tuple:
        """(GEMMs, kernel, swapab tiles) from `skinny_gemm` / `skinny_impl` / `skinny_tiles`, each None its
        default: `skinny_default(device)`, SKINNY_IMPL, SKINNY_TILES (for swapab; none for splitk)."""
        impl = _skinny_impl(SKINNY_IMPL if impl is None else impl)
        gemms = skinny_default(self.device, self.dtype) if names is None else _skinny_set(names)
        return gemms, impl, _skinny_tiles((SKINNY_TILES if impl == "swapab" else {}) if tiles is None else tiles)

    def _pdl_default(self) -> int:
        """The PDL level of `pdl=None`: PDL_SWAPAB while swapab GEMMs run (they want the previous kernel's trigger),
        else PDL_DEFAULT."""
        return PDL_SWAPAB if self.skinny_gemm and self.skinny_impl == "swapab" else PDL_DEFAULT

    def set_skinny_gemm(self, names, impl: str | None = None, tiles=None) -> None:
        """Which GEMMs run as `ops.skinny_linear` from the next step, its kernel and swapab's tiles per site, each
        None its default (see the class docstring). The PDL level is not changed: `set_pdl` after (None: the
        level that goes with the new choice)."""
        self.skinny_gemm, self.skinny_impl, self.skinny_tiles = self._skinny_choice(names, impl, tiles)
        self.drop_graphs()

    def _mlp(self, mlp, fl, x, compiled: bool = False, residual: torch.Tensor | None = None,
             scale: torch.Tensor | None = None):
        """The MLP of one token per row: one gate/up GEMM and `ops.silu_mul` when fused, else the module.
        residual: the down GEMM adds it in its epilogue where it can (a `_Resid` then, see `_out`; scale its hn's)."""
        if fl is None or fl.gate_up is None:
            return mlp(x)
        kw = self._silu_kw(fl, x)
        if kw is not None:
            return self._out(mlp.down_proj, skinny_silu_mul(x, fl.gate_up.weight, **kw), compiled, "down_proj",
                             residual, scale)
        gu = fl.gate_up(x, skinny=self._skinny("gate_up", fl.gate_up, x), skinny_kw=self._skinny_kw("gate_up"))
        if fl.silu:
            a = silu_mul(gu, pdl=self.pdl)
        else:
            g, u = gu.split(fl.gate_up.sizes, dim=1)
            a = mlp.act_fn(g) * u
        return self._out(mlp.down_proj, a, compiled, "down_proj", residual, scale)

    def _fused_post_norm(self, layer, fl, o, res, chain: torch.Tensor | None = None):
        """The layer's o_proj, residual add, RMSNorm and MLP with the add and the norm inside the GEMMs (`fuse_norm`):
        o_proj's epilogue writes h = res + o_proj(o), each tile's per-row sum of h^2 and hn = h * the norm's weight;
        the fused gate/up (with SiLU * up) multiplies hn and scales its sums by 1 / rms(h) from those sums; one launch
        a layer fewer than `add_rmsnorm`. o `[B, H * D]`, res `[B, hidden]` -> (h, the MLP's output: with chain (the
        next layer's input norm weight), a `_Resid`, the down GEMM adding h so the next layer's q/k/v GEMM
        normalizes it the same way), or None where it does not apply (needs the swap-AB o_proj and gate/up,
        `fuse_silu`, a plain bias-free o_proj, at most SKINNY_MAX_ROWS rows). Same values as the unfused path up to
        bf16 rounding (the norm's weight rounded into hn, 1 / rms applied once in fp32: `ops.skinny_linear`)."""
        op, mlp, norm = layer.self_attn.o_proj, layer.mlp, layer.post_attention_layernorm
        kw_g = self._silu_kw(fl, o) if self.fuse_norm and self.fused and res is not None else None
        if kw_g is None or not self._out_skinny(op, o, False, "o_proj"):
            return None
        h, ps, hn = self._out(op, o, False, "o_proj", res, norm.weight)
        a = skinny_silu_mul(hn, fl.gate_up.weight, norm=(ps, norm.variance_epsilon), **kw_g)
        return h, self._out(mlp.down_proj, a, False, "down_proj", None if chain is None else h, chain)

    def set_fuse_norm(self, on: bool) -> None:
        """The residual adds + RMSNorms inside the swap-AB GEMMs (True) or `add_rmsnorm`'s launches from the next step
        (the CUDA graphs hold the old launches: dropped when the choice changes)."""
        self._set_launch_flag("fuse_norm", on)

    @staticmethod
    def _indexer_step(ix, x, cos, sin, pos, k_cache, backend, z=None, k_scale=None, pdl: bool = False):
        """The indexer for one token per row, eager: its three projections (z, their outputs from the
        layer's fused GEMM, else the modules themselves, so peft wrappers apply), then
        `ops.indexer_decode` (one Triton launch on a GPU for what the module's elementwise ops take ~20)
        writing the key into k_cache `[B, S_max, d_I]` (fp8: quantized, its scale into k_scale `[B, S_max]`).
        x `[B, hidden]`, cos/sin `[B, 1, D_h]` -> q_I `[B, H_I, d_I]`, w `[B, H_I]`."""
        zq, zk, zw = z if z is not None else (ix.wq(x), ix.wk(x), ix.ww(x))
        return indexer_decode(zq, zk, zw, cos[:, 0], sin[:, 0], ix.k_norm.weight, ix.k_norm.bias, ix.k_norm.eps,
                              ix.rope_dim, pos, k_cache, k_scale, backend=backend, pdl=pdl)

    def _attend(self, q, kc, vc, sel, scale, backend, compiled, pdl: bool = False):
        """q `[B, H, D]`, full layer caches `[B, S_max, H_kv, D]`, sel `[B, K]` -> `[B, H, D]`."""
        if compiled:
            return C.sparse_decode(q, kc, vc, sel, scale, backend)
        return sparse_decode(q, kc, vc, sel, scale=scale, backend=backend, pdl=pdl,
                             merge="fused" if self.fuse_merge else "kernel")[0]

    def _grouped(self, st, index, short: bool, compiled: bool, B: int) -> bool:
        """Whether this layer's select + attention run in row groups (`select_streams`): eager, an indexer
        layer with token-level rows that selects this step (not `short`), at least one row a group."""
        return (self.select_streams > 1 and not compiled and index is not None and not st.cfg.granular
                and not short and B >= self.select_streams)

    def _grouped_select_attend(self, st, q, kc, vc, index, pos, S: int, dsel: DecodeSelect, scale, pdl: int):
        """The layer's select and sparse attention over `select_streams` groups of rows, group g > 0 on side
        stream g - 1 (forked from the current stream and joined back; on a CPU the groups run in turn). q
        `[B, H, D]`, kc / vc `[B, S_max, H_kv, D]`, index (q_I `[B, H_I, d_I]`, w `[B, H_I]`, the index-key cache
        `[B, S_max, d_I]`[, its fp8 scales `[B, S_max]`]), pos `[B]` int32 -> `[B, H, D]`. Every row's keys and
        output are the whole batch's: each row's select and attention read only that row. Each group takes the
        decode select without `sync_min_batch` (the sync select's barrier counters are one buffer a device, and
        two of its launches at once could each wait on programs the other keeps from running), and the attention's
        split of the whole batch (its heuristic fills the GPU with one group's programs alone)."""
        B, n = q.shape[0], self.select_streams
        if dsel.sync_min_batch:
            dsel = dataclasses.replace(dsel, sync_min_batch=0)
        nsplit = None
        cuda = q.is_cuda
        if cuda:
            from sparse_rl.sparse.ops.sparse_attention.triton import decode_splits

            nsplit = decode_splits(B, kc.shape[2], st.cfg.topk, q.device)
            main = torch.cuda.current_stream(q.device)
            for side in self._side_streams[:n - 1]:  # fork before any group's work: each waits only for the
                side.wait_stream(main)                # layer's inputs, not for the groups issued before it
        outs = []
        for g in range(n):
            r = slice(B * g // n, B * (g + 1) // n)
            with torch.cuda.stream(self._side_streams[g - 1]) if cuda and g else contextlib.nullcontext():
                sel = select(st, q[r], kc[r], tuple(t[r] for t in index), pos=pos[r], S=S, ops=DecodeOps,
                             decode_select=dsel)
                # the merge as its own launch: the fused one's counters are one buffer a device (groups run at once)
                outs.append(sparse_decode(q[r], kc[r], vc[r], sel, scale=scale, backend=st.backend, pdl=pdl,
                                          nsplit=nsplit)[0])
        if cuda:
            for side in self._side_streams[:n - 1]:
                main.wait_stream(side)
        return torch.cat(outs)

    def set_select_streams(self, n: int) -> None:
        """Row groups (and CUDA streams) of the sparse layers' select + attention from the next step (see the
        class docstring); the CUDA graphs hold the old launches and are dropped when n changes."""
        n = int(n)
        if n < 1:
            raise SparseRLError(f"select_streams {n}: must be at least 1")
        if self.is_cuda:
            while len(self._side_streams) < n - 1:
                self._side_streams.append(torch.cuda.Stream(self.device))
        if n != self.select_streams:
            self.select_streams = n
            self.drop_graphs()

    def _short(self, S: int, mode: str) -> bool:
        return mode == "sparse" and all(st is None or S <= st.cfg.topk for st in self.states)

    def _keys(self, cache: KVCache, S: int) -> torch.Tensor:
        """`[S]` arange as a view of one per-cache buffer (a stable address for the CUDA graphs)."""
        ks = self._arange.get(id(cache.k))
        if ks is None or ks.shape[0] < cache.s_max:
            ks = self._arange[id(cache.k)] = torch.arange(cache.s_max, device=self.device)
        return ks[:S]

    def decode_eager(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, S: int, mode: str) -> torch.Tensor:
        """tokens `[B]` (B = all slots), pos `[B]` (each slot's position for this token) -> logits `[B, V]`."""
        with _blas_library(self.blas, self.is_cuda):
            return self._decode_core(tokens, pos, torch.arange(S, device=tokens.device), cache.k, cache.v, cache.idx,
                                     cache.idx_scale, mode, self._short(S, mode), False, cache=cache)

    def _compiled_fn(self, mode: str, short: bool):
        key = (mode, short)
        fn = self._compiled.get(key)
        if fn is None:
            runner = self

            def step(tokens, pos, keys, k_all, v_all, idx_all, scale_all):
                return runner._decode_core(tokens, pos, keys, k_all, v_all, idx_all, scale_all, mode, short, True)

            fn = self._compiled[key] = torch.compile(C.fresh_function(step), dynamic=None,
                                                     backend=C.counting_backend(self.compile_backend,
                                                                                self.compile_stats,
                                                                                pdl=self._inductor_pdl()))
        return fn

    def decode_compiled(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, S: int,
                        mode: str) -> torch.Tensor:
        """The compiled step (raises what compilation raises; `_step` falls back)."""
        short = self._short(S, mode)
        keys = self._keys(cache, S)
        torch._dynamo.mark_dynamic(keys, 0)  # one graph for every bucket S
        # everything else static: dynamo's automatic-dynamic state is keyed by the code's file, line
        # and name, so it is shared by every runner's copy of `step` (and kept on disk between
        # processes); a second engine with another batch would otherwise compile a graph dynamic
        # in B and the cache shapes
        for t in (tokens, pos, cache.k, cache.v, cache.idx, cache.idx_scale):
            if t is not None:
                torch._dynamo.mark_static(t)
        first = (mode, short) not in self._compiled
        graphs0, t0 = self.compile_stats["graphs"], time.perf_counter()
        out = self._compiled_fn(mode, short)(tokens, pos, keys, cache.k, cache.v, cache.idx, cache.idx_scale)
        if first:
            if self.compile_stats["graphs"] == graphs0:
                raise RuntimeError("dynamo compiled no graph for the decode step (recompile limit reached?)")
            self.compile_stats["seconds"] += time.perf_counter() - t0
        return out

    def _step(self, cache, tokens, pos, S, mode):
        """One decode step, compiled when enabled; a failed compilation falls back to the eager step
        for good and leaves its reason in `compile_error`."""
        if self.compile and not self._granular(mode):
            try:
                return self.decode_compiled(cache, tokens, pos, S, mode)
            except Exception as e:
                self._compile_failed(e)
        return self.decode_eager(cache, tokens, pos, S, mode)

    def _compile_failed(self, e: Exception) -> None:
        # one line, but with the wrapped cause (dynamo puts it on the message's next lines)
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        self.compile = False
        self.compile_error = f"{type(e).__name__}: {' '.join(lines[:3])[:400]}"
        self._compiled.clear()
        self._graphs.clear()  # graphs of the compiled step, if any: every bucket is recaptured eagerly
        if self.is_cuda:
            torch.cuda.synchronize()

    def _granular(self, mode: str) -> bool:
        """Granular selection (key blocks, query groups) runs the eager step, never the compiled one: the
        compiled step's inputs do not carry the query-group buffers (`cache.group`). Its decode select
        has static shapes per bucket and reads nothing back to the host (`ops.granular_topk_decode`,
        the indexer's decode top-k for token-level groups), so the eager step is captured in CUDA graphs."""
        return mode == "sparse" and any(s is not None and s.cfg.granular for s in self.states)

    def graphable(self, mode: str) -> bool:
        """Block selection is per row with host-side positions, so it runs without graphs."""
        if not self.use_graphs:
            return False
        return not (mode == "sparse" and any(s is not None and s.cfg.selector == "block" for s in self.states))

    def decode(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, S: int, mode: str) -> torch.Tensor:
        """One decode step; replays a CUDA graph captured per (mode, S, cache) when possible."""
        if not self.graphable(mode):
            return self._step(cache, tokens, pos, S, mode)
        key = (mode, S, id(cache.k))
        st = self._static.get(id(cache.k))
        if st is None:
            st = self._static[id(cache.k)] = (torch.zeros_like(tokens), torch.zeros_like(pos))
        st[0].copy_(tokens)
        st[1].copy_(pos)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(cache, st[0], st[1], S, mode)
            except Exception as e:
                if self.compile:  # the compiled step did not capture: the eager one may
                    self._compile_failed(RuntimeError(f"CUDA graph capture of the compiled step failed: "
                                                      f"{type(e).__name__}: {e}"))
                    return self.decode(cache, tokens, pos, S, mode)
                # keep generating, eagerly; the reason stays visible in graph_error
                self.use_graphs = False
                self.graph_error = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize()
                return self.decode_eager(cache, tokens, pos, S, mode)
            self._graphs[key] = entry
        entry[0].replay()
        return entry[1]

    def _capture(self, cache, tok, pos, S, mode):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles (dynamo, Triton), settles allocations
            for _ in range(2):
                self._step(cache, tok, pos, S, mode)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # no fallback inside a capture: a compiled step that fails here is handled by `decode`
        step = self.decode_compiled if self.compile and not self._granular(mode) else self.decode_eager
        with torch.cuda.graph(graph, pool=self._pool):
            out = step(cache, tok, pos, S, mode)
        return graph, out

    def sync_weights(self) -> bool:
        """Re-concatenate the fused projections whose parameters were given new storage since (see
        fused_weights.py; in-place updates need nothing), dropping the CUDA graphs that read the old
        buffers. Returns whether anything was rebuilt."""
        if self.fused_layers is None:
            return False
        stale = [i for i, fl in enumerate(self.fused_layers) if not fl.valid()]
        for i in stale:
            self.fused_layers[i] = FusedLayer.build(self.layers[i], self.qkv_pad)
        if stale:
            self.drop_graphs()
        return bool(stale)

    def set_qkv_pad(self, pad: int) -> None:
        """Rebuild the fused q/k/v(+indexer) weights padded with zero rows to a multiple of `pad` output
        columns (1: none), dropping the CUDA graphs. Why: at N = 6468 (Qwen3-4B's q/k/v + a 4 x 64
        indexer) the output rows are not 16-byte aligned and cuBLAS ran an sm80 `align2` kernel at 2.25x
        the weight's bytes at M = 32 on the H200 (results/2026-12-01-h200-rollout-session7.md)."""
        self.qkv_pad = int(pad)
        if self.fused_layers is not None:
            self.fused_layers = [FusedLayer.build(layer, self.qkv_pad) for layer in self.layers]
            self.drop_graphs()

    def set_pdl(self, pdl: bool | int | None) -> None:
        """Programmatic dependent launch from the next step (see the class docstring), dropping the CUDA graphs
        (they hold the old launches) when the level changes, and the compiled steps when inductor's flag does (it
        is fixed at compile)."""
        new, ind = resolve_pdl(pdl, self.device, self._pdl_default()), self._inductor_pdl()
        old, self.pdl, self._pdl_asked = self.pdl, new, pdl
        if self._inductor_pdl() != ind:
            self._compiled.clear()
        if new != old or self._inductor_pdl() != ind:
            self.drop_graphs()

    def _inductor_pdl(self) -> bool:
        """Whether the compiled step compiles under inductor's `triton.enable_pdl`: only when `pdl` was asked for
        (not by default: it was never timed; the default covers the eager step's own kernels)."""
        return bool(self.pdl) and self._pdl_asked is not None

    def set_fuse_silu(self, on: bool) -> None:
        """SiLU(gate) * up in the swap-AB gate/up GEMM (True) or its own launch from the next step (the CUDA graphs
        hold the old launches: dropped when the choice changes)."""
        self._set_launch_flag("fuse_silu", on)

    def _set_launch_flag(self, name: str, on: bool) -> None:
        """Set one of the step's launch choices (a bool attribute), dropping the CUDA graphs, which hold the old
        launches, when it changes."""
        if bool(on) != getattr(self, name):
            setattr(self, name, bool(on))
            self.drop_graphs()

    def set_fuse_merge(self, on: bool) -> None:
        """The split decode attention's merge inside the attention kernel (True) or as its own launch from the next
        step (the CUDA graphs hold the old launches: dropped when the choice changes)."""
        self._set_launch_flag("fuse_merge", on)

    def set_fuse_indexer(self, on: bool) -> None:
        """One launch (True) or two for a sparse layer's q/k RoPE and its indexer from the next step (the CUDA
        graphs hold the old launches: dropped when the choice changes)."""
        self._set_launch_flag("fuse_indexer", on)

    def set_decode_select(self, decode_select: DecodeSelect) -> None:
        """Run `decode_select` from the next step on, dropping the CUDA graphs (they hold the old kernels;
        compiled steps are recompiled, since dynamo guards on the attribute)."""
        self.decode_select = decode_select
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget captured graphs (compiled steps stay: their parameters and caches are inputs)."""
        self._graphs.clear()
        self._static.clear()
        self._arange.clear()
        self._pool = None

    def check_supported(self, max_seq_len: int) -> None:
        wins = [w for w in (getattr(layer.self_attn, "sliding_window", None) for layer in self.layers) if w]
        if wins and max_seq_len > min(wins):
            raise SparseRLError(f"max_seq_len {max_seq_len} exceeds the model's sliding window ({min(wins)}): the "
                                "rollout engine attends fully, so keep sequences within the window")
