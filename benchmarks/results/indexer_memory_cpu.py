"""Peak memory of one indexer warm-up step against sequence length, at a fixed query chunk (CPU).

Each length runs in a fresh process; the number is the growth of the peak resident set during the
step (ru_maxrss after the step minus the resident set before it), so the interpreter, torch and the
weights cancel out. The model: 2 Qwen2-0.5B-shaped layers (14 heads, 2 KV heads, head dim 64,
random fp32 weights), layer 0 dense, layer 1 with an indexer (4 heads x 64).

    PYTHONPATH=. python benchmarks/results/indexer_memory_cpu.py [--chunk 128] [--lengths 2048,4096,8192,16384]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def one(L: int, chunk: int) -> dict:
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.patch import attach_sparse
    from sparse_rl.sparse.train.hooks import StepStats, indexed_attention, warmup_forward

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=L,
                      use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    attach_sparse(model, SparseConfig(topk=2048, index_heads=4, index_dim=64, rope_dim=32, dense_layers=[0]))
    model.requires_grad_(False)
    for m in indexed_attention(model):
        m.indexer.requires_grad_(True)
    ids = torch.randint(0, 4096, (1, L))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    import os

    with open("/proc/self/statm") as fh:  # current resident set (Linux), in KiB like ru_maxrss
        rss0 = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    t = time.perf_counter()
    st = StepStats(torch.device("cpu"))
    warmup_forward(model, ids, st, 1.0 / L, chunk=chunk)
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"L": L, "chunk": chunk, "step_s": dt, "peak_growth_mb": (peak - max(before, rss0)) / 1024,
            "kl": float(st.v[0] / st.v[1]), "would_be_LxLxH_fp32_mb": L * L * 14 * 4 / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--one", type=int, default=0)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.chunk)))
        return
    rows = []
    for L in map(int, args.lengths.split(",")):
        out = subprocess.run([sys.executable, __file__, "--one", str(L), "--chunk", str(args.chunk)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print("| L | chunk | peak growth (MB) | [L, L, H] fp32 would be (MB) | step (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['L']} | {r['chunk']} | {r['peak_growth_mb']:.0f} | {r['would_be_LxLxH_fp32_mb']:.0f} | {r['step_s']:.1f} |")


if __name__ == "__main__":
    main()
