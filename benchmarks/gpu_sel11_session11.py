"""Session 11, helper sel11 (issue 14): the fine decode select with its row's threshold resolved ONCE a row
(`DecodeSelect(fine_resolve="arrive" | "pass")`, decode_fine_once.py) and the default's resolving pass with a
register cap (`fine_maxnreg`), against the engine's default (fine, 64-key score step, every (chunk, row) program
resolving: `fine_resolve="each"`), on the shared harness.

    PYTHONPATH=$PWD python benchmarks/gpu_sel11_session11.py --budget 140 --commit SHA                   (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_sel11_session11.py --cpu-smoke --budget 900

Phases, each gated on the time LEFT of --budget (compiles included; the JSON and log under $OUT/sel11/ are
rewritten after every row):
1. one child process a new form (`--prove FORM`), started first: the form on the GPU == the reference on
   integer ties (ReLU zeros among them; the sub-bin ranked, and cap 2: the radix levels) and == the default on
   random bf16 rows at 32 x 2304 / 8192 / 16384 and 16 x 32768 (mixed-sign weights; and weights (-1, -1, -1,
   1), whose ReLU zeros put the threshold among the zeros in some rows), twice each. The children also compile
   the new kernels for the timed shapes into Triton's disk cache while the parent builds the model;
2. meanwhile the parent (old kernels only): setup, the default's steps at 2304 / 8192 / 16384 (batch 32: its
   compiles; "steps_early", beside the children's work) and its one-step profile at 16K;
3. only for the forms whose proof passed: the select alone (score + select, graph-timed; the default in the
   same run) at 32 x 2304 / 8192 / 16384 (the engine's layer-2 index cache) and 16 x 32768 (random keys), each
   form's rows == the default's; the steps of the default and the new forms, context by context; the fastest
   form's profile (us a layer per kernel);
4. the whole 16K batch-32 generation (integrated: dense, default, the fastest new form) if budget is left;
5. a summary table.

Call 1 (commit 7cf68c1, 16 s; results/call1/sel11): nothing measured. Every fine select, the default too, failed
to COMPILE on the H200's Triton 3.6: a `CM: tl.constexpr = ""` parameter added to `decode_fine._rank_sub_bin`
and `decode_steps._radix_threshold`, left to its default by the old callers, reaches 3.6's code generator as a
bare str ("'str' object has no attribute 'type'"); Triton 3.9 (the CPU tests') accepts it. Fixed by keeping
those helpers as they were (decode_fine_once passes its cache modifier only to its own loads, explicitly), and
checked by compiling every kernel of both forms for sm_90a under Triton 3.6 on the CPU host
(benchmarks/sm90_regs.py; results/2026-12-02-cpu-sm90-regs-sel11.txt). That check also shows that 3.6's
register counts are not 3.9's (the ones the session-9 notes quote): `_resolve_write` 147 (3 programs an SM, so
32 x 16K's 512 programs in two waves), 128 with no spill when capped (maxnreg 128); `_gather_once` with the
resolve inlined ("arrive") 156 (168 at one 1024-key step), 128 capped with 8-16 B of stack; without it
("pass") 64 (123); `_resolve_rows` 153 (32 programs only); `_write_once` 32; `_sub_gather` 56; hist 32. Hence
this call's forms: base_r128, pass, pass_b1k, arrive_r128 (uncapped arrive dropped: two waves on 3.6).

Predictions (written before any measurement, session 11; the session-9/10 profile at 32 x 16K: `_hist_chunk`
4.9 us a layer, `_sub_gather` 9.1, `_resolve_write` 22.8; the lead's bsearch run: fine alone 0.0206 / 0.0348 /
0.0500 ms at 32 x 2304 / 8192 / 16384, 0.0502 at 16 x 32K; the score pass alone 0.0094-0.0178):
- base_r128: `_resolve_write` in one wave: 22.8 -> ~18 us a layer (session 9's 2 -> 3 programs an SM took
  28.4 -> 22.8), the step -0.15 ms at 16K; equal at 2304 (32 x 9 programs fit one wave anyway).
- pass: `_hist_tick` ~4.9, `_gather_once` ~9, `_resolve_rows` ~7 (the chain once, 32 programs), `_write_once`
  ~4 (as decode._write / decode_bits._write: 3.9 / 4.5): ~25 us after the score against 36.8, ~-0.35 ms a step
  at 16K (the task's target, <= ~20 us and -0.5 ms, is predicted to be missed: the resolve's chain of dependent
  reductions is done once, not shortened). Alone: 32 x 16K 0.050 -> ~0.040 ms, 16 x 32K 0.050 -> ~0.041,
  32 x 8192 0.035 -> ~0.028, 32 x 2304 0.021 -> ~0.018.
- pass_b1k (one loop step a chunk: every load of a pass issued at once, one scan instead of four): -2 to -3 us a
  layer below pass at 8K-16K (the same code at 2304).
- arrive_r128: one launch fewer than pass (-2 us) but its 8-16 B spill and the ticket's atomic (+1 us): within
  1-2 us of pass.
- Whole 16K batch 32 with the fastest: 1.65x -> ~1.70x dense.
- Uncertain: whether the resolve's chain is latency (then once a row buys little: the same chain after the
  gather instead of inside the write) or the 512 programs' contention (then once a row buys most of 22.8 - 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import gpu_rollout_session10 as S10  # noqa: E402
import rollout_harness as rh  # noqa: E402
from granular_harness import T0, Run, log  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect  # noqa: E402

FORMS = {"base": ENGINE_SELECT,
         # the default with its resolving pass capped at 128 registers (Triton 3.6 gives `_resolve_write` 147:
         # 3 programs an SM; capped, no spill: 4, 32 x 16K's 512 programs in one wave)
         "base_r128": DecodeSelect("fine", score_block=64, fine_maxnreg=128),
         # resolved once a row by a [B]-program pass (the gather at 64 registers on 3.6)
         "pass": DecodeSelect("fine", score_block=64, fine_resolve="pass"),
         # ... with one loop step a chunk (up to 1024 keys: every load of a pass issued at once, one scan not four)
         "pass_b1k": DecodeSelect("fine", score_block=64, fine_resolve="pass", fine_block=1024),
         # resolved by the row's last gather program, capped at 128 registers (156 on 3.6 uncapped; 8-16 B spill)
         "arrive_r128": DecodeSelect("fine", score_block=64, fine_resolve="arrive", fine_maxnreg=128)}
NEW = ("base_r128", "pass", "pass_b1k", "arrive_r128")
for _n, _s in FORMS.items():
    S10.VARIANTS[_n] = rh.Variant(_s)
# device seconds a phase needs (session 10's logs: setup ~15, alone ~6 s a shape with its compiles, steps
# ~0.3 s a row after the first compile, profile ~1, whole 16K batch 32 ~30 for three runs)
NEED = {"setup": 18, "steps": 8, "profile": 3, "alone": 16, "whole_16k_b32": 34}
S10.NEED["whole_16k_b32"] = NEED["whole_16k_b32"]


def prove(form: str, smoke: bool) -> dict:
    """Child (`--prove FORM`): FORM's select == the reference on integer ties and == the default on random bf16
    rows at the timed shapes, twice each (a faulting or racing kernel shows here, not in the parent)."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    dev = "cpu" if smoke else "cuda"
    sel = FORMS[form]
    out = {}
    g = torch.Generator(device=dev).manual_seed(11)
    dt = torch.float32 if smoke else torch.bfloat16
    B, S, K, HI, DI = (3, 200, 40, 2, 16) if smoke else (4, 3000, 512, 4, 64)
    q = torch.randint(-2, 3, (B, HI, DI), device=dev, generator=g).to(dt)
    w = torch.randint(-1, 3, (B, HI), device=dev, generator=g).to(dt)
    k = torch.randint(-2, 3, (B, S, DI), device=dev, generator=g).to(dt)
    pos = torch.tensor([S - 1, S // 2, K // 2, S - 7][:B], device=dev)
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, sink=2, window=4)
    for cap in (32, 2):
        s = DecodeSelect("fine", score_block=sel.score_block, fine_resolve=sel.fine_resolve, fine_cap=cap,
                         fine_block=sel.fine_block, fine_maxnreg=sel.fine_maxnreg)
        out[f"ints_cap{cap}"] = all(torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=4,
                                                                        **s.as_kwargs()), ref) for _ in range(2))
    shapes = [(3, 300)] if smoke else [(32, 2304), (32, 8192), (32, 16384), (16, 32768)]
    K = 40 if smoke else 2048
    for B, S in shapes:
        for wname in ("randn", "zeros"):
            q = torch.randn(B, HI, DI, device=dev, generator=g).to(dt)
            # "zeros": weights (-1, .., -1, 1): ~1/2^HI of the keys score exactly 0 and ~1/10 above it, so
            # the k-th key is a zero in some rows (the zeros' slots give the cut), below them in others
            w = (torch.randn(B, HI, device=dev, generator=g) if wname == "randn"
                 else torch.tensor([-1.0] * (HI - 1) + [1.0], device=dev).expand(B, HI)).to(dt).contiguous()
            k = torch.randn(B, S, DI, device=dev, generator=g).to(dt)
            pos = torch.randint(S // 2, S, (B,), device=dev, generator=g)
            pos[0] = S - 1
            kw = dict(sink=4, window=64 if not smoke else 4)
            base = itd.indexer_topk_decode(q, w, k, pos, K, **kw, **ENGINE_SELECT.as_kwargs())
            out[f"b{B}_s{S}_{wname}"] = all(torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, **kw,
                                                                                **sel.as_kwargs()), base)
                                            for _ in range(2))
        if not smoke:
            torch.cuda.synchronize()
    print("PROVE " + json.dumps({"ok": all(out.values()), "cases": out}), flush=True)
    return out


