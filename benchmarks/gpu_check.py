"""`make gpu-check`: everything about the CUDA path that a machine without a GPU cannot show,
in one command that finishes in ≤ 6 minutes on one H100. See docs/gpu.md.

Every part runs in its own subprocess under its own time limit (`PARTS`), cut where needed so
that the later parts' reserves still fit in `DEADLINE_S` (345 s from the start). A part that fails
or runs out of time is reported as such with whatever it finished (the training parts write
their figures after every run), and the script still prints the ONE summary table at the end
and writes ``benchmarks/results/gpu_check.json``. Parts:

1. ``cuda_tests``: ``pytest -q -rfs --tb=short -m "not slow"`` on the test files with CUDA
   tests (`cuda_test_files`: tests/unit/tracking/test_worker_eigh_and_cuda.py,
   tests/unit/tracking/test_tracker_lifecycle.py and any file with a ``skipif(not
   torch.cuda.is_available())`` marker): passed / failed / skipped; none
   may fail or skip on a GPU.
2. ``micro``: snapshot eigendecompositions (`eigh_factors`) of side 4096 and 11008 on the GPU
   (float32) against float64 on the CPU (4096); the bf16 tensor-core fold (`gram_fp32`) of
   6560 rows of 4096; the `FactorStore` device path: `push_device` of a 4096-side factor's
   bf16 rows 20 times (each update then `end_update`, as the factor worker does), then one
   `flush` streaming the FP16 factor through the device: ms per update, flush ms and GB/s, 0
   bytes moved and 0 host entries per update, and the flushed factor against the float64 EMA
   of the unrounded rows (`STORE_TOL`).
3. ``train_fp32_autocast`` / ``train_bf16``: a ~1.1B Llama built from a config (TinyLlama's
   shapes, random weights and tokens: nothing downloaded), (a) fp32 weights + bf16 autocast,
   micro-batch 4 x 1024, gradient accumulation 2; (b) pure bf16 weights, 1 x 2048. One
   process and one model per setting (the build and CUDA start paid once), the runs of `RUNS`
   in interleaved blocks (plain, the callback at the defaults (``update_every=10``), at
   ``update_every=1``, and the ablation at ``update_every=1``: the replay without the fold,
   the fold without a replay), ``blocks`` times (3 on a GPU), then plain once more (drift
   shows). Each run 10 warm-up + 10 timed optimizer steps (whole update cycles); per-step
   time from a CUDA event recorded at every step's end (no host sync added). A run's ratio is
   the **median over the blocks** of its mean s/step over the same block's plain run's (the
   median step is printed too, but at ``update_every=10`` it is that of the steps
   without an update, so it cannot show an update's cost).

   The tracked runs use ``KFACConfig(min_window_sequences=0, snapshot_every=10**6)``, and the
   script prints so: a short run would otherwise raise the MC share for its final window
   (`kfac_stream.config.window_mc_share`; 70 steps raised it to 1, 2x a plain step), while
   these figures are meant for a long run's share (0.05 of an update step's sequences); and no
   snapshot is taken: the final one is replaced by a timed flush (what a snapshot pays before
   its eigendecompositions, which are part 2's). At the long-run share an update step
   updates the factors only when the replay draws a sequence, with probability ``min(1,
   0.05·C)`` for its ``C`` sequences (0.4 in (a), 0.05 in (b)), so 30 steps hold few updates:
   each tracked run reports how many it held against the expectation, and the defaults' ratio
   is also projected from ``update_every=1``'s (every step an update step: 10x the samples),
   ``1 + (r₁ − 1)/10``; the target must hold for both.

   Reported per tracked run, from the tracker's counters: the ratio, waits, fold ms per
   update, bytes to the host / device per update and at the final flush, the final flush's
   seconds and host syncs, host entries, budget flushes, the device budget, peak resident
   bytes, and the extra peak GPU memory (``torch.cuda.max_memory_allocated`` with the callback
   minus plain, the peak reset between runs); and host syncs of kfac_stream's on the training
   thread in the first two steps (step 0 is an update step in every setting; counted by
   `tests/support/syncs.py`, which slows every op, so only there).
4. ``exchange``: a one-rank NCCL exchange (`start_exchange` from a side stream, the way the
   tracker issues it, then `finish_exchange`): rows back exactly. Kept: a few seconds.

Targets (the summary's PASS/MISS): no CUDA test failing or skipped; step time
≤ 1.02x plain at the defaults with no waits, ≤ 1.10x at ``update_every=1``; extra peak memory
within the device budget; the whole check ≤ 6 minutes. Exit status 1 when any is missed.

On a machine without CUDA (or with ``--dry-run``) it says so and runs the same parts, in
subprocesses, on tiny sizes on the CPU (part 1 only collects the CUDA tests; the tracker on
the device path with the CPU standing in for the device, ``fold_on="device"``, and the worker
on, as on CUDA; the exchange on gloo): a check that the script works (CI runs it:
tests/bench/test_gpu_check.py). Performance targets are not judged there; a dry run writes its JSON
only where ``--json`` or ``GPU_CHECK_JSON`` says.

Usage: ``python benchmarks/gpu_check.py [--dry-run] [--only PART,...] [--steps 30]
[--warmup 10] [--json PATH]``; ``--part NAME --out FILE`` runs one part (what the parent
starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

_STARTED = time.perf_counter()  # the ≤ 6 minutes count from here (torch's import included)

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT = HERE / "results" / "gpu_check.json"
sys.path.insert(0, str(HERE))  # its plan and summary beside it (also when loaded by path)

from gpu_check_plan import (  # noqa: E402
    ABLATION_DROP,
    CUDA_TEST_FILES,
    DEADLINE_S,
    DRY,
    FINAL_RUN,
    FOLD_TOL,
    FULL,
    PARTS,
    RUNS,
    STORE_ROUNDED_TOL,
    STORE_TOL,
    SYNC_COUNT_STEPS,
    TEST_TIMEOUT_S,
    TRACKED,
    Part,
    eigh_tol,
)
from gpu_check_summary import fmt_bytes, fmt_gb, print_table, summarise, timed_steps  # noqa: E402

# -- helpers (the parts') ------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> tuple[float, object]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def _write(path: Path, payload: dict) -> None:
    """Atomically (a part killed mid-write leaves the previous figures)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def cuda_test_files() -> list[str]:
    """`CUDA_TEST_FILES` and every test file with a CUDA-only marker (not this script's own
    test, which runs the dry run)."""
    found = list(CUDA_TEST_FILES)
    marker = re.compile(r"skipif\(\s*not\s+torch\.cuda\.is_available\(\)")
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in found and path.name != "test_gpu_check.py" and \
                marker.search(path.read_text()):
            found.append(rel)
    return found


