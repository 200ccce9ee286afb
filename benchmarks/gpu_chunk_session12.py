"""Session 12 (lead, issue 14): the decode select's chunk size past a power of two of the context.

Why: session 12's call 1 step points show the sparse step jumping where the context crosses a power of two
(batch 32: 8.729 ms at 16,384 -> 9.368 at 16,512; batch 16: 7.727 at 32,768 -> 8.157 at 32,896), while dense
grows smoothly. `decode_fine.fine_chunk` (keys a (chunk, row) program) doubles the chunk when B x P would
pass 512 programs or P 32 chunks, and `PMAX` (the [PMAX]-wide per-chunk tiles of the resolving pass) is the
power of two above P: at batch 32 x 16,640 keys it takes 2,048-key chunks (288 programs; session 10 measured
that chunk 18% slower than 1,024 alone at 32 x 16K), at batch 16 x 16,640 1,024-key chunks with P = 17, so
PMAX = 32 for the whole second half of a 32K generation.

What this times (graph-timed, random bf16 keys, mixed-sign weights, every row at or near the end): score +
select alone with the rule's chunk and with fixed 1,024 / 2,048 / 4,096-key chunks, each == the rule's rows,
at the shapes either side of the jumps. Step rows are not timed here (the CLI run's step points straddle
the powers of two now).

Predictions (before the call): at 32 x 16,640 a 1,024-key chunk (544 programs, PMAX 32) ~0.058-0.062 ms
against the rule's 2,048 (~0.069); at 16 x 16,640 / 24,576 a 2,048-key chunk (PMAX 16) within +-5% of the
rule's 1,024 (PMAX 32), i.e. PMAX costs little and the jump at 16 x 16K is small; at 16 x 32,896 1,024-key
chunks (P 33, PMAX 64: spills, session 9 says 255 registers at P = 64) slower than the rule's 2,048.

Call 1 (`9279655`, session 12): 32 x 16,640: the rule's 2,048-key chunk 0.0686 ms, 1,024 0.0564 (-18%), 4,096
0.1041; 16 x 16,384 / 16,640 / 24,576 / 32,768: the rule's chunk (512 / 1,024 / 1,024 / 1,024) the fastest
(0.0323 / 0.0406 / 0.0462 / 0.0646 ms; 2,048 +22-33%). So the rule's 512-program cap was wrong at 32 x 16,640:
raised to 640. Call 2 (`--call 2`) times the shapes whose chunk that changes (32 x 8,448 / 16,640 / 20,480,
64 x 2,304 / 8,448 / 16,640); predicted: the new rule's chunk within 5% of the fastest at each.

    PYTHONPATH=$PWD python benchmarks/gpu_chunk_session12.py --budget 60 [--call 2]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_chunk_session12.py --cpu-smoke --budget 300
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from granular_harness import Run, log  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "chunk"))
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--call", type=int, default=1, choices=(1, 2))
    a = ap.parse_args()
    from sparse_rl.bench.timing import bench_ms, device_name
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.decode_fine import fine_chunk
    from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT

    smoke = a.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda")
    run = Run(a.out, f"chunk_session12_call{a.call}.json", a.budget, {"device": device_name(dev), "commit": a.commit,
                                                       "torch": torch.__version__})
    K, HI, DI = (40, 2, 16) if smoke else (2048, 4, 64)
    # call 2 (after the rule's cap went 512 -> 640 programs): the shapes whose chunk that changed
    shapes = [(2, 300), (2, 520)] if smoke else ([(32, 8448), (32, 16640), (32, 20480), (64, 2304), (64, 8448),
                                                  (64, 16640)] if a.call == 2 else
                                                 [(32, 16384), (32, 16640), (16, 16384), (16, 16640), (16, 24576),
                                                  (16, 32768), (16, 33024)])
    chunks = (64, 128) if smoke else ((256, 512, 1024, 2048, 4096) if a.call == 2 else (1024, 2048, 4096))
    g = torch.Generator(device=dev).manual_seed(12)
    dt = torch.float32 if smoke else torch.bfloat16
    rows = run.res.setdefault("rows", [])
    for B, S in shapes:
        if not run.gate(6, f"{B}x{S}"):
            break
        keys = torch.randn(B, S, DI, device=dev, generator=g).to(dt)
        qi = torch.randn(B, HI, DI, device=dev, generator=g).to(dt)
        wi = torch.randn(B, HI, device=dev, generator=g).to(dt)
        pos = torch.full((B,), S - 1, device=dev, dtype=torch.int32)
        pos[1::3] = S - 1 - torch.randint(0, 200 if not smoke else 20, (len(range(1, B, 3)),), device=dev,
                                         generator=g).to(torch.int32)
        kw = dict(sink=min(4, K // 4), window=min(64, K // 4), **ENGINE_SELECT.as_kwargs())
        rule = fine_chunk(B, S, smoke)
        row = {"batch": B, "keys": S, "rule_chunk": rule,
               "floor_ms": None if smoke else round(1e3 * B * S * DI * 2 / 4.2e12, 4)}
        with torch.inference_mode():
            ref = itd.indexer_topk_decode(qi, wi, keys, pos, K, **kw)
            row["rule_ms"] = round(bench_ms(lambda: itd.indexer_topk_decode(qi, wi, keys, pos, K, **kw), dev,
                                            graph=not smoke), 4)
            for ch in chunks:
                if ch == rule or -(-S // ch) > 64 or -(-S // ch) < 2:
                    continue
                fn = (lambda c=ch: itd.indexer_topk_decode(qi, wi, keys, pos, K, chunk=c, **kw))
                row[f"c{ch}_equal"] = bool(torch.equal(fn(), ref))
                row[f"c{ch}_ms"] = round(bench_ms(fn, dev, graph=not smoke), 4)
        rows.append(row)
        log(" ".join(f"{k}={v}" for k, v in row.items()))
        run.save()
    run.save()
    print("| batch | keys | rule chunk | rule ms | " + " | ".join(f"{c} ms (equal)" for c in chunks) + " |")
    for r in rows:
        print(f"| {r['batch']} | {r['keys']} | {r['rule_chunk']} | {r['rule_ms']} | " + " | ".join(
            f"{r.get(f'c{c}_ms', '-')} ({r.get(f'c{c}_equal', '-')})" for c in chunks) + " |")


if __name__ == "__main__":
    main()
