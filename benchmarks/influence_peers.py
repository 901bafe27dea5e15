r"""Influence scores from the streamed factors against kronfluence, against exact-curvature
influence, and what they cost.

Everything is read from the machine (Python's reference documentation, ``pydoc_data.topics``,
as byte tokens) and every model is built from a config: nothing is downloaded.

Models and data
---------------
* ``tiny``: a byte-level GPT-2 (``tiny_gpt2(n_layer=2, n_embd=16, n_head=2)``, 256 tokens,
  ``--tiny-seq`` = 32 positions), small enough for the exact GGN of its tracked layers. Its
  training set: ``--tiny-n`` (128) non-overlapping 32-byte windows of the documentation, drawn
  at random (seeded); its queries: ``--queries`` (10) other windows, each labelled on its second
  half only (a prompt and a completion).
* ``demo``: the demo's model, built from ``conf/model/tiny.yaml`` (GPT-2, 2 layers × 128, 4
  heads, byte vocabulary, 128 positions); training set: the first ``max(--demo-n)`` (1,000)
  128-byte windows of a seeded draw, queries: ``--queries`` others, labelled on their second half.
* Tracked layers: kfac_stream's default selection (every Conv1D inside the blocks, not the LM
  head): 8 layers for both models (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj per block).
  kronfluence (which wraps ``nn.Linear`` only) runs on a copy in which each of these ``Conv1D``
  is an equal ``nn.Linear`` (`conv1d_to_linear`), its task tracks exactly these layers.
* The real training runs: a ``transformers.Trainer`` with one `KFACStreamCallback` at the
  DEFAULT `KFACConfig` (MC Fisher, token_fraction 0.05, update_every 10, final window), but for
  ``output_dir``, ``seed`` and one snapshot at the end; AdamW, cosine schedule, batch 8: the
  tiny model ``--tiny-steps`` (300) steps at lr 3e-3 on its 128 windows, the demo model
  ``--demo-steps`` (100) steps at lr 1e-3 on its 1,000 windows. The trained weights are the
  fixed weights of everything below.

The loss of an example is the SUM of the NLL of its labelled tokens (kfac_stream's
``example_losses``; kronfluence's task below returns the same sum for ``compute_train_loss``
and ``compute_measurement``). Sign: kronfluence's (positive = the training example lowers the
query's loss).

Part 1: agreement with kronfluence (tiny model, float64)
---------------------------------------------------------
* Ours: the trained weights in float64; factors from a pass at learning rate 0 over the 128
  training sequences (one epoch, batch 8; the weights are checked unchanged) with
  ``KFACConfig(token_fraction=1.0, ema_decay=1.0, fisher="empirical", update_every=1,
  final_window=0, storage_dtype="float64", min_window_sequences=0)``; the Trainer's loss is the
  mean token NLL computed in float64 (``compute_loss_func``: transformers' own causal-LM loss
  casts the logits to float32, which would put float32 rounding, ~1e-8, into G; the tracker
  itself applies the inverse loss scale ``1/c`` in float32, ``tracker.py``'s ``w.root / c``,
  which is exact here, ``c = 1/248``, but off by ~1e-7 in G for other counts). Scores:
  ``Influence(LaplacePosterior(model, snapshot), damping).scores(queries, train batches of 8)``.
* kronfluence 1.0.1 on the Linear copy of the same float64 weights: ``Analyzer.fit_all_factors``
  with ``FactorArguments(strategy="kfac", use_empirical_fisher=True, activation_covariance_dtype
  =gradient_covariance_dtype=float64)`` (eigendecomposition float64, its default) over the same
  128 sequences, then ``compute_pairwise_scores`` with ``ScoreArguments(damping_factor=λ,
  per_sample_gradient_dtype=precondition_dtype=score_dtype=float64)``.
* Normalisation (`benchmarks/peers.py` checks it on the same mapping): kronfluence stores sums
  of ``ā āᵀ`` and ``g gᵀ`` with their position counts and divides before the eigendecomposition,
  bias column last, so ``A_kf = A``, ``G_kf = G`` (our token-weighted means) when its loss is
  the summed NLL; there is no padding in the training windows (its ``get_attention_mask``
  returns the mask, all ones there), so both count the same ``N·T`` positions (the last
  position of each window, which has no label, counts with ``g = 0`` on both sides).
* Damping, two settings: (a) the same explicit ``λ`` for every layer on both sides, ``λ = 0.1 ·
  mean over layers of mean(γ αᵀ)`` of our factors; (b) each side's heuristic: ours
  ``damping="heuristic"`` (``0.1 · mean(γ αᵀ)`` per layer) against kronfluence's
  ``damping_factor=None`` (``HEURISTIC_DAMPING_SCALE · mean(kron(α, γ))`` per module,
  kronfluence/factor/config.py ``Kfac.prepare``: the same quantity, ``mean(γ αᵀ) = mean(γ) ·
  mean(α)``; ours clamps negative eigenvalues to 0 first, kronfluence does not); the per-layer
  λ of both are compared (kronfluence's from its stored eigenvalues).
* Reported: per query, Spearman's rank correlation of the 128 scores (acceptance: ≥ 0.95 for
  every query) and the max relative difference ``max_n |ours − theirs| / max_n |theirs|``;
  the factors' relative Frobenius differences.

Part 2: rank correlation with exact-curvature influence (tiny model, float64, dense)
-------------------------------------------------------------------------------------
Exact curvature of the tracked layers, block-diagonal per layer, dense, on the same weights and
training set, each layer's block on the same scale as ``A ⊗ G`` (the K-FAC expand form
approximates the summed curvature by ``n·A⊗G``, ``n = N·T`` positions), so the same damping
means the same thing:

* exact GGN: ``F_l = (1/n) Σ_{n,t} J_{l,t}ᵀ H_t J_{l,t}`` (``J_{l,t}``: the Jacobian of the
  logits at position ``t`` with respect to the layer's ``[W b]``, ``H_t = diag(p_t) − p_t p_tᵀ``;
  the GGN of the summed NLL has no cross-position terms). Computed without ``V`` backward rows
  per position: the LM head is linear (``logits = W_e h``), so ``J_tᵀ H_t J_t = (∂h_t/∂θ)ᵀ
  (W_eᵀ H_t W_e) (∂h_t/∂θ)``, and ``W_eᵀ H_t W_e = K_t K_tᵀ`` (eigh, ``d × d``) gives ``d``
  rows per position: backward rows ``K_t[:, k]`` at the head's input ``h_t``, per row the
  layer's gradient ``Σ_s δ_s ā_sᵀ``, accumulated as ``JᵀJ``. Checked against the direct
  ``V``-row form (``√p_c (e_c − p_t)`` at the logits) on one sequence.
* exact empirical Fisher: ``F_l = (1/n) Σ_n ∇_l L_n ∇_l L_nᵀ``.
* per-example gradients (training and query) by this script's own hooks (``Σ_t δ_t ā_tᵀ``),
  checked against autograd's parameter gradients on one example.
* scores: ``Σ_l ∇_l L_qᵀ (F_l + λ_l I)⁻¹ ∇_l L_n`` by a Cholesky solve, at the two damping
  settings of part 1 (the heuristic: our per-layer λ). Pipeline check: with ``F_l`` the dense
  Kronecker expansion of our factors (``G ⊗ A`` for the row-major ``[d_out, d_A]`` gradient)
  the same code must give our scores (relative difference reported).
* reported: per query Spearman of ours (the lr-0 empirical-Fisher K-FAC), of kronfluence's
  K-FAC, of ours from the REAL run's snapshot (MC Fisher, defaults, explicit λ) and of the plain
  gradient dot product (no curvature) against the exact GGN and the exact empirical Fisher
  scores: median and worst over the queries. No threshold: the figures as they come.

Part 3: run time side by side (both models, float32, the trained weights)
--------------------------------------------------------------------------
* kronfluence, fit-factors-then-score: the two stages ``fit_all_factors`` runs for K-FAC,
  ``fit_covariance_matrices`` and ``perform_eigendecomposition`` (``FactorArguments(strategy=
  "kfac")``, otherwise its defaults: the true Fisher with sampled labels, float32 covariances,
  float64 eigendecomposition), timed apart, over the training set, batch 8, then
  ``compute_pairwise_scores`` (``damping_factor=None``: its heuristic; query batch = all queries,
  training batch 8); its own writes of factors and scores to a temporary directory included (its
  workflow). Its eigendecomposition runs on ONE torch thread (as our snapshots' do below side
  1024): on these busy cores a 2-thread LAPACK eigh of the demo's factors took 4-23 s against
  1.3 s on one thread, an artefact of the shared machine, not of kronfluence, that would
  inflate its time.
* ours, score-from-snapshot: ``Snapshot.load`` of the real run's final snapshot,
  ``LaplacePosterior``, ``influence_scores(..., damping="heuristic")`` over the same training
  batches of 8 (the factors came with training: the tracker's own time in that run, the
  manifest's ``tracker_seconds``, is reported beside the training wall time).
* the demo model's timing uses the first ``--demo-timing-n`` (250) training sequences.
* one untimed warm-up of both on one batch, then ``--repeats`` (3) repeats, interleaved (the
  order alternates per repeat); MEDIANS reported,
  and each repeat. The machine has 2 cores shared with other work: timings are noisy (the load
  average at start and end is recorded).

Part 4: cost on the demo's model
---------------------------------
Scores of ``N`` ∈ ``--demo-n`` (250, 500, 1,000) training sequences × ``--queries`` (10)
queries from the real run's snapshot (heuristic damping), each ``N`` in its own child process
(a fresh allocator): the model and snapshot loaded, the queries built, the training batches (8
sequences) produced lazily from the windows; one warm-up call on one batch, then the peak
resident set size is reset (``/proc/self/clear_refs`` ``5``) and ``influence_scores`` runs on
the ``N`` sequences: reported, its wall time, time per training example and the peak RSS
increase over the RSS before the call (``VmHWM − VmRSS``), next to the ``[Q, N]`` score
matrix's bytes. ``--cost-repeats`` (3) timed runs per ``N`` in rotated order (median time),
then one more with ``MALLOC_MMAP_THRESHOLD_=65536`` for the memory: glibc's default heap keeps
freed blocks, so a default run's peak RSS creeps up with ``N`` by retention (in a probe of 2,000
sequences it rose ~90 MB while the live tensors stayed the same, and ``malloc_trim(0)`` gave it
all back); with the threshold every block from 64 KiB up is unmapped when freed and the RSS
stayed flat. Flop model per training example (the module docstring of
`kfac_stream.query.influence`): a forward (``2·T·Σ d_in·d_out`` in the tracked layers, ``4·T²·d``
per block for attention, ``2·T·d·V`` for the tied head), a backward to the tracked layers'
outputs only (no weight gradients: ≈ the forward's cost again), and per layer the dense
per-example gradient (``2·T·d_out·d_A``) and its inner products with the ``R`` preconditioned
query rows (``2·R·d_out·d_A``; the factored form only when ``R = 1``); the queries'
preconditioning is paid once (``2·R·(d_out²·d_A + d_out·d_A²)·2``).

Usage: ``python benchmarks/influence_peers.py [--repeats 3] [--threads 2] [--parts 1 2 3 4]``;
``--quick``: a smoke run (small sizes, 1 repeat) that writes nothing. Writes
``benchmarks/results/influence_peers.json`` and the section of ``benchmarks/RESULTS.md``
between the ``influence-peers`` markers (only with every part). Needs kronfluence 1.0.1
(``make .venv/.bench-peers``: ``pip install --no-deps kronfluence==1.0.1``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from exact_curvature import (
    check_per_example_grad,
    exact_ggn,
    exact_scores,
    ggn_direct_check,
    per_example_grads,
    rel,
    sum_nll,
)
from influence_peers_report import BEGIN, END, MMAP_THRESHOLD, SPEARMAN_BAR, report
from torch import nn
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

from kfac_stream import (
    Influence,
    KFACConfig,
    KFACStreamCallback,
    LaplacePosterior,
    Snapshot,
    influence_scores,
)
from kfac_stream.app.data import ExampleDataset
from kfac_stream.app.models import tiny_gpt2

from _common import conv1d_to_linear, dist_version, log, machine, write_json, write_section

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BATCH = 8
HEURISTIC_SCALE = 0.1  # kfac_stream.query.influence.HEURISTIC_FACTOR, kronfluence's scale
LR0_CONFIG = dict(token_fraction=1.0, ema_decay=1.0, fisher="empirical", update_every=1,
                  final_window=0.0, storage_dtype="float64", min_window_sequences=0)


# -- data ---------------------------------------------------------------------------------------

def windows(seq: int, seed: int) -> torch.Tensor:
    """Every non-overlapping ``seq``-byte window of ``pydoc_data.topics`` (the topics joined as
    `_common.make_data` joins them), in a seeded random order: ``[M, seq]`` int64."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    w = ids[:len(ids) // seq * seq].view(-1, seq)
    return w[torch.randperm(len(w), generator=torch.Generator().manual_seed(seed))]