# -- part 2: eigh, fold, store -------------------------------------------------------------------

def eigh_part(sizes, device: torch.device) -> dict:
    """`eigh_factors` on ``device`` (and the CPU float64 reference for the smallest)."""
    from kfac_stream.stats.spectrum import eigh_factors

    out = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for i, d in enumerate(sizes):
        x = torch.randn(d + 64, d, generator=gen, device=device)  # built where it is fast
        f_dev = x.T @ x / d  # [d, d] SPD
        del x
        f = f_dev.double().cpu()  # factors reach eigh_factors as float64 on the CPU
        if i == 0:
            eigh_factors({"warm": f[:64, :64]}, device=device)  # stream, handles, kernels
        secs, res = _timed(lambda f=f: eigh_factors({"f": f}, device=device), device)
        w, q = (t.to(device, f_dev.dtype) for t in res["f"])
        err = float(((q * w) @ q.T - f_dev).abs().max() / w.max())
        row = {"seconds": secs, "max_err_rel_to_top": err, "tol": eigh_tol(d),
               "ok": err <= eigh_tol(d)}
        if i == 0 and device.type == "cuda":
            row["cpu_float64_seconds"] = _timed(lambda f=f: eigh_factors({"f": f}),
                                                torch.device("cpu"))[0]
        out[str(d)] = row
        print(f"eigh {d}: {secs:.3f} s on {device.type}, reconstruction error {err:.2e} of the "
              f"top eigenvalue (≤ {eigh_tol(d):.1e})"
              + (f"; CPU float64: {row['cpu_float64_seconds']:.2f} s"
                 if "cpu_float64_seconds" in row else ""), flush=True)
        del f_dev, f, w, q, res
    return out


