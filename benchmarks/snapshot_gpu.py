"""The ~1.1B Llama's snapshots on a GPU: what they cost the training run.

Method: TinyLlama's shapes (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads,
vocabulary 32000; 242 dense factors, 2.56e9 entries) built from a config on the GPU, fp32
weights with bf16 autocast, micro-batch 4 x 1024 random tokens, in one process:

1. **plain**: ``--warmup`` + ``--plain`` steps without the callback (the step time of reference);
2. **tracked**: ``KFACConfig(min_window_sequences=0, snapshot_every=10**6)`` (the long-run MC
   share; no snapshot but the ones this script asks for): after ``--warmup`` + ``--baseline``
   steps it calls ``save_snapshot`` at a step's end, as the callback does every
   ``snapshot_every`` steps, and trains on until that snapshot is complete and at least
   ``--after`` steps have passed; training then stops, which writes the final snapshot
   (``on_train_end``). Under the default ``eigendecompose="auto"`` the periodic snapshot's
   eigendecomposition is deferred when its predicted share of the interval is above 1%
   (`kfac_stream.snapshot.eigen_rule`: it is, at 1.1B on one GPU);
3. ``Snapshot.load`` of the final snapshot, then ``LaplacePosterior(model, snap,
   prior_precision="marglik")``; then the periodic snapshot: its load without
   eigendecomposition, its first posterior (decomposed on the GPU and cached beside it) and
   a second one (the cache read); the periodic snapshot is then deleted (disk);
4. with ``--reference`` (and time left): the unavoidable work of that snapshot, a float32
   ``eigh`` on the GPU of each dense factor plus one safetensors write (and fsync) of the same
   bytes (factors, scales, eigenvalues, eigenvectors).

Each step's time comes from a CUDA event recorded at its end (no host sync added). Reported,
against the targets below:

- the training thread's hold of the periodic snapshot (``snapshot_hold_seconds``) <= 0.1 s;
- the step time while the snapshot runs in the background against the tracked steps before
  it, and the rise this makes over one default snapshot interval (``snapshot_every`` = 500
  steps: the extra seconds of the steps the background overlapped, over 500 baseline steps)
  <= 1%; the tracked steps against plain too (the tracker's overhead, for context);
- the final snapshot: last step's end -> ``trainer.train()`` returns, complete with its
  eigendecompositions, <= 20 s, split into the eigendecompositions and the write (timed in the
  background by wrapping the callback's two calls);
- the host memory a snapshot adds beyond the factor store (peak RSS while it runs, sampled
  every 10 ms, less the RSS when it began) <= 0.5 x the snapshot's size on disk;
- ``LaplacePosterior(..., "marglik")`` <= 1 s after ``Snapshot.load``;
- the periodic snapshot: ``Snapshot.load`` <= 5 s (no eigendecomposition), its first
  posterior <= 25 s, <= 5 s once cached.

Without CUDA (or with ``--dry-run``) the same sequence runs on a 2-layer Llama on the CPU
(the device path with the CPU standing in for the device) and nothing is judged:
``tests/bench/test_snapshot_gpu.py`` runs it in CI. Figures go to ``--json`` (on a GPU, by default
``benchmarks/results/snapshot_gpu.json``) after each phase, so a run cut short keeps them.

Usage (on the GPU machine, see docs/gpu.md): ``python3 benchmarks/snapshot_gpu.py``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

_STARTED = time.perf_counter()

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import kfac_stream.tracking.session as session_module  # noqa: E402
from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot  # noqa: E402
from kfac_stream.snapshot.eigen_stream import EigenStream  # noqa: E402

from _common import RandomTokens, snapshot_reference  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "snapshot_gpu.json"

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
FULL = dict(llama=TINYLLAMA, batch=4, seq=1024, warmup=10, plain=30, baseline=40, after=20,
            max_steps=3000)
DRY = dict(llama=TINY, batch=2, seq=32, warmup=3, plain=5, baseline=5, after=3, max_steps=400)
#: The tracked run: the long-run MC share on a short run; snapshots only where asked.
TRACKED = dict(min_window_sequences=0, snapshot_every=10**6)
#: The snapshot interval the step-time rise is judged over (KFACConfig's default).
DEFAULT_INTERVAL = KFACConfig().snapshot_every
# targets
HOLD_S, RISE, FINAL_S, MARGLIK_S, HOST_MEMORY = 0.1, 0.01, 20.0, 1.0, 0.5
LOAD_S, FIRST_POSTERIOR_S, CACHED_POSTERIOR_S = 5.0, 25.0, 5.0


class RssSampler:
    """The process's resident set size every ``every`` seconds on a thread (``/proc``)."""

    def __init__(self, every: float = 0.01):
        self.every, self.samples = every, []  # (perf_counter, bytes)
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.rss()))
            time.sleep(self.every)

    def peak(self, t0: float, t1: float) -> int:
        return max((b for t, b in self.samples if t0 <= t <= t1), default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class StepClock(TrainerCallback):
    """Last in the callback list: each step's end as a CUDA event (no sync) or wall time."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks, self.wall = cuda, [], []

    def on_step_end(self, args, state, control, **kw):
        self.wall.append(time.perf_counter())
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(self.wall[-1])

    def step_seconds(self) -> list[float]:
        """``[i]``: step ``i+1``'s seconds (from step ``i``'s end to step ``i+1``'s)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class Driver(TrainerCallback):
    """After the kfac callback: the periodic snapshot at step ``at``; then stop once it is
    complete and ``after`` steps have passed (deleting it: a 1.1B snapshot is ~16 GB)."""

    def __init__(self, kfac: KFACStreamCallback, at: int, after: int, stop_by: float):
        self.kfac, self.at, self.after, self.stop_by = kfac, at, after, stop_by
        self.t_snapshot = self.done_step = self.path = None
        self.cut_short = False

    def on_step_end(self, args, state, control, **kw):
        step = state.global_step
        if step == self.at:
            self.t_snapshot = time.perf_counter()
            self.path = self.kfac.save_snapshot(step, state.epoch)
        elif (self.path is not None and self.done_step is None
              and not self.kfac.session.snapshot_in_flight):
            self.done_step, self.t_done = step, time.perf_counter()
        if self.done_step is not None and step >= self.at + self.after:
            control.should_training_stop = True
        elif time.perf_counter() > self.stop_by:  # the final snapshot and queries need time
            control.should_training_stop = self.cut_short = True
        return control


#: The callback's calls timed in the background: ``{phase: name in the tracking session module}``.
PHASES = {"finish_s": "finish_snapshot", "media_s": "make_media"}


def _timed_phases(log: dict):
    """Wrap the callback's background calls (`PHASES`) to time them, and record each
    `EigenStream`'s split (decomposition seconds, the writer's waits); returns the undo."""
    real = {phase: getattr(session_module, name) for phase, name in PHASES.items()}
    real_close = EigenStream.close

    def timed(phase):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return real[phase](*a, **kw)
            finally:
                log.setdefault(phase, []).append(time.perf_counter() - t)
        return call

    def close(self):
        log.setdefault("eigh_s", []).append(self.eigh_seconds)
        log.setdefault("writer_waited_s", []).append(self.wait_seconds)
        return real_close(self)

    for phase, name in PHASES.items():
        setattr(session_module, name, timed(phase))
    EigenStream.close = close

    def undo():
        for phase, name in PHASES.items():
            setattr(session_module, name, real[phase])
        EigenStream.close = real_close
    return undo


def _args(out: str, sizes: dict, steps: int, cuda: bool) -> TrainingArguments:
    return TrainingArguments(
        out, per_device_train_batch_size=sizes["batch"], max_steps=steps, learning_rate=1e-5,
        lr_scheduler_type="constant", report_to=[], use_cpu=not cuda, bf16=True,
        logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_pin_memory=False, max_grad_norm=0.0)


def _dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _write(path: Path | None, payload: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1, default=str))


