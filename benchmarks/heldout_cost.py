r"""What the held-out fit of ``τ`` and the link costs at the end of training.

Usage: ``python benchmarks/heldout_cost.py [--repeats 5]``; ``--quick`` is a smoke run that
writes nothing. Writes ``benchmarks/results/heldout_cost.json`` and the ``heldout-cost``
section of ``benchmarks/RESULTS.md``.

The task is the suite's hidden-style encoder (``suite_tasks.EncoderFileKind``: a 2-layer BERT
classifier with a pooled head, 10 classes, 300 training sequences, 400 steps), trained by a
real ``Trainer`` with 200 eval examples and the defaults (so ``HeldoutConfig.prior_precision=
"auto"`` fits at the end of training). Then, on the trained model and its final snapshot,
interleaved ``--repeats`` times:

* one eval pass: the model's forward over the Trainer's eval dataloader (what ``evaluate``
  costs, without the metrics);
* the held-out fit itself (`fit_prior_precision` on a loaded snapshot: the marginal-likelihood
  ``τ``, one Jacobian pass, every (``τ``, link) candidate through
  `LaplacePosterior.covariance_grid`), and the same with the link fixed to probit (its exact
  variances only);
* the exact per-``τ`` path the fit used before : `predictive_covariances` at
  every candidate, each ``τ`` and layer recomputed over all weights, both links' NLLs;
* the whole end-of-training step the callback adds: loading the snapshot, building the
  posterior, the fit and writing it.

The target: the fit in at most ``2K + 2`` eval passes' time for ``K`` classes.
Medians are reported with their ratio to the eval pass measured in the same run; the line
``fit: … eval passes`` says it in one run. The per-token fit of a seq2seq model (no answer
tokens) is not measured here: its cost is stated from its count of forwards.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time

import torch
from tasks import suite_tasks as st
from tasks.pools import file_kind_pools
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.app.data import ExampleDataset
from kfac_stream.query.calibration import probs_from_gaussian
from kfac_stream.query.heldout_tau import LINKS, fit_prior_precision
from kfac_stream.query.heldout_tokens import DECADES, FORWARDS, MAX_SEQUENCES, TOKEN_SAMPLES
from kfac_stream.snapshot.heldout_prior import write_heldout_prior

from _common import machine, write_json, write_section

BEGIN, END = "<!-- heldout-cost:begin -->", "<!-- heldout-cost:end -->"


class Task(st.EncoderFileKind):
    """The suite's encoder task with 20 eval examples per class (200 in all)."""

    def __init__(self, seed: int):
        st.Classifier.__init__(self, seed, file_kind_pools(64), (30, 20, 30))


def batches(trainer: Trainer):
    return [{k: v for k, v in b.items() if torch.is_tensor(v)}
            for b in trainer.get_eval_dataloader()]


def flop_counts(model, post, evals) -> dict[str, float]:
    """Matrix-product FLOPs (``torch.utils.flop_counter.FlopCounterMode``: matmuls and batched
    products, in place too, and attention, the CPU's too) of one eval pass, of the Jacobian
    pass without and with its features, and of the fit; the rest of each (elementwise work,
    copies) is not counted."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    def attention(q, k, v, *args, **kwargs) -> int:
        return fc.sdpa_flop_count(q, k, v)

    def attention_backward(grad, q, k, v, *args, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad, q, k, v)

    def product(_self, a, b, *args, **kwargs) -> int:  # addmm_ [m, k] [k, n]; baddbmm_
        return 2 * math.prod(a) * b[-1]

    extra = {aten.addmm_: product, aten.baddbmm_: product,
             aten._scaled_dot_product_flash_attention_for_cpu: attention,
             aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward}

    def count(fn) -> float:
        with fc.FlopCounterMode(display=False, custom_mapping=extra) as c:
            fn()
        return float(c.get_total_flops())

    def eval_pass():
        with torch.no_grad():
            for b in evals:
                model(**{k: v for k, v in b.items() if k != "labels"})

    def jacobian(features: bool):
        for b in evals:
            _, feats = post.jacobian_features(b)  # the forward and K backwards run here
            for _ in feats if features else ():
                pass

    return {"eval_pass": count(eval_pass), "forward_and_backwards": count(lambda: jacobian(False)),
            "jacobian": count(lambda: jacobian(True)),
            "fit": count(lambda: fit_prior_precision(post, evals))}


def exact_path(post, evals, taus) -> None:
    """The fit's candidates as before the τ grid (`tau_grid`): every candidate's covariance
    recomputed over all weights (`predictive_covariances`), both links' per-example NLLs."""
    for b in evals:
        mean, covs = post.predictive_covariances(b, prior_precisions=list(taus))
        y = b["labels"]
        for link in LINKS:
            for cov in covs:
                probs_from_gaussian(mean, cov, link)[torch.arange(len(y)), y].log()


