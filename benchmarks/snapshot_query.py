"""Cost of kfac_stream snapshots and Laplace predictive queries on the overhead.py GPT-2 (CPU).

Method
------
Model, data and Trainer setup as ``benchmarks/overhead.py`` (imported from it): GPT-2 with 4
layers, n_embd 256, vocabulary 2048, batch 8 x 256 byte tokens of ``pydoc_data.topics``, AdamW,
CPU, ``torch.set_flush_denormal(True)``. One training run of ``k * --snapshots`` steps with
``KFACStreamCallback(token_fraction=0.05, update_every=1, snapshot_every=k)`` (every step is an
update step, so steps differ only by the snapshot); 16 tracked layers, 32 factors, FP16 store.

1. Snapshot vs eigh. After training, on the tracker's final factors, ``--reps`` interleaved
   repetitions (order rotated) of: (a) ``snapshot_contents(tracker, step)`` (float64
   ``safe_psd_eigh`` of every factor, clones, spectrum stats) + ``write_snapshot`` (safetensors,
   fsync, sha256) into a temporary directory; (b) the sum over the 32 factors of a plain
   ``torch.linalg.eigh`` of the same dequantised matrix in float64, and (c) in float32.
   Reported: medians; ratio = snapshot / eigh sum.
2. Snapshot step spike. In the training run, step time = ``on_step_begin`` -> ``on_step_end``
   (a callback before the kfac callback starts the clock, one after it stops it, as in
   overhead.py). Mean of the steps that write a snapshot (the snapshot runs synchronously in
   the kfac callback's ``on_step_end``) vs the mean of the other steps; the first
   ``WARMUP`` steps are left out.
3. Predictive query. ``LaplacePosterior(model, Snapshot.load(last), prior_precision=1.0)
   .predictive(batch, positions=-1, token_ids=range(K))`` for K in {1, 4, 16} on a batch of
   2 x 128 tokens, vs one forward pass of the same batch (``torch.no_grad``, eval mode);
   ``--reps`` interleaved repetitions, medians. Goal: query <= (K+2) x forward. If a query
   misses its goal by more than 2x, a cProfile top list of one call (largest K) is printed
   and stored in the json.

Usage: ``python benchmarks/snapshot_query.py [--reps 7] [--snapshots 6] [--every 5]``;
``--quick`` is a smoke run. Writes the section of ``benchmarks/RESULTS.md`` between the
``snapshot_query`` markers and ``benchmarks/results/snapshot_query.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import BATCH, MODEL, make_data, machine  # noqa: E402

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot  # noqa: E402
from kfac_stream.snapshot.contents import snapshot_contents  # noqa: E402
from kfac_stream.snapshot.writer import write_snapshot  # noqa: E402

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- snapshot_query:begin -->", "<!-- snapshot_query:end -->"
WARMUP, KS, QB, QT = 2, (1, 4, 16), 2, 128  # warm-up steps left out; K values; query batch


def log(msg: str) -> None:
    print(msg, flush=True)


def med_ms(xs) -> float:
    return 1e3 * statistics.median(xs)


class _Clock(TrainerCallback):
    """``first=True``: starts the clock in on_step_begin; otherwise stops it in on_step_end."""

    def __init__(self, times: list, first: bool):
        self.times, self.first = times, first

    def on_step_begin(self, args, state, control, **kw):
        if self.first:
            self.times.append(-time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        if not self.first:
            self.times[-1] += time.perf_counter()


def train(a, tmp: str):
    """Part 2: one training run with snapshots every ``a.every`` steps, every step timed."""
    transformers.set_seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    steps = a.every * a.snapshots
    kfac = KFACStreamCallback(KFACConfig(token_fraction=0.05, update_every=1, seed=a.seed,
                                         snapshot_every=a.every,
                                         output_dir=os.path.join(tmp, "kfac")))
    times: list[float] = []
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                             seed=a.seed, per_device_train_batch_size=BATCH, max_steps=steps,
                             dataloader_num_workers=0)
    cbs = [_Clock(times, True), kfac, _Clock(times, False)]
    Trainer(model=model, args=args, train_dataset=make_data(BATCH * steps), callbacks=cbs).train()
    snap = [s for s in range(WARMUP, steps) if (s + 1) % a.every == 0]  # 0-based step indices
    other = [s for s in range(WARMUP, steps) if (s + 1) % a.every != 0]
    res = {"steps": steps, "step_ms": [1e3 * t for t in times],
           "snapshot_step_ms": 1e3 * statistics.mean(times[s] for s in snap),
           "other_step_ms": 1e3 * statistics.mean(times[s] for s in other),
           "n_snapshot_steps": len(snap), "n_other_steps": len(other),
           "snapshot_bytes": sum(p.stat().st_size for p in Path(kfac.snapshots[-1]).iterdir())}
    res["extra_ms"] = res["snapshot_step_ms"] - res["other_step_ms"]
    res["ratio"] = res["snapshot_step_ms"] / res["other_step_ms"]
    return model, kfac, res


def bench_snapshot(kfac, reps: int, tmp: str) -> dict:
    """Part 1: snapshot_contents + write_snapshot vs plain eigh of the same matrices."""
    tracker = kfac.tracker
    tracker.flush()
    mats = {k: f.value() for k, f in tracker.store.factors.items()}
    dims = sorted(m.shape[0] for m in mats.values())
    root = os.path.join(tmp, "bench")
    t = {"contents": [], "write": [], "snapshot": [], "eigh64": [], "eigh32": []}

    def snapshot(r):
        t0 = time.perf_counter()
        tensors, manifest = snapshot_contents(tracker, 10**6 + r)
        t1 = time.perf_counter()
        write_snapshot(root, 10**6 + r, tensors, manifest)
        t2 = time.perf_counter()
        t["contents"].append(t1 - t0)
        t["write"].append(t2 - t1)
        t["snapshot"].append(t2 - t0)
        shutil.rmtree(root)

    def eigh(dtype, key):
        ms = {k: m.to(dtype) for k, m in mats.items()}
        total = 0.0
        for m in ms.values():
            t0 = time.perf_counter()
            torch.linalg.eigh(m)
            total += time.perf_counter() - t0
        t[key].append(total)

    jobs = [snapshot, lambda r: eigh(torch.float64, "eigh64"), lambda r: eigh(torch.float32, "eigh32")]
    eigh(torch.float64, "eigh64"), t["eigh64"].clear()  # warm-up (LAPACK workspaces)
    for r in range(reps):
        for j in range(len(jobs)):
            jobs[(j + r) % len(jobs)](r)
    res = {k: med_ms(v) for k, v in t.items()}
    res.update(factors=len(mats), dims=dims, raw_ms={k: [1e3 * x for x in v] for k, v in t.items()},
               ratio_eigh64=res["snapshot"] / res["eigh64"],
               ratio_eigh32=res["snapshot"] / res["eigh32"])
    return res


def bench_query(model, path: str, reps: int) -> dict:
    """Part 3: predictive(K) vs one no-grad forward of a 2 x 128 batch."""
    model.eval()
    t0 = time.perf_counter()
    post = LaplacePosterior(model, Snapshot.load(path), prior_precision=1.0)
    setup_ms = 1e3 * (time.perf_counter() - t0)
    ids = make_data(QB * 2)[QB]["input_ids"]  # a window not at the start of the text
    ids = torch.stack([make_data(QB + i + 1)[QB + i]["input_ids"][:QT] for i in range(QB)])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    t: dict[str, list[float]] = {"forward": [], **{f"K={k}": [] for k in KS}}

    def forward():
        t0 = time.perf_counter()
        with torch.no_grad():
            model(**batch)
        t["forward"].append(time.perf_counter() - t0)

    def query(k):
        t0 = time.perf_counter()
        post.predictive(batch, positions=-1, token_ids=list(range(k)))
        t[f"K={k}"].append(time.perf_counter() - t0)

    jobs = [forward] + [lambda k=k: query(k) for k in KS]
    forward(), query(1)  # warm-up
    t["forward"].clear(), t["K=1"].clear()
    for r in range(reps):
        for j in range(len(jobs)):
            jobs[(j + r) % len(jobs)]()
    fwd = med_ms(t["forward"])
    res = {"batch": [QB, QT], "setup_ms": setup_ms, "forward_ms": fwd, "per_k": {}}
    for k in KS:
        ms = med_ms(t[f"K={k}"])
        res["per_k"][k] = {"ms": ms, "ratio": ms / fwd, "goal": k + 2, "met": ms / fwd <= k + 2}
    worst = max(res["per_k"].values(), key=lambda v: v["ratio"] / v["goal"])
    if worst["ratio"] > 2 * worst["goal"]:
        prof = cProfile.Profile()
        prof.runcall(post.predictive, batch, positions=-1, token_ids=list(range(KS[-1])))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        res["profile"] = s.getvalue()
        log(f"cProfile of one predictive call, K={KS[-1]} (top 12 by tottime):\n{res['profile']}")
    return res


def table(r) -> str:
    s, st, q = r["snapshot"], r["steps"], r["query"]
    rows = ["| measurement | ms | reference | ref ms | ratio | goal |", "|---|---|---|---|---|---|",
            f"| snapshot: contents + write ({s['factors']} factors) | {s['snapshot']:.0f} | "
            f"eigh float64, same matrices | {s['eigh64']:.0f} | {s['ratio_eigh64']:.2f} | – |",
            f"| snapshot: contents + write | {s['snapshot']:.0f} | eigh float32, same matrices | "
            f"{s['eigh32']:.0f} | {s['ratio_eigh32']:.2f} | – |",
            f"| · of which snapshot_contents | {s['contents']:.0f} | eigh float64 | "
            f"{s['eigh64']:.0f} | {s['contents'] / s['eigh64']:.2f} | – |",
            f"| · of which write_snapshot ({st['snapshot_bytes'] / 2**20:.0f} MiB) | "
            f"{s['write']:.0f} | | | | – |",
            f"| training step writing a snapshot (every {r['args']['every']}) | "
            f"{st['snapshot_step_ms']:.0f} | other steps | {st['other_step_ms']:.0f} | "
            f"{st['ratio']:.2f} | – |"]
    for k, v in q["per_k"].items():
        rows.append(f"| predictive, K={k}, {QB}×{QT} tokens | {v['ms']:.0f} | forward, no grad | "
                    f"{q['forward_ms']:.1f} | {v['ratio']:.1f} | ≤ {v['goal']} "
                    f"({'met' if v['met'] else 'NOT met'}) |")
    return "\n".join(rows)


def write_outputs(r, a, info) -> None:
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "snapshot_query.json").write_text(json.dumps(
        {"machine": info, "command": a.command, "args": vars(a), **r}, indent=1, default=str))
    st = r["steps"]
    section = "\n".join([
        BEGIN, "## Snapshot and query cost (`benchmarks/snapshot_query.py`)", "",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch "
        f"threads); torch {info['torch']}, transformers {info['transformers']}, "
        f"Python {info['python']}",
        f"- load average (1 min) at start / end: {info['load_start']:.2f} / {info['load_end']:.2f}",
        f"- command: `{a.command}`",
        f"- medians of {a.reps} interleaved repetitions (snapshot vs eigh; forward vs queries); "
        f"step times: means over one run of {st['steps']} steps, snapshot_every={a.every}, "
        f"token_fraction=0.05, update_every=1 ({st['n_snapshot_steps']} snapshot steps vs "
        f"{st['n_other_steps']} others, first {WARMUP} left out). Snapshots run synchronously "
        "on the training thread: the extra step time is the snapshot's. Method: docstring of "
        "the script.", "", table(r), "",
        f"- snapshot step spike: +{st['extra_ms']:.0f} ms per snapshot "
        f"(+{st['extra_ms'] / a.every:.0f} ms per step amortised over {a.every} steps).", END])
    path = HERE / "RESULTS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + section + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions (parts 1, 3)")
    p.add_argument("--snapshots", type=int, default=6, help="snapshots in the training run")
    p.add_argument("--every", type=int, default=5, help="snapshot_every of the training run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 reps, 2 snapshots")
    a = p.parse_args(argv)
    a.command = "python benchmarks/snapshot_query.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    if a.quick:
        a.reps, a.snapshots = 2, 2
    torch.set_flush_denormal(True)
    info = {**machine(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load_start": os.getloadavg()[0]}
    log(f"snapshot/query benchmark; {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"load {info['load_start']:.2f}")
    r = {"load": {}}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, kfac, r["steps"] = train(a, tmp)
        st = r["steps"]
        r["load"]["after_train"] = os.getloadavg()[0]
        log(f"[2] {st['steps']} steps in {time.perf_counter() - t0:.0f} s: snapshot steps "
            f"{st['snapshot_step_ms']:.0f} ms, others {st['other_step_ms']:.0f} ms "
            f"(x{st['ratio']:.2f}; load {r['load']['after_train']:.2f})")
        r["snapshot"] = s = bench_snapshot(kfac, a.reps, tmp)
        r["load"]["after_snapshot"] = os.getloadavg()[0]
        log(f"[1] snapshot {s['snapshot']:.0f} ms (contents {s['contents']:.0f} + write "
            f"{s['write']:.0f}); eigh float64 {s['eigh64']:.0f} ms, float32 {s['eigh32']:.0f} ms; "
            f"ratio {s['ratio_eigh64']:.2f} / {s['ratio_eigh32']:.2f} "
            f"(load {r['load']['after_snapshot']:.2f})")
        r["query"] = q = bench_query(model, kfac.snapshots[-1], a.reps)
        r["load"]["after_query"] = os.getloadavg()[0]
        log(f"[3] forward {q['forward_ms']:.1f} ms; " + ", ".join(
            f"K={k}: {v['ms']:.0f} ms ({v['ratio']:.1f}x, goal {v['goal']}x)"
            for k, v in q["per_k"].items()) + f" (load {r['load']['after_query']:.2f})")
    info["load_end"] = os.getloadavg()[0]
    r["args"] = vars(a)
    log("\n" + table(r))
    write_outputs(r, a, info)
    log(f"wrote {HERE / 'RESULTS.md'} and {HERE / 'results' / 'snapshot_query.json'}")


if __name__ == "__main__":
    main()