def plain_run(model, data, sizes: dict, cuda: bool, tmp: str, name: str) -> float:
    """Mean seconds per step of ``sizes["plain"]`` steps without the callback (after
    ``sizes["warmup"]``)."""
    clock, w = StepClock(cuda), sizes["warmup"]
    Trainer(model=model, args=_args(os.path.join(tmp, name), sizes, w + sizes["plain"], cuda),
            train_dataset=data, callbacks=[clock]).train()
    secs = clock.step_seconds()[w - 1:]
    print(f"{name}: {statistics.fmean(secs) * 1e3:.1f} ms/step ({len(secs)} steps)", flush=True)
    gc.collect()
    return statistics.fmean(secs)


def tracked_host_figures(report: dict) -> None:
    """The tracked run's host-memory figures (its spares plus what each snapshot's background
    added while it ran) into ``report["tracked"]``, and its line printed."""
    t = report["tracked"]
    b, buffers = t["s_per_step_before_snapshot"], t["spare_bytes"]
    at, done_step = t["periodic"]["at_step"], t["periodic"]["complete_by_step"]
    f = report["tracked"]["final"]
    # beyond the factor store: the spares plus what a snapshot's background adds while
    # it runs (RSS peak less RSS when it began)
    f["host_transient_bytes"] = f["rss_peak"] - f["rss_at_last_step"]
    f["host_added_bytes"] = buffers + f["host_transient_bytes"]
    f["host_added_vs_size"] = f["host_added_bytes"] / f["bytes"]
    p = report["tracked"]["periodic"]
    if p["host_added_bytes"] is not None:
        p["host_transient_bytes"] = p.pop("host_added_bytes")
        p["host_added_vs_size"] = (buffers + p["host_transient_bytes"]) / f["bytes"]
    print(f"tracked: {b * 1e3:.1f} ms/step before the snapshot "
          f"({b / report['plain_s_per_step']:.3f}x plain); periodic snapshot at step {at}: "
          f"hold {p['hold_s']:.3f} s, complete by step {done_step} "
          f"({p['background_s_upper']} s), "
          f"{p['s_per_step_during']} s/step during; final {f['seconds']:.1f} s "
          f"(eigh {f['eigh_s']} s overlapping the write, the writer waited "
          f"{f['writer_waited_s']} s; media {f['media_s']} s), {f['bytes'] / 1e9:.2f} GB; "
          f"host: spares {buffers / 1e9:.2f} GB + {f['host_transient_bytes'] / 1e9:.2f} GB "
          "while it ran", flush=True)