def fold_part(rows: int, d: int, device: torch.device) -> dict:
    """The bf16 fold (`gram_fp32`) against the Gram of the rounded rows in float64."""
    from kfac_stream.store.folding import gram_fp32

    gen = torch.Generator().manual_seed(1)
    xb = torch.randn(rows, d, generator=gen).to(device, torch.bfloat16)
    gram_fp32(xb, False)  # warm-up (cuBLAS handle, kernels)
    fold_s, got = _timed(lambda: gram_fp32(xb, False), device)
    rounded = xb.double()
    ref = rounded.T @ rounded
    err = float(torch.linalg.norm(got.double() - ref) / torch.linalg.norm(ref))
    print(f"fold [{rows}, {d}] bf16 on {device.type}: {fold_s * 1e3:.2f} ms, relative error "
          f"{err:.1e} against the rounded rows' Gram (≤ {FOLD_TOL:.0e})", flush=True)
    return {"seconds": fold_s, "rel_err": err, "tol": FOLD_TOL, "ok": err <= FOLD_TOL}


def store_part(d: int, m: int, k: int, device: torch.device) -> dict:
    """The store's device path: ``k`` updates of ``m`` bf16 rows of a ``d``-side factor
    (`push_device` + `end_update` each), one flush, against the float64 EMA."""
    from kfac_stream.stats.ema import ema_step
    from kfac_stream.store.factor_store import FactorStore
    from kfac_stream.store.traffic import Traffic

    gen = torch.Generator(device=device).manual_seed(3)
    col = torch.exp(0.5 * torch.randn(d, generator=gen, device=device))  # uneven scales
    rows = [torch.randn(m, d, generator=gen, device=device) * col for _ in range(k)]
    xb = [x.to(torch.bfloat16) for x in rows]
    budget = 1 << 32  # resident: the flush is the only traffic

    def updates(store: FactorStore) -> float:
        def go():
            for x in xb:
                store.push_device("f", x, "rows", float(m), m)
                store.end_update()
        return _timed(go, device)[0]

    def new_store(traffic: Traffic) -> FactorStore:
        store = FactorStore("float16", 0.95, device=device, device_budget=budget,
                            traffic=traffic)
        store.add("f", d, False)
        return store

    warm = new_store(Traffic())  # kernels, streams, pinned allocations
    updates(warm)
    warm.flush()
    del warm
    traffic = Traffic()
    store = new_store(traffic)
    upd_s = updates(store)
    before = traffic.traffic()
    flush_s = _timed(store.flush, device)[0]
    after = traffic.traffic()
    got = store.values()["f"].to(device, torch.float64)
    ref = torch.zeros(d, d, dtype=torch.float64, device=device)
    ref_rounded = torch.zeros_like(ref)
    weight = 0.0
    for x, b in zip(rows, xb):
        weight, eta = ema_step(weight, m, 0.95)
        x64, b64 = x.double(), b.double()
        ref.mul_(1 - eta).add_(x64.T @ x64, alpha=eta / m)
        ref_rounded.mul_(1 - eta).add_(b64.T @ b64, alpha=eta / m)
    err = float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))
    err_r = float(torch.linalg.norm(got - ref_rounded) / torch.linalg.norm(ref_rounded))
    moved = (after["bytes_to_host"] - before["bytes_to_host"]
             + after["bytes_to_device"] - before["bytes_to_device"])
    per_update_traffic = before["bytes_to_host"] + before["bytes_to_device"]
    ok = (err <= STORE_TOL and err_r <= STORE_ROUNDED_TOL and per_update_traffic == 0
          and before["host_entries"] == 0 and after["host_entries"] == 0)
    out = {"d": d, "rows": m, "updates": k, "update_ms": upd_s / k * 1e3,
           "flush_ms": flush_s * 1e3, "flush_bytes": moved,
           "flush_gb_per_s": moved / flush_s / 1e9 if flush_s > 0 else None,
           "rel_err": err, "tol": STORE_TOL, "rel_err_rounded_rows": err_r,
           "tol_rounded_rows": STORE_ROUNDED_TOL, "bytes_moved_by_updates": per_update_traffic,
           "traffic_before_flush": before, "traffic_after_flush": after, "ok": ok}
    print(f"store device path, {k} updates of [{m}, {d}] bf16 rows: {out['update_ms']:.2f} ms "
          f"per update ({fmt_bytes(per_update_traffic)} moved, {before['host_entries']} host "
          f"entries), one flush {out['flush_ms']:.2f} ms ({fmt_bytes(moved)}, "
          f"{out['flush_gb_per_s'] or 0:.1f} GB/s both ways, {after['flush_syncs']} host sync); "
          f"relative error {err:.2e} against the float64 EMA (≤ {STORE_TOL:.0e}: fp16 storage "
          f"2^-11 + bf16 rows), {err_r:.2e} against that of the rounded rows "
          f"(≤ {STORE_ROUNDED_TOL:.1e})", flush=True)
    return out


