"""Overhead of `KFACStreamCallback` on a small GPT-2, CPU, interleaved with plain training.

Method
------
* Model ``GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256)``,
  dropout 0 (same work every step), batch 8 x 256 tokens, AdamW lr 1e-4, CPU. Data:
  ``pydoc_data.topics`` (ships with CPython) as UTF-8 bytes, token id = byte (0..255); only
  256 of the 2048 vocabulary rows are ever targets, which does not change the cost (the LM
  head computes all 2048 logits anyway).
* One *run* = a fresh model (same seed -> same init, same data order) trained ``warmup +
  timed`` steps. Step time = ``on_step_begin`` -> ``on_step_end``, clocked by one callback
  placed before the kfac callback and one after it, so the tracker's ``on_step_end`` is inside
  and data loading (done by the Trainer before ``on_step_begin``) is outside. ``timed`` is
  rounded up to a multiple of ``update_every`` so the window holds exactly its share of update
  steps, and a run's statistic is the MEAN timed step (a median would hide the update steps).
* The store folds pushed rows into the factors (the ``AᵀA`` GEMMs) only every few updates.
  So that a short window neither misses nor double-counts folds, the tracked run flushes the
  store untimed before the first timed step and TIMED after the last one (added to the
  window): the window pays exactly for its own updates.
* One *pair* = a plain and a tracked run with the same seed, order alternating between pairs.
  Every run is a fresh spawned process. Reported: MEDIAN over pairs of tracked/plain
  (min-max), also for process CPU time (all threads; less sensitive than wall time to other
  processes competing for the cores).
* FLOP lower bound (multiply-add = 2 FLOPs; N = 8*256 tokens; P = weights of all matmuls
  incl. the LM head): plain step = 6*P*N + 3 * (4*B*T^2*E per layer: attention QK^T and AV
  forward, x3 for forward + backward). Tracker per update = sum over tracked layers of
  2*n*(a_dim^2 + g_dim^2), n = token_fraction*N; fisher="mc" adds a forward (2*P*N +
  attention) and a backward to the activations only (no weight gradients: ~2*P*N + 2x the
  attention forward). Per step: / update_every. Bound ratio = 1 + extra/plain. Row gathers,
  softmaxes, sampling and FP16 conversions are not counted.

Usage: ``python benchmarks/overhead.py [--pairs 5] [--timed-steps 20] [--configs ...]``;
``--quick`` is a smoke run. Writes the section of ``benchmarks/RESULTS.md`` between the
``overhead`` markers and ``benchmarks/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback

HERE = Path(__file__).resolve().parent
BATCH, SEQ = 8, 256
MODEL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=SEQ, resid_pdrop=0.0,
             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
ALL = [(tf, fi, k) for fi in ("empirical", "mc") for k in (1, 10) for tf in (1.0, 0.25, 0.05)]
QUICK = [(0.05, "empirical", 1), (0.05, "empirical", 10), (1.0, "mc", 1)]
DEFAULTS = [(0.05, "empirical", 1), (0.05, "empirical", 10)]  # the acceptance target
BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"


def log(msg: str) -> None:
    print(msg, flush=True)


def name(cfg) -> str:
    return f"tf={cfg[0]:g} {cfg[1]} k={cfg[2]}"


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_data(n: int) -> ListDataset:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    assert len(ids) >= n * SEQ, "not enough text"
    return ListDataset([{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}
                        for x in (ids[i * SEQ:(i + 1) * SEQ] for i in range(n))])


class StepStart(TrainerCallback):
    """Placed first: starts the clock (before the kfac callback's on_step_begin)."""

    def __init__(self, timer):
        self.timer = timer

    def on_step_begin(self, args, state, control, **kw):
        self.timer.start(state.global_step)


class StepStop(TrainerCallback):
    """Placed last: stops the clock after the kfac callback's on_step_end."""

    def __init__(self, warmup: int, total: int, kfac: KFACStreamCallback | None):
        self.warmup, self.total, self.kfac = warmup, total, kfac
        self.times, self.cpu, self.tracker_s, self.flush_s = [], [], [], 0.0

    def _tracker_seconds(self) -> float:
        return self.kfac.tracker.counters.tracker_seconds if self.kfac else 0.0

    def start(self, step: int) -> None:
        if step == self.warmup and self.kfac:  # untimed: fold what the warm-up updates left
            self.kfac.tracker.flush()
        self._c0 = self._tracker_seconds()
        self._p0, self._t0 = time.process_time(), time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        dt = time.perf_counter() - self._t0
        self.tracker_s.append(self._tracker_seconds() - self._c0)
        if state.global_step == self.total and self.kfac:  # timed: fold the window's updates
            t = time.perf_counter()
            self.kfac.tracker.flush()
            self.flush_s = time.perf_counter() - t
            dt += self.flush_s  # the window pays for the fold of its own updates
        self.times.append(dt)
        self.cpu.append(time.process_time() - self._p0)  # all threads: less load-sensitive


def run_isolated(*args) -> dict:
    """`run_once` in a fresh (spawned) process: no allocator state, thread pool or memory a
    previous run left behind can bias the next one."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(run_once, *args).result()


def run_once(cfg, tracked: bool, warmup: int, timed: int, seed: int) -> dict:
    # x86 CPUs slow down ~10x on denormal floats, which a tiny-weight model's training produces;
    # flushing them to zero is standard for CPU training and makes the timings meaningful.
    torch.set_flush_denormal(True)
    data = make_data(BATCH * (warmup + timed))
    transformers.set_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        kfac = None
        if tracked:
            kfac = KFACStreamCallback(KFACConfig(
                token_fraction=cfg[0], ema_decay=0.95, update_every=cfg[2], fisher=cfg[1],
                snapshot_every=10**9, output_dir=os.path.join(tmp, "kfac"), seed=seed))
        stop = StepStop(warmup, warmup + timed, kfac)
        args = TrainingArguments(
            output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, learning_rate=1e-4, seed=seed,
            per_device_train_batch_size=BATCH, max_steps=warmup + timed,
            dataloader_num_workers=0)
        cbs = [StepStart(stop)] + ([kfac] if kfac else []) + [stop]
        t0 = time.perf_counter()
        Trainer(model=model, args=args, train_dataset=data, callbacks=cbs).train()
        wall = time.perf_counter() - t0
    times = stop.times[warmup:]
    assert len(times) == timed, (len(times), timed)
    out = {"mean_s": sum(times) / timed, "cpu_mean_s": sum(stop.cpu[warmup:]) / timed,
           "step_s": times, "wall_s": wall, "flush_s": stop.flush_s, "load": os.getloadavg()[0]}
    if kfac:
        tr = kfac.tracker
        out["tracker_s_per_step"] = (sum(stop.tracker_s[warmup:]) + stop.flush_s) / timed
        out["counters"] = {k: v for k, v in vars(tr.counters).items() if k != "skipped_steps"}
        out["specs"] = [(s.a_dim, s.g_dim, s.d_in * s.d_out) for s in tr.specs.values()]
    del model
    gc.collect()
    return out


def flop_bound(cfg, specs) -> dict:
    """FLOPs per step: plain, and the tracker's extra amortised over update_every."""
    tf, fisher, k = cfg
    c = MODEL
    n_tok = BATCH * SEQ
    params = sum(p for _, _, p in specs) + c["vocab_size"] * c["n_embd"]  # blocks + LM head
    attn_fwd = 4 * BATCH * SEQ**2 * c["n_embd"] * c["n_layer"]
    plain = 6 * params * n_tok + 3 * attn_fwd
    per_update = sum(2 * tf * n_tok * (a * a + g * g) for a, g, _ in specs)
    if fisher == "mc":
        per_update += 4 * params * n_tok + 3 * attn_fwd
    extra = per_update / k
    return {"plain_flops": plain, "extra_flops_per_step": extra, "ratio": 1 + extra / plain}


def machine() -> dict:
    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def measure(cfg, a, estimate) -> dict:
    k = cfg[2]
    timed = math.ceil(a.timed_steps / k) * k
    pairs = []
    for i in range(a.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        res = {}
        for tracked in order:
            r = run_isolated(cfg, tracked, a.warmup, timed, a.seed + i)
            res["tracked" if tracked else "plain"] = r
            log(f"  [{name(cfg)}] pair {i + 1}/{a.pairs} {'tracked' if tracked else 'plain  '}: "
                f"mean step {1e3 * r['mean_s']:.1f} ms, CPU {1e3 * r['cpu_mean_s']:.0f} ms "
                f"(run wall {r['wall_s']:.1f} s, load {r['load']:.2f})")
            if estimate is not None:
                estimate(r)
                estimate = None
        res["ratio"] = res["tracked"]["mean_s"] / res["plain"]["mean_s"]
        res["cpu_ratio"] = res["tracked"]["cpu_mean_s"] / res["plain"]["cpu_mean_s"]
        log(f"  [{name(cfg)}] pair {i + 1}: ratio {res['ratio']:.4f} "
            f"(CPU time {res['cpu_ratio']:.4f})")
        pairs.append(res)
    ratios = [p["ratio"] for p in pairs]
    bound = flop_bound(cfg, pairs[0]["tracked"]["specs"])
    med = statistics.median(ratios)
    return {
        "config": {"token_fraction": cfg[0], "fisher": cfg[1], "update_every": k},
        "name": name(cfg), "timed_steps": timed, "warmup": a.warmup,
        "plain_ms": 1e3 * statistics.median(p["plain"]["mean_s"] for p in pairs),
        "tracked_ms": 1e3 * statistics.median(p["tracked"]["mean_s"] for p in pairs),
        "tracker_ms_per_step": 1e3 * statistics.median(
            p["tracked"]["tracker_s_per_step"] for p in pairs),
        "ratio_median": med, "ratio_min": min(ratios), "ratio_max": max(ratios),
        "cpu_ratio_median": statistics.median(p["cpu_ratio"] for p in pairs),
        "bound": bound,
        "overhead_vs_bound": (med - 1) / (bound["ratio"] - 1) if bound["ratio"] > 1 else None,
        "pairs": pairs,
    }


def table(results) -> str:
    rows = ["| config | plain ms | tracked ms | median ratio [min–max] | FLOP-bound ratio | "
            "overhead / bound overhead | CPU-time ratio | tracker ms/step |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ob = "–" if r["overhead_vs_bound"] is None else f"{r['overhead_vs_bound']:.2f}"
        rows.append(
            f"| {r['name']} | {r['plain_ms']:.0f} | {r['tracked_ms']:.0f} | "
            f"{r['ratio_median']:.4f} [{r['ratio_min']:.4f}–{r['ratio_max']:.4f}] | "
            f"{r['bound']['ratio']:.4f} | {ob} | {r['cpu_ratio_median']:.4f} | "
            f"{r['tracker_ms_per_step']:.1f} |")
    return "\n".join(rows)


def verdict(results) -> str:
    lines = []
    for r in results:
        c = r["config"]
        if (c["token_fraction"], c["fisher"]) != (0.05, "empirical"):
            continue
        ok_ratio = r["ratio_median"] <= 1.02
        ok_bound = r["overhead_vs_bound"] is not None and r["overhead_vs_bound"] <= 1.2
        half = (r["ratio_max"] - r["ratio_min"]) / 2
        lines.append(
            f"- default target, update_every={c['update_every']}: ratio {r['ratio_median']:.4f} "
            f"{'≤' if ok_ratio else '>'} 1.02 ({'met' if ok_ratio else 'NOT met'}); overhead "
            f"{'≤' if ok_bound else '>'} 1.2× the FLOP-bound overhead "
            f"({'met' if ok_bound else 'NOT met'}; FLOP-bound ratio "
            f"{r['bound']['ratio']:.4f})."
            + (f" Pairs spread ±{100 * half:.1f}% around 1, more than the FLOP-bound overhead: "
               "this run cannot resolve an overhead that small." if r["ratio_min"] <= 1
               <= r["ratio_max"] and half > r["bound"]["ratio"] - 1 else ""))
    return "\n".join(lines) or "- default configuration not measured in this run."


def write_outputs(results, a, info) -> None:
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "overhead.json").write_text(json.dumps(
        {"machine": info, "command": a.command, "args": vars(a), "results": results}, indent=1))
    section = "\n".join([
        BEGIN, "## Training overhead of KFACStreamCallback (`benchmarks/overhead.py`)", "",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch "
        f"threads); torch {info['torch']}, transformers {info['transformers']}, "
        f"Python {info['python']}",
        f"- load average (1 min) at start / end: {info['load_start']:.2f} / "
        f"{info['load_end']:.2f}",
        f"- command: `{a.command}`",
        f"- {a.pairs} interleaved pairs per config, {a.warmup} warm-up steps, timed window "
        "rounded up to a multiple of update_every; ratio = mean tracked step / mean plain step "
        "of a pair (median over pairs); tracker ms/step = training-thread time in on_step_end "
        "(+ the window's final fold). Method and FLOP model: docstring of the script.", "",
        table(results), "", verdict(results), END])
    path = HERE / "RESULTS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + section + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed-steps", type=int, default=20,
                   help="timed steps per run (rounded up to a multiple of update_every)")
    p.add_argument("--configs", nargs="*", default=None,
                   help="TF:FISHER:K filters, '*' matches anything, e.g. 0.05:empirical:*; "
                        "'default' = the acceptance configs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 pair, 3 configs, 2 steps")
    a = p.parse_args(argv)
    a.command = "python benchmarks/overhead.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    configs = ALL
    if a.quick:
        a.pairs, a.timed_steps, configs = 1, 2, QUICK
    if a.configs:
        def match(cfg, f):
            if f == "default":
                return cfg in DEFAULTS
            parts = f.split(":")
            vals = (f"{cfg[0]:g}", cfg[1], str(cfg[2]))
            return all(x in ("*", v) for x, v in zip(parts, vals))
        configs = [c for c in ALL if any(match(c, f) for f in a.configs)]
    if not configs:
        p.error("no configuration matches --configs")
    info = {**machine(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load_start": os.getloadavg()[0]}
    log(f"overhead benchmark: {len(configs)} configs x {a.pairs} pairs; {info['cpu']}, "
        f"{info['cores']} cores, torch {info['torch']}, load {info['load_start']:.2f}")
    steps = [a.warmup + math.ceil(a.timed_steps / c[2]) * c[2] for c in configs]

    def estimate(first):
        per_step = first["wall_s"] / steps[0]
        total = sum(2 * a.pairs * (s * per_step + 6.0) for s in steps)  # + ~6 s process start
        log(f"first run: {1e3 * first['mean_s']:.0f} ms/step, {first['wall_s']:.1f} s wall; "
            f"expected total ≈ {total / 60:.1f} min (tracked runs take longer for mc/tf=1)")

    results = []
    for j, cfg in enumerate(configs):
        log(f"[{j + 1}/{len(configs)}] {name(cfg)}")
        r = measure(cfg, a, estimate if j == 0 else None)
        log(f"[{name(cfg)}] plain {r['plain_ms']:.0f} ms, tracked {r['tracked_ms']:.0f} ms, "
            f"ratio {r['ratio_median']:.4f} [{r['ratio_min']:.4f}-{r['ratio_max']:.4f}], "
            f"FLOP bound {r['bound']['ratio']:.4f}, tracker {r['tracker_ms_per_step']:.1f} ms/step")
        results.append(r)
    info["load_end"] = os.getloadavg()[0]
    log("\n" + table(results) + "\n" + verdict(results))
    write_outputs(results, a, info)
    log(f"wrote {HERE / 'RESULTS.md'} and {HERE / 'results' / 'overhead.json'}")


if __name__ == "__main__":
    main()