def examples(rows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Training examples: labels = inputs (every position after the first is a target)."""
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}
            for x in rows]


def query_batch(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Queries: each window labelled on its second half only (prompt, completion)."""
    seq = rows.shape[1]
    labels = torch.where(torch.arange(seq) >= seq // 2, rows, torch.full_like(rows, -100))
    return {"input_ids": rows, "attention_mask": torch.ones_like(rows), "labels": labels}


def batches(exs: list[dict], size: int = BATCH) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.stack([e[k] for e in exs[i:i + size]]) for k in exs[0]}
            for i in range(0, len(exs), size)]


def to_examples(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]


def demo_model_config() -> dict:
    """The demo's model arguments from ``conf/model/tiny.yaml`` (``kind`` dropped)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())
    return {k: v for k, v in cfg.items() if k != "kind"}


# -- training runs ------------------------------------------------------------------------------


def mean_nll_loss(outputs, labels, num_items_in_batch=None):
    """The Trainer's loss for the lr-0 pass: the mean token NLL in the logits' dtype."""
    logits = outputs["logits"]
    return sum_nll(logits, labels).sum() / (labels[:, 1:] != -100).sum()


def trainer_args(out: str, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, weight_decay=0.0,
                             save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, **kw)


def real_run(model: nn.Module, exs: list[dict], steps: int, lr: float, out: str,
             seed: int) -> dict:
    """Train ``model`` with one callback at the default `KFACConfig` (one snapshot at the end):
    returns ``{"snapshot", "train_s", "callback_train_s", "counts", "losses"}``."""
    cb = KFACStreamCallback(KFACConfig(output_dir=os.path.join(out, "kfac"),
                                       snapshot_every=10 * steps, seed=seed))
    args = trainer_args(out, max_steps=steps, learning_rate=lr, lr_scheduler_type="cosine",
                        warmup_steps=max(steps // 20, 1), logging_steps=max(steps // 4, 1),
                        seed=seed)
    trainer = Trainer(model=model, args=args, train_dataset=ExampleDataset(exs), callbacks=[cb])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    model.eval()
    snap = cb.snapshots[-1]
    return {"snapshot": snap, "train_s": wall, "callback_train_s": cb.train_seconds,
            "counts": Snapshot.load(snap, show_progress=False).meta["counts"],
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


def lr0_pass(model: nn.Module, exs: list[dict], out: str) -> Snapshot:
    """Our factors at fixed weights: one epoch at learning rate 0 with `LR0_CONFIG`."""
    before = [p.detach().clone() for p in model.parameters()]
    cb = KFACStreamCallback(KFACConfig(output_dir=os.path.join(out, "kfac"),
                                       snapshot_every=10**9, **LR0_CONFIG))
    args = trainer_args(out, num_train_epochs=1, learning_rate=0.0,
                        lr_scheduler_type="constant", logging_steps=10**6, seed=0)
    Trainer(model=model, args=args, train_dataset=ExampleDataset(exs), callbacks=[cb],
            compute_loss_func=mean_nll_loss).train()
    model.eval()
    if not all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
        raise SystemExit("the learning-rate-0 pass changed the weights")
    return Snapshot.load(cb.snapshots[-1], show_progress=False)


# -- kronfluence --------------------------------------------------------------------------------

def kf_task(layers: list[str]):
    from kronfluence.task import Task

    class LMTask(Task):
        """The summed NLL of the labelled tokens (``sample``: labels drawn from the model at
        the labelled positions, for its true-Fisher factors)."""

        def compute_train_loss(self, batch, model, sample=False):
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"]
            if sample:
                with torch.no_grad():
                    probs = torch.softmax(logits[:, :-1].detach().double(), -1)
                    draw = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
                    labels = labels.clone()
                    labels[:, 1:] = torch.where(labels[:, 1:] == -100, labels[:, 1:], draw)
            return sum_nll(logits, labels).sum()

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return list(layers)

        def get_attention_mask(self, batch):
            """The positions whose next-token loss carries a gradient: each sequence's real
            tokens but its last (kfac_stream's usable positions; the attention mask would
            count the last token too, and fit other factors)."""
            labels = batch["labels"]
            lengths = (labels != -100).sum(1)
            return (torch.arange(labels.shape[1])[None] < (lengths[:, None] - 1)).long()

    return LMTask()


class Kronfluence:
    """kronfluence's Analyzer on a Linear copy of ``model`` tracking ``layers``."""

    def __init__(self, model: nn.Module, layers: list[str], out: str):
        from kronfluence.analyzer import Analyzer, prepare_model

        self.task = kf_task(layers)
        lin = conv1d_to_linear(model, layers).to(next(model.parameters()).dtype)
        self.model = prepare_model(lin, self.task)
        self.analyzer = Analyzer("influence_peers", self.model, self.task, cpu=True,
                                 log_level=logging.WARNING, disable_tqdm=True, output_dir=out)
        self.runs = 0

    def fit(self, exs: list[dict], float64: bool, empirical: bool) -> tuple[str, dict]:
        """``fit_all_factors``' two stages for ``strategy="kfac"`` (covariances, then their
        eigendecomposition: it fits no lambda matrices for K-FAC), timed apart; the
        eigendecomposition on one torch thread (module docstring). Returns the factors' name and
        ``{"cov_s", "eig_s"}``."""
        from kronfluence.arguments import FactorArguments

        self.runs += 1
        name = f"factors{self.runs}"
        kw = (dict(activation_covariance_dtype=torch.float64,
                   gradient_covariance_dtype=torch.float64) if float64 else {})
        args = FactorArguments(strategy="kfac", use_empirical_fisher=empirical, **kw)
        t0 = time.perf_counter()
        self.analyzer.fit_covariance_matrices(name, ExampleDataset(exs),
                                              per_device_batch_size=BATCH, factor_args=args,
                                              overwrite_output_dir=True)
        t1 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.analyzer.perform_eigendecomposition(name, factor_args=args,
                                                     overwrite_output_dir=True)
        finally:
            torch.set_num_threads(threads)
        return name, {"cov_s": t1 - t0, "eig_s": time.perf_counter() - t1}

    def scores(self, factors: str, queries: dict, exs: list[dict], damping: float | None,
               float64: bool) -> torch.Tensor:
        from kronfluence.arguments import ScoreArguments

        kw = (dict(per_sample_gradient_dtype=torch.float64, precondition_dtype=torch.float64,
                   score_dtype=torch.float64) if float64 else {})
        args = ScoreArguments(damping_factor=damping, **kw)
        name = f"scores_{factors}_{damping}"
        q = to_examples(queries)
        self.analyzer.compute_pairwise_scores(name, factors, ExampleDataset(q),
                                              ExampleDataset(exs),
                                              per_device_query_batch_size=len(q),
                                              per_device_train_batch_size=BATCH,
                                              score_args=args, overwrite_output_dir=True)
        return self.analyzer.load_pairwise_scores(name)["all_modules"].double()

    def factors(self, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer: (A, G)}``: the covariances divided by their counts."""
        cov = self.analyzer.load_covariance_matrices(name)
        return {n: (cov["activation_covariance"][n].double()
                    / cov["num_activation_covariance_processed"][n],
                    cov["gradient_covariance"][n].double()
                    / cov["num_gradient_covariance_processed"][n])
                for n in cov["activation_covariance"]}

    def heuristic_damping(self, name: str) -> dict[str, float]:
        """kronfluence's ``damping_factor=None`` per module, from its stored eigenvalues:
        ``HEURISTIC_DAMPING_SCALE · mean(kron(α, γ))`` (``Kfac.prepare``)."""
        from kronfluence.utils.constants import HEURISTIC_DAMPING_SCALE

        eig = self.analyzer.load_eigendecomposition(name)
        return {n: float(HEURISTIC_DAMPING_SCALE * torch.kron(
                    eig["activation_eigenvalues"][n].double()[None],
                    eig["gradient_eigenvalues"][n].double()[:, None]).mean())
                for n in eig["activation_eigenvalues"]}


# -- statistics ---------------------------------------------------------------------------------

def spearman(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per row of ``[Q, N]`` scores: Spearman's rank correlation."""
    from scipy.stats import spearmanr

    return [float(spearmanr(x[q].numpy(), y[q].numpy()).statistic) for q in range(len(x))]


