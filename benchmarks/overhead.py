"""Overhead of `KFACStreamCallback` on a small GPT-2, CPU, interleaved with plain training.

Method
------
* Model ``GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=256)``,
  dropout 0 (same work every step), batch 8 x 256 tokens, AdamW lr 1e-4, CPU. Data:
  ``pydoc_data.topics`` (ships with CPython) as UTF-8 bytes, token id = byte (0..255); only
  256 of the 2048 vocabulary rows are ever targets, which does not change the cost (the LM
  head computes all 2048 logits anyway).
* Model, data, and the block clock below are shared with the other cost benchmarks
  (``benchmarks/_common.py``: ``MODEL``, ``make_data``, ``BlockClock``).
* One training run per configuration (in a fresh spawned process): a few tracked warm-up
  steps, then ``--pairs`` pairs of blocks, each pair a PLAIN block and a TRACKED block of
  ``--timed-steps`` steps (rounded up to a multiple of ``update_every``; blocks start at
  multiples of it, so a tracked block holds exactly its share of update steps), the order
  alternating between pairs. Interleaving inside one process removes the run-to-run and
  process-to-process variance (allocator state, memory placement: +-5-15% here) that
  separate runs suffer. In a plain block the kfac hooks are removed from the model
  (``Tracker.detach``: a true plain step); they are put back for the tracked block
  (``Tracker.attach``).
* Step time = ``on_step_begin`` -> ``on_step_end``, clocked by a callback placed before the
  kfac callback and one after it (data loading, done by the Trainer before
  ``on_step_begin``, is outside). A block's statistic is its MEAN step (a median would hide
  the update steps). The store folds pushed rows into the factors (the ``AᵀA`` GEMMs) only
  every few updates, so the last step of each tracked block also folds, TIMED: each block
  pays exactly for its own updates.
* Reported: MEDIAN over pairs of tracked/plain (min-max), also for process CPU time.
* FLOP lower bound (multiply-add = 2 FLOPs; N = 8*256 tokens; P = weights of all matmuls
  incl. the LM head): plain step = 6*P*N + 3 * (4*B*T^2*E per layer: attention QK^T and AV
  forward, x3 for forward + backward). Tracker per update = sum over tracked layers of
  n*(a_dim*(a_dim+1) + g_dim*(g_dim+1)) (the upper triangles of the symmetric second
  moments, which is what the store computes), n = token_fraction*N; the MC Fisher adds a
  forward (2*P*N + attention) and a backward to the activations only (no weight gradients:
  ~2*P*N + 2x the attention forward) of the sequences it runs on: ``mc`` (the default share
  ``KFACConfig().mc_sequences`` of the update step's sequences, a replay after the step)
  scales that by the share (the expected sequences; the timing runs set
  ``min_window_sequences=0`` so that the share is the long run's, never raised for a short run,
  `kfac_stream.config.window_mc_share`),
  ``mc-all`` (``mc_sequences="all"``: the whole batch, its backward inside the training
  forward; the real in-forward pass needs no second forward, so its bound overstates it).
  Per step: / update_every. Bound ratio = 1 + extra/plain. Row gathers, softmaxes, sampling
  and FP16 conversions are not counted.
* Configs are ``(token_fraction, fisher, update_every)`` with fisher ``empirical``, ``mc``
  (KFACConfig's default: ``fisher="mc"`` on its default share) or ``mc-all``.

Usage: ``python benchmarks/overhead.py [--pairs 6] [--timed-steps 20] [--grid-pairs 3]
[--grid-timed-steps 10] [--configs ...] [--no-write]`` (the first two for the default and
the empirical token_fraction 0.05 configs, the grid options for the rest); ``--quick`` is a
smoke run that writes nothing, ``--no-write`` prints the table without writing. Writes the
section of ``benchmarks/RESULTS.md`` between the ``overhead`` markers and
``benchmarks/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback

from _common import (
    BATCH,
    MODEL,
    SEQ,
    BlockClock,
    GatedKFAC,
    StartClock,
    StopClock,
    log,
    machine,
    make_data,
    write_json,
    write_section,
)

HERE = Path(__file__).resolve().parent
# fisher label -> KFACConfig(fisher, mc_sequences)
MC_SHARE = KFACConfig().mc_sequences  # the default share of an update step's sequences
FISHERS = {"empirical": ("empirical", "all"), "mc": ("mc", MC_SHARE), "mc-all": ("mc", "all")}
ALL = [(tf, fi, k) for fi in FISHERS for k in (1, 10) for tf in (1.0, 0.25, 0.05)]
QUICK = [(0.05, "mc", 1), (0.05, "empirical", 1), (1.0, "mc-all", 1)]
DEFAULTS = [(0.05, "mc", 1), (0.05, "mc", 10)]  # KFACConfig's defaults: the acceptance target
# measured with as many pairs as the defaults: the empirical Fisher at the same cost settings
MAIN = DEFAULTS + [(0.05, "empirical", 1), (0.05, "empirical", 10)]
BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"


def name(cfg) -> str:
    return f"tf={cfg[0]:g} {cfg[1]} k={cfg[2]}"


def run_isolated(*args) -> dict:
    """`run_blocks` in a fresh (spawned) process per configuration."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(run_blocks, *args).result()