def machine() -> dict:
    """CPU, cores, versions (what `_common.machine` records, without its imports: 5 s)."""
    import platform

    import transformers

    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version()}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def micro_main(sizes: dict, device: torch.device, out: Path) -> int:
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "machine": machine()}
    _write(out, result)
    result["eigh"] = eigh_part(sizes["eigh"], device)
    _write(out, result)
    result["fold"] = fold_part(sizes["fold_rows"], sizes["fold_d"], device)
    _write(out, result)
    result["store"] = store_part(sizes["store_d"], sizes["store_rows"],
                                 sizes["store_updates"], device)
    _write(out, result)
    return 0


# -- part 3: training ----------------------------------------------------------------------------

def _counters(c) -> dict:
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c)
            if isinstance(getattr(c, f.name), (int, float))}


def _kfac_callback(config):
    """The callback with its final snapshot replaced by a timed flush (see the docstring):
    the counters before and after it in ``.final``."""
    from kfac_stream import KFACStreamCallback

    class FlushAtEnd(KFACStreamCallback):
        final: dict | None = None

        def on_train_end(self, args, state, control, model=None, **kwargs):
            tr = self.tracker
            if tr is not None:
                tr.updater.wait()
                before = _counters(tr.read_counters())
                t = time.perf_counter()
                tr.flush()
                secs = time.perf_counter() - t
                self.final = {"before": before, "after": _counters(tr.read_counters()),
                              "seconds": secs}
                self.close()
            return control

    return FlushAtEnd(config)


