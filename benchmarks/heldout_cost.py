r"""What the held-out fit of ``τ`` and the link costs at the end of training.

Usage: ``python benchmarks/heldout_cost.py [--repeats 5]``; ``--quick`` is a smoke run that
writes nothing. Writes ``benchmarks/results/heldout_cost.json`` and the ``heldout-cost``
section of ``benchmarks/RESULTS.md``.

The task is the suite's hidden-style encoder (``suite_tasks.EncoderFileKind``: a 2-layer BERT
classifier with a pooled head, 10 classes, 300 training sequences, 400 steps), trained by a
real ``Trainer`` with 200 eval examples and the default ``KFACConfig()`` (so
``eval_prior_precision="auto"`` fits at the end of training). Then, on the trained model and
its final snapshot, interleaved ``--repeats`` times:

* one eval pass: the model's forward over the Trainer's eval dataloader (what ``evaluate``
  costs, without the metrics);
* the held-out fit itself (`fit_prior_precision` on a loaded snapshot: the marginal-likelihood
  ``τ``, one Jacobian pass, every (``τ``, link) candidate);
* the whole end-of-training step the callback adds: loading the snapshot, building the
  posterior, the fit and writing it.

The target: the fit in at most ``K + 2`` eval passes' time for ``K`` classes (a
forward and ``K`` logit backwards is ``≈ K + 1`` passes' work). Medians are reported with their
ratio to the eval pass measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import suite_tasks as st
import torch
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.app.data import ExampleDataset
from kfac_stream.query.heldout_tau import fit_prior_precision
from kfac_stream.snapshot.heldout_prior import write_heldout_prior

from _common import machine, write_json, write_section

BEGIN, END = "<!-- heldout-cost:begin -->", "<!-- heldout-cost:end -->"


class Task(st.EncoderFileKind):
    """The suite's encoder task with 20 eval examples per class (200 in all)."""

    def __init__(self, seed: int):
        st._Classifier.__init__(self, seed, st.file_kind_pools(64), (30, 20, 30))


def batches(trainer: Trainer):
    return [{k: v for k, v in b.items() if torch.is_tensor(v)}
            for b in trainer.get_eval_dataloader()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    task = Task(0)
    if a.quick:
        task.steps, a.repeats = 40, 1
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = task.model()
        val_items = [task.example(s, c) for s, c in task.splits["val"]]
        cb = KFACStreamCallback(KFACConfig(output_dir=f"{tmp}/kfac", snapshot_every=10 ** 6))
        args = TrainingArguments(tmp, max_steps=task.steps, per_device_train_batch_size=30,
                                 per_device_eval_batch_size=32, learning_rate=task.lr,
                                 save_strategy="no", report_to="none", disable_tqdm=True,
                                 use_cpu=True, seed=0, logging_steps=10 ** 6)
        trainer = Trainer(model=model, args=args, train_dataset=ExampleDataset(task.train_items),
                          eval_dataset=ExampleDataset(val_items), callbacks=[cb])
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        snap_path = cb.snapshots[-1]
        stored = Snapshot.load(snap_path).heldout_prior
        if stored is None:
            raise SystemExit("the callback stored no held-out fit")
        model.eval()
        evals = batches(trainer)
        K = task.n_classes
        times: dict[str, list[float]] = {"eval_pass": [], "jacobian": [], "fit": [],
                                         "end_of_training": []}
        for _ in range(a.repeats):
            t = time.perf_counter()
            with torch.no_grad():
                for b in evals:
                    model(**{k: v for k, v in b.items() if k != "labels"})
            times["eval_pass"].append(time.perf_counter() - t)
            post = LaplacePosterior(model, Snapshot.load(snap_path, show_progress=False), 1.0)
            t = time.perf_counter()
            for b in evals:  # what every candidate shares: the forward, K backwards, features
                _, feats = post.jacobian_features(b)
                for _ in feats:
                    pass
            times["jacobian"].append(time.perf_counter() - t)
            t = time.perf_counter()
            fit = fit_prior_precision(post, evals)
            times["fit"].append(time.perf_counter() - t)
            t = time.perf_counter()
            post = LaplacePosterior(model, Snapshot.load(snap_path, show_progress=False), 1.0)
            write_heldout_prior(snap_path, fit_prior_precision(post, evals))
            times["end_of_training"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"task": "encoder-filekind, 200 eval examples", "classes": K, "train_seconds": train_s,
           "eval_examples": fit.examples, "medians": med, "times": times,
           "fit_in_eval_passes": med["fit"] / med["eval_pass"],
           "jacobian_in_eval_passes": med["jacobian"] / med["eval_pass"],
           "candidates": len(fit.grid) * len(fit.link_nll),
           "end_in_eval_passes": med["end_of_training"] / med["eval_pass"],
           "target_eval_passes": K + 2, "callback_fit_seconds": stored.seconds,
           "chosen": {"tau": fit.tau, "link": fit.link, "verdict": fit.verdict()},
           "machine": machine()}
    lines = [BEGIN, "## The held-out fit's cost (`benchmarks/heldout_cost.py`)", "",
             f"{out['task']}, K = {K} classes, a {train_s:.0f} s training run on "
             f"{out['machine']['cpu']} ({out['machine']['cores']} cores); medians of "
             f"{a.repeats} interleaved repeats:", "",
             "| what | seconds | eval passes |", "|---|---|---|",
             f"| one eval pass (forward over the eval set) | {med['eval_pass']:.3f} | 1 |",
             f"| the Jacobian pass alone (forward, {K} logit backwards, the features) | "
             f"{med['jacobian']:.3f} | {out['jacobian_in_eval_passes']:.1f} |",
             f"| the fit (`fit_prior_precision`: the Jacobian pass and {len(fit.grid)} τ × "
             f"{len(fit.link_nll)} links) | {med['fit']:.3f} | "
             f"{out['fit_in_eval_passes']:.1f} |",
             f"| the end-of-training step (load, posterior, fit, write) | "
             f"{med['end_of_training']:.3f} | {out['end_in_eval_passes']:.1f} |", "",
             f"Target: ≤ K + 2 = {K + 2} eval passes. The callback's own fit in the training "
             f"run: {stored.seconds:.2f} s. Chosen: {fit.verdict()}.", END]
    section = "\n".join(lines)
    print(section)
    if not a.quick:
        write_json("heldout_cost", out)
        write_section(BEGIN, END, section)


if __name__ == "__main__":
    main()
