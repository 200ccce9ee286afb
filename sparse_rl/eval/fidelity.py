"""`eval fidelity`: how far the sparse model's next-token distributions are from the dense ones,
on the same tokens.

For every scored position t (predicting token x_{t+1}) with dense log-probs log p and sparse
log-probs log q over the vocabulary:
  kl         KL(p || q) = sum_v p_v (log p_v - log q_v), the dense policy as reference (as in
             the RL mismatch metrics: π_dense against μ_sparse);
  top1       argmax p == argmax q;
  acceptance min(1, p(x_{t+1}) / q(x_{t+1})) of the actual next token: the probability a
             rejection step would keep a token the sparse model proposed; its 5th percentile
             shows the tail that mismatch corrections (TIS, masking) act on.
  attn_recall per sparse layer and query: the share of the layer's dense attention mass (summed
             over keys, averaged over heads) inside the keys the selector kept, i.e.
             exp(lse_selected - lse_dense) from the patch's `recorder` hook; layers kept dense
             are left out.
Positions are grouped into power-of-two buckets of absolute position, because sparse attention
only drops keys once a query has more predecessors than the top-k budget.

One sparse model dir is loaded once; each sequence runs through the decoder in sparse mode and in
dense mode (`set_attention`), keeping only final hidden states `[T, D]`; logits `[t, V]` are made
from them in chunks of positions so long sequences never hold two `[T, V]` tensors. With an
adapter, the sparse side is the sparse model plus that LoRA adapter (DistillSparse's mu) and the
dense side runs with the adapter disabled (peft's `disable_adapter()`).
Inputs: JSONL with `text`, or completion records (`prompt` as text or chat messages, encoded as the
rollout engine does, + `completion`, whose tokens are taken from `tokens` when it is a list of
ids); only completion positions are scored for those.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

from sparse_rl.errors import SparseRLError, UsageError


@dataclass
class FidelityConfig:
    """Options of `sparse-rl eval fidelity` (YAML keys = these names)."""

    model: Optional[str] = None  # sparse model dir (sparse_config.json + indexer weights)
    adapter: Optional[str] = None  # peft LoRA adapter dir of the sparse policy (grpo's sparse+distill phi)
    data: Optional[str] = None  # JSONL of texts or completions ("-" = stdin)
    out: Optional[str] = None  # results dir: records.jsonl, summary.json, plots
    max_tokens: int = 4096  # longer sequences are truncated to their first max_tokens tokens
    limit: int = 0  # score at most this many records (0 = all)
    device: str = "auto"
    dtype: str = "auto"
    chunk: int = 512  # positions per logits chunk


def bucket_of(pos: int) -> int:
    """Lower edge of the power-of-two bucket of a position: 0 for [0, 32), then [32, 64), [64, 128)..."""
    if pos < 32:
        return 0
    return 1 << (pos.bit_length() - 1)


def _sequences(records: list[dict], tokenizer, max_tokens: int, source: str):
    """Yield (id, input_ids list, first scored position) per record."""
    for i, rec in enumerate(records, 1):
        rid = str(rec.get("id", i))
        if isinstance(rec.get("text"), str):
            ids = tokenizer(rec["text"])["input_ids"]
            start = 0
        elif isinstance(rec.get("prompt"), (str, list)) and isinstance(rec.get("completion"), str):
            from sparse_rl.rl.rollout import encode_prompt

            # the prompt tokens exactly as the rollout engine made them (chat template for messages)
            p = rec["prompt"]
            prompt = encode_prompt(tokenizer, {"prompt": p} if isinstance(p, str) else {"messages": p})
            toks = rec.get("tokens")
            if isinstance(toks, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                comp = toks
            else:
                comp = tokenizer(rec["completion"], add_special_tokens=False)["input_ids"]
            ids, start = prompt + comp, max(len(prompt) - 1, 0)
        else:
            raise SparseRLError(f"{source} record {i}: needs 'text', or 'prompt' (text or chat messages) and "
                                f"'completion'")
        ids = ids[:max_tokens]
        if len(ids) - 1 <= start:
            continue  # nothing to score (a single token, or the completion cut off by max_tokens)
        yield rid, ids, start


@contextlib.contextmanager
def _recall_hooks(model, start: int, sink: dict):
    """While active, every sparse layer's forward puts its attention recall per query position
    into `sink[layer_idx]` (`[T - 1 - start]`: positions start..T-2, as the token metrics; mean
    over heads): the share of the layer's dense attention
    mass that falls inside the selected keys, exp(lse_selected - lse_dense), from the log-sum-exps
    the patch hands its `recorder` hook. Layers kept dense are not sparse and report nothing."""
    from sparse_rl.sparse.layer import set_recorder, sparse_layers
    from sparse_rl.sparse.ops import dense_lse

    hooked = []
    for m in sparse_layers(model):
        i = m.layer_idx

        def rec(module, query, key, kv_start, lse, _i=i, **_):
            # query [B, H, T, D], key [B, H_kv, S, D]; lse and the dense lse are [B, T, H]
            lse_d = dense_lse(query, key, module.scaling, q_offset=key.shape[2] - query.shape[2], kv_start=kv_start)
            sink[_i] = (lse.float() - lse_d).exp()[0, start:-1].mean(-1).cpu()

        hooked.append((m, set_recorder(m, rec)))
    try:
        yield
    finally:
        for m, prev in hooked:
            set_recorder(m, prev)


def compare_sequence(model, input_ids, start: int = 0, chunk: int = 512, recall: bool = True) -> dict:
    """Dense-vs-sparse metrics at positions start..T-2 of one sequence `[T]`.

    Returns float32 CPU tensors `pos, kl, top1, acceptance`, each `[T - 1 - start]`, and with
    `recall` a dict `recall` {sparse layer index: `[T - 1 - start]` attention recall per position}.
    """
    import torch

    from sparse_rl.sparse.loader import set_attention

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its base
    ids = torch.tensor([input_ids], device=next(model.parameters()).device)
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    hidden, recalls = {}, {}
    with torch.no_grad():
        for mode in ("dense", "sparse"):
            set_attention(model, mode)
            hooks = _recall_hooks(model, start, recalls) if (recall and mode == "sparse") else contextlib.nullcontext()
            # A LoRA adapter belongs to the sparse policy mu only; the dense policy runs without it.
            no_lora = model.disable_adapter() if (mode == "dense" and hasattr(model, "disable_adapter")) \
                else contextlib.nullcontext()
            with hooks, no_lora:
                hidden[mode] = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]  # [T, D]
        T = ids.shape[1]
        out = {k: [] for k in ("kl", "top1", "acceptance")}
        for a in range(start, T - 1, chunk):
            b = min(a + chunk, T - 1)
            lp = torch.log_softmax(head(hidden["dense"][a:b]).float(), -1)  # [t, V]
            lq = torch.log_softmax(head(hidden["sparse"][a:b]).float(), -1)
            out["kl"].append((lp.exp() * (lp - lq)).sum(-1).clamp(min=0.0))
            out["top1"].append((lp.argmax(-1) == lq.argmax(-1)).float())
            nxt = ids[0, a + 1:b + 1].unsqueeze(-1)
            ratio = lp.gather(-1, nxt).squeeze(-1) - lq.gather(-1, nxt).squeeze(-1)
            out["acceptance"].append(ratio.clamp(max=0.0).exp())
    res = {k: torch.cat(v).cpu() for k, v in out.items()}
    res["pos"] = torch.arange(start, T - 1, dtype=torch.float32)
    if recall:
        res["recall"] = recalls
    return res


def _stats(kl, top1, acc, recall=None) -> dict:
    import numpy as np

    # numpy rather than torch.quantile, which refuses inputs above 16M elements
    out = {"tokens": int(kl.numel()), "kl": float(kl.mean()), "top1_agreement": float(top1.mean()),
           "acceptance_mean": float(acc.mean()), "acceptance_p5": float(np.percentile(acc.double().numpy(), 5))}
    if recall is not None:
        out["attn_recall"] = float(recall.mean())
    return out


def _with_adapter(model, path: str):
    import warnings

    from sparse_rl.sparse.loader import check_adapter_dir

    check_adapter_dir(path)

    from peft import PeftModel

    try:
        with warnings.catch_warnings():
            # peft probes a deprecated transformers property while wrapping; not ours to fix
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return PeftModel.from_pretrained(model, path, is_trainable=False).eval()
    except Exception as e:  # peft raises many kinds for a mismatched adapter
        raise SparseRLError(f"--adapter {path}: cannot load it onto the model ({' '.join(str(e).split())[:200]})") from None


def run(cfg: FidelityConfig, force: bool = False, progress: bool = True) -> dict:
    """Score every record, write `out/` (records.jsonl, summary.json, fidelity_kl.png,
    fidelity_agreement.png) atomically, return the summary."""
    import torch

    from sparse_rl.io import atomic_dir, atomic_write_json, read_jsonl, write_jsonl
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.loader import check_model_dir, load_model, load_tokenizer

    if not cfg.model or not cfg.data or not cfg.out:
        raise UsageError("eval fidelity needs MODEL, --data FILE and --out DIR")
    if cfg.max_tokens < 2 or cfg.chunk < 1 or cfg.limit < 0:
        raise UsageError("--max-tokens must be >= 2, --chunk >= 1 and --limit >= 0")
    check_model_dir(cfg.model, flag="MODEL")
    if SparseConfig.load(cfg.model) is None:
        raise SparseRLError(f"MODEL {cfg.model}: not a sparse model dir (no sparse_config.json); run `sparse-rl convert`")
    source = "<stdin>" if cfg.data == "-" else cfg.data
    records = read_jsonl(cfg.data)
    if cfg.limit:
        records = records[:cfg.limit]
    from sparse_rl.devices import resolve_device

    device = resolve_device(cfg.device)
    tok = load_tokenizer(cfg.model)
    seqs = list(_sequences(records, tok, cfg.max_tokens, source))
    if not seqs:
        raise SparseRLError(f"{source}: no record has a token to score (empty input, or all cut by --max-tokens)")
    model = load_model(cfg.model, attention="sparse", device=device, dtype=cfg.dtype)
    if cfg.adapter:
        model = _with_adapter(model, cfg.adapter)

    from rich.console import Console
    from rich.progress import Progress

    per, allm = [], {k: [] for k in ("pos", "kl", "top1", "acceptance", "recall")}
    layer_recall: dict[int, list] = {}
    with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
        job = bar.add_task("fidelity", total=len(seqs))
        for rid, ids, start in seqs:
            m = compare_sequence(model, ids, start, cfg.chunk)
            for i, r in m["recall"].items():
                layer_recall.setdefault(i, []).append(r)
            m["recall"] = torch.stack(list(m["recall"].values())).mean(0)  # mean over sparse layers
            for k in allm:
                allm[k].append(m[k])
            per.append({"id": rid, "length": len(ids), "scored_from": start,
                        **_stats(m["kl"], m["top1"], m["acceptance"], m["recall"])})
            bar.advance(job)
    cat = {k: torch.cat(v) for k, v in allm.items()}
    buckets = sorted({bucket_of(int(p)) for p in cat["pos"].tolist()})
    bidx = torch.tensor([bucket_of(int(p)) for p in cat["pos"].tolist()])
    by_bucket = []
    for b in buckets:
        sel = bidx == b
        by_bucket.append({"from": b, "to": max(32, 2 * b),
                          **_stats(cat["kl"][sel], cat["top1"][sel], cat["acceptance"][sel], cat["recall"][sel])})
    summary = {"model": str(cfg.model), "adapter": cfg.adapter, "records": len(per),
               **_stats(cat["kl"], cat["top1"], cat["acceptance"], cat["recall"]),
               "attn_recall_by_layer": {str(i): float(torch.cat(v).mean()) for i, v in sorted(layer_recall.items())},
               "by_position": by_bucket,
               "files": {"records": "records.jsonl", "kl_plot": "fidelity_kl.png",
                         "agreement_plot": "fidelity_agreement.png"}}
    from sparse_rl.eval.plots import line_plot

    x = [b["to"] for b in by_bucket]  # bucket ends: all > 0, so a log2 axis works
    with atomic_dir(cfg.out, force=force, flag="--out") as tmp:
        write_jsonl(tmp / "records.jsonl", per)
        atomic_write_json(tmp / "summary.json", summary)
        line_plot(x, {"KL(dense || sparse)": [b["kl"] for b in by_bucket]}, tmp / "fidelity_kl.png",
                  title="sparse vs dense: token KL by position", xlabel="token position (end of bucket)",
                  ylabel="mean KL (nats)", logx=len(x) > 1)
        line_plot(x, {"top-1 agreement": [b["top1_agreement"] for b in by_bucket],
                      "acceptance mean": [b["acceptance_mean"] for b in by_bucket],
                      "acceptance p5": [b["acceptance_p5"] for b in by_bucket],
                      "attention recall": [b["attn_recall"] for b in by_bucket]}, tmp / "fidelity_agreement.png",
                  title="sparse vs dense: agreement and attention recall by position",
                  xlabel="token position (end of bucket)",
                  ylabel="fraction", logx=len(x) > 1)
    return summary