def _clocks(device: torch.device, count_steps: int, warmup: int):
    """(first, last, state) of Trainer callbacks: the first enters a host-sync counter at the
    first ``count_steps`` steps' begin (before the tracker's) and reads the tracker's update
    count when the timed steps begin (``state["updates_at_warmup"]``, no wait: the worker has
    long applied the update of ``every`` steps before); the last leaves the counter and marks
    every step's end (after the tracker's): a CUDA event on the current stream (no sync), or
    the wall clock on CPU."""
    from transformers import TrainerCallback

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from syncs import CudaSyncCounter, SyncCounter

    cuda = device.type == "cuda"
    state = {"mode": None, "count": 0, "ours": Counter(), "model": 0, "model_at": Counter(),
             "replayed": 0,
             "marks": [], "kfac": None, "updates_at_warmup": None}

    class First(TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            if st.global_step == warmup and state["kfac"] is not None:
                tr = state["kfac"].tracker
                state["updates_at_warmup"] = tr.counters.updates if tr is not None else None
            if st.global_step < count_steps:
                state["mode"] = CudaSyncCounter() if cuda else SyncCounter()
                state["mode"].__enter__()

    class Last(TrainerCallback):
        def on_step_end(self, args, st, control, **kwargs):
            mode = state["mode"]
            if mode is not None:
                mode.__exit__(None, None, None)
                state["mode"] = None
                state["count"] += mode.count
                state["ours"].update(mode.ours)
                state["model"] += sum(mode.model.values())
                state["model_at"].update(mode.model)
                state["replayed"] += getattr(mode, "replayed", 0)
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                state["marks"].append(ev)
            else:
                state["marks"].append(time.perf_counter())

        def step_seconds(self) -> list[float]:
            """Seconds of steps 1.. (step i: from step i-1's end to step i's)."""
            marks = state["marks"]
            if cuda:
                torch.cuda.synchronize(device)
                return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
            return [b - a for a, b in zip(marks, marks[1:])]

    return First(), Last(), state


def update_probability(cfg: dict, setting: dict) -> float:
    """The chance that an update step updates the factors at the long-run MC share ``f``:
    the replay draws each of the step's ``C`` sequences with probability ``f`` (systematic
    sampling, `kfac_stream.fisher.replay_draws.replay_counts`), and a step that draws none
    captures no rows (A's and G's both come from the replayed sub-batch) and brings no
    update: ``min(1, f·C)`` (step 0 always draws one)."""
    from kfac_stream import KFACConfig

    f = KFACConfig(**cfg).mc_sequences
    if not isinstance(f, float) or f >= 1.0:
        return 1.0
    return min(1.0, f * setting["batch"] * setting["accumulation"])


def one_run(model, data, cfg, setting: dict, sizes: dict, device: torch.device, tmp: Path,
            name: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from kfac_stream import KFACConfig

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    allocated = torch.cuda.memory_allocated(device) if cuda else None
    warmup = sizes["warmup"]
    first, last, clock = _clocks(device, SYNC_COUNT_STEPS, warmup)
    kfac = None
    cfg = dict(cfg) if cfg is not None else None
    ablation = cfg.pop("ablation", None) if cfg is not None else None
    if cfg is not None:
        # on CPU the device path with the CPU standing in for the device, and the worker on,
        # as on CUDA (the CPU defaults are the host fold on the training thread)
        extra = {} if cuda else {"async_updates": True, "fold_on": "device"}
        kfac = _kfac_callback(KFACConfig(**TRACKED, output_dir=str(tmp / f"kfac-{name}"),
                                         **cfg, **extra))
        clock["kfac"] = kfac
    total = warmup + sizes["steps"]
    args = TrainingArguments(
        str(tmp / f"run-{name}"), per_device_train_batch_size=setting["batch"],
        gradient_accumulation_steps=setting["accumulation"], max_steps=total,
        learning_rate=1e-5, lr_scheduler_type="constant", report_to=[], use_cpu=not cuda,
        bf16=setting["autocast"], logging_strategy="no", save_strategy="no",
        disable_tqdm=True, seed=0, dataloader_pin_memory=False,
        logging_nan_inf_filter=False, max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[first, *([kfac] if kfac else []), last])
    from kfac_stream.tracking.factor_updates import FactorUpdater

    submit = FactorUpdater.submit
    if ablation == ABLATION_DROP:  # the update job is made, then dropped before the worker
        FactorUpdater.submit = lambda self, job, step_seconds: None
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        FactorUpdater.submit = submit
    wall = time.perf_counter() - t0
    secs = last.step_seconds()
    timed = timed_steps(secs, warmup)
    row = {"steps": total, "warmup": warmup, "wall_seconds": wall,
           "step_seconds": [round(s, 6) for s in secs],
           "mean_s_per_step": statistics.fmean(timed),
           "median_s_per_step": statistics.median(timed),
           "host_syncs": clock["count"], "kfac_host_syncs": dict(clock["ours"]),
           "model_host_syncs": clock["model"], "model_host_syncs_at": dict(clock["model_at"]),
           "replayed_host_syncs": clock["replayed"]}
    if cuda:  # allocated at the start: the model alone (a leak of the last run would show)
        row.update(peak_bytes=torch.cuda.max_memory_allocated(device),
                   allocated_at_start=allocated)
    if kfac is not None and kfac.final is not None and ablation is None:
        row.update(_breakdown(kfac.final))
        every = kfac.tracker.config.update_every
        p = update_probability({**TRACKED, **cfg}, setting)
        start = clock["updates_at_warmup"]
        row.update(update_every=every, mc_sequences=kfac.tracker.config.mc_sequences,
                   update_probability=p,
                   updates_in_timed_steps=None if start is None else row["updates"] - start,
                   expected_updates_in_timed_steps=p * math.ceil(sizes["steps"] / every))
    del trainer
    return row


def _breakdown(final: dict) -> dict:
    """The tracker's per-update figures from its counters before / after the final flush."""
    b, a = final["before"], final["after"]
    u = max(b["updates"], 1)
    return {"updates": b["updates"], "waits": b["waits"], "wait_seconds": b["wait_seconds"],
            "tracker_seconds": b["tracker_seconds"],
            "fold_ms_per_update": b["fold_seconds"] / u * 1e3,
            "bytes_to_host_per_update": b["bytes_to_host"] / u,
            "bytes_to_device_per_update": b["bytes_to_device"] / u,
            "flush_seconds_before_end": b["flush_seconds"],
            "final_flush_seconds": final["seconds"],
            "final_flush_bytes_to_host": a["bytes_to_host"] - b["bytes_to_host"],
            "final_flush_bytes_to_device": a["bytes_to_device"] - b["bytes_to_device"],
            "final_flush_syncs": a["flush_syncs"] - b["flush_syncs"],
            "flush_syncs": a["flush_syncs"], "host_entries": a["host_entries"],
            "budget_flushes": a["budget_flushes"], "device_budget": a["device_budget"],
            "peak_resident_bytes": a["peak_resident_bytes"],
            "counters_before_final_flush": b, "counters_after_final_flush": a}


def train_main(which: str, sizes: dict, device: torch.device, out: Path) -> int:
    """One setting: one model, the runs of `RUNS` on it, figures written after each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kfac_stream import KFACConfig
    from kfac_stream.tracking.plan import window_mc_share

    setting = sizes["settings"][which]
    cuda = device.type == "cuda"
    total = sizes["warmup"] + sizes["steps"]
    share = KFACConfig().mc_sequences
    raised = window_mc_share(KFACConfig(), setting["batch"], setting["accumulation"], 1, total)
    print(f"KFACConfig({', '.join(f'{k}={v}' for k, v in TRACKED.items())}) in every tracked "
          f"run: min_window_sequences=0 keeps the long-run MC share ({share}) on this short "
          f"run ({total} steps at the default min_window_sequences="
          f"{KFACConfig().min_window_sequences} would raise it to {raised or share:.3g} for "
          "the final window), so the figures are those of a long run; no snapshot inside the "
          "steps, the final one replaced by a timed flush", flush=True)
    seq = setting["seq"]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it will train
        model = LlamaForCausalLM(LlamaConfig(**sizes["llama"], max_position_embeddings=seq,
                                             use_cache=False))
    model = model.to(getattr(torch, setting["weights"]))
    n = (sizes["warmup"] + sizes["steps"]) * setting["batch"] * setting["accumulation"]
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in
            torch.randint(0, sizes["llama"]["vocab_size"], (n, seq), generator=gen)]
    result: dict = {"setting": setting, "params": sum(p.numel() for p in model.parameters()),
                    "build_seconds": time.perf_counter() - t0, "runs": {}}
    _write(out, result)
    order = [(b, name) for b in range(sizes["blocks"]) for name in RUNS] + \
        [(sizes["blocks"] - 1, FINAL_RUN)]
    result["blocks"] = {}
    with tempfile.TemporaryDirectory(prefix="kfac-gpu-check-") as tmp:
        for block, name in order:
            row = one_run(model, data, RUNS.get(name), setting, sizes, device, Path(tmp),
                          f"{name}-{block}")
            row["block"] = block
            result["blocks"].setdefault(name, []).append(row)
            result["runs"][name] = row  # the last block's (the JSON keeps every block's)
            _write(out, result)
            print(f"block {block} {name}: {row['mean_s_per_step'] * 1e3:.1f} ms/step mean, "
                  f"{row['median_s_per_step'] * 1e3:.1f} median over the timed steps"
                  + (f", {row['updates_in_timed_steps']} updates in them (expected "
                     f"{row['expected_updates_in_timed_steps']:.1f})"
                     if "updates_in_timed_steps" in row else "")
                  + (f", peak {fmt_gb(row.get('peak_bytes'))}" if cuda else "")
                  + (f", updates {row['updates']}, waits {row['waits']}, fold "
                     f"{row['fold_ms_per_update']:.1f} ms/update, final flush "
                     f"{row['final_flush_seconds']:.3f} s" if "updates" in row else "")
                  + f"; run {row['wall_seconds']:.1f} s", flush=True)
    return 0


# -- part 4: exchange ----------------------------------------------------------------------------

def exchange_main(device: torch.device, out: Path) -> int:
    """A one-rank exchange, issued from a side stream as the tracker issues it."""
    import torch.distributed as dist

    from kfac_stream.distributed.exchange import ExchangeRequest, finish_exchange, start_exchange
    from kfac_stream.distributed.ownership import assign_owners

    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:"
                            f"{free_port()}", rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))
    try:
        plan = dist.new_group(backend="gloo") if cuda else None
        dims = {"l.A": (256, False), "l.G": (128, False), "d.A": (64, True)}
        own = assign_owners(dims, 1, 2)
        gen = torch.Generator().manual_seed(2)
        rows = {k: torch.randn(40, d, generator=gen).to(device, torch.bfloat16)
                for k, (d, diag) in dims.items() if not diag}
        sums = {"d.A": torch.rand(64, generator=gen).to(device)}
        t = time.perf_counter()
        if cuda:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                pending = start_exchange(ExchangeRequest(
                    rows, dims, own, 0, 1, strategy="rows", device=device, sums=sums,
                    plan_group=plan, weights={"d.A": torch.tensor(40.0, device=device)},
                    positions={"d.A": 40}))
                ex = finish_exchange(pending)
        else:
            ex = finish_exchange(start_exchange(ExchangeRequest(
                rows, dims, own, 0, 1, strategy="rows", device=device, sums=sums,
                weights={"d.A": 40.0}, positions={"d.A": 40})))
        secs = time.perf_counter() - t
        exact = bool(all(torch.equal(ex.owned[k][1], rows[k]) for k in rows)
                     and torch.equal(ex.owned["d.A"][1][0], sums["d.A"].float()) and ex.ok)
        print(f"one-rank {'NCCL' if cuda else 'gloo'} exchange from "
              f"{'a side stream' if cuda else 'the CPU'}: {secs * 1e3:.1f} ms, rows back "
              f"exactly: {exact}", flush=True)
        _write(out, {"backend": "nccl" if cuda else "gloo", "exchange_seconds": secs,
                     "exact": exact})
        return 0
    finally:
        dist.destroy_process_group()


# -- the parent: parts under time limits, the summary --------------------------------------------

def _run_limited(cmd: list[str], limit: float, env: dict) -> tuple[int | None, list[str], float]:
    """Run ``cmd`` (its own process group), relaying its output indented; kill the group
    after ``limit`` seconds. Returns (exit status or None when killed, last lines, seconds)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            bufsize=1, start_new_session=True)
    tail: list[str] = []

    def relay():
        for line in proc.stdout:
            print("    " + line.rstrip(), flush=True)
            tail.append(line.rstrip())
            del tail[:-60]

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(limit, 1.0))
    except subprocess.TimeoutExpired:
        rc = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=5)
    return rc, tail, time.perf_counter() - t


