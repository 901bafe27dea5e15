r"""Linear datamodeling score (LDS) and noisy-label detection: influence from the streamed
factors against dattri's methods, on the same retrained ground truth.

Usage: ``python benchmarks/influence_lds.py [--seeds 0 1 2] [--subsets 50] [--workers 2]``;
``--quick``: a smoke run (tiny sizes, one seed, a few subsets, ~20 s for digits and ~40 s for
text on 2 idle cores) that writes nothing. Parts side by side: each ``--tasks T --seeds S
--workers 1 --json PART`` in its own process, then ``--combine PART...`` (the recorded run
did this: one process per task and seed, all under ``nice -n 10`` on a 2-core machine shared
with other work, which starved a single process). Writes
``benchmarks/results/influence_lds.json`` and the section of ``benchmarks/RESULTS.md`` between
the ``influence-lds`` markers. Everything is read from the machine and every model is built
from a config: nothing is downloaded. Peers (pinned, installed
``--no-deps`` by the Makefile's ``PEER_PKGS``): dattri 0.3.0; scikit-learn 1.9.1 (joblib 1.6.0,
threadpoolctl 3.8.0, cloudpickle 3.1.2, narwhals 2.29.0) for its digits.

Tasks and recipe (`lds_tasks`; fixed by whether the models train, before any score was seen)
------------------------------------------------------------------------------------------------
* ``digits``: scikit-learn's 1,797 8×8 digits, rows as tokens (8 positions, a row's 8 pixels
  / 16 as input features), a GPT-2 sequence classifier of 2 layers × 32 (4 heads);
  ``--digits-n`` (1,000) training images, ``--digits-q`` (100) held-out query images; AdamW
  lr 5e-3, batch 64, 15 epochs (235 steps on 1,000; chosen on a probe of seed 0: 15 epochs at
  batch 64 reached 93-98% held-out accuracy where pixels as 64 tokens of a 17-token vocabulary
  reached 73% after 20 epochs and cost 8x per step). A query's output: its cross-entropy.
* ``text``: a byte-level GPT-2 LM of 2 layers × 32 (4 heads) on ``--text-n`` (600)
  non-overlapping 32-byte windows of Python's reference documentation (``pydoc_data.topics``),
  ``--text-q`` (50) other windows as queries; AdamW lr 3e-3, batch 32, 10 epochs (188 steps;
  the windows were 64 bytes in a probe, query NLL 5.5 → 2.6 nats/byte, and were halved for the
  time the retrainings take; the table gives the query loss untrained → trained). A query's
  output: its NLL summed over its 31 labelled next-byte positions.
* Both: cosine schedule, 5% warm-up, gradient norm clipped at 1, no dropout, a fixed data order
  per seed (epoch ``e`` a seeded permutation from which the examples outside a subset are
  dropped). The scored model is trained by a real ``transformers.Trainer`` with one
  `KFACStreamCallback` at the default `KFACConfig` but for ``output_dir``, ``seed`` and
  ``snapshot_every`` = ⌈steps / 4⌉ (periodic snapshots; the final one is unchanged by them).

Ground truth
------------
Per seed (the seed sets the initialisation, the data order and the subsets), ``--subsets``
(50) random halves of the training set, each retrained from scratch with the same recipe (same
epochs: half the steps; the same initialisation and order restricted to the half) by a plain
torch loop with the Trainer's optimizer, schedule and clipping (`lds_tasks.train_fast`; on the
full set it reproduces the Trainer run's weights on digits exactly; on text it is 0.045-0.15
off in max abs weight, a difference from the plain Trainer's own loop, not from the callback: a
Trainer run without the callback equals the tracked one bit for bit; reported per run), in
``--workers`` processes; the query outputs recorded. LDS of a query: Spearman over the subsets
between the summed scores of the subset's members and the MINUS retrained output (scores are
positive for helpful examples, which lower the loss). Reported: per seed the mean over queries
± its standard error, and over the seeds mean ± s.e.

Methods (same trained weights, same queries; ``[Q, N]`` scores, positive = helpful)
-----------------------------------------------------------------------------------
* ``ours``: ``influence_scores`` from the final snapshot at its defaults (``damping=
  "heuristic"``, ``eigenvalues="auto"``, the run has no EK-FAC, so K-FAC);
* ``ours, prior damping``: ``damping="prior"`` (τ/N of the default ``LaplacePosterior``);
* ``ours, EK-FAC``: a second tracked run with ``KFACConfig(ekfac=True)`` (same seed; its
  weights are the first run's, reported), its final snapshot, defaults;
* ``ours, snapshot mean``: `trajectory_influence` at its defaults, the mean of the default scores
  over the run's snapshots (periodic and final), each with the weights of its step;
* ``ours, damping f × …``: `Influence` with each layer's heuristic damping scaled from 0.1 to
  ``f`` (`DAMPING_SWEEP`) of the layer's mean eigenvalue: whether the default share holds;
* ``gradient dot``: ``Influence.gradients`` of the same layers dotted, no preconditioning
  (TracIn at the last checkpoint);
* dattri 0.3.0, on the same parameters (weights and biases of the tracked layers) and the same
  per-example loss, ``AttributionTask`` with a ``torch.func`` loss: ``TracInAttributor`` over
  the weights at the periodic snapshot steps, weighted by the learning rate there (its default
  random projection, 512 dimensions); ``TRAKAttributor`` (its margin ``log p − log(1 − p)`` of
  the example's loss as the function, default projection 512) with the final model (TRAK-1) and
  with it plus ``--trak-models`` − 1 (9) models trained on the full set from other seeds
  (TRAK-10); ``IFAttributorCG`` (defaults: 10 CG iterations; ``regularization`` = our heuristic
  damping averaged over the layers, times the labelled tokens per example: the same damping on
  the per-example loss's scale), its Hessian over the whole training set in one batch. IF-CG
  costs 10 Hessian-vector products over the whole training set PER QUERY (a first run spent
  over 10 minutes of its share of the shared cores on 50 digits queries without finishing), so
  it scores only the first ``--ifcg-queries`` (5) queries of each seed, and its LDS is shown
  beside ours on the same queries (the acceptance compares it there). TracIn's checkpoint at
  the last step has learning rate 0 and so weight 0: it is left out (the sum is the same).

Noisy labels
------------
Per seed, 10% of the training examples corrupted (digits: the label replaced by another class;
text: the window's bytes shuffled), one tracked run on the noisy set, the training examples
ranked by self-influence ``I(z, z)``: ours (``self_influence``, defaults), the squared gradient
norm (gradient dot on itself), dattri's ``TracInAttributor.self_attribute`` and
``TRAKAttributor.self_attribute`` (TRAK-1), and the training loss itself as a reference.
Reported: the AUC of the score for the corrupted ones and the share of them among the top 10%
/ 20%.

Acceptance: ours (defaults) ≥ every dattri method that ran and ≥ the gradient dot product in
mean LDS on both tasks; on digits a noisy-label AUC ≥ 0.95 and top-20% recall ≥ 0.8.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import multiprocessing
import os
import random
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from tasks import lds_tasks as T

from kfac_stream import (
    Influence,
    LaplacePosterior,
    Snapshot,
    influence_scores,
    self_influence,
    trajectory_influence,
)
from kfac_stream.query.influence import HEURISTIC_FACTOR

from _common import machine, write_json, write_section

BEGIN, END = "<!-- influence-lds:begin -->", "<!-- influence-lds:end -->"
#: the damping sweep's factors (the default heuristic takes 0.1 of each layer's mean eigenvalue)
DAMPING_SWEEP = (0.01, 0.03, 0.3, 1.0)
#: (key, label) of the LDS methods, in the table's order.
METHODS = (("ours", "ours: influence_scores, defaults (heuristic damping, final snapshot)"),
           ("ours_prior", "ours, damping='prior'"),
           ("ours_ekfac", "ours, EK-FAC run (ekfac=True), defaults"),
           ("ours_snapshot_mean", "ours: trajectory_influence (mean over the run's snapshots)"),
           ("grad_dot", "gradient dot (TracIn at the last checkpoint)"),
           ("dattri_tracin", "dattri TracIn (periodic checkpoints)"),
           ("dattri_trak1", "dattri TRAK, 1 model"),
           ("dattri_trak10", "dattri TRAK, 10 models"),
           ("dattri_ifcg", "dattri IF-CG (its queries: the first --ifcg-queries)"),
           ("ours_ifcg_queries", "ours, defaults, on IF-CG's queries (paired)"),
           *((f"ours_heuristic_{f:g}", f"ours, damping {f:g} × the layer's mean eigenvalue "
              "(sweep; default 0.1)") for f in DAMPING_SWEEP))
NOISY_METHODS = (("ours", "ours: self_influence, defaults"),
                 ("grad_norm", "squared gradient norm (gradient dot)"),
                 ("dattri_tracin", "dattri TracIn self_attribute"),
                 ("dattri_trak1", "dattri TRAK-1 self_attribute"),
                 ("loss", "training loss (reference)"))
DATTRI = ("dattri_tracin", "dattri_trak1", "dattri_trak10", "dattri_ifcg")


# -- retraining in worker processes -------------------------------------------------------------

_DATA: dict = {}


def task_data(task: str, a) -> dict:
    key = (task, a.sizes[task])
    if key not in _DATA:
        _DATA[key] = T.build_data(task, *a.sizes[task])
    return _DATA[key]


def retrain_outputs(task: str, a, subset: list[int] | None, seed: int,
                    init_seed: int | None = None, state: bool = False):
    """Worker: the recipe on ``subset`` → the query outputs ``[Q]`` (and the state dict)."""
    torch.set_num_threads(1)
    d = task_data(task, a)
    model = T.train_fast(task, d["train"], subset, seed, init_seed)
    out = T.example_losses(model, d["queries"])
    return (out, model.state_dict()) if state else out


# -- scores ---------------------------------------------------------------------------------------

def grad_dot(post: LaplacePosterior, queries: list[dict], train: list[dict]) -> torch.Tensor:
    inf = Influence(post)
    q = {n: g.double().flatten(1) for b in queries for n, g in inf.gradients(b).items()}
    cols = []
    for b in train:
        g = inf.gradients(b)
        cols.append(sum(q[n] @ g[n].double().flatten(1).T for n in q))
    return torch.cat(cols, 1)


def grad_norms(post: LaplacePosterior, train: list[dict]) -> torch.Tensor:
    inf = Influence(post)
    return torch.cat([sum(g.double().flatten(1).square().sum(1) for g in inf.gradients(b).values())
                      for b in train])


def snapshot_dirs(kfac_dir: str) -> list[str]:
    return sorted(str(p) for p in Path(kfac_dir).iterdir()
                  if p.is_dir() and p.name.startswith("step-") and "." not in p.name)


def model_at(task: str, state: dict) -> torch.nn.Module:
    m = T.new_model(task, 0)
    m.load_state_dict(state)
    return m.eval()


class DattriTask:
    """dattri's view of one task: ``torch.func`` losses over the tracked layers' parameters."""

    def __init__(self, task: str, model: torch.nn.Module):
        self.task, self.model = task, model
        layers = T.tracked_layers(model)
        names = dict(model.named_parameters())
        self.params = [f"{n}.{w}" for n in layers for w in ("weight", "bias")
                       if f"{n}.{w}" in names]
        self.tokens = 1 if task == "digits" else T.TEXT_SEQ - 1

    def dataset(self, examples: list[dict]) -> torch.utils.data.TensorDataset:
        b = T.collate(examples)
        x = b["inputs_embeds"] if self.task == "digits" else b["input_ids"]
        return torch.utils.data.TensorDataset(x, b["labels"])

    def per_example(self, params, data) -> torch.Tensor:
        """The example's loss (CE / summed NLL); on a batch: their mean."""
        x, y = data
        one = x.dim() == (2 if self.task == "digits" else 1)
        if one:
            x, y = x.unsqueeze(0), y.unsqueeze(0)
        key = "inputs_embeds" if self.task == "digits" else "input_ids"
        logits = torch.func.functional_call(self.model, params, (), {key: x}).logits
        if self.task == "digits":
            loss = F.cross_entropy(logits, y, reduction="none")
        else:
            loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:],
                                   reduction="none").sum(1)
        return loss[0] if one else loss.mean()

    def margin(self, params, data) -> torch.Tensor:
        logp = -self.per_example(params, data)
        return logp - torch.log(-torch.expm1(logp))

    def prob(self, params, data) -> torch.Tensor:
        return torch.exp(-self.per_example(params, data))


