"""Can a snapshot refresh each eigenbasis from the previous snapshot's instead of a full eigh?

The idea: as Shampoo/SOAP implementations do, update each factor's eigenbasis by
orthogonal-iteration steps started from the previous snapshot's (``Q ← qr(F·Q)``, eigenvalues
``diag(Qᵀ F Q)``), falling back to a full ``eigh`` when the residual exceeds a stated bound;
kept only if it is accurate and faster.

Method: the GPT-2 of the cost benchmarks (4 layers, width 256; `_common.MODEL`) trained on real
text (`_common.make_data`) with ``KFACConfig(update_every=1, snapshot_every=--every,
min_window_sequences=0)`` for 3 snapshot intervals: between two snapshots the EMA takes
``--every`` updates (50: as many as the defaults' 500 steps at ``update_every=10``, so the
factor keeps 0.95^50 = 8% of its old weight). For every dense factor of each later snapshot,
starting from the earlier snapshot's stored eigenvectors: the relative residual
``‖F Q − Q Λ‖_F / ‖F‖_F`` after 1, 2, 4 and 8 refresh steps, and its time, against a float64
``eigh`` of the same factor (its residual and time). A factor passes at a residual ≤
`BOUND` (the float32 eigh's own residual is ~1e-7; 1e-4 already moves the small eigenvalues,
which the posterior variance weighs most, by up to 1e-4·‖F‖).

Prints per step count the median and worst residual, the share of factors that pass and the
time against eigh, and writes ``benchmarks/results/eigh_refresh.json``.

Usage: ``python benchmarks/probes/eigh_refresh.py [--every 50] [--quick]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, Snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import BATCH, MODEL, log, machine, make_data, write_json  # noqa: E402

BOUND = 1e-4
STEPS = (1, 2, 4, 8)


def residual(f: torch.Tensor, q: torch.Tensor) -> tuple[float, torch.Tensor]:
    """``‖F Q − Q diag(QᵀFQ)‖_F / ‖F‖_F`` and the eigenvalues ``diag(QᵀFQ)``."""
    fq = f @ q
    lam = (q * fq).sum(0)
    return float(torch.linalg.norm(fq - q * lam) / torch.linalg.norm(f)), lam


def refresh(f: torch.Tensor, q: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        q, r = torch.linalg.qr(f @ q)
        q = q * torch.sign(torch.diagonal(r))  # keep each column's orientation
    return q


def compare(prev: Snapshot, new: Snapshot) -> list[dict]:
    rows = []
    seen = set()
    for name in new.layer_names:
        for kind in "AG":
            key = getattr(new.manifest.layers[name], kind).key
            old_q = getattr(prev[name], f"{kind}_eigvecs")
            if key in seen or old_q is None:
                continue
            seen.add(key)
            f = getattr(new[name], kind).double()
            f = (f + f.T) * 0.5
            t = time.perf_counter()
            w, q_exact = torch.linalg.eigh(f)
            t_eigh = time.perf_counter() - t
            row = {"key": key, "d": f.shape[0], "eigh_s": t_eigh,
                   "eigh_residual": residual(f, q_exact)[0]}
            for k in STEPS:
                t = time.perf_counter()
                q = refresh(f, old_q.double(), k)
                res, _ = residual(f, q)
                row[f"refresh{k}_s"] = time.perf_counter() - t
                row[f"refresh{k}_residual"] = res
            row["start_residual"] = residual(f, old_q.double())[0]
            rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="a smoke run (writes nothing)")
    a = p.parse_args(argv)
    torch.set_flush_denormal(True)
    every = 4 if a.quick else a.every
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        kfac = KFACStreamCallback(KFACConfig(update_every=1, snapshot_every=every,
                                             min_window_sequences=0, final_window=0.0))
        args = TrainingArguments(tmp, per_device_train_batch_size=2 if a.quick else BATCH,
                                 max_steps=3 * every, learning_rate=3e-4, report_to=[],
                                 use_cpu=True, save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, seed=0)
        Trainer(model=model, args=args, train_dataset=make_data(3 * every * BATCH),
                callbacks=[kfac]).train()
        snaps = [Snapshot.load(p, show_progress=False) for p in kfac.snapshots]
        rows = []
        for prev, new in zip(snaps, snaps[1:]):
            rows += [dict(r, step=new.step) for r in compare(prev, new)]
    summary = {}
    log(f"{len(rows)} factor refreshes over {len(snaps) - 1} snapshot intervals of {every} "
        f"updates (sides {sorted({r['d'] for r in rows})}); pass: residual <= {BOUND:g}")
    log(f"start (previous basis): median residual "
        f"{statistics.median(r['start_residual'] for r in rows):.2e}; float64 eigh: worst "
        f"{max(r['eigh_residual'] for r in rows):.1e}")
    for k in STEPS:
        res = [r[f"refresh{k}_residual"] for r in rows]
        ratio = sum(r[f"refresh{k}_s"] for r in rows) / sum(r["eigh_s"] for r in rows)
        summary[k] = {"median_residual": statistics.median(res), "worst_residual": max(res),
                      "pass_share": sum(x <= BOUND for x in res) / len(res),
                      "time_vs_eigh": ratio}
        s = summary[k]
        log(f"{k} step(s): median {s['median_residual']:.2e}, worst {s['worst_residual']:.2e}, "
            f"{s['pass_share']:.0%} pass, time {s['time_vs_eigh']:.2f}x eigh")
    if not a.quick:
        write_json("eigh_refresh", {"machine": machine(), "every": every, "bound": BOUND,
                                    "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
