"""Learnability pilot for the evidence recipe's look-up task (issue 17), one variant per process.

Session 5's run 3 pre-trained the 5.5M model for 3,000 steps on 4-digit, 4-hop, 16-row tables and it
never learned the look-up (0/128 first hops right). This pilot asks, per variant (code digits, hops,
table rows, model size, lr), how fast the look-up is learned, with a curriculum that lengthens the
tables in stages by time (rows[0] for the first half, then rows[1], then rows[2]).

It trains with the sft stage's own pieces (packing with per-document position ids, `token_nll_sum`,
bf16 autocast over float32 weights, AdamW) on fresh tasks every step, and every EVAL_S seconds scores
held-out tasks of every stage's table size teacher-forced: `exact` = every solution token is the
argmax (the same as greedy decoding being right), `hop1` = the first written step is right.

    python benchmarks/gpu_evidence_pilot6.py --name A --digits 2 --hops 2 --rows 8,24,64 --size small \
        --lr 2e-3 --seconds 200 --out DIR        # writes DIR/A.json (rewritten at every eval)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def encode(tok, tasks: list[dict]) -> list:
    """Token ids + assistant mask of each task (its prompt and worked solution in the chat template),
    batch-tokenised: the template is rendered as text and the assistant turn found by its header."""
    from sparse_rl.sft.data import Document

    texts = [tok.apply_chat_template(t["messages"] + [{"role": "assistant", "content": t["solution"]}],
                                     tokenize=False) for t in tasks]
    head = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    docs = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        s = next(i for i in range(len(ids) - len(head), -1, -1) if ids[i:i + len(head)] == head) + len(head)
        e = ids.index(end, s) + 1
        docs.append(Document(ids, [s <= i < e for i in range(len(ids))]))
    return docs


def batch_of(tok, rng: random.Random, rows: int, a, seq: int, bs: int, dev) -> dict:
    from sparse_rl.sft.data import pack
    from sparse_rl.synth.lookup import make_task

    per = max(1, seq * bs // (13 * rows + 60))  # about enough documents to fill bs rows
    tasks = [make_task(rng.randrange(10**9), i, rows, a.hops, a.digits) for i in range(int(per * 1.1))]
    b, _ = pack(encode(tok, tasks), seq, tok.pad_token_id or 0)
    return {k: v[:bs].to(dev) for k, v in b.items()}


@torch.no_grad()
def evaluate(model, tok, docs, tasks, dev) -> dict:
    """Teacher-forced argmax over the solution tokens of each held-out task, 32 at a time."""
    exact = hop1 = 0
    nl = tok("\n", add_special_tokens=False)["input_ids"][-1]
    for i in range(0, len(docs), 32):
        chunk = docs[i:i + 32]
        n = max(len(d.ids) for d in chunk)
        ids = torch.zeros(len(chunk), n, dtype=torch.long)
        for j, d in enumerate(chunk):
            ids[j, :len(d.ids)] = torch.tensor(d.ids)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            pred = model(input_ids=ids.to(dev)).logits.argmax(-1).cpu()
        for j, d in enumerate(chunk):
            idx = [k for k, m in enumerate(d.mask) if m]
            ok = [int(pred[j, k - 1]) == d.ids[k] for k in idx]
            exact += all(ok)
            first_nl = next((m for m, k in enumerate(idx) if d.ids[k] == nl), len(idx))
            hop1 += all(ok[:first_nl])
    return {"exact": exact / len(docs), "hop1": hop1 / len(docs)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--hops", type=int, default=2)
    p.add_argument("--rows", default="8,24,64")
    p.add_argument("--size", default="small")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--seconds", type=float, default=200)
    p.add_argument("--eval-s", type=float, default=25)
    p.add_argument("--heldout", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--save", default=None, help="write the final model dir here")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.synth.lookup import make_task
    from sparse_rl.sft.trainer import token_nll_sum

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{a.name}-base"
    init_model(base, ModelInitConfig(size=a.size, seed=0), force=True)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rows = [int(r) for r in a.rows.split(",")]
    held = {r: [make_task(777, i, r, a.hops, a.digits) for i in range(a.heldout)] for r in rows}
    held_docs = {r: encode(tok, ts) for r, ts in held.items()}
    import queue
    import threading

    want = {"rows": rows[0]}
    q: queue.Queue = queue.Queue(maxsize=4)

    def produce():  # batches are built on the CPU while the GPU trains on the previous ones
        rng = random.Random(1)
        while True:
            r = want["rows"]
            q.put((r, batch_of(tok, rng, r, a, a.seq, a.bs, torch.device("cpu"))))

    threading.Thread(target=produce, daemon=True).start()
    rec = {"args": vars(a), "params": sum(x.numel() for x in model.parameters()), "curve": [], "losses": []}
    t0 = time.time()
    next_eval, step = 0.0, 0
    while True:
        el = time.time() - t0
        frac = el / a.seconds
        stage = 0 if frac < 0.5 else 1 if frac < 0.75 else 2
        stage = min(stage, len(rows) - 1)
        if el >= next_eval or el >= a.seconds:
            model.eval()
            ev = {f"r{r}": evaluate(model, tok, held_docs[r], held[r], dev) for r in rows}
            model.train()
            rec["curve"].append({"t": round(el, 1), "step": step, "stage_rows": rows[stage], **ev})
            (out / f"{a.name}.json").write_text(json.dumps(rec, indent=1))
            print(a.name, rec["curve"][-1], flush=True)
            next_eval = el + a.eval_s
            if el >= a.seconds:
                break
        lr = a.lr * min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr
        want["rows"] = rows[stage]
        _, b = q.get()
        b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
        nll, n = token_nll_sum(model, b, autocast="bf16")
        loss = nll / max(1, n)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            rec["losses"].append([step, round(time.time() - t0, 1), rows[stage], round(float(loss), 4)])
    if a.save:
        model.save_pretrained(a.save)
        tok.save_pretrained(a.save)


if __name__ == "__main__":
    main()