def loader(ds, batch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False)


def dattri_scores(task: str, model, states: dict, d: dict, ifcg_reg: float, a,
                  self_only: bool = False) -> tuple[dict, dict, dict]:
    """dattri's methods: ``({method: [Q, N]} or {method: [N]} with ``self_only``,
    {method: seconds}, {method: why it did not run})``. ``states``: ``{"tracin": ([states],
    [lrs]), "trak": [states]}``."""
    from dattri.algorithm.influence_function import IFAttributorCG
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.algorithm.trak import TRAKAttributor
    from dattri.task import AttributionTask

    dt = DattriTask(task, model)
    train = dt.dataset(d["train"])
    test = dt.dataset(d["queries"])
    n = len(train)
    proj = {"proj_dim": a.proj_dim}
    out, secs, failed = {}, {}, {}

    def run(name, fn):
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name] = fn().detach().double()
        except Exception as e:  # a peer that cannot run: say why, go on
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        secs[name] = time.perf_counter() - t0

    ck, lrs = states["tracin"]
    ck, lrs = [c for c, lr in zip(ck, lrs) if lr > 0], [lr for lr in lrs if lr > 0]  # η = 0: 0

    def tracin():
        t = AttributionTask(loss_func=dt.per_example, model=model, checkpoints=ck)
        att = TracInAttributor(t, weight_list=torch.tensor(lrs), normalized_grad=False,
                               layer_name=dt.params, projector_kwargs=dict(proj))
        if self_only:
            return att.self_attribute(loader(train, n))
        return att.attribute(loader(train, n), loader(test, len(test))).T

    def trak(k):
        def f():
            t = AttributionTask(loss_func=dt.margin, model=model, checkpoints=states["trak"][:k])
            att = TRAKAttributor(t, correct_probability_func=dt.prob, layer_name=dt.params,
                                 projector_kwargs=dict(proj))
            if self_only:  # its cached path has no training gradients in dattri 0.3.0
                return att.self_attribute(loader(train, n)).flatten()
            att.cache(loader(train, n))
            return att.attribute(loader(test, len(test))).T
        return f

    def ifcg():  # the first --ifcg-queries queries only (its cost: module docstring)
        t = AttributionTask(loss_func=dt.per_example, model=model, checkpoints=states["trak"][0])
        att = IFAttributorCG(t, layer_name=dt.params, regularization=ifcg_reg * dt.tokens)
        att.cache(loader(train, n))  # one batch: its inverse-HVP is per cached batch
        few = torch.utils.data.Subset(test, range(min(a.ifcg_queries, len(test))))
        return att.attribute(loader(train, n), loader(few, a.ifcg_batch[task])).T

    run("dattri_tracin", tracin)
    run("dattri_trak1", trak(1))
    if not self_only:
        run("dattri_trak10", trak(a.trak_models))
        run("dattri_ifcg", ifcg)
    return out, secs, failed