def start_proofs(script: str, smoke: bool) -> dict:
    args = ["--cpu-smoke"] if smoke else []
    return {f: subprocess.Popen([sys.executable, script, "--prove", f, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for f in NEW}


def alone(run, b, eng, ctxs, forms, smoke) -> dict:
    """Score + select alone, graph-timed, every form in the same run; each form's rows == the default's."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.decode_fine import fine_chunk

    dev, K = eng.device, b.cfg.topk
    HI, DI = b.cfg.index_heads, b.cfg.index_dim
    sink, win = min(4, K // 4), min(64, K // 4)
    cache = eng._ensure_cache(max(ctxs))
    g = torch.Generator(device=dev).manual_seed(5)
    shapes = [(eng.max_batch, c, None) for c in ctxs] + ([(2, 256, "random")] if smoke else [(16, 32768, "random")])
    res = run.res.setdefault("alone", {})
    for B, ctx, src in shapes:
        if not run.gate(3, f"alone {B}x{ctx}"):
            break
        view = cache.idx[2][:B, :ctx] if src is None else torch.randn(B, ctx, DI, device=dev, generator=g).to(
            cache.idx[2].dtype)
        qi = torch.randn(B, HI, DI, device=dev, generator=g).to(view.dtype)
        wi = torch.randn(B, HI, device=dev, generator=g).to(view.dtype)
        pos = torch.full((B,), ctx - 1, device=dev, dtype=torch.int32)
        pos[1::3] = torch.randint(K, ctx, (len(range(1, B, 3)),), device=dev, generator=g).to(torch.int32)
        row = res[f"{B}x{ctx}"] = {"batch": B, "context": ctx, "keys": src or "engine layer 2",
                                   "floor_ms": round(1e3 * B * ctx * DI * view.element_size() / b.bw, 4)}
        fns = {n: (lambda s=FORMS[n]: itd.indexer_topk_decode(qi, wi, view, pos, K, sink=sink, window=win,
                                                              **s.as_kwargs())) for n in forms}
        with torch.inference_mode():
            ref = fns["base"]()
            for n in forms:
                if n != "base":
                    row[f"{n}_equal"] = bool(torch.equal(fns[n](), ref))
            for n, fn in fns.items():
                row[f"{n}_ms"] = round(bench_ms(fn, dev, graph=not smoke), 4)
            ch = fine_chunk(B, ctx, smoke)
            row["score_only_ms"] = round(bench_ms(lambda: rh.score_pass(qi, wi, view, pos, ch, sink, win,
                                                                        bn=16 if smoke else 64), dev,
                                                  graph=not smoke), 4)
        log(f"alone {B}x{ctx}: " + " ".join(f"{k} {v}" for k, v in row.items() if k.endswith(("_ms", "_equal"))))
        run.save()
    return res


def select_kernels(p: dict) -> dict:
    """us a call (= a sparse layer: each runs once a layer) of each select / score kernel of a step profile."""
    return {r["kernel"][:48]: {"us_a_layer": round(r["us"] / r["calls"], 2), "calls": r["calls"]}
            for r in p.get("top", []) if r["class"] in ("select", "index_score")}


def profile(run, eng, big, names) -> None:
    prof = run.res.setdefault("profile", {})
    for name in names:
        if not run.gate(NEED["profile"], f"profile {name}"):
            break
        rh.apply(eng, S10.VARIANTS[name])
        p = run.guarded(f"profile {name}", rh.profile_step, eng, big, "sparse", top=80)
        if p is not None:
            p["select_us_a_layer"] = select_kernels(p)
            prof[name] = p
            log(f"profile {name} sparse {big}: {p['kernel_us_total']} us in {p['kernels']} kernels: {p['classes_us']}")
            log(f"  select/score us a layer: {p['select_us_a_layer']}")
        run.save()
    rh.apply(eng, S10.VARIANTS["base"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/sel11")
    ap.add_argument("--budget", type=float, default=140)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--cpu-smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    ap.add_argument("--prove", choices=NEW, help="(child) prove one new form on the device")
    a = ap.parse_args()
    smoke = a.cpu_smoke
    if a.prove:
        prove(a.prove, smoke)
        return
    dev = torch.device("cpu" if smoke else "cuda")
    procs = start_proofs(os.path.abspath(__file__), smoke)
    run = Run(a.out or os.path.join(os.environ.get("OUT", "/tmp"), "sel11"), "sel11_session11.json", a.budget,
              {"commit": a.commit, "budget_s": a.budget, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "forms": {k: v.as_kwargs() for k, v in FORMS.items()}, "need_s": NEED})
    from sparse_rl.bench.rollout import BenchRolloutConfig

    if smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
        B, ctxs, big = 4, [64, 100, 160], 160
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
        B, ctxs, big = 32, [2304, 8192, 16384], 16384
    st: dict = {}
    if run.gate(NEED["setup"], "setup"):
        run.res["setup"] = run.guarded("setup", S10.build, cfg, B, big + 128, st)
        run.save()
    if "eng" not in st:
        log("setup failed: nothing else runs")
        return
    b, eng = st["b"], st["eng"]
    base = {"base": S10.VARIANTS["base"]}
    if run.gate(NEED["steps"], "steps base"):  # old kernels only while the children prove the new ones (their
        # compiles and GPU work overlap these rows: the default is timed again beside the new forms below)
        rh.step_rows(run, b, eng, ctxs, base, modes=("sparse",), need_s=2, key="steps_early")
    profile(run, eng, big, ["base"])
    deadline = 900 if smoke else 80  # s after the start: the children's compiles + checks (~40 s planned)
    proofs = {f: S10.proof_result(p, deadline - (time.time() - T0)) for f, p in procs.items()}
    run.res["proofs"] = proofs
    ok = [f for f in NEW if proofs[f].get("ok")]
    log(f"proofs: " + "; ".join(f"{f} {proofs[f].get('ok')} {proofs[f].get('cases', '')} {proofs[f].get('error', '')}"
                                for f in NEW))
    if not ok:
        log("no new form proved: nothing new runs")
    else:
        if run.gate(NEED["alone"], "alone"):
            run.guarded("alone", alone, run, b, eng, ctxs, ["base", *ok], smoke)
            run.save()
        bad = [f for f in ok for r in (run.res.get("alone") or {}).values() if r.get(f"{f}_equal") is False]
        ok = [f for f in ok if f not in bad]
        if bad:
            log(f"not equal to the default alone: {bad}")
        if ok and run.gate(NEED["steps"], "steps"):
            rh.step_rows(run, b, eng, ctxs, {f: S10.VARIANTS[f] for f in ("base", *ok)}, modes=("sparse",), need_s=2)
        best = S10.best_of(run.res.get("steps") or [], ["base", *ok]) if ok else "base"
        new = best if best != "base" else (ok[0] if ok else None)
        run.res["chosen"] = {"fastest": best, "whole_new": new}
        log(f"fastest in the steps: {best}")
        if new:
            profile(run, eng, big, [new])
        del eng
        st.pop("eng")
        rh.free()
        if new:
            plan = [("dense", "base", S10.VARIANTS["base"]), ("sparse", "base", S10.VARIANTS["base"]),
                    ("sparse", new, S10.VARIANTS[new])]
            S10.whole_run(run, b, cfg, "whole_16k_b32", plan)
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    print("| phase | form | size | value |")
    for k, r in (run.res.get("alone") or {}).items():
        print(f"| alone | " + " ".join(f"{f} {r.get(f + '_ms')}" for f in FORMS if f + "_ms" in r)
              + f" | {k} | score {r.get('score_only_ms')} ms |")
    for r in run.res.get("steps") or []:
        print(f"| steps | {r['variant']} | b{r['batch']} {r['context']} | {r['ms']} ms ({r['x_floor']}x floor) |")
    for n, p in (run.res.get("profile") or {}).items():
        sel = sum(v["us_a_layer"] for kk, v in p["select_us_a_layer"].items() if "_score_max" not in kk)
        print(f"| profile | {n} | b{B} {big} | select after score {sel:.1f} us a layer, {p['kernels']} kernels |")
    for r in run.res.get("whole_16k_b32") or []:
        print(f"| whole_16k_b32 | {r['mode']} {r['variant']} | b{r['batch']} | {r['tokens_per_s']} tok/s "
              f"({r.get('sparse_over_dense', '-')}x dense) |")


if __name__ == "__main__":
    main()
