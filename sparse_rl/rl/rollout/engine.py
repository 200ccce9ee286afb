"""The rollout engine: batched prefill + decode over a slot KV cache, continuous batching, log-probs.

    engine = RolloutEngine(model, tokenizer, max_batch=64, max_seq_len=4096)
    outs = engine.generate(prompts, SamplingParams(samples=4, temperature=1.0, max_new_tokens=512))

Scheduling: `max_batch` slots. A prompt is admitted when `n` slots are free; its prompt is
prefilled once (batched with the other prompts admitted in the same round, right-padded) and the
filled cache rows are copied to the other n-1 slots. Every step decodes one token for all live
slots; a finished sequence frees its slot and the next waiting prompt takes it after the step in
flight, so long and short generations share the batch. Each step is launched before the host reads
the previous one (its tokens feed the next step on the device), so the GPU does not wait on the
host's bookkeeping; rows of sequences that turn out to have ended in the previous step are dropped.

Finish reasons (OpenAI's): "stop" for an EOS id or a stop string, "length" for max_new_tokens or a
full cache row. Tokens include the EOS token / the token that completed a stop string; the text is
decoded without special tokens and cut before the first stop string.

Weights: the engine runs the model's own modules (see forward.py), so in-place parameter updates
(optimizer steps, `load_state_dict`) are live at the next step, CUDA graphs and the compiled step
included (the graphs hold the parameters' addresses; the compiled step takes them as inputs).
`refresh()` drops captured graphs; call it if parameters were replaced by new tensors rather than
updated in place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.rl.rollout.cache import KVCache
from sparse_rl.rl.rollout.forward import ModelRunner, _base
from sparse_rl.rl.rollout.sampler import Sampler, SamplingParams, to_device
from sparse_rl.sparse.layer import get_attention, set_attention


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    tokens: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str
    prompt_tokens: list[int]


@dataclass
class _Step:
    """A launched decode step: its slots with their request ids, steps and positions, the sampled tokens
    on the device (the next step's inputs) and their host copies with the event that completes them."""
    slots: list[int]
    rids: list[int]
    steps: list[int]
    pos: list[int]
    tok_dev: torch.Tensor
    tok_host: torch.Tensor
    lp_host: torch.Tensor
    event: object


@dataclass
class _Seq:
    prompt_index: int
    sample_index: int
    rid: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gc = getattr(_base(model), "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(_base(model).config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    return {int(i) for i in ids}


class RolloutEngine:
    """Fast sampling from a loaded HF causal LM (dense or sparse attention).

    model: an HF causal LM from `sparse_rl.sparse.loader.load_model` (or any llama/qwen2/qwen3/
    mistral model); tokenizer: needed for str prompts, texts and stop strings.
    max_batch: decode slots. max_seq_len: cache rows per slot (prompt + completion); None grows the
    cache to each call's need, up to the model's max_position_embeddings.
    device: where the model lives (default: its parameters' device). use_cuda_graphs: default on CUDA.
    compile: torch.compile the decode step (inductor), captured in the CUDA graphs; default off
    (`SPARSE_RL_COMPILE=1` turns it on; see forward.default_compile). A failed compilation falls back to
    the eager step: `engine.runner.compile_error` says why. compile_backend: the dynamo backend.
    fuse_projections: one GEMM for each layer's q/k/v (+ indexer) and gate/up projections in the eager
    step (default on CUDA); the model's parameters then live in the concatenated buffers (forward.py).
    prefill_chunk: chunked prefill (as vLLM's and SGLang's): no prefill call takes more than this many
    prompt tokens; a longer prompt is prefilled a chunk at a time, each chunk followed by a decode step
    of the running sequences, so that long prompts do not stall decoding (None: whole prompts, up to
    max_prefill_tokens a call; granular selection always prefills whole prompts).
    runner_options: keyword arguments of `ModelRunner` for its kernel choices: qkv_pad, decode_select
    (a `DecodeSelect`); defaults when absent.
    """

    def __init__(self, model, tokenizer=None, max_batch: int = 32, max_seq_len: int | None = None,
                 device=None, use_cuda_graphs: bool | None = None, eos_token_ids: Sequence[int] | None = None,
                 bucket: int = 256, max_prefill_tokens: int = 32768, compile: bool | None = None,
                 compile_backend="inductor", fuse_projections: bool | None = None,
                 prefill_chunk: int | None = None, runner_options: dict | None = None):
        if max_batch < 1:
            raise UsageError(f"max_batch must be >= 1 (got {max_batch})")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise UsageError(f"prefill_chunk must be >= 1 tokens (got {prefill_chunk})")
        self.model = model
        self.tokenizer = tokenizer
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        # runner_options: ModelRunner's kernel choices (qkv_pad, decode_select), its defaults when absent
        self.runner = ModelRunner(model, dev, use_cuda_graphs, compile=compile, compile_backend=compile_backend,
                                  fuse_projections=fuse_projections, **(runner_options or {}))
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.bucket = bucket
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk = prefill_chunk
        self.eos = set(eos_token_ids) if eos_token_ids is not None else _eos_ids(model, tokenizer)
        self.sampler = Sampler(self.runner.vocab, dev)
        self.cache: KVCache | None = None
        self._lora_base: dict[str, torch.Tensor] | None = None
        self.stats = {"prefill_tokens": 0, "decode_steps": 0, "generated_tokens": 0}

    # ------------------------------------------------------------------ config
    @property
    def mode(self) -> str:
        """The attention mode, read from the model's sparse layers (`sparse.layer.get_attention`)."""
        return get_attention(self.model)

    def set_attention(self, mode: str) -> None:
        """Switch the engine's model between "dense" and "sparse" attention (`sparse.layer.set_attention`:
        the model's HF forward follows too)."""
        set_attention(self.model, mode)

    def refresh(self) -> None:
        """Forget captured CUDA graphs (recaptured lazily). Needed only when parameters were replaced by
        new tensors; in-place updates are seen without it (and fused projections whose parameters were
        replaced are concatenated again at the next generation anyway)."""
        self.runner.drop_graphs()
        self.runner.sync_weights()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy `state` (full or partial, HF parameter names; a peft model's `base_model.model.` prefix and
        `.base_layer.` are accepted) into the engine's model in place. Unknown keys are an error."""
        own = _base(self.model).state_dict(keep_vars=True)
        norm = {}
        for k, v in state.items():
            key = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
            if key not in own:
                raise SparseRLError(f"load_state_dict: unknown parameter '{k}' (LoRA weights go through load_lora)")
            norm[key] = v
        with torch.no_grad():
            for k, v in norm.items():
                own[k].copy_(v)
        self._lora_base = None

    def load_lora(self, src, scaling: float | None = None, adapter_name: str = "default") -> int:
        """Merge a LoRA adapter into the engine's weights: W = W_base + scaling * B @ A.

        src: a peft model (its base weights and `get_delta_weight` are used, so the engine gets exactly
        the peft model's current policy), or an adapter state dict (peft key names, `lora_A`/`lora_B`)
        with `scaling` (= lora_alpha / r); W_base is then the engine's weights at the first such call
        (reset by `load_state_dict`). The engine must hold its own copy of the base model: a model
        wrapped by peft itself already runs its LoRA layers live. Returns the number of merged modules.
        """
        base = _base(self.model)
        with torch.no_grad():
            if isinstance(src, torch.nn.Module):
                n = 0
                for name, mod in src.named_modules():
                    if not (hasattr(mod, "get_delta_weight") and hasattr(mod, "base_layer")):
                        continue
                    if adapter_name not in getattr(mod, "lora_A", {}):
                        continue
                    target = self._target(base, name)
                    target.weight.copy_(mod.base_layer.weight + mod.get_delta_weight(adapter_name))
                    n += 1
                return n
            if scaling is None:
                raise UsageError("load_lora(state_dict): pass scaling = lora_alpha / r")
            pairs: dict[str, dict[str, torch.Tensor]] = {}
            for k, v in src.items():
                for part in ("lora_A", "lora_B"):
                    if f".{part}." in k:
                        mod_name = k.split(f".{part}.")[0]
                        pairs.setdefault(mod_name, {})[part] = v
                        break
                else:
                    raise SparseRLError(f"load_lora: unexpected adapter key '{k}' (only lora_A/lora_B of Linear layers)")
            if self._lora_base is None:
                self._lora_base = {}
            for mod_name, ab in pairs.items():
                if set(ab) != {"lora_A", "lora_B"}:
                    raise SparseRLError(f"load_lora: '{mod_name}' lacks {({'lora_A', 'lora_B'} - set(ab)).pop()}")
                target = self._target(base, mod_name)
                key = mod_name.removeprefix("base_model.model.")
                if key not in self._lora_base:
                    self._lora_base[key] = target.weight.detach().clone()
                w0 = self._lora_base[key]
                delta = (ab["lora_B"].to(torch.float32) @ ab["lora_A"].to(torch.float32)) * scaling
                target.weight.copy_((w0.float() + delta.to(w0.device)).to(w0.dtype))
            return len(pairs)

    @staticmethod
    def _target(base, name: str):
        key = name.removeprefix("base_model.model.")
        try:
            mod = base.get_submodule(key)
        except AttributeError:
            raise SparseRLError(f"load_lora: the engine's model has no module '{key}'") from None
        if hasattr(mod, "base_layer"):
            raise SparseRLError(f"load_lora: '{key}' is itself a LoRA layer (the engine wraps the peft model, whose "
                                "adapters already run live); give the engine its own copy of the base model")
        return mod

    # ------------------------------------------------------------------ cache
    def _cap(self) -> int:
        return self.max_seq_len or int(getattr(self.runner.config, "max_position_embeddings", 1 << 30))

    def _ensure_cache(self, need: int) -> KVCache:
        need = min(self._cap(), need)
        if self.max_seq_len is not None:
            need = self.max_seq_len
        if self.cache is None or self.cache.s_max < need:
            self.cache = None
            self.runner.drop_graphs()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            s_max = need if self.max_seq_len else min(self._cap(), -(-need // self.bucket) * self.bucket)
            self.runner.check_supported(s_max)
            self.cache = KVCache.allocate(self.runner.n_layers, self.max_batch, s_max, self.runner.H_kv,
                                          self.runner.D, self.runner.index_dim if self.mode == "sparse" else None,
                                          self.runner.dtype, self.device, self.runner.index_dtype)
        if self.mode == "sparse" and self.runner.index_dim and self.cache.idx is None:
            self.cache.add_index(self.runner.index_dim, self.runner.dtype, self.runner.index_dtype)
            self.runner.drop_graphs()
        return self.cache

    # ------------------------------------------------------------------ warm-up / timing
    def _bucket(self, length: int, s_max: int) -> int:
        return min(s_max, -(-length // self.bucket) * self.bucket)

    @torch.inference_mode()
    def warmup(self, max_len: int, prompts: list | None = None) -> None:
        """Compile kernels and capture the decode graph of every cache bucket up to `max_len` tokens,
        so that a timed `generate` pays none of it (the graphs are kept until `refresh`). prompts: also
        prefill these (one new token each), so that the prefill kernels are compiled for the batch and
        prompt lengths the timed run will prefill: the sparse prefill's Triton kernels specialise on them,
        and a first sparse prefill of 32 x 128 tokens paid ~7 s of compiling in a timed 2,600-token
        generation on an H200 (session 12, benchmarks/gpu_realgen_session12.py)."""
        cache = self._ensure_cache(max_len)
        self.generate([[0] * 8], SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=False))
        if prompts:
            self.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True, logprobs=False))
        if not self.runner.graphable(self.mode):
            return
        zeros = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        for S in range(self.bucket, self._bucket(max_len, cache.s_max) + self.bucket, self.bucket):
            self.runner.decode(cache, zeros, zeros, min(S, cache.s_max), self.mode)

    @torch.inference_mode()
    def time_step(self, pos: int, reps: int = 20, queued: bool = False) -> float:
        """Milliseconds of one decode step with every slot at position `pos` (CUDA events on a GPU).
        queued=False: the median of `reps` steps, each launched on an idle device and waited for; queued=True:
        `reps` steps launched back to back between two events, their mean, as a generation runs them (its loop
        queues the next step before the last one ends, so no step starts on an idle device or waits for the
        host's launch)."""
        self.runner.sync_weights()
        cache = self._ensure_cache(pos + 1)
        tok = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        p = torch.full_like(tok, pos)
        S = self._bucket(pos + 1, cache.s_max)
        self.runner.decode(cache, tok, p, S, self.mode)
        if queued and self.device.type == "cuda":
            self.runner.decode(cache, tok, p, S, self.mode)  # the device busy before the first timed step
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                self.runner.decode(cache, tok, p, S, self.mode)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / reps
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                self.runner.decode(cache, tok, p, S, self.mode)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                import time

                t0 = time.perf_counter()
                self.runner.decode(cache, tok, p, S, self.mode)
                times.append(1000 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]

    # ------------------------------------------------------------------ generate
    def _encode(self, prompts) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise UsageError("string prompts need a tokenizer (RolloutEngine(model, tokenizer))")
                p = self.tokenizer(p, add_special_tokens=True)["input_ids"]
            p = [int(t) for t in p]
            if not p:
                raise SparseRLError(f"prompt {i}: empty (no tokens)")
            if max(p) >= self.runner.vocab or min(p) < 0:
                raise SparseRLError(f"prompt {i}: token id out of range for a vocabulary of {self.runner.vocab}")
            out.append(p)
        return out

    def _text(self, tokens: list[int], stop: list[str]) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    def _hit_stop(self, tokens: list[int], stop: list[str]) -> bool:
        if not stop or self.tokenizer is None:
            return False
        window = 4 * max(len(s) for s in stop) + 4  # a stop string spans at most this many tokens
        tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[str], params: SamplingParams | None = None,
                 on_complete: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Sample `params.samples` completions per prompt. Returns them ordered by (prompt, sample);
        `on_complete` is called as each one finishes. The model runs in eval mode (no dropout, e.g.
        peft's lora_dropout) and is put back in its previous mode afterwards."""
        self.runner.sync_weights()
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, params, on_complete)
        finally:
            self.model.train(was_training)

    @torch.inference_mode()
    def _generate(self, prompts, params, on_complete) -> list[Completion]:
        p = params or SamplingParams()
        if p.samples > self.max_batch:
            raise UsageError(f"--samples {p.samples} exceeds the batch of {self.max_batch} slots (raise --max-batch)")
        if p.stop and self.tokenizer is None:
            raise UsageError("stop strings need a tokenizer")
        toks = self._encode(prompts)
        if not toks:
            return []
        cap = self._cap()
        for i, t in enumerate(toks):
            if len(t) >= cap:
                raise SparseRLError(f"prompt {i}: {len(t)} tokens leave no room to generate within max_seq_len {cap}")
        cache = self._ensure_cache(max(len(t) for t in toks) + p.max_new_tokens)
        s_max, B, n = cache.s_max, self.max_batch, p.samples
        queue = deque(range(len(toks)))
        free = deque(range(B))
        live: dict[int, _Seq] = {}
        results: list[Completion | None] = [None] * (len(toks) * n)

        def finish(slot: int, reason: str) -> None:
            s = live.pop(slot)
            free.append(slot)
            c = Completion(s.prompt_index, s.sample_index, s.tokens, self._text(s.tokens, p.stop),
                           s.logprobs if p.logprobs else None, reason, s.prompt)
            results[s.rid] = c
            if on_complete is not None:
                on_complete(c)

        def push(slot: int, tok: int, lp: float) -> None:
            s = live[slot]
            s.tokens.append(tok)
            s.logprobs.append(lp)
            self.stats["generated_tokens"] += 1
            if not p.ignore_eos and tok in self.eos:
                finish(slot, "stop")
            elif self._hit_stop(s.tokens, p.stop):
                finish(slot, "stop")
            elif len(s.tokens) >= p.max_new_tokens or len(s.prompt) + len(s.tokens) >= s_max:
                finish(slot, "length")

        def launch(slots: list[int], rids: list[int], steps: list[int], pos: list[int], tokens,
                   parked: dict[int, int]) -> _Step:
            """Enqueue one decode step for `slots` (the other slots compute on dummies) and its sampling;
            tokens: host ints, or the device tokens `[len(slots)]` of the step in flight. parked: slots
            of a prompt being prefilled in chunks -> the row their dummy writes (its next chunk's first,
            rewritten by that chunk), so that the dummy never overwrites a prefilled row."""
            full = len(slots) == B  # slots are sorted: then they are 0..B-1
            idx = None if full else to_device(torch.tensor(slots, dtype=torch.long), self.device)
            if isinstance(tokens, list):
                tok_t = torch.zeros(B, dtype=torch.long).index_copy_(0, torch.tensor(slots), torch.tensor(tokens))
                tok_t = to_device(tok_t, self.device)
            elif full:
                tok_t = tokens
            else:
                tok_t = torch.zeros(B, dtype=torch.long, device=self.device).index_copy_(0, idx, tokens)
            pos_host = [parked.get(sl, 0) for sl in range(B)]
            for sl, q in zip(slots, pos):
                pos_host[sl] = q
            pos_t = to_device(torch.tensor(pos_host, dtype=torch.long), self.device)
            logits = self.runner.decode(cache, tok_t, pos_t, self._bucket(max(pos) + 1, s_max), self.mode)
            sel = logits if full else logits[idx]
            new, lps = self.sampler.sample(sel, p, rids, steps)
            self.stats["decode_steps"] += 1
            return _Step(slots, rids, steps, pos, new, *self._to_host(new, lps))

        def process(st: _Step) -> None:
            """Wait for a launched step's tokens and push them; rows of sequences that finished while it
            was in flight (it was launched on the guess that they go on) are dropped."""
            if st.event is not None:
                st.event.synchronize()
            for sl, rid, t, lp in zip(st.slots, st.rids, st.tok_host.tolist(), st.lp_host.tolist()):
                s = live.get(sl)
                if s is not None and s.rid == rid:
                    push(sl, t, lp)

        def goes_on(sl: int, rid: int) -> bool:
            """Whether request `rid`, in slot `sl` when the step in flight was launched, can take one more
            token after that step's: it is still running (it may have ended in the step before) and has
            room. EOS and stop strings in the step in flight are not known yet: those rows are computed
            and dropped."""
            s = live.get(sl)
            if s is None or s.rid != rid:
                return False
            return len(s.tokens) + 1 < p.max_new_tokens and len(s.prompt) + len(s.tokens) + 1 < s_max

        # The next step is launched before the host reads the one in flight, so the GPU does not wait on
        # the host's bookkeeping (token lists, stop checks, the next inputs): one step is always queued
        # ahead. Admissions (and chunks of a chunked prefill) run between steps with nothing in flight.
        chunk = self.prefill_chunk if self.prefill_chunk and not self.runner._granular(self.mode) else None
        budget = min(self.max_prefill_tokens, chunk) if chunk else self.max_prefill_tokens
        pending: deque = deque()  # chunked prompts: [prompt index, slots, rows prefilled so far]
        inflight: _Step | None = None
        while queue or live or inflight is not None or pending:
            if inflight is None:
                if pending:  # one chunk of the oldest chunked prompt, then a decode step
                    self._prefill_chunk(cache, toks, pending, chunk, p, live, push)
                else:  # admit waiting prompts into free slots: one batched prefill per round
                    admit: list[tuple[int, list[int]]] = []
                    longest = 0
                    while queue and len(free) >= n:
                        L = len(toks[queue[0]])
                        if chunk and L > chunk:  # prefilled a chunk at a time, from the next round on
                            pending.append([queue.popleft(), [free.popleft() for _ in range(n)], 0])
                            break
                        if admit and max(longest, L) * (len(admit) + 1) > budget:
                            break
                        longest = max(longest, L)
                        pi = queue.popleft()
                        admit.append((pi, [free.popleft() for _ in range(n)]))
                    if admit:
                        self._prefill(cache, toks, admit, longest, p, live, push)
                if not live:
                    continue
                slots = sorted(live)
                inflight = launch(slots, [live[sl].rid for sl in slots], [len(live[sl].tokens) for sl in slots],
                                  [len(live[sl].prompt) + len(live[sl].tokens) - 1 for sl in slots],
                                  [live[sl].tokens[-1] for sl in slots], self._parked(pending))
            nxt = None
            keep = [i for i, sl in enumerate(inflight.slots) if goes_on(sl, inflight.rids[i])]
            if keep:
                tok_dev = inflight.tok_dev
                if len(keep) < len(inflight.slots):
                    tok_dev = tok_dev[to_device(torch.tensor(keep, dtype=torch.long), self.device)]
                nxt = launch([inflight.slots[i] for i in keep], [inflight.rids[i] for i in keep],
                             [inflight.steps[i] + 1 for i in keep], [inflight.pos[i] + 1 for i in keep], tok_dev,
                             self._parked(pending))
            process(inflight)
            inflight = nxt
            if inflight is not None and ((queue and len(free) >= n) or pending):
                process(inflight)  # drain, so that the freed slots take waiting prompts (or the next chunk runs)
                inflight = None
        return results  # type: ignore[return-value]

    def _to_host(self, new: torch.Tensor, lps: torch.Tensor):
        """Start copying a step's tokens and log-probs to the host: (tokens, log-probs, event to wait on)."""
        if self.device.type != "cuda":
            return new, lps, None
        th = torch.empty(new.shape, dtype=new.dtype, pin_memory=True)
        lh = torch.empty(lps.shape, dtype=lps.dtype, pin_memory=True)
        th.copy_(new, non_blocking=True)
        lh.copy_(lps, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return th, lh, ev

    @staticmethod
    def _parked(pending) -> dict[int, int]:
        """Slots of prompts being prefilled in chunks -> the next row their prefill writes."""
        return {sl: done for _, slots, done in pending for sl in slots}

    def _prefill_chunk(self, cache, toks, pending, chunk: int, p, live, push) -> None:
        """The next chunk of the oldest chunked prompt (its first slot; the samples' slots copy the prefix
        once the last chunk is in), which starts its samples when it completes the prompt."""
        pi, slots, done = pending[0]
        t = toks[pi]
        T = min(chunk, len(t) - done)
        logits = self.runner.prefill(cache, torch.tensor([t[done:done + T]], device=self.device), [T], slots[:1],
                                     self.mode, start=done)
        self.stats["prefill_tokens"] += T
        pending[0][2] = done + T
        if done + T == len(t):
            pending.popleft()
            self._start(cache, toks, [(pi, slots)], [len(t)], logits, p, live, push)

    def _prefill(self, cache, toks, admit, longest, p, live, push) -> None:
        P = len(admit)
        batch = torch.zeros(P, longest, dtype=torch.long)
        lengths = []
        for r, (pi, _) in enumerate(admit):
            t = toks[pi]
            batch[r, :len(t)] = torch.tensor(t)
            lengths.append(len(t))
        logits = self.runner.prefill(cache, batch.to(self.device), lengths, [sl[0] for _, sl in admit], self.mode)
        self.stats["prefill_tokens"] += sum(lengths)
        self._start(cache, toks, admit, lengths, logits, p, live, push)

    def _start(self, cache, toks, admit, lengths, logits, p, live, push) -> None:
        """Prefilled prompts (`admit`: (prompt index, slots), logits `[P, V]` at their last tokens): copy
        each prefix into its samples' slots, register the sequences and sample their first tokens."""
        n = p.samples
        rids, rows, slots = [], [], []
        for r, (pi, sls) in enumerate(admit):
            cache.copy_prefix(sls[0], sls[1:], lengths[r])
            for j, sl in enumerate(sls):
                live[sl] = _Seq(pi, j, pi * n + j, toks[pi], [], [])
                rids.append(pi * n + j)
                rows.append(r)
                slots.append(sl)
        sel = logits[torch.tensor(rows, device=logits.device)]
        new, lps = self.sampler.sample(sel, p, rids, [0] * len(rids))
        for sl, t, lp in zip(slots, new.tolist(), lps.tolist()):
            push(sl, t, lp)


def load_engine(model_dir, attention: str = "dense", device: str = "auto", dtype="auto", max_batch: int = 32,
                max_seq_len: int | None = None, use_cuda_graphs: bool | None = None,
                compile: bool | None = None) -> RolloutEngine:
    """Open a model dir (dense or sparse) and wrap it in an engine (compile: see RolloutEngine)."""
    from sparse_rl.devices import resolve_device
    from sparse_rl.sparse.loader import load_model, load_tokenizer

    device = resolve_device(device)
    model = load_model(model_dir, attention=attention, device=device, dtype=dtype)
    tok = load_tokenizer(model_dir)
    eng = RolloutEngine(model, tok, max_batch=max_batch, max_seq_len=max_seq_len, device=device,
                        use_cuda_graphs=use_cuda_graphs, compile=compile)
    eng.set_attention(attention)
    return eng


def make_generate_fn(model_dir, attention: str = "dense", device: str = "auto", dtype="auto", max_batch: int = 32,
                     chat: bool = False) -> Callable[[list[str], int], list[str]]:
    """A greedy `generate_fn(prompts, max_new_tokens) -> texts` over one loaded engine (eval niah).
    chat: wrap each prompt as a user message with the chat template."""
    eng = load_engine(model_dir, attention, device, dtype, max_batch)

    def generate_fn(prompts: list[str], max_new_tokens: int) -> list[str]:
        ids = [encode_prompt(eng.tokenizer, {"messages": [{"role": "user", "content": q}]} if chat else {"prompt": q})
               for q in prompts]
        outs = eng.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, logprobs=False))
        return [c.text for c in outs]

    return generate_fn


def generate_texts(model_dir, prompts: list[str], max_new_tokens: int = 64, attention: str = "dense",
                   device: str = "auto", dtype="auto", max_batch: int = 32, chat: bool = False) -> list[str]:
    """Greedy completions of `prompts` from a model dir (loads the model once for this call)."""
    return make_generate_fn(model_dir, attention, device, dtype, max_batch, chat)(prompts, max_new_tokens)


def render_prompt(tokenizer, rec: dict) -> str:
    """The text the model sees for a prompt record: `messages` through the chat template (with the
    generation prompt), else `prompt` as it is."""
    if "messages" in rec:
        return tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=False)
    return rec["prompt"]


def encode_prompt(tokenizer, rec: dict) -> list[int]:
    """Token ids of a prompt record. The chat template already holds any BOS, so special tokens are
    added only to plain `prompt` text."""
    text = render_prompt(tokenizer, rec)
    return tokenizer(text, add_special_tokens="messages" not in rec)["input_ids"]