def run_blocks(cfg, warmup: int, block: int, pairs: int, seed: int) -> dict:
    """One training run: ``warmup`` tracked steps, then ``pairs`` x (plain block, tracked
    block), the order alternating between pairs. All blocks start at multiples of
    ``update_every`` so each tracked block holds exactly ``block / update_every`` updates."""
    # x86 CPUs slow down ~10x on denormal floats, which a tiny-weight model's training produces;
    # flushing them to zero is standard for CPU training and makes the timings meaningful.
    torch.set_flush_denormal(True)
    schedule = ["tracked"] * warmup
    for i in range(pairs):
        order = ("plain", "tracked") if i % 2 == 0 else ("tracked", "plain")
        for mode in order:
            schedule += [mode] * block
    data = make_data(BATCH * len(schedule))
    transformers.set_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        fisher, mc_sequences = FISHERS[cfg[1]]
        kfac = KFACStreamCallback(KFACConfig(
            token_fraction=cfg[0], ema_decay=0.95, update_every=cfg[2], fisher=fisher,
            mc_sequences=mc_sequences, snapshot_every=10**9, min_window_sequences=0,
            output_dir=os.path.join(tmp, "kfac"), seed=seed))
        clock = BlockClock(schedule, kfac)
        args = TrainingArguments(
            output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, learning_rate=1e-4, seed=seed,
            per_device_train_batch_size=BATCH, max_steps=len(schedule),
            dataloader_num_workers=0)
        cbs = [StartClock(clock), GatedKFAC(kfac, schedule), StopClock(clock)]
        Trainer(model=model, args=args, train_dataset=data, callbacks=cbs).train()
    out = {"pairs": [], "specs": [(s.a_dim, s.g_dim, s.d_in * s.d_out)
                                  for s in kfac.tracker.specs.values()],
           "counters": {k: v for k, v in vars(kfac.tracker.counters).items()
                        if k != "skipped_steps"}, "load": os.getloadavg()[0]}
    pos = warmup
    for i in range(pairs):
        order = ("plain", "tracked") if i % 2 == 0 else ("tracked", "plain")
        res = {}
        for mode in order:
            sl = slice(pos, pos + block)
            res[mode] = {"mean_s": sum(clock.times[sl]) / block,
                         "cpu_mean_s": sum(clock.cpu[sl]) / block,
                         "tracker_s_per_step": sum(clock.tracker_s[sl]) / block}
            pos += block
        res["ratio"] = res["tracked"]["mean_s"] / res["plain"]["mean_s"]
        res["cpu_ratio"] = res["tracked"]["cpu_mean_s"] / res["plain"]["cpu_mean_s"]
        out["pairs"].append(res)
    return out


def flop_bound(cfg, specs) -> dict:
    """FLOPs per step: plain, and the tracker's extra amortised over update_every."""
    tf, fisher, k = cfg
    c = MODEL
    n_tok = BATCH * SEQ
    params = sum(p for _, _, p in specs) + c["vocab_size"] * c["n_embd"]  # blocks + LM head
    attn_fwd = 4 * BATCH * SEQ**2 * c["n_embd"] * c["n_layer"]
    plain = 6 * params * n_tok + 3 * attn_fwd
    # symmetric second moments: only the upper triangle, d(d+1)/2 entries x n MACs x 2 FLOPs
    per_update = sum(tf * n_tok * (a * (a + 1) + g * (g + 1)) for a, g, _ in specs)
    if fisher != "empirical":
        spec = FISHERS[fisher][1]
        share = 1.0 if spec == "all" else float(spec)  # expected share of sequences run
        per_update += share * (4 * params * n_tok + 3 * attn_fwd)
    extra = per_update / k
    return {"plain_flops": plain, "extra_flops_per_step": extra, "ratio": 1 + extra / plain}