def max_rel(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per row: ``max_n |x − y| / max_n |y|``."""
    return [float((x[q] - y[q]).abs().max() / y[q].abs().max()) for q in range(len(x))]


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "worst": min(xs), "per_query": xs}


# -- part 1 and 2 -------------------------------------------------------------------------------

def tiny_parts(a, tmp: str, parts: set[int]) -> dict:
    w = windows(a.tiny_seq, a.seed)
    train_ex = examples(w[:a.tiny_n])
    qb = query_batch(w[a.tiny_n:a.tiny_n + a.queries])
    tb = batches(train_ex)
    model = tiny_gpt2(n_layer=2, n_embd=16, n_head=2, seq_len=a.tiny_seq, seed=a.seed)
    log(f"[tiny] GPT-2 2×16, T={a.tiny_seq}: training {a.tiny_steps} steps on {a.tiny_n} "
        "windows with the callback at defaults")
    run = real_run(model, train_ex, a.tiny_steps, 3e-3, os.path.join(tmp, "tiny-real"), a.seed)
    log(f"[tiny] trained in {run['train_s']:.1f} s, losses {run['losses']}; tracker "
        f"{run['counts']['tracker_seconds']:.2f} s on the training thread")
    layers = list(Snapshot.load(run["snapshot"], show_progress=False).layer_names)
    out = {"model": "tiny", "config": dict(n_layer=2, n_embd=16, n_head=2, vocab_size=256,
                                          seq_len=a.tiny_seq),
           "n_train": a.tiny_n, "n_queries": a.queries, "layers": layers,
           "real_run": {k: v for k, v in run.items() if k != "snapshot"}}
    res = {"tiny": out, "_tiny_state": (model, run, train_ex, qb, tb, layers)}
    if not parts & {1, 2}:
        return res

    m64 = copy.deepcopy(model).double().eval()
    t0 = time.perf_counter()
    snap = lr0_pass(m64, train_ex, os.path.join(tmp, "tiny-lr0"))
    c = snap.manifest.counts
    n_pos = a.tiny_n * a.tiny_seq
    log(f"[tiny] lr-0 pass {time.perf_counter() - t0:.1f} s: {c.updates} updates, "
        f"{c.positions_sampled} positions of {c.tokens_seen} (N·T = {n_pos})")
    post = LaplacePosterior(m64, snap, 1.0)
    eig = {n: post.eig.eigvals(n) for n in layers}
    lam = HEURISTIC_SCALE * statistics.fmean(
        float(g.clamp(min=0).mean() * av.clamp(min=0).mean()) for av, g in eig.values())
    inf_h = Influence(post, "heuristic")
    settings = {"explicit": dict.fromkeys(layers, lam), "heuristic": dict(inf_h.damping)}
    ours = {"explicit": Influence(post, lam).scores(qb, tb, show_progress=False).scores,
            "heuristic": inf_h.scores(qb, tb, show_progress=False).scores}
    out["lr0"] = {"counts": {k: getattr(c, k) for k in ("updates", "positions_sampled",
                                                        "tokens_seen", "sequences_seen")},
                  "explicit_damping": lam, "heuristic_damping": settings["heuristic"]}

    kf = Kronfluence(m64, layers, os.path.join(tmp, "kf-tiny64"))
    fname, _ = kf.fit(train_ex, float64=True, empirical=True)
    theirs = {"explicit": kf.scores(fname, qb, train_ex, lam, float64=True),
              "heuristic": kf.scores(fname, qb, train_ex, None, float64=True)}
    if 1 in parts:
        kfac = kf.factors(fname)
        fa = {n: {"A": rel(snap[n].A, kfac[n][0]), "G": rel(snap[n].G, kfac[n][1])}
              for n in layers}
        kf_h = kf.heuristic_damping(fname)
        agree = {"factors_rel_frobenius": fa,
                 "factors_worst": {"A": max(x["A"] for x in fa.values()),
                                   "G": max(x["G"] for x in fa.values())},
                 "heuristic_damping": {n: {"ours": settings["heuristic"][n],
                                           "kronfluence": kf_h[n],
                                           "rel_diff": abs(settings["heuristic"][n] - kf_h[n])
                                           / kf_h[n]} for n in layers}}
        for s in settings:
            rho = spearman(ours[s], theirs[s])
            mr = max_rel(ours[s], theirs[s])
            agree[s] = {"spearman": summary(rho), "max_rel_diff": max(mr),
                        "max_rel_diff_per_query": mr, "ok": min(rho) >= SPEARMAN_BAR}
            log(f"[part 1] {s} damping: Spearman per query "
                + " ".join(f"{x:.6f}" for x in rho)
                + f"; max rel diff {max(mr):.2e} -> "
                + ("OK" if agree[s]["ok"] else "BELOW 0.95"))
        log(f"[part 1] factors: max rel Frobenius A {agree['factors_worst']['A']:.2e}, G "
            f"{agree['factors_worst']['G']:.2e}; heuristic λ rel diff max "
            f"{max(x['rel_diff'] for x in agree['heuristic_damping'].values()):.2e}")
        out["kronfluence_agreement"] = agree

    if 2 in parts:
        t0 = time.perf_counter()
        g_check = check_per_example_grad(m64, layers, train_ex[0])
        ggn_check = ggn_direct_check(m64, layers, train_ex[0])
        gt = per_example_grads(m64, layers, tb)
        gq = per_example_grads(m64, layers, [qb])
        ggn = {n: f / n_pos for n, f in exact_ggn(m64, layers, train_ex).items()}
        ef = {n: gt[n].T @ gt[n] / n_pos for n in layers}
        kron = {n: torch.kron(snap[n].G.double(), snap[n].A.double()) for n in layers}
        log(f"[part 2] exact curvature {time.perf_counter() - t0:.1f} s "
            f"(per-example gradient check {g_check:.1e}, GGN vs direct V-row form "
            f"{ggn_check:.1e}); blocks " + ", ".join(str(len(f)) for f in ggn.values()))
        real_post = LaplacePosterior(model, Snapshot.load(run["snapshot"], show_progress=False))
        real = Influence(real_post, lam).scores(qb, tb, show_progress=False).scores.double()
        dot = sum(gq[n] @ gt[n].T for n in layers)
        ex_out = {"per_example_grad_check": g_check, "ggn_direct_check": ggn_check,
                  "positions": n_pos, "block_sizes": {n: len(f) for n, f in ggn.items()}}
        for s, damp in settings.items():
            ref = {"ggn": exact_scores(ggn, damp, gq, gt), "ef": exact_scores(ef, damp, gq, gt)}
            kron_scores = exact_scores(kron, damp, gq, gt)
            row = {"pipeline_check_rel": max(max_rel(kron_scores, ours[s]))}
            cands = {"ours": ours[s], "kronfluence": theirs[s], "grad_dot": dot}
            if s == "explicit":
                cands["ours_real_run"] = real
            for key, sc in cands.items():
                for rk, rv in ref.items():
                    row[f"{key}_vs_{rk}"] = summary(spearman(sc, rv))
            row["exact_ef_vs_ggn"] = summary(spearman(ref["ef"], ref["ggn"]))
            ex_out[s] = row
            log(f"[part 2] {s} damping: pipeline check (dense G⊗A vs ours) "
                f"{row['pipeline_check_rel']:.1e}; Spearman median / worst: "
                + "; ".join(f"{k} {v['median']:.3f} / {v['worst']:.3f}" for k, v in row.items()
                            if isinstance(v, dict)))
        out["exact"] = ex_out
    return res


# -- part 3: run time ---------------------------------------------------------------------------

def ours_from_snapshot(model, snap_path: str, qb: dict, tb: list[dict]
                       ) -> tuple[torch.Tensor, dict]:
    t0 = time.perf_counter()
    snap = Snapshot.load(snap_path, show_progress=False)
    post = LaplacePosterior(model, snap)
    t1 = time.perf_counter()
    s = influence_scores(post, qb, tb, damping="heuristic", show_progress=False).scores
    t2 = time.perf_counter()
    return s, {"load_s": t1 - t0, "score_s": t2 - t1, "total_s": t2 - t0}


def kf_fit_and_score(kf: Kronfluence, qb: dict, exs: list[dict]) -> tuple[torch.Tensor, dict]:
    t0 = time.perf_counter()
    name, stages = kf.fit(exs, float64=False, empirical=False)
    t1 = time.perf_counter()
    s = kf.scores(name, qb, exs, None, float64=False)
    t2 = time.perf_counter()
    return s, {**stages, "fit_s": t1 - t0, "score_s": t2 - t1, "total_s": t2 - t0}


def timing(kind: str, model, run: dict, exs: list[dict], qb: dict, a, tmp: str) -> dict:
    tb = batches(exs)
    layers = list(Snapshot.load(run["snapshot"], show_progress=False).layer_names)
    kf = Kronfluence(model, layers, os.path.join(tmp, f"kf-time-{kind}"))
    kf_fit_and_score(kf, qb, exs[:BATCH])  # warm-up of both, untimed: one batch
    ours_from_snapshot(model, run["snapshot"], qb, tb[:1])
    reps = []
    for r in range(a.repeats):
        rec = {}
        for who in (["kf", "ours"] if r % 2 == 0 else ["ours", "kf"]):
            if who == "kf":
                rec["kf_scores"], rec["kronfluence"] = kf_fit_and_score(kf, qb, exs)
            else:
                rec["ours_scores"], rec["ours"] = ours_from_snapshot(model, run["snapshot"],
                                                                     qb, tb)
        rho = spearman(rec.pop("ours_scores"), rec.pop("kf_scores"))
        rec["spearman_ours_real_vs_kf_true_fisher"] = summary(rho)
        reps.append(rec)
        log(f"[part 3] {kind} repeat {r + 1}/{a.repeats}: kronfluence fit "
            f"{rec['kronfluence']['fit_s']:.2f} s (covariances "
            f"{rec['kronfluence']['cov_s']:.2f} s, eigendecomposition "
            f"{rec['kronfluence']['eig_s']:.2f} s) + score {rec['kronfluence']['score_s']:.2f} s;"
            f" ours load {rec['ours']['load_s']:.2f} s + score {rec['ours']['score_s']:.2f} s")
    med = lambda who, key: statistics.median(r[who][key] for r in reps)  # noqa: E731
    c = run["counts"]
    out = {"model": kind, "n_train": len(exs), "n_queries": len(qb["input_ids"]),
           "repeats": reps,
           "kronfluence": {k: med("kronfluence", k)
                           for k in ("cov_s", "eig_s", "fit_s", "score_s", "total_s")},
           "ours": {k: med("ours", k) for k in ("load_s", "score_s", "total_s")},
           "train_s": run["train_s"], "callback_train_s": run["callback_train_s"],
           "tracker_s": c["tracker_seconds"], "updates": c["updates"],
           "tracker_share": c["tracker_seconds"] / (run["callback_train_s"] or run["train_s"])}
    out["spearman_vs_kf"] = reps[0]["spearman_ours_real_vs_kf_true_fisher"]
    out["speedup_total"] = out["kronfluence"]["total_s"] / out["ours"]["total_s"]
    log(f"[part 3] {kind}: kronfluence fit+score {out['kronfluence']['total_s']:.2f} s vs ours "
        f"{out['ours']['total_s']:.2f} s (median of {a.repeats}; {out['speedup_total']:.1f}×); "
        f"tracker {out['tracker_s']:.2f} s of {out['callback_train_s']:.1f} s training "
        f"({100 * out['tracker_share']:.1f}%)")
    return out


# -- part 4: cost on the demo model -------------------------------------------------------------

def flops_per_example(cfg: dict, layers: dict[str, tuple[int, int]], rows: int) -> dict:
    """The flop model of the module docstring (per training example; ``layers``:
    ``{name: (d_out, d_A)}``, ``d_A`` with the bias column)."""
    seq, d, v, blocks = cfg["seq_len"], cfg["n_embd"], cfg["vocab_size"], cfg["n_layer"]
    lin = sum(o * (da - 1) for o, da in layers.values())  # d_in·d_out (bias adds are O(T·d))
    forward = 2 * seq * lin + 4 * seq * seq * d * blocks + 2 * seq * d * v
    grads = sum(2 * seq * o * da for o, da in layers.values())
    inner = sum(2 * rows * o * da for o, da in layers.values())
    once = sum(2 * rows * (o * o * da + o * da * da) * 2 for o, da in layers.values())
    return {"forward": forward, "backward_to_outputs": forward, "per_example_grads": grads,
            "inner_products": inner, "total": 2 * forward + grads + inner,
            "queries_once": once}


def proc_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def memory_child(spec: dict) -> dict:
    """One ``N`` of part 4 in this (fresh) process: see the module docstring."""
    torch.set_num_threads(spec["threads"])
    model = GPT2LMHeadModel.from_pretrained(spec["model"]).eval()
    snap = Snapshot.load(spec["snapshot"], show_progress=False)
    post = LaplacePosterior(model, snap)
    w = windows(spec["seq"], spec["seed"])
    qb = query_batch(w[spec["n_max"]:spec["n_max"] + spec["queries"]])
    n = spec["n"]

    def lazy(count):
        for i in range(0, count, BATCH):
            rows = w[i:min(i + BATCH, count)]
            yield {"input_ids": rows, "attention_mask": torch.ones_like(rows),
                   "labels": rows.clone()}

    influence_scores(post, qb, lazy(BATCH), show_progress=False)  # warm-up: one batch
    rss0 = proc_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    s = influence_scores(post, qb, lazy(n), show_progress=False)
    wall = time.perf_counter() - t0
    peak = proc_kb("VmHWM")
    return {"n": n, "score_s": wall, "s_per_example": wall / n, "rss_before_mb": rss0 / 1024,
            "peak_rss_mb": peak / 1024, "peak_increase_mb": (peak - rss0) / 1024,
            "scores_shape": list(s.scores.shape),
            "scores_bytes": s.scores.numel() * s.scores.element_size()}


def demo_parts(a, tmp: str, parts: set[int]) -> dict:
    cfg = demo_model_config()
    n_max = max(a.demo_n)
    w = windows(cfg["seq_len"], a.seed)
    train_ex = examples(w[:n_max])
    qb = query_batch(w[n_max:n_max + a.queries])
    model = tiny_gpt2(**cfg)
    log(f"[demo] GPT-2 from conf/model/tiny.yaml {cfg}: training {a.demo_steps} steps on "
        f"{n_max} windows with the callback at defaults")
    run = real_run(model, train_ex, a.demo_steps, 1e-3, os.path.join(tmp, "demo-real"), a.seed)
    log(f"[demo] trained in {run['train_s']:.1f} s, losses {run['losses']}; tracker "
        f"{run['counts']['tracker_seconds']:.2f} s on the training thread")
    out = {"config": cfg, "real_run": {k: v for k, v in run.items() if k != "snapshot"}}
    snap = Snapshot.load(run["snapshot"], show_progress=False)
    layers = {n: (snap[n].G.shape[0], snap[n].A.shape[0]) for n in snap.layer_names}
    out["layers"] = layers
    if 4 in parts:
        mdir = os.path.join(tmp, "demo-model")
        model.save_pretrained(mdir)
        def child(n: int, live: bool) -> dict:
            spec = {"model": mdir, "snapshot": run["snapshot"], "seq": cfg["seq_len"],
                    "seed": a.seed, "n_max": n_max, "queries": a.queries, "n": n,
                    "threads": a.threads}
            env = dict(os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
                                      if live else {}))
            res = subprocess.run([sys.executable, __file__, "--memory-child", json.dumps(spec)],
                                 capture_output=True, text=True, check=False, env=env)
            if res.returncode:
                raise SystemExit(f"memory child N={n} failed:\n{res.stderr[-3000:]}")
            x = json.loads(res.stdout.strip().splitlines()[-1])
            log(f"[part 4] {'live-set run' if live else 'timed run'} N={n}: {x['score_s']:.1f} "
                f"s, {1e3 * x['s_per_example']:.1f} ms / training example; peak RSS "
                f"+{x['peak_increase_mb']:.1f} MB over {x['rss_before_mb']:.0f} MB")
            return x

        runs: dict[int, list[dict]] = {n: [] for n in a.demo_n}
        for rep in range(a.cost_repeats):
            k = rep % len(a.demo_n)
            for n in a.demo_n[k:] + a.demo_n[:k]:  # rotated order per repeat
                runs[n].append(child(n, live=False))
        rows = []
        for n in a.demo_n:
            xs = runs[n]
            live = child(n, live=True)
            row = {"n": n, "score_s": statistics.median(x["score_s"] for x in xs),
                   "peak_increase_mb": max(x["peak_increase_mb"] for x in xs),
                   "live_peak_increase_mb": live["peak_increase_mb"],
                   "rss_before_mb": statistics.median(x["rss_before_mb"] for x in xs),
                   "scores_bytes": xs[0]["scores_bytes"], "runs": xs, "live_run": live}
            row["s_per_example"] = row["score_s"] / n
            rows.append(row)
            log(f"[part 4] N={n}: median {row['score_s']:.1f} s "
                f"({1e3 * row['s_per_example']:.1f} ms / training example); peak RSS "
                f"increase: live set {row['live_peak_increase_mb']:.1f} MB, default allocator "
                f"(largest) {row['peak_increase_mb']:.1f} MB (scores {row['scores_bytes']} "
                "bytes)")
        fl = flops_per_example(cfg, layers, a.queries)
        last = rows[-1]
        out["cost"] = {"rows": rows, "flops_per_example": fl,
                       "achieved_gflops": fl["total"] / last["s_per_example"] / 1e9}
        log(f"[part 4] flops per training example: forward {fl['forward']:.3g}, backward to "
            f"outputs ≈ {fl['backward_to_outputs']:.3g}, per-example gradients "
            f"{fl['per_example_grads']:.3g}, inner products {fl['inner_products']:.3g}: "
            f"total {fl['total']:.3g} ({out['cost']['achieved_gflops']:.2f} GFLOP/s achieved "
            f"at N={last['n']}); queries once {fl['queries_once']:.3g}")
    if 3 in parts:
        out["timing"] = timing("demo", model, run, train_ex[:a.demo_timing_n], qb, a, tmp)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="*", type=int, default=[1, 2, 3, 4], choices=[1, 2, 3, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--queries", type=int, default=10)
    p.add_argument("--tiny-n", type=int, default=128)
    p.add_argument("--tiny-seq", type=int, default=32)
    p.add_argument("--tiny-steps", type=int, default=300)
    p.add_argument("--demo-n", type=int, nargs="*", default=[250, 500, 1000])
    p.add_argument("--demo-steps", type=int, default=100)
    p.add_argument("--cost-repeats", type=int, default=3)
    p.add_argument("--demo-timing-n", type=int, default=250,
                   help="training sequences of the demo model's side-by-side timing")
    p.add_argument("--quick", action="store_true", help="smoke run: small sizes, writes nothing")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.memory_child:
        print(json.dumps(memory_child(json.loads(a.memory_child))), flush=True)
        return
    a.command = " ".join(["python benchmarks/influence_peers.py", *map(shlex.quote, sys.argv[1:])])
    if a.quick:
        a.repeats, a.tiny_n, a.tiny_seq, a.tiny_steps, a.cost_repeats = 1, 16, 16, 20, 1
        a.demo_n, a.demo_steps, a.queries, a.demo_timing_n = [16, 32], 10, 3, 16
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*loss_type=None.*")
    torch.set_flush_denormal(True)
    parts = set(a.parts)
    t0 = time.perf_counter()
    info = {**machine({"kronfluence": "kronfluence", "scipy": "scipy"}),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load_start": os.getloadavg()[0]}
    log(f"influence peers: parts {sorted(parts)}; {info['cpu']}, {info['cores']} cores, "
        f"{a.threads} threads, torch {info['torch']}, transformers {info['transformers']}, "
        f"kronfluence {dist_version('kronfluence')}; load {info['load_start']:.2f}")
    tmp = tempfile.mkdtemp(prefix="kfac-infl-peers-")
    try:
        r = tiny_parts(a, tmp, parts)
        model, run, train_ex, qb, _, _ = r.pop("_tiny_state")
        if 3 in parts:
            r["tiny"]["timing"] = timing("tiny", model, run, train_ex, qb, a, tmp)
        if parts & {3, 4}:
            r["demo"] = demo_parts(a, tmp, parts)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r["queries"] = a.queries
    info["load_end"] = os.getloadavg()[0]
    info["wall_s"] = time.perf_counter() - t0
    section = report(r, a, info)
    log("\n" + section)
    if a.quick or parts != {1, 2, 3, 4}:
        log("--quick or a subset of the parts: nothing written")
        return
    write_json("influence_peers", {"machine": info, "command": a.command, "args": vars(a),
                                   "results": r})
    write_section(BEGIN, END, section)
    log(f"wrote {HERE / 'RESULTS.md'} and {HERE / 'results' / 'influence_peers.json'}")


if __name__ == "__main__":
    main()
