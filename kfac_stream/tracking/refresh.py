"""Factors at the final weights: the end-of-training refresh (``KFACConfig.final_refresh``).

A posterior is a Gaussian around the weights the user keeps; its curvature should be theirs.
A run whose final window holds most of the run (a short fine-tune: ``min_window_sequences``
pushes the window back, up to step 0) averages factors over weights far from the final ones.
Where the run plan says so (`kfac_stream.tracking.plan.plan_refresh`), the end of training,
before the final snapshot, runs a pass over the training data at the final weights and
REPLACES the factors by the plain token-weighted mean of its statistics (the first update
restarts the average, ``λ = 0``, the later ones add to it, ``λ = 1``: the final window's
arithmetic, `FactorUpdater.decay_at`).

The pass: the model in eval mode (`posterior_mode`), the run's Fisher (the empirical one: the
model's own loss on the batch's labels, its gradient to the tracked layers' outputs only; a
sampled-label Fisher: `REFRESH_MC_DRAWS` MC replays of every sequence of each batch,
`mc_sequences="all"`),
every usable position a row (`REFRESH_TOKEN_FRACTION`: the refresh has few sequences, a tenth
of the run's at most, where the final window it replaces had the whole run's; a row's fold
is small beside its sequence's forward and backward), every batch one factor update (with
several ranks the usual exchange, in lockstep: each rank its own shard of the data). No
optimizer step and no weight gradient (``torch.autograd.grad`` to the layer outputs: every
parameter's ``.grad`` stays as it was), the Trainer's dataloader state untouched (its
underlying loader is iterated afresh), and every global generator as it was afterwards
(`own_draws`: the pass draws from a seed of the tracker's own, restored on exit), so the
training run is bit-identical with and without it. ``tokens_seen`` does not count it.

Budget: at most one epoch of this rank's batches and at most `REFRESH_SHARE` of the training's
FLOPs: the sequences this rank trained on (``max_steps × gradient_accumulation × batch``)
times `REFRESH_SHARE` over `sequence_cost_ratio` (the last batch cut to fit), whichever
comes first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..capture.posterior_mode import posterior_mode
from ..fisher import estimator_for
from ..fisher.replay_draws import replay_seed
from ..utils.own_rng import own_draws
from .collect import collect_update

logger = logging.getLogger("kfac_stream")

#: The share of each refreshed sequence's usable positions that are rows: all of them.
REFRESH_TOKEN_FRACTION = 1.0
#: Labels drawn per position by a sampled-label (MC) refresh, each draw a replay of the batch
#: (the budget counts each, `sequence_cost_ratio`). The refresh cannot see more than an epoch,
#: so only more draws lower its G's sampling error (0.4-0.9 relative on a 15-epoch seq2seq
#: fine-tune's training data with one); two were measured on the suite
#: (`benchmarks/suite_default.py`, its `two_draw_refresh` parts) and judged by the worst task
#: no better than one (ft-seq2seq 1.057 against 1.055 × laplace-torch's NLL; license-fit 0.83
#: against 0.76) at twice the cost: one.
REFRESH_MC_DRAWS = 1
#: A seed offset of the refresh's draws (the replays' seeds are ``replay_seed`` of a step).
_SEED_OFFSET = 104_729


@dataclass(frozen=True)
class RefreshResult:
    """What a refresh did.

    Attributes:
        sequences: Training sequences it ran on, over all ranks.
        seconds: Its wall time (the slowest rank's).
        batches: Batches (factor updates) it ran, the same on every rank.
    """

    sequences: int
    seconds: float
    batches: int

    def manifest_entry(self) -> dict[str, Any]:
        """The final snapshot's ``final_refresh`` entry."""
        return {"sequences": int(self.sequences), "seconds": float(self.seconds)}


def sequence_cost_ratio(model: nn.Module, dims: dict[str, tuple[int, bool]],
                        draws: int = 1) -> float:
    """A refreshed sequence's FLOPs over a training sequence's, per token: ``(4P + F) / (4P +
    2P_t)``. ``P`` the model's parameters, ``P_t`` its trainable ones: training takes a
    forward (``2P``), the activations' backward (``2P``) and the trainable weights' gradients
    (``2P_t``); the refresh a forward and the activations' backward to the tracked outputs
    (``4P`` at most) and the fold of each position's rows, ``F = Σ 2d²`` over the dense
    factors (``dims``: ``{key: (side, diagonal)}``), ``Σ 2d`` over the diagonal ones, times
    `REFRESH_TOKEN_FRACTION`; all of it ``draws`` times (`REFRESH_MC_DRAWS` for an MC
    refresh, `refresh_draws`)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fold = sum(2 * d * (1 if diagonal else d) for d, diagonal in dims.values())
    return draws * (4 * total + REFRESH_TOKEN_FRACTION * fold) / max(4 * total + 2 * trainable, 1)


def refresh_draws(tracker) -> int:
    """Replays per refreshed batch: `REFRESH_MC_DRAWS` for a sampled-label Fisher, else 1."""
    return REFRESH_MC_DRAWS if tracker.fisher.sampled_labels else 1


def refresh_budget(run, cost_ratio: float = 1.0) -> int:
    """The most sequences this rank's refresh runs: `REFRESH_SHARE` (``run.refresh``) of the
    sequences it trained on (``max_steps × accumulation × batch`` of ``run.shape``) over
    ``cost_ratio`` (`sequence_cost_ratio`), rounded down: that share of the training's FLOPs;
    0 when the run's length is unknown (then one epoch alone bounds it)."""
    shape = run.shape
    trained = shape.max_steps * max(shape.accumulation, 1) * shape.batch
    return int(math.floor(run.refresh.budget_share * trained / cost_ratio + 1e-9))


def batch_rows(batch: dict[str, Any]) -> int:
    """``B`` of a batch: the first dimension of its ``input_ids`` (else of its first tensor
    of at least one dimension); 0 when it has none."""
    x = batch.get("input_ids")
    if not isinstance(x, Tensor) or x.dim() == 0:
        x = next((v for v in batch.values() if isinstance(v, Tensor) and v.dim() > 0), None)
    return int(x.shape[0]) if x is not None else 0


def _prepared(batch: dict[str, Any], device: torch.device, keep: int) -> dict[str, Any]:
    """``batch`` on ``device`` (tensors moved, other values as they are), cut to its first
    ``keep`` sequences (every tensor whose first dimension is the batch's ``B``)."""
    rows = batch_rows(batch)
    out = {}
    for k, v in batch.items():
        if isinstance(v, Tensor):
            if keep < rows and v.dim() > 0 and v.shape[0] == rows:
                v = v[:keep]
            v = v.to(device)
        out[k] = v
    return out


@contextlib.contextmanager
def _plain_mean(tracker, step: int) -> Iterator[None]:
    """Within the block, the updates submitted for ``step`` make the factors their plain
    token-weighted mean (the first restarts the average); afterwards, every update folded, the
    final window's state (its restart step, ``counts.window_start_step``) and the training's
    update counts (``counts.updates``, ``positions_sampled``) are as before: the manifest's
    ``final_refresh`` says what the refresh did."""
    updater, counters = tracker.updater, tracker.counters
    tracker.flush()  # the worker is idle: nothing reads the window's state meanwhile
    saved = (updater.restart_step, counters.window_start_step, tracker.step, counters.updates,
             counters.positions_sampled)
    updater.restart_step, counters.window_start_step, tracker.step = step, -1, step
    try:
        yield
    finally:
        try:
            tracker.flush()
        finally:
            (updater.restart_step, counters.window_start_step, tracker.step, counters.updates,
             counters.positions_sampled) = saved


@contextlib.contextmanager
def _token_fraction(capture, fraction: float) -> Iterator[None]:
    """The capture takes ``fraction`` of each pass's usable positions within the block."""
    saved, capture.token_fraction = capture.token_fraction, fraction
    try:
        yield
    finally:
        capture.token_fraction = saved


def _all_have(tracker, have: bool) -> bool:
    """Whether every rank has a batch for the next update (``have`` on one process)."""
    if tracker.world_size == 1:
        return have
    return all(tracker.dist.snapshot_comm.all_gather(bool(have)))


def _passes(tracker, model: nn.Module, batch: dict[str, Any], replays) -> list:
    """The pass records of one batch at the final weights (the model in eval mode)."""
    fisher, capture, ctx = tracker.fisher, tracker.capture, tracker.fisher_context()
    if replays is not None:  # sampled labels: MC replays of every sequence of the batch
        return [rec for _ in range(REFRESH_MC_DRAWS)
                for rec in replays.passes(ctx, model, [], [batch])]
    mode = dataclasses.replace(fisher.capture_mode(ctx, True), count_tokens=False, replay=True,
                               keep_outputs=True, on_forward_end=None, record_inputs=False)
    capture.take()  # nothing of the training's steps is left in it
    with capture.using(mode), torch.enable_grad():
        output = model(**batch)
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        records = list(capture.passes)
        outputs = [o for rec in records for o in rec.outputs]
        try:
            if loss is None:
                raise _NoLoss()
            if outputs:  # the gradient to the layer outputs: no weight gradient at all
                torch.autograd.grad(loss, outputs, allow_unused=True)
        finally:
            for rec in records:  # outputs -> hooks -> rec -> outputs: a GC-invisible cycle
                rec.outputs = []
    return fisher.passes(ctx, model, capture.take()[0], [])


class _NoLoss(Exception):
    """The model returned no loss for a training batch (the empirical Fisher needs one)."""


def refresh_factors(tracker, model: nn.Module, batches: Iterable[dict[str, Any]], step: int,
                    budget: int) -> RefreshResult:
    """Replace ``tracker``'s factors by their plain mean over a pass at ``model``'s weights
    over ``batches`` (this rank's training batches: at most one pass over them and at most
    ``budget`` sequences, 0: no limit but the epoch), folded as the updates of ``step``
    (module docstring). With several ranks every rank calls it and the ranks run the same
    number of updates (while every rank has a batch). Returns what it did; a run whose model
    returns no loss under the empirical Fisher is left as it was (a warning)."""
    started = time.perf_counter()
    device, cfg = tracker.device, tracker.config
    replays = None
    if tracker.fisher.sampled_labels:
        replays = estimator_for(dataclasses.replace(cfg, mc_sequences="all"))()
    used = count = 0
    source = iter(batches)
    seed = replay_seed(cfg.seed + _SEED_OFFSET, tracker.rank, step)
    with own_draws(seed, [device]), _plain_mean(tracker, step), posterior_mode(model), \
            _token_fraction(tracker.capture, REFRESH_TOKEN_FRACTION):
        while True:
            batch = None
            if budget <= 0 or used < budget:
                batch = next(source, None)
            rows = batch_rows(batch) if batch is not None else 0
            if not _all_have(tracker, rows > 0):
                break
            keep = rows if budget <= 0 else min(rows, budget - used)
            try:
                passes = _passes(tracker, model, _prepared(batch, device, keep), replays)
            except _NoLoss:
                if count == 0:  # every rank's batches lack labels alike: nothing submitted
                    logger.warning("kfac_stream: final-weight refresh skipped: the model "
                                   "returned no loss for a training batch (the empirical "
                                   "Fisher needs the batch's labels); the factors are the "
                                   "run's")
                    return RefreshResult(0, time.perf_counter() - started, 0)
                raise RuntimeError("kfac_stream: the final-weight refresh needs the model's "
                                   "loss on every training batch (labels in the batch); set "
                                   "KFACConfig(final_refresh='off')") from None
            tracker.dissolve_groups(tracker.capture.dissolved)
            job = collect_update(tracker, passes)
            if job is not None:
                tracker.updater.submit(job, 0.0)
            used, count = used + keep, count + 1
    seconds = time.perf_counter() - started
    if tracker.world_size > 1:
        parts = tracker.dist.snapshot_comm.all_gather((used, seconds))
        used, seconds = sum(p[0] for p in parts), max(p[1] for p in parts)
    return RefreshResult(int(used), float(seconds), count)