def plan(cfg, a) -> tuple[int, int, int]:
    """``(warm-up steps, block steps, pairs)`` of one config: the acceptance configs and the
    empirical Fisher at token_fraction 0.05 (`MAIN`) get ``--pairs`` x ``--timed-steps``, the
    rest of the grid ``--grid-pairs`` x ``--grid-timed-steps``; steps rounded up to a multiple
    of update_every."""
    k = cfg[2]
    pairs, timed = ((a.pairs, a.timed_steps) if cfg in MAIN
                    else (a.grid_pairs, a.grid_timed_steps))
    return math.ceil(a.warmup / k) * k, math.ceil(timed / k) * k, pairs


def measure(cfg, a) -> dict:
    warmup, block, n_pairs = plan(cfg, a)
    t0 = time.perf_counter()
    run = run_isolated(cfg, warmup, block, n_pairs, a.seed)
    pairs = run["pairs"]
    for i, p in enumerate(pairs):
        log(f"  [{name(cfg)}] pair {i + 1}/{n_pairs}: plain {1e3 * p['plain']['mean_s']:.1f} ms, "
            f"tracked {1e3 * p['tracked']['mean_s']:.1f} ms, ratio {p['ratio']:.4f} "
            f"(CPU time {p['cpu_ratio']:.4f})")
    log(f"  [{name(cfg)}] {warmup + 2 * n_pairs * block} steps in "
        f"{time.perf_counter() - t0:.0f} s (load {run['load']:.2f})")
    ratios = [p["ratio"] for p in pairs]
    bound = flop_bound(cfg, run["specs"])
    med = statistics.median(ratios)
    return {
        "config": {"token_fraction": cfg[0], "fisher": FISHERS[cfg[1]][0],
                   "mc_sequences": FISHERS[cfg[1]][1] if cfg[1] != "empirical" else None,
                   "update_every": cfg[2]},
        "name": name(cfg), "block_steps": block, "warmup": warmup,
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
    rows = ["| config | pairs x steps | plain ms | tracked ms | median ratio [min–max] | "
            "FLOP-bound ratio | overhead / bound overhead | CPU-time ratio | tracker ms/step |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ob = "–" if r["overhead_vs_bound"] is None else f"{r['overhead_vs_bound']:.2f}"
        rows.append(
            f"| {r['name']} | {len(r['pairs'])} x {r['block_steps']} | {r['plain_ms']:.0f} | "
            f"{r['tracked_ms']:.0f} | "
            f"{r['ratio_median']:.4f} [{r['ratio_min']:.4f}–{r['ratio_max']:.4f}] | "
            f"{r['bound']['ratio']:.4f} | {ob} | {r['cpu_ratio_median']:.4f} | "
            f"{r['tracker_ms_per_step']:.1f} |")
    return "\n".join(rows)


def verdict(results) -> str:
    lines = []
    for r in results:
        c = r["config"]
        if (c["token_fraction"], c["fisher"], c["mc_sequences"]) != (0.05, "mc", MC_SHARE):
            continue
        ok_ratio = r["ratio_median"] <= 1.02
        ok_bound = r["overhead_vs_bound"] is not None and r["overhead_vs_bound"] <= 1.2
        half = (r["ratio_max"] - r["ratio_min"]) / 2
        lines.append(
            f"- default target (fisher mc, mc_sequences {MC_SHARE:g}), "
            f"update_every={c['update_every']}: ratio {r['ratio_median']:.4f} "
            f"{'≤' if ok_ratio else '>'} 1.02 ({'met' if ok_ratio else 'NOT met'}); overhead "
            f"{'≤' if ok_bound else '>'} 1.2× the FLOP-bound overhead "
            f"({'met' if ok_bound else 'NOT met'}; FLOP-bound ratio "
            f"{r['bound']['ratio']:.4f})."
            + (f" Pairs spread ±{100 * half:.1f}% around 1, more than the FLOP-bound overhead: "
               "this run cannot resolve an overhead that small." if r["ratio_min"] <= 1
               <= r["ratio_max"] and half > r["bound"]["ratio"] - 1 else ""))
    return "\n".join(lines) or "- default configuration not measured in this run."


def write_outputs(results, a, info) -> None:
    write_json("overhead",
        {"machine": info, "command": a.command, "args": vars(a), "results": results})
    section = "\n".join([
        BEGIN, "## Training overhead of KFACStreamCallback (`benchmarks/overhead.py`)", "",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch "
        f"threads); torch {info['torch']}, transformers {info['transformers']}, "
        f"Python {info['python']}",
        f"- load average (1 min) at start / end: {info['load_start']:.2f} / "
        f"{info['load_end']:.2f}",
        f"- command: `{a.command}`",
        f"- one training run per config: {a.pairs} interleaved pairs of plain/tracked blocks of "
        f"{a.timed_steps} steps for the two default configs, {a.grid_pairs} pairs of "
        f"{a.grid_timed_steps} steps for the rest of the grid (rounded up to a multiple of "
        "update_every), after "
        f"{a.warmup} warm-up steps; ratio = mean tracked step / mean plain step of a pair "
        "(median over pairs); tracker ms/step = training-thread time in on_step_end (+ the "
        "block's final fold). Method and FLOP model: docstring of the script.", "",
        table(results), "", verdict(results), END])
    write_section(BEGIN, END, section)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6, help="pairs for the two default configs")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed-steps", type=int, default=20,
                   help="steps per plain/tracked block of the default configs (rounded up to a "
                        "multiple of update_every)")
    p.add_argument("--grid-pairs", type=int, default=3, help="pairs for the other configs")
    p.add_argument("--grid-timed-steps", type=int, default=10,
                   help="steps per block for the other configs")
    p.add_argument("--configs", nargs="*", default=None,
                   help="TF:FISHER:K filters, '*' matches anything, e.g. 0.05:empirical:*; "
                        "'default' = the acceptance configs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 pair, 3 configs, 2 steps; writes nothing")
    p.add_argument("--no-write", action="store_true",
                   help="print the table and the verdict, write no file")
    a = p.parse_args(argv)
    a.command = "python benchmarks/overhead.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    configs = ALL
    if a.quick:
        a.pairs, a.timed_steps, configs = 1, 2, QUICK
        a.grid_pairs, a.grid_timed_steps = a.pairs, a.timed_steps
    if a.configs:
        def match(cfg, f):
            if f == "default":
                return cfg in DEFAULTS
            parts = f.split(":")
            vals = (f"{cfg[0]:g}", cfg[1], str(cfg[2]))
            # a filter may name fewer fields than a config has
            return all(x in ("*", v) for x, v in zip(parts, vals, strict=False))
        configs = [c for c in ALL if any(match(c, f) for f in a.configs)]
    if not configs:
        p.error("no configuration matches --configs")
    info = {**machine(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load_start": os.getloadavg()[0]}
    log(f"overhead benchmark: {len(configs)} configs; {info['cpu']}, "
        f"{info['cores']} cores, torch {info['torch']}, load {info['load_start']:.2f}")
    steps = sum(w + 2 * n * b for w, b, n in (plan(c, a) for c in configs))
    log(f"{steps} training steps in all (~0.4 s each plain on this CPU; tracked ones more)")
    results = []
    for j, cfg in enumerate(configs):
        log(f"[{j + 1}/{len(configs)}] {name(cfg)}")
        r = measure(cfg, a)
        log(f"[{name(cfg)}] plain {r['plain_ms']:.0f} ms, tracked {r['tracked_ms']:.0f} ms, "
            f"ratio {r['ratio_median']:.4f} [{r['ratio_min']:.4f}-{r['ratio_max']:.4f}], "
            f"FLOP bound {r['bound']['ratio']:.4f}, tracker {r['tracker_ms_per_step']:.1f} ms/step")
        results.append(r)
    info["load_end"] = os.getloadavg()[0]
    log("\n" + table(results) + "\n" + verdict(results))
    if a.quick or a.no_write:
        log(f"{'--quick' if a.quick else '--no-write'}: nothing written")
        return
    write_outputs(results, a, info)
    log(f"wrote {HERE / 'RESULTS.md'} and {HERE / 'results' / 'overhead.json'}")


if __name__ == "__main__":
    main()