def _pytest_counts(lines: list[str]) -> dict:
    text = "\n".join(lines)
    out: dict = dict.fromkeys(("passed", "failed", "skipped", "errors", "collected"), 0)
    for k, pat in (("passed", r"(\d+) passed"), ("failed", r"(\d+) failed"),
                   ("skipped", r"(\d+) skipped"), ("errors", r"(\d+) errors?\b"),
                   ("collected", r"(\d+) tests? collected")):
        hits = re.findall(pat, text)
        out[k] = int(hits[-1]) if hits else 0
    out["failures"] = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    out["skips"] = [ln for ln in lines if ln.startswith("SKIPPED")]
    return out


def run_part(part: Part, limit: float, dry: bool, a, env: dict, tmp: Path) -> dict:
    out = tmp / f"{part.name}.json"
    if part.name == "cuda_tests":
        files = cuda_test_files()
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfs", "--tb=short", "-m", "not slow",
               "-p", "no:cacheprovider", *files]
        if dry:  # no CUDA: the tests would skip; check that the selection collects
            cmd += ["--collect-only"]
        elif importlib.util.find_spec("pytest_timeout") is not None:
            cmd += ["--timeout", str(TEST_TIMEOUT_S)]  # a hung test fails alone, reported
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part.name,
               "--out", str(out), "--steps", str(a.steps), "--warmup", str(a.warmup)]
        if dry:
            cmd.append("--dry-run")
    rc, tail, secs = _run_limited(cmd, limit, env)
    res: dict = {"limit_s": round(limit, 1), "seconds": secs, "rc": rc,
                 "status": "timeout" if rc is None else ("ok" if rc == 0 else "error")}
    if part.name == "cuda_tests":
        res.update(files=cuda_test_files(), command=" ".join(cmd[1:]), tail=tail[-25:],
                   **_pytest_counts(tail))
        if rc == 1 and res["failed"]:
            res["status"] = "failed"
    else:
        if out.exists():  # what the part finished (the parent's fields win)
            res = {**json.loads(out.read_text()), **res}
        if rc != 0:
            res["tail"] = tail[-25:]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny CPU parts only")
    p.add_argument("--only", default=None, help="comma-separated part names (default: all)")
    p.add_argument("--skip-tests", action="store_true", help="leave out part 1 (pytest)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per training run")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per training run")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: one part
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    dry = a.dry_run or not torch.cuda.is_available()
    sizes = dict(DRY if dry else FULL)
    a.steps = a.steps or sizes["steps"]
    a.warmup = max(a.warmup or sizes["warmup"], 1)
    sizes.update(steps=a.steps, warmup=10 * math.ceil(a.warmup / 10))  # whole update cycles

    if a.part is not None:  # a child process: one part, its figures to --out
        device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
        if dry:  # as the test suite runs on CPU: tiny ops gain nothing from intra-op threads
            torch.set_num_threads(1)  # (and spin under load), denormals slow x86 ~10x
            torch.set_flush_denormal(True)
        out = Path(a.out)
        if a.part == "micro":
            return micro_main(sizes, device, out)
        if a.part.startswith("train_"):
            return train_main(a.part[len("train_"):], sizes, device, out)
        if a.part == "exchange":
            return exchange_main(device, out)
        p.error(f"unknown part {a.part!r}")

    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine: a dry run of the same parts "
              "on tiny sizes on the CPU (no figures of the GPU); run it on a GPU for them "
              "(docs/gpu.md).", flush=True)
    elif dry:
        print("gpu_check: --dry-run: the same parts on tiny sizes on the CPU.", flush=True)
    wanted = [q for q in PARTS if (a.only is None or q.name in a.only.split(","))
              and not (a.skip_tests and q.name == "cuda_tests")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(x for x in [str(ROOT), os.environ.get("PYTHONPATH")]
                                         if x)}
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    report: dict = {"dry_run": dry, "device": "cpu" if dry else "cuda", "sizes": sizes,
                    "deadline_s": None if dry else DEADLINE_S, "parts": {}}
    t0 = _STARTED
    with tempfile.TemporaryDirectory(prefix="kfac-gpu-check-") as tmp:
        for i, part in enumerate(wanted):
            if dry:
                limit = part.dry_limit_s
            else:  # its own limit, less what the later parts' reserves need of the deadline
                left = DEADLINE_S - (time.perf_counter() - t0)
                limit = min(part.limit_s, left - sum(q.reserve_s for q in wanted[i + 1:]))
                limit = max(limit, 5.0)
            print(f"\n{part.title} (limit {limit:.0f} s)", flush=True)
            res = run_part(part, limit, dry, a, env, Path(tmp))
            report["parts"][part.name] = res
            if res["status"] != "ok":
                print(f"  {part.name}: {res['status']} after {res['seconds']:.0f} s"
                      + (" (time limit)" if res["status"] == "timeout" else ""), flush=True)
    if "micro" in report["parts"]:
        report["device"] = report["parts"]["micro"].get("device", report["device"])
        report["machine"] = report["parts"]["micro"].get("machine")
    report["seconds"] = time.perf_counter() - t0
    rows = summarise(report, dry)
    report["summary"] = rows
    report["ok"] = all(not r["verdict"].startswith("MISS") for r in rows)
    print_table(rows)
    print(f"\ngpu_check: {'OK' if report['ok'] else 'MISSED TARGETS'} in "
          f"{report['seconds']:.0f} s on {report['device']}"
          + (" (dry run: tiny CPU sizes, timing targets not judged)" if dry else ""))
    paths = [Path(x) for x in (a.json, os.environ.get("GPU_CHECK_JSON")) if x]
    if not dry:
        paths.insert(0, RESULT)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