# -- metrics --------------------------------------------------------------------------------------

def lds(scores: torch.Tensor, subsets: list[list[int]], outputs: torch.Tensor) -> list[float]:
    """Per query: Spearman over subsets of (Σ scores over the subset, −retrained output)."""
    pred = torch.stack([scores[:, s].sum(1) for s in subsets])  # [K, Q]
    out = []
    for q in range(scores.shape[0]):
        rho = spearmanr(pred[:, q].numpy(), (-outputs[:, q]).numpy()).statistic
        out.append(float(rho) if math.isfinite(rho) else 0.0)
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def auc(score: torch.Tensor, positive: list[bool]) -> float:
    """P(score of a corrupted example > that of a clean one), ties 1/2."""
    pos = score[torch.tensor(positive)]
    neg = score[~torch.tensor(positive)]
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def recall_top(score: torch.Tensor, positive: list[bool], share: float) -> float:
    k = max(1, round(share * len(score)))
    top = score.argsort(descending=True)[:k]
    pos = torch.tensor(positive)
    return float(pos[top].sum() / pos.sum())


# -- one task, one seed ---------------------------------------------------------------------------

def submit(task: str, seed: int, a, pool) -> dict:
    """The seed's retrainings, queued in the worker processes: the subsets', the full set's
    (the check against the Trainer) and the extra TRAK models'."""
    n = a.sizes[task][0]
    rng = random.Random(1_000_003 * seed + 17)
    subsets = [sorted(rng.sample(range(n), n // 2)) for _ in range(a.subsets)]
    return {"subsets": subsets,
            "full": pool.submit(retrain_outputs, task, a, None, seed, None, True),
            "jobs": [pool.submit(retrain_outputs, task, a, s, seed) for s in subsets],
            "extra": [pool.submit(retrain_outputs, task, a, None, 1000 + 100 * seed + k, None,
                                  True) for k in range(1, a.trak_models)]}


def lds_seed(task: str, seed: int, a, queued: dict, tmp: str) -> dict:
    d = task_data(task, a)
    n = len(d["train"])
    subsets, jobs, extra, full_job = (queued["subsets"], queued["jobs"], queued["extra"],
                                      queued["full"])
    r: dict = {"seed": seed, "n_train": n, "n_queries": len(d["queries"]),
               "subsets": a.subsets}
    run = T.train_tracked(task, d["train"], seed, os.path.join(tmp, f"{task}-{seed}"))
    model = run["model"]
    r.update(train_s=run["train_s"], steps=run["steps"], snapshot_every=run["snapshot_every"],
             query_accuracy=T.accuracy(model, d["queries"]),
             query_loss=float(T.example_losses(model, d["queries"]).mean()),
             query_loss_untrained=float(T.example_losses(T.new_model(task, seed),
                                                         d["queries"]).mean()))
    bs = T.RECIPES[task].batch
    train_b, query_b = T.batches(d["train"], bs), T.batches(d["queries"], len(d["queries"]))
    scores, secs = {}, {}
    snap = Snapshot.latest(run["kfac_dir"])
    post = LaplacePosterior(model, snap)
    t0 = time.perf_counter()
    res = influence_scores(post, query_b, train_b, show_progress=False)
    scores["ours"], secs["ours"] = res.scores, time.perf_counter() - t0
    lam = sum(res.damping.values()) / len(res.damping)
    for f in DAMPING_SWEEP:  # the same rule at another share of each layer's mean eigenvalue
        inf = Influence(post)
        inf.damping = {n: v * f / HEURISTIC_FACTOR for n, v in inf.damping.items()}
        scores[f"ours_heuristic_{f:g}"] = inf.scores(query_b, train_b, show_progress=False).scores
    t0 = time.perf_counter()
    scores["ours_prior"] = influence_scores(post, query_b, train_b, damping="prior",
                                            show_progress=False).scores
    secs["ours_prior"] = time.perf_counter() - t0
    r["tau"] = float(post.tau(post.layer_names[0]))
    t0 = time.perf_counter()
    scores["grad_dot"], secs["grad_dot"] = grad_dot(post, query_b, train_b), 0.0
    secs["grad_dot"] = time.perf_counter() - t0
    # trajectory_influence: the mean over the run's snapshots, each with the weights of its step
    ck, snaps = run["ckpt"], [Snapshot.load(p) for p in snapshot_dirs(run["kfac_dir"])]
    t0 = time.perf_counter()
    posts = (LaplacePosterior(model_at(task, ck.states[ck.at.index(s.step)]), s) for s in snaps)
    scores["ours_snapshot_mean"] = trajectory_influence(posts, query_b, train_b,
                                                        show_progress=False)
    secs["ours_snapshot_mean"] = time.perf_counter() - t0
    r["periodic_snapshots"] = len(snaps)
    # EK-FAC: its own tracked run (same seed)
    ek = T.train_tracked(task, d["train"], seed, os.path.join(tmp, f"{task}-{seed}-ekfac"),
                         ekfac=True)
    r["ekfac_run_weights_max_abs_diff"] = max(float((p - q).abs().max()) for p, q in zip(
        ek["model"].parameters(), model.parameters()))
    t0 = time.perf_counter()
    ek_snap = Snapshot.latest(ek["kfac_dir"])
    r["ekfac_layers_corrected"] = sum(ek_snap[n].ekfac_eigvals is not None
                                      for n in ek_snap.layer_names)
    scores["ours_ekfac"] = influence_scores(LaplacePosterior(ek["model"], ek_snap), query_b,
                                            train_b, show_progress=False).scores
    secs["ours_ekfac"] = time.perf_counter() - t0
    # dattri
    final_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full_out, full_state = full_job.result()
    r["fast_loop_vs_trainer_max_abs_diff"] = max(
        float((full_state[k] - final_state[k]).abs().max()) for k in final_state)
    states = {"tracin": (ck.states[:len(ck.at)], ck.lrs),
              "trak": [final_state] + [f.result()[1] for f in extra]}
    ds, dsecs, failed = dattri_scores(task, model_at(task, final_state), states, d, lam, a)
    scores.update(ds)
    secs.update(dsecs)
    r["dattri_failed"] = failed
    r["ifcg_regularization"] = lam * (1 if task == "digits" else T.TEXT_SEQ - 1)
    r["tracin_checkpoints"] = {"steps": ck.at, "lrs": ck.lrs}
    outputs = torch.stack([j.result() for j in jobs])  # [K, Q]
    r["retrained_query_loss_mean"] = float(outputs.mean())
    r["full_retrain_query_loss_mean"] = float(full_out.mean())
    r["lds"] = {}
    for key, _ in METHODS:
        if key in scores:
            rows = scores[key].shape[0]  # IF-CG: its first queries only
            per_q = lds(scores[key], subsets, outputs[:, :rows])
            m, se = mean_se(per_q)
            r["lds"][key] = {"mean": m, "se": se, "per_query": per_q}
    if "dattri_ifcg" in r["lds"]:  # ours on IF-CG's queries, paired
        per_q = r["lds"]["ours"]["per_query"][:len(r["lds"]["dattri_ifcg"]["per_query"])]
        m, se = mean_se(per_q)
        r["lds"]["ours_ifcg_queries"] = {"mean": m, "se": se, "per_query": per_q}
    r["score_seconds"] = secs
    return r


def noisy_seed(task: str, seed: int, a, tmp: str) -> dict:
    d = T.build_data(task, *a.sizes[task], noise=a.noise, noise_seed=seed)
    run = T.train_tracked(task, d["train"], seed, os.path.join(tmp, f"{task}-{seed}-noisy"))
    model = run["model"]
    bs = T.RECIPES[task].batch
    train_b = T.batches(d["train"], bs)
    post = LaplacePosterior(model, Snapshot.latest(run["kfac_dir"]))
    t0 = time.perf_counter()
    sc = {"ours": self_influence(post, train_b, show_progress=False)}
    secs = {"ours": time.perf_counter() - t0}
    sc["grad_norm"] = grad_norms(post, train_b)
    sc["loss"] = T.example_losses(model, d["train"])
    ck = run["ckpt"]
    final_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ds, dsecs, failed = dattri_scores(task, model_at(task, final_state),
                                      {"tracin": (ck.states, ck.lrs), "trak": [final_state]},
                                      d, 0.0, a, self_only=True)
    sc.update(ds)
    secs.update(dsecs)
    r = {"seed": seed, "n_noisy": sum(d["noisy"]), "n_train": len(d["train"]),
         "query_accuracy": T.accuracy(model, d["queries"]), "dattri_failed": failed,
         "score_seconds": secs, "detect": {}}
    for key, _ in NOISY_METHODS:
        if key in sc:
            s = sc[key].double()
            r["detect"][key] = {"auc": auc(s, d["noisy"]),
                                "recall_top10": recall_top(s, d["noisy"], 0.1),
                                "recall_top20": recall_top(s, d["noisy"], 0.2)}
    return r


# -- report ---------------------------------------------------------------------------------------

def across(values: list[float]) -> str:
    m, se = mean_se(values)
    return f"{m:+.3f} ± {se:.3f}"


def verdicts(r: dict) -> list[tuple[str, bool]]:
    out = []
    for task, res in r["tasks"].items():
        seeds = res["lds"]

        def avg(key, seeds=seeds):
            vals = [s["lds"][key]["mean"] for s in seeds if key in s["lds"]]
            return sum(vals) / len(vals) if len(vals) == len(seeds) else None

        ours = avg("ours")
        peers = {k: avg(k) for k in DATTRI + ("grad_dot",) if avg(k) is not None}
        if "dattri_ifcg" in peers:  # on its own queries: against ours on the same ones
            peers["dattri_ifcg"] -= avg("ours_ifcg_queries") - ours
        out.append((f"{task}: ours (defaults) ≥ every dattri method that ran and ≥ gradient dot "
                    "in mean LDS (IF-CG: on its queries)", all(ours >= v for v in peers.values())))
    if "digits" in r["tasks"] and r["tasks"]["digits"]["noisy"]:
        nz = r["tasks"]["digits"]["noisy"]
        a_ = sum(s["detect"]["ours"]["auc"] for s in nz) / len(nz)
        rc = sum(s["detect"]["ours"]["recall_top20"] for s in nz) / len(nz)
        out.append(("digits noisy labels: ours AUC ≥ 0.95 (mean over seeds)", a_ >= 0.95))
        out.append(("digits noisy labels: ours top-20% recall ≥ 0.8 (mean over seeds)",
                    rc >= 0.8))
    return out


def table(r: dict) -> list[str]:
    L = []
    for task, res in r["tasks"].items():
        seeds = res["lds"]
        if not seeds:
            continue
        s0 = seeds[0]
        L += ["", f"**{task}** ({s0['n_train']} training examples, {s0['n_queries']} queries, "
              f"{s0['subsets']} half-subsets per seed; query accuracy "
              + ", ".join(f"{s['query_accuracy']:.3f}" for s in seeds)
              + "; query loss untrained → trained "
              + ", ".join(f"{s['query_loss_untrained']:.2f} → {s['query_loss']:.2f}"
                          for s in seeds) + ")", "",
              "| method | LDS: mean ± s.e. over seeds | "
              + " | ".join(f"seed {s['seed']}: mean ± s.e. over queries" for s in seeds)
              + " |", "|---|---|" + "---|" * len(seeds)]
        for key, label in METHODS:
            if not all(key in s["lds"] for s in seeds):
                why = "; ".join(sorted({s["dattri_failed"].get(key, "not run")
                                        for s in seeds if key not in s["lds"]}))
                L.append(f"| {label} | did not run: {why} |" + " |" * len(seeds))
                continue
            vals = [s["lds"][key]["mean"] for s in seeds]
            L.append(f"| {label} | **{across(vals)}** | " + " | ".join(
                f"{s['lds'][key]['mean']:+.3f} ± {s['lds'][key]['se']:.3f}" for s in seeds)
                + " |")
        nz = res["noisy"]
        if nz:
            L += ["", f"{task}, noisy labels ({nz[0]['n_noisy']} of {nz[0]['n_train']} "
                  "corrupted; mean over seeds, per seed in brackets):", "",
                  "| method | AUC | recall in top 10% | recall in top 20% |", "|---|---|---|---|"]
            for key, label in NOISY_METHODS:
                if not all(key in s["detect"] for s in nz):
                    why = "; ".join(sorted({s["dattri_failed"].get(key, "not run")
                                            for s in nz if key not in s["detect"]}))
                    L.append(f"| {label} | did not run: {why} | | |")
                    continue
                cells = []
                for m in ("auc", "recall_top10", "recall_top20"):
                    v = [s["detect"][key][m] for s in nz]
                    cells.append(f"{sum(v) / len(v):.3f} ("
                                 + ", ".join(f"{x:.2f}" for x in v) + ")")
                L.append(f"| {label} | " + " | ".join(cells) + " |")
    return L


def report(r: dict, a, info: dict) -> str:
    L = [BEGIN, "## Influence: LDS and noisy labels against dattri (`benchmarks/influence_lds.py`)",
         "", f"- date: {info['date']}",
         f"- machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch "
         f"thread per process, {a.workers} retraining workers); torch {info['torch']}, "
         f"transformers {info['transformers']}, dattri {info['dattri']}, scikit-learn "
         f"{info['sklearn']}, Python {info['python']}",
         f"- command: `{a.command}`; total {r['total_seconds']:.0f} s",
         "- LDS: Spearman over random half-subsets (each retrained from scratch, same recipe) "
         "between a query's summed scores over the subset and minus its retrained loss "
         "(digits: cross-entropy; text: summed NLL); seed = initialisation + data order + "
         "subsets. Methods, recipe and sizes: the script's docstring."]
    L += table(r)
    L += ["", "Checks: fast retraining loop vs the Trainer run on the full set (max abs weight "
          "difference): " + ", ".join(
              f"{t} {max(s['fast_loop_vs_trainer_max_abs_diff'] for s in res['lds']):.1e}"
              for t, res in r["tasks"].items() if res["lds"])
          + "; EK-FAC run vs the default run (max abs weight difference): " + ", ".join(
              f"{t} {max(s['ekfac_run_weights_max_abs_diff'] for s in res['lds']):.1e}"
              for t, res in r["tasks"].items() if res["lds"])
          + "; layers with an EK-FAC correction in its final snapshot: " + ", ".join(
              f"{t} " + "/".join(str(s["ekfac_layers_corrected"]) for s in res["lds"])
              for t, res in r["tasks"].items() if res["lds"]), ""]
    for text, ok in verdicts(r):
        L.append(f"- {text}: {'met' if ok else 'NOT met'}")
    L.append(END)
    return "\n".join(L)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(T.TASKS), choices=T.TASKS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--subsets", type=int, default=50)
    p.add_argument("--digits-n", type=int, default=1000)
    p.add_argument("--digits-q", type=int, default=100)
    p.add_argument("--text-n", type=int, default=600)
    p.add_argument("--text-q", type=int, default=50)
    p.add_argument("--trak-models", type=int, default=10)
    p.add_argument("--proj-dim", type=int, default=512,
                   help="dattri's random projection (TracIn, TRAK); 512 is its default")
    p.add_argument("--ifcg-queries", type=int, default=5,
                   help="IF-CG scores only the first this many queries (its cost)")
    p.add_argument("--ifcg-batch", type=int, nargs=2, default=[5, 1],
                   metavar=("DIGITS", "TEXT"),
                   help="queries per IF-CG solve (memory: the whole training set's HVP per "
                   "query in the batch; text at 5 grew past 15 GB and was OOM-killed on a "
                   "24 GiB machine)")
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--skip-noisy", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", metavar="PATH",
                   help="write this run's results to PATH only (a part for --combine)")
    p.add_argument("--combine", nargs="+", metavar="PATH",
                   help="merge the parts written with --json (tasks and seeds side by side, "
                   "in seed order) into the results and the RESULTS.md section; runs nothing")
    p.add_argument("--quick", action="store_true", help="smoke run; writes nothing")
    p.add_argument("--no-write", action="store_true", help="print only, write nothing")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    a.command = "python benchmarks/influence_lds.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    if a.quick:
        a.seeds, a.subsets, a.trak_models, a.proj_dim = a.seeds[:1], 6, 2, 16
        a.digits_n, a.digits_q, a.text_n, a.text_q = 64, 6, 32, 4
    a.sizes = {"digits": (a.digits_n, a.digits_q), "text": (a.text_n, a.text_q)}
    a.ifcg_batch = dict(zip(T.TASKS, a.ifcg_batch))
    info = dict(machine({"dattri": "dattri", "sklearn": "scikit-learn"}),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if a.combine:
        combine(a, info)
        return
    t0 = time.perf_counter()
    r: dict = {"tasks": {}}
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="kfac-lds-") as tmp, \
            cf.ProcessPoolExecutor(a.workers, mp_context=ctx) as pool:
        queued = {(t, seed): submit(t, seed, a, pool) for t in a.tasks for seed in a.seeds}
        for task in a.tasks:
            res = r["tasks"][task] = {"lds": [], "noisy": []}
            for seed in a.seeds:
                s = lds_seed(task, seed, a, queued[task, seed], tmp)
                res["lds"].append(s)
                print(f"{task} seed {seed}: " + ", ".join(
                    f"{k} {v['mean']:+.3f}" for k, v in s["lds"].items())
                    + (f"; dattri failed: {s['dattri_failed']}" if s["dattri_failed"] else "")
                    + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
                if not a.skip_noisy:
                    nz = noisy_seed(task, seed, a, tmp)
                    res["noisy"].append(nz)
                    print(f"{task} seed {seed} noisy: " + ", ".join(
                        f"{k} AUC {v['auc']:.3f} top20 {v['recall_top20']:.2f}"
                        for k, v in nz["detect"].items()) + f" ({time.perf_counter() - t0:.0f} s)",
                        flush=True)
                if not (a.quick or a.no_write):  # what is done so far, in case the run is cut
                    r["total_seconds"] = time.perf_counter() - t0
                    finish(r, a, info, quiet=True)
    r["total_seconds"] = time.perf_counter() - t0
    finish(r, a, info)


def combine(a, info: dict) -> None:
    """Merge parts run side by side (each ``--json``, its own tasks and seeds): the seeds of a
    task in seed order; the command lists every part's; the wall time is the longest part's."""
    parts = [json.loads(Path(p).read_text()) for p in a.combine]
    r: dict = {"tasks": {}, "parts": [{"command": q["command"],
                                       "total_seconds": q["total_seconds"]} for q in parts]}
    for q in parts:
        for task, res in q["tasks"].items():
            mine = r["tasks"].setdefault(task, {"lds": [], "noisy": []})
            mine["lds"] += res["lds"]
            mine["noisy"] += res["noisy"]
    for res in r["tasks"].values():
        res["lds"].sort(key=lambda s: s["seed"])
        res["noisy"].sort(key=lambda s: s["seed"])
    r["total_seconds"] = max(q["total_seconds"] for q in parts)
    for k, v in parts[0]["args"].items():
        if k not in ("command", "combine", "json", "tasks", "seeds", "sizes", "ifcg_batch"):
            setattr(a, k, v)
    a.command = " & ".join(q["command"] for q in parts) + " (side by side, then --combine)"
    info = parts[0]["machine"]
    finish(r, a, info)


def finish(r: dict, a, info: dict, quiet: bool = False) -> None:
    r["verdicts"] = [{"criterion": t, "met": ok} for t, ok in verdicts(r)]
    section = report(r, a, info)
    if not quiet:
        print(section, flush=True)
    if a.quick or a.no_write:
        return
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": info, "command": a.command,
                                            "args": dict(vars(a)), **r}, indent=1, default=str))
        return
    write_json("influence_lds", {"machine": info, "command": a.command,
                                 "args": dict(vars(a)), **r})
    write_section(BEGIN, END, section)


if __name__ == "__main__":
    main()
