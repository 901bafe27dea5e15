"""Periodic snapshots on the mid-size Llama (CPU): the training thread's hold, the eigh they
launch at the default rule, and the deferred eigendecomposition's first and cached use.

Method: the mid-size Llama of ``_common.MID_LLAMA`` (hidden 1024, intermediate 2816, 4 layers,
vocabulary 4096, random init, no download: 44 dense factors, 1.29e8 entries) trained
``--steps`` (9) steps of 4 x 128 random tokens with ``KFACStreamCallback(KFACConfig(
update_every=2, snapshot_every=4, min_window_sequences=0))``, everything else the default
(``eigendecompose="auto"``), in one process. Counted: every factor eigendecomposition (calls
of the CPU path's ``safe_psd_eigh``, on any thread) while each snapshot is finished, from the
manifests' ``eigen`` entries and the counts. Timed: ``snapshot_hold_seconds`` (the training
thread's part of each snapshot) and the training thread's whole ``save_snapshot`` (with its
wait for the snapshot before, if that one is still being finished), then for the last periodic
snapshot ``Snapshot.load`` without eigendecomposition, with ``eigen=True`` the first time
(decomposed and cached beside it) and again (the cache read), median of ``--reps`` (3) loads
for the plain and the cached ones.

Prints the figures and writes ``benchmarks/results/snapshot_periodic.json``. Targets: a
periodic snapshot launches no eigh at the default rule and holds the training thread
<= 0.1 s. ``--quick``: a tiny model, nothing written.

Usage: ``python benchmarks/probes/snapshot_periodic.py [--steps 9] [--reps 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import kfac_stream.tracking.session as session_module
from kfac_stream import KFACConfig, KFACStreamCallback, Snapshot
from kfac_stream.stats import spectrum

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import MID_LLAMA, QUICK_LLAMA, RandomTokens, machine, write_json  # noqa: E402

HOLD_S = 0.1


def counted_eighs(log: list[int]):
    """Counts every factor eigendecomposition (`spectrum.safe_psd_eigh`) into ``log``."""
    real = spectrum.safe_psd_eigh

    def counted(f, *a, **k):
        log.append(int(f.shape[0]))
        return real(f, *a, **k)

    spectrum.safe_psd_eigh = counted
    return lambda: setattr(spectrum, "safe_psd_eigh", real)


def timed(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def run(a, cfg: dict, tmp: str) -> dict:
    transformers.set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    kfac = KFACStreamCallback(KFACConfig(update_every=2, snapshot_every=4,
                                         min_window_sequences=0,
                                         output_dir=os.path.join(tmp, "kfac")))
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, seed=0,
                             per_device_train_batch_size=4, max_steps=a.steps)
    eighs: list[int] = []
    undo = counted_eighs(eighs)
    saves: list[float] = []  # the training thread's whole save_snapshot: a wait included
    real_save = session_module.TrackingSession.save_snapshot

    def save(self, *args, **kw):
        t = time.perf_counter()
        try:
            return real_save(self, *args, **kw)
        finally:
            saves.append(time.perf_counter() - t)

    session_module.TrackingSession.save_snapshot = save
    try:
        Trainer(model=model, args=args, train_dataset=RandomTokens(4 * a.steps, a.seq,
                                                                   cfg["vocab_size"]),
                callbacks=[kfac]).train()
    finally:
        undo()
        session_module.TrackingSession.save_snapshot = real_save
    metas = [json.loads(Path(p, "manifest.json").read_text()) for p in kfac.snapshots]
    factors = len({e[f]["key"] for e in metas[-1]["layers"].values() for f in ("A", "G")})
    periodic = [m for m in metas if not m["eigen"]["final"]]
    in_run = [m for m in metas if m["eigen"]["in_run"]]
    last = kfac.snapshots[len(periodic) - 1]
    out = {"snapshots": [{"step": m["step"], **m["eigen"]} for m in metas],
           "hold_s": kfac.snapshot_hold_seconds, "save_snapshot_s": saves,
           "factors": factors,
           # the final snapshot decomposes every factor once; the rest came from periodic ones
           "eighs_total": len(eighs),
           "eighs_in_periodic": len(eighs) - factors * sum(m["eigen"]["final"] for m in in_run),
           "periodic_in_run": sum(1 for m in periodic if m["eigen"]["in_run"])}
    if not periodic or periodic[-1]["eigen"]["in_run"]:
        return out
    out["load_s"] = timed(lambda: Snapshot.load(last, show_progress=False), a.reps)
    t = time.perf_counter()
    Snapshot.load(last, show_progress=False, eigen=True)
    out["first_eigen_load_s"] = time.perf_counter() - t
    out["cached_eigen_load_s"] = timed(
        lambda: Snapshot.load(last, show_progress=False, eigen=True), a.reps)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny model, writes nothing")
    a = p.parse_args(argv)
    cfg = dict(QUICK_LLAMA if a.quick else MID_LLAMA, vocab_size=256 if a.quick else 4096)
    if a.quick:
        a.seq, a.reps = 16, 1
    with tempfile.TemporaryDirectory() as tmp:
        r = run(a, cfg, tmp)
    periodic_holds = r["hold_s"][:-1] if len(r["hold_s"]) > 1 else r["hold_s"]
    r["met"] = {"no_eigh_in_periodic": r["eighs_in_periodic"] == 0 and not r["periodic_in_run"],
                "hold": max(periodic_holds) <= HOLD_S}
    for s in r["snapshots"]:
        print(f"step {s['step']}: in_run={s['in_run']} ({s['reason']})")
    print(f"save_snapshot on the training thread (a wait for the previous one included): "
          f"{', '.join(f'{h:.2f} s' for h in r['save_snapshot_s'])}")
    print(f"holds {', '.join(f'{h * 1e3:.1f} ms' for h in r['hold_s'])} (target <= "
          f"{HOLD_S * 1e3:.0f} ms); eigh calls {r['eighs_total']} for {r['factors']} factors, "
          f"{r['eighs_in_periodic']} in periodic snapshots")
    if "load_s" in r:
        print(f"last periodic snapshot: load {r['load_s']:.2f} s, first eigen load "
              f"{r['first_eigen_load_s']:.2f} s (decompose + cache), cached "
              f"{r['cached_eigen_load_s']:.2f} s")
    print(f"met: {r['met']}")
    if not a.quick:
        info = dict(machine(), threads=torch.get_num_threads(), model=cfg, steps=a.steps,
                    batch=[4, a.seq])
        print("wrote", write_json("snapshot_periodic", {"info": info, **r}))


if __name__ == "__main__":
    main()