def reference_part(a, report: dict, final_path: str, device: torch.device, tmp: str) -> None:
    """Part 4: the final snapshot's unavoidable work (eigh + one write) when time is left."""
    f = report["tracked"]["final"]
    left = a.deadline - (time.perf_counter() - _STARTED)
    if a.reference and left > a.reference_s:
        report["reference"] = snapshot_reference(final_path, device, tmp)
        r = report["reference"]
        r["final_vs_unavoidable"] = f["seconds"] / r["unavoidable_s"]
        print(f"unavoidable: eigh {r['eigh_s']:.1f} s + write {r['write_s']:.1f} s = "
              f"{r['unavoidable_s']:.1f} s; final snapshot {r['final_vs_unavoidable']:.2f}x",
              flush=True)
    elif a.reference:
        report["reference"] = f"skipped: {left:.0f} s left, {a.reference_s} s needed"


def run(a, sizes: dict, device: torch.device, out: Path | None) -> dict:
    cuda = device.type == "cuda"
    report: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "torch": torch.__version__, "sizes": sizes, "tracked": TRACKED,
                    "targets": {"hold_s": HOLD_S, "rise": RISE, "final_s": FINAL_S,
                                "marglik_s": MARGLIK_S, "host_memory": HOST_MEMORY,
                                "load_s": LOAD_S, "first_posterior_s": FIRST_POSTERIOR_S,
                                "cached_posterior_s": CACHED_POSTERIOR_S}}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**sizes["llama"],
                                             max_position_embeddings=sizes["seq"],
                                             use_cache=False))
    report["params"] = sum(p.numel() for p in model.parameters())
    report["build_s"] = time.perf_counter() - t0
    data = RandomTokens(sizes["batch"] * sizes["max_steps"], sizes["seq"],
                   sizes["llama"]["vocab_size"])
    rss = RssSampler()
    tmp = tempfile.mkdtemp(prefix="kfac-snapshot-gpu-", dir=a.tmp)
    try:
        # 1. plain
        w = sizes["warmup"]
        report["plain_s_per_step"] = plain_run(model, data, sizes, cuda, tmp, "plain")
        _write(out, report)

        # 2. tracked: a periodic snapshot, then the final one
        at = w + sizes["baseline"]
        kfac = KFACStreamCallback(KFACConfig(**TRACKED, output_dir=os.path.join(tmp, "kfac"),
                                             **({} if cuda else {"async_updates": True,
                                                                 "fold_on": "device"})))
        stop_by = _STARTED + a.deadline - a.after_training_s
        driver, clock = Driver(kfac, at, sizes["after"], stop_by), StepClock(cuda)
        phases: dict = {}
        restore = _timed_phases(phases)
        trainer = Trainer(model=model, args=_args(os.path.join(tmp, "tracked"), sizes,
                                                  sizes["max_steps"], cuda),
                          train_dataset=data, callbacks=[kfac, driver, clock])
        try:
            trainer.train()
            if cuda:
                torch.cuda.synchronize()
            t_end = time.perf_counter()
        finally:
            restore()
        secs = clock.step_seconds()  # secs[i]: step i+1
        first = w  # tracked, nothing in the background, after the warm-up
        base = secs[first - 1:at - 1]
        done = driver.done_step or len(secs)
        during = secs[at:done]  # steps at+1 .. done: the periodic snapshot in the background
        b = statistics.fmean(base)
        extra = sum(during) - len(during) * b
        periodic_path = driver.path
        final_path = kfac.snapshots[-1]
        t_last = clock.wall[-1]
        # memory kept for snapshots beyond the factor store: spares (a snapshot holds the
        # stored tensors themselves; a flush while it is in flight writes into a spare)
        buffers = kfac.tracker.store.spare_bytes()
        report["tracked"] = {
            "steps": len(clock.wall), "updates": kfac.tracker.counters.updates,
            "baseline_steps": [first, at - 1],
            "step_seconds": [round(x, 5) for x in secs],
            "spare_bytes": buffers,
            "cut_short_by_deadline": driver.cut_short,
            "s_per_step_before_snapshot": b,
            "vs_plain": b / report["plain_s_per_step"],
            "vs_plain_after": None,
            "periodic": {
                "at_step": at, "complete_by_step": driver.done_step,
                "hold_s": kfac.snapshot_hold_seconds[0],
                "background_s_upper": driver.t_done - driver.t_snapshot
                if driver.done_step else None,
                "steps_overlapped": len(during),
                "s_per_step_during": statistics.fmean(during) if during else None,
                "during_vs_before": statistics.fmean(during) / b if during else None,
                "extra_s": extra,
                "rise_over_default_interval": extra / (DEFAULT_INTERVAL * b),
                "host_added_bytes": rss.peak(driver.t_snapshot, driver.t_done)
                - rss.peak(driver.t_snapshot - 0.05, driver.t_snapshot)
                if driver.done_step else None},
            "final": {
                "seconds": t_end - t_last, "hold_s": kfac.snapshot_hold_seconds[-1],
                "finish_s": phases.get("finish_s", [None])[-1],
                "eigh_s": phases.get("eigh_s", [None])[-1],
                "writer_waited_s": phases.get("writer_waited_s", [None])[-1],
                "media_s": phases.get("media_s", [None])[-1],
                "rss_at_last_step": rss.peak(t_last - 0.05, t_last),
                "rss_peak": rss.peak(t_last, t_end),
                "bytes": _dir_bytes(final_path)},
            "phases": phases}
        tracked_host_figures(report)
        _write(out, report)
        del trainer
        # plain again: drift of the machine between the runs shows
        report["plain_after_s_per_step"] = plain_run(model, data, sizes, cuda, tmp, "plain-2")
        report["tracked"]["vs_plain_after"] = b / report["plain_after_s_per_step"]
        _write(out, report)

        # 3. the posterior: the final snapshot (decomposed in the run), then the periodic one
        # (deferred: its first posterior decomposes and caches, the second reads the cache)
        report["posterior"] = posterior_times(model, final_path, cuda)
        if periodic_path and os.path.isdir(periodic_path):
            report["posterior"]["periodic"] = periodic_times(model, periodic_path, cuda)
            shutil.rmtree(periodic_path)
        print(f"posterior: {json.dumps(report['posterior'])}", flush=True)
        _write(out, report)

        # 4. the unavoidable work
        reference_part(a, report, final_path, device, tmp)
        _write(out, report)
    finally:
        rss.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def posterior_times(model, path: str, cuda: bool) -> dict:
    """``Snapshot.load`` of ``path`` and the marglik posterior after it, timed."""
    t = time.perf_counter()
    snap = Snapshot.load(path, show_progress=False)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    post = LaplacePosterior(model, snap, prior_precision="marglik")
    if cuda:
        torch.cuda.synchronize()
    return {"load_s": load_s, "marglik_s": time.perf_counter() - t,
            "tau": post.prior_precision, "in_run_eigen": snap.in_run_eigen}