def timed_repeats(model, snap_path: str, evals: list[dict], repeats: int):
    """``({what: [seconds per repeat]}, the last repeat's fit)``: the eval pass, the Jacobian
    pass, the fit (both links and probit only), the exact per-τ path and the end-of-training
    step, interleaved over ``repeats``."""
    times: dict[str, list[float]] = {"eval_pass": [], "jacobian": [], "fit": [],
                                     "fit_probit": [], "exact_path": [],
                                     "end_of_training": []}
    for _ in range(repeats):
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
        fit_prior_precision(post, evals, link="probit")
        times["fit_probit"].append(time.perf_counter() - t)
        t = time.perf_counter()
        exact_path(post, evals, fit.grid)
        times["exact_path"].append(time.perf_counter() - t)
        t = time.perf_counter()
        post = LaplacePosterior(model, Snapshot.load(snap_path, show_progress=False), 1.0)
        write_heldout_prior(snap_path, fit_prior_precision(post, evals))
        times["end_of_training"].append(time.perf_counter() - t)
    return times, fit


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
        times, fit = timed_repeats(model, snap_path, evals, a.repeats)
        flops = flop_counts(model, LaplacePosterior(
            model, Snapshot.load(snap_path, show_progress=False), 1.0), evals)
    med = {k: statistics.median(v) for k, v in times.items()}
    fl = {k: v / flops["eval_pass"] for k, v in flops.items()}  # in eval passes' FLOPs
    ratio = {k: v / med["eval_pass"] for k, v in med.items()}
    target = 2 * K + 2
    # the per-token fit: on its first MAX_SEQUENCES eval rows, every candidate's TOKEN_SAMPLES
    # linearised forwards (about 2 forwards each, `sampled_predictive(linearized=True)`) and
    # MAP's own forward
    per_token = FORWARDS
    out = {"task": "encoder-filekind, 200 eval examples", "classes": K, "train_seconds": train_s,
           "eval_examples": fit.examples, "medians": med, "times": times,
           "fit_in_eval_passes": med["fit"] / med["eval_pass"],
           "jacobian_in_eval_passes": med["jacobian"] / med["eval_pass"],
           "candidates": len(fit.grid) * len(fit.link_nll),
           "end_in_eval_passes": med["end_of_training"] / med["eval_pass"],
           "fit_probit_in_eval_passes": ratio["fit_probit"],
           "exact_path_in_eval_passes": ratio["exact_path"],
           "per_token_fit_forwards_of_its_rows": per_token, "per_token_fit_rows": MAX_SEQUENCES,
           "matmul_flops": flops, "matmul_flops_in_eval_passes": fl,
           "target_eval_passes": target, "callback_fit_seconds": stored.seconds,
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
             f"| the fit with the link fixed to probit (exact variances only) | "
             f"{med['fit_probit']:.3f} | {ratio['fit_probit']:.1f} |",
             f"| before: the exact per-τ path (`predictive_covariances` at every candidate, "
             f"both links) | {med['exact_path']:.3f} | {ratio['exact_path']:.1f} |",
             f"| the end-of-training step (load, posterior, fit, write) | "
             f"{med['end_of_training']:.3f} | {out['end_in_eval_passes']:.1f} |", "",
             f"Matrix-product FLOPs (torch's `FlopCounterMode`), in eval passes' worth: the "
             f"forward and {K} logit backwards {fl['forward_and_backwards']:.1f}, the features "
             f"{fl['jacobian'] - fl['forward_and_backwards']:.1f}, the τ grid (exact variances, "
             f"binned covariances, links) {fl['fit'] - fl['jacobian']:.1f}: the fit's "
             f"{fl['fit']:.1f} eval passes' FLOPs, {med['fit'] / med['eval_pass'] / fl['fit']:.2f}"
             f"× their time at the eval pass's own FLOP rate. The features are exact: per "
             f"layer and example ``K·T'·d_out·d_A`` multiply-adds for the sum over the ``T'`` "
             f"positions with a gradient, ``K·d_out²·min(T', d_A)`` to rotate into ``Q_G`` and "
             f"``d_A²·min(T', K·d_out)`` into ``Q_A``, against the forward's ``T·d_out·d_in``: "
             f"about ``2K`` forwards of a square layer read at every position (``T ≈ d``), "
             f"``(1 + d_out/d_A)·K`` of the MLP's widening layer; with the ``K`` backwards "
             f"(each about a forward) more than ``2K + 2`` eval passes' FLOPs whenever most "
             f"layers are read at every position.", "",
             f"Target: ≤ 2K + 2 = {target} eval passes: "
             f"{'met' if ratio['fit'] <= target else 'not met'}. The callback's own fit in the "
             f"training run: {stored.seconds:.2f} s. Chosen: {fit.verdict()}.", "",
             f"The per-token fit of a language model without answer tokens (not run here): "
             f"on the first {MAX_SEQUENCES} eval rows, {len(DECADES)} candidates × "
             f"{TOKEN_SAMPLES} draws of the linearised model (about 2 forwards each) and MAP's "
             f"forward, about {per_token} forwards of those rows: about {per_token} eval passes "
             f"of an eval set of {MAX_SEQUENCES} rows, fewer of a larger one.", END]
    section = "\n".join(lines)
    print(section)
    print(f"fit: {ratio['fit']:.1f} eval passes (target ≤ 2K + 2 = {target}; probit only "
          f"{ratio['fit_probit']:.1f}; the exact per-τ path {ratio['exact_path']:.1f})")
    if not a.quick:
        write_json("heldout_cost", out)
        write_section(BEGIN, END, section)


if __name__ == "__main__":
    main()