def periodic_times(model, path: str, cuda: bool) -> dict:
    """A deferred snapshot: its load without eigendecomposition, its first posterior (load,
    eigendecomposition on the GPU and cache write, marglik) and a second one (the cache read),
    timed."""
    t = time.perf_counter()
    Snapshot.load(path, show_progress=False)
    load_s = time.perf_counter() - t
    out = {"load_s": load_s}
    for name in ("first", "cached"):
        t = time.perf_counter()
        times = posterior_times(model, path, cuda)
        out[f"{name}_posterior_s"] = time.perf_counter() - t
        out[f"{name}"] = times
    out["cache_bytes"] = _dir_bytes(os.path.join(path, "eigen"))
    return out


def summary(report: dict, judged: bool) -> list[tuple[str, str, str, str]]:
    """(what, figure, target, verdict) rows."""
    tr, post = report.get("tracked", {}), report.get("posterior", {})
    p, f = tr.get("periodic", {}), tr.get("final", {})
    per = post.get("periodic", {})

    def row(what, value, fmt, target, ok):
        shown = "—" if value is None else fmt.format(value)
        verdict = "—" if value is None or not judged else ("PASS" if ok(value) else "MISS")
        return what, shown, target, verdict

    return [
        row("periodic snapshot: training thread hold", p.get("hold_s"), "{:.3f} s",
            f"≤ {HOLD_S} s", lambda v: v <= HOLD_S),
        row(f"step-time rise over a {DEFAULT_INTERVAL}-step interval",
            p.get("rise_over_default_interval"), "{:.2%}", f"≤ {RISE:.0%}",
            lambda v: v <= RISE),
        row("steps while the snapshot runs / before", p.get("during_vs_before"), "{:.3f}x",
            "(context)", lambda v: True),
        row("tracked steps / plain before", tr.get("vs_plain"), "{:.3f}x", "(context)",
            lambda v: True),
        row("tracked steps / plain after", tr.get("vs_plain_after"), "{:.3f}x", "(context)",
            lambda v: True),
        row("final snapshot: last step -> train() returns", f.get("seconds"), "{:.1f} s",
            f"≤ {FINAL_S:.0f} s", lambda v: v <= FINAL_S),
        row("host memory for snapshots (spares + transient) / size",
            f.get("host_added_vs_size"), "{:.2f}x",
            f"≤ {HOST_MEMORY}x", lambda v: v <= HOST_MEMORY),
        row("LaplacePosterior(marglik) after load", post.get("marglik_s"), "{:.2f} s",
            f"≤ {MARGLIK_S:.0f} s", lambda v: v <= MARGLIK_S),
        row("periodic snapshot: Snapshot.load (no eigendecomposition)", per.get("load_s"),
            "{:.1f} s", f"≤ {LOAD_S:.0f} s", lambda v: v <= LOAD_S),
        row("periodic snapshot: first posterior (decompose + cache)",
            per.get("first_posterior_s"), "{:.1f} s", f"≤ {FIRST_POSTERIOR_S:.0f} s",
            lambda v: v <= FIRST_POSTERIOR_S),
        row("periodic snapshot: posterior once cached", per.get("cached_posterior_s"),
            "{:.1f} s", f"≤ {CACHED_POSTERIOR_S:.0f} s", lambda v: v <= CACHED_POSTERIOR_S),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, not judged")
    p.add_argument("--json", default=None, help=f"where the figures go (GPU default {RESULT})")
    p.add_argument("--tmp", default=None, help="where the snapshots are written (~16 GB each)")
    p.add_argument("--reference", action="store_true", help="also time eigh + one write")
    p.add_argument("--reference-s", type=float, default=90.0,
                   help="time the reference needs (skipped when less is left)")
    p.add_argument("--deadline", type=float, default=290.0, help="seconds for the whole run")
    p.add_argument("--after-training-s", type=float, default=110.0,
                   help="kept for the final snapshot and the posterior: training stops "
                        "this long before the deadline even if the periodic snapshot is "
                        "still running")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        print("snapshot_gpu: no CUDA (or --dry-run): the sequence on a tiny Llama on the CPU, "
              "nothing judged", flush=True)
    out = Path(a.json) if a.json else (RESULT if cuda else None)
    report = run(a, FULL if cuda else DRY, device, out)
    report["seconds"] = time.perf_counter() - _STARTED
    rows = summary(report, judged=cuda)
    report["summary"] = [dict(zip(("what", "figure", "target", "verdict"), r)) for r in rows]
    _write(out, report)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'what':<{width}} | figure | target | verdict")
    for r in rows:
        print(f"{r[0]:<{width}} | {r[1]} | {r[2]} | {r[3]}")
    print(f"({report['seconds']:.0f} s in all)")
    return 1 if any(r[3] == "MISS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
