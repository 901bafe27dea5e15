"""`RunPlan`: what a tracking run is, decided once at train begin, in one place.

`RunPlan.resolve` turns the user's `KFACConfig`, the model and what the run is (`RunShape`:
micro-batch size, gradient accumulation, ranks, optimizer steps) into an immutable plan: every
``"auto"`` resolved, the curvature (Fisher type, factor form), the MC share (raised on a run too
short for its final window), the final window, the fold's place, the device budget, where
snapshots eigendecompose. The tracker, the factor updater and the store take only these values;
nothing downstream derives any of them again (`tests/unit/tracking/test_plan.py` greps for it). The
plan is logged at train begin (`RunPlan.describe`) and written whole into every snapshot's manifest
(``"run_plan"``, `RunPlan.to_dict`).

==========================  ===============================================================
setting                     resolved to
==========================  ===============================================================
``fold_on``                 ``"device"`` on CUDA, ``"host"`` on CPU
``async_updates``           on when the model is on CUDA (the CPU is idle during a step),
                            off on CPU training (a second thread competes for its cores)
``eigh_device``             the model's device for ``"auto"``, None (CPU float64) for
                            ``"cpu"``
``device_memory_budget``    bytes, or None for ``"auto"`` on CUDA: decided by
                            `device_budget_from_memory` at the first update, after the first
                            optimizer step has allocated its state (the one setting that
                            needs the run's own memory use; `store.residency`)
``mc_sequences``            the configured share, raised on a run too short for its final
                            window (`window_mc_share`)
``factor_form``             ``"reduce"`` for a sequence-level loss, else ``"expand"``
                            (`Curvature.of`)
``final_window``            the restart step and what the window holds (`plan_window`)
``fold_defer``              `FOLD_DEFER` updates per fold of a factor group's held rows on
                            the device path (fewer while they would leave the budget), 1 on
                            the host path
``final_refresh``           whether train end refreshes the factors at the final weights
                            (`plan_refresh`): ``"auto"`` when the final window starts in
                            the first half of the run
``exchange``                as configured: ``"auto"`` is chosen per factor and update by the
                            bytes each way moves (`distributed.exchange`), not here
``prior_precision``         `HeldoutConfig`'s (``KFACConfig.eval_prior_precision`` in its
                            old place): whether train end fits ``τ`` and the link on the
                            eval set (`plan_heldout`): ``"auto"`` whenever the front end
                            hands one that is not empty (`EvalBatches`) to a run in one
                            process
==========================  ===============================================================
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import torch
from torch import nn

from ..config import KFACConfig, mc_full_batch
from ..exceptions import KFACConfigError
from ..fisher.base import registered_fisher
from ..fisher.curvature import Curvature
from ..fisher.replay_draws import replay_counts
from .heldout_config import HeldoutConfig

#: Device path: updates whose rows a factor group holds before one fold into its pending sums
#: (one read-modify-write of its ``G·d²`` pending entries per fold instead of per update). At
#: ~1.1B parameters the pending sums are ~2.5·10⁹ float32 entries, 20 GB read and written per
#: fold (~4 ms at an H200's 4.8 TB/s), while an update's held rows are a few hundred MB.
FOLD_DEFER = 4


@dataclass(frozen=True)
class RunShape:
    """What the run is, from the Trainer's arguments (0: unknown).

    Attributes:
        batch: Sequences per micro-batch on one rank.
        accumulation: Micro-batches per optimizer step.
        world: Ranks.
        max_steps: Optimizer steps of the run.
    """

    batch: int = 0
    accumulation: int = 1
    world: int = 1
    max_steps: int = 0

    @classmethod
    def of_trainer(cls, args, state, world: int = 1) -> RunShape:
        """From ``TrainingArguments`` and ``TrainerState`` (``max_steps``)."""
        return cls(int(getattr(args, "per_device_train_batch_size", 0) or 0),
                   int(getattr(args, "gradient_accumulation_steps", 1) or 1),
                   max(int(world), 1), int(getattr(state, "max_steps", 0) or 0))


@dataclass(frozen=True)
class WindowPlan:
    """What the final window of a run will hold (`plan_window`).

    Attributes:
        restart_step: The window's first update step.
        updates: Update steps in the window (skipped or empty updates not foreseen).
        sequences: Sequences its updates' statistics come from, each update step's own (an MC
            share's draw of that step) for full micro-batches (0: unknown).
        sequences_per_update: Per update (0: unknown; an MC share's expectation, rounded).
    """

    restart_step: int
    updates: int
    sequences: int
    sequences_per_update: int


#: The refresh's compute at most, as a share of the training's (FLOPs: its sequences are
#: capped at this share of the run's, scaled by a training sequence's cost over a refreshed
#: one's, `kfac_stream.tracking.refresh.sequence_cost_ratio`; one epoch at most).
REFRESH_SHARE = 0.1


@dataclass(frozen=True)
class RefreshPlan:
    """Whether the end of training refreshes the factors at the final weights (`plan_refresh`,
    `kfac_stream.tracking.refresh`).

    Attributes:
        on: Refresh before the final snapshot.
        reason: Why, in words (the train-begin line).
        budget_share: The most compute it may take, as a share of the training's
            (`REFRESH_SHARE`).
    """

    on: bool
    reason: str
    budget_share: float = REFRESH_SHARE


class EvalBatches(Protocol):
    """The eval set a front end hands the session for the held-out fit
    (`kfac_stream.tracking.heldout_fit`; the HF callback's: the Trainer's,
    `kfac_stream.integrations.eval_set`).

    Attributes:
        dataset: The eval set as given, read when asked (at train begin and at train end): a
            dataset, a dict of named ones, or None (none).
    """

    @property
    def dataset(self) -> Any:
        """The eval set as given (None: none)."""

    def batches(self) -> Iterable[Mapping[str, Any]]:
        """One pass over the eval set: collated batches ``{name: tensor [B, ...] or other}``
        (on any device)."""


@dataclass(frozen=True)
class HeldoutPlan:
    """Whether the end of training fits ``τ`` and the link on the eval set
    (``HeldoutConfig.prior_precision``, `plan_heldout`; its train-begin lines:
    `kfac_stream.tracking.heldout_fit.heldout_lines`).

    Attributes:
        on: Fit after the final snapshot.
        why: Why not, when off: ``"off"`` (``prior_precision=False``), ``"ranks"``
            (several processes), ``"no front end"`` (none handed an eval set: not said),
            ``"no eval set"`` (its dataset is None), ``"empty"`` (0 examples); ``"on"``.
        asked: ``prior_precision=True`` (not ``"auto"``): a missing eval set is a
            warning.
        world: Ranks.
    """

    on: bool
    why: str
    asked: bool = False
    world: int = 1


@dataclass(frozen=True)
class RunPlan:
    """One run's resolved settings (the module table). Build it with `resolve`.

    Attributes:
        requested: The user's configuration, as given.
        config: The configuration with ``async_updates`` and ``mc_sequences`` resolved (as
            snapshot manifests record it).
        curvature: The Fisher type and the factor form (``"auto"`` resolved on the model).
        shape: The run's micro-batches, ranks and steps.
        fold_on: ``"device"`` or ``"host"``.
        eigh_device: Where snapshots eigendecompose (None: the CPU in float64).
        device_budget: Bytes of device memory for the resident pending statistics; None:
            decided from the device's memory at the first update (`device_budget_from_memory`).
        fold_defer: Device path: updates whose rows a group of factors holds before one fold
            into its pending sums (`kfac_stream.store.device_groups`; fewer while they would
            leave the device budget); 1 on the host path.
        mc_share_raised: The configured MC share when this run raised it, else None.
        sequences_per_update: Sequences one factor update's statistics come from, over all
            ranks (0: unknown; an MC share's expectation, rounded).
        window: The final window (None: the EMA throughout).
        refresh: Whether train end refreshes the factors at the final weights.
        heldout: Whether train end fits ``τ`` and the link on the eval set.
        heldout_config: The held-out fit's and the queries' options (`HeldoutConfig`; the
            manifests record them in ``config``, `manifest_config`).
    """

    requested: KFACConfig
    config: KFACConfig
    curvature: Curvature
    shape: RunShape
    fold_on: str
    eigh_device: torch.device | None
    device_budget: int | None
    fold_defer: int
    mc_share_raised: float | None
    sequences_per_update: int
    window: WindowPlan | None
    refresh: RefreshPlan = RefreshPlan(False, "not planned")
    heldout: HeldoutPlan = HeldoutPlan(False, "no front end")
    heldout_config: HeldoutConfig = HeldoutConfig()

    @classmethod
    def resolve(cls, config: KFACConfig, model: nn.Module | None = None, *,
                device: torch.device | None = None, shape: RunShape | None = None,
                eval_set: EvalBatches | None = None,
                heldout: HeldoutConfig | None = None) -> RunPlan:
        """Resolve every ``"auto"`` and derived setting of ``config`` for ``model`` on
        ``device`` (default: the model's; the CPU without a model) in a run of ``shape``
        (default: unknown, the MC share kept as configured and no final window planned) with
        the held-out fit on ``eval_set`` (None: none handed, no fit) as ``heldout`` asks
        (None: as ``config`` asks in the options' old place, else the defaults:
        `HeldoutConfig.of_run`). A ``config.fisher`` no estimator is registered under is
        refused (`KFACConfigError` naming the registered ones)."""
        registered_fisher(config.fisher)
        heldout = HeldoutConfig.of_run(config, heldout)
        shape = shape or RunShape()
        if device is None:
            p = next(model.parameters(), None) if model is not None else None
            device = p.device if p is not None else torch.device("cpu")
        on_gpu = device.type == "cuda"
        resolved, raised = config, None
        run = (shape.batch, shape.accumulation, shape.world)
        share = window_mc_share(config, *run, shape.max_steps)
        if share is not None:
            raised, resolved = config.mc_sequences, replace(config, mc_sequences=share)
        resolved = replace(resolved, async_updates=on_gpu if config.async_updates is None
                           else config.async_updates)
        fold_on = config.fold_on if config.fold_on != "auto" else ("device" if on_gpu else "host")
        budget = config.device_memory_budget
        if fold_on != "device":
            budget = 0
        elif budget == "auto":
            budget = None if on_gpu else _host_standin_budget()
        per_update = sequences_per_update(resolved, *run)
        window = plan_window(resolved, shape.max_steps, per_update,
                             update_sequences(resolved, *run))
        return cls(requested=config, config=resolved,
                   curvature=Curvature.of(resolved, model), shape=shape, fold_on=fold_on,
                   eigh_device=device if config.eigh_device == "auto" else None,
                   device_budget=budget, mc_share_raised=raised,
                   fold_defer=FOLD_DEFER if fold_on == "device" else 1,
                   sequences_per_update=per_update, window=window,
                   refresh=plan_refresh(resolved, window, shape.max_steps,
                                        _sharding_engine(model)),
                   heldout=plan_heldout(heldout, shape.world, eval_set),
                   heldout_config=heldout)

    @property
    def async_updates(self) -> bool:
        """Factor updates on the worker thread."""
        return bool(self.config.async_updates)

    def sequences_at(self, step: int) -> int:
        """The sequences the factor update of optimizer step ``step`` takes its statistics
        from, over all ranks (`update_sequences`)."""
        shape = self.shape
        return update_sequences(self.config, shape.batch, shape.accumulation, shape.world)(step)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON, as written into every snapshot's manifest (``"run_plan"``,
        `kfac_stream.snapshot.manifest_types.RunPlanEntry`; the resolved config is the
        manifest's ``config``)."""
        out = {"fisher": self.curvature.fisher, "form": self.curvature.form,
               **asdict(self.shape), "fold_on": self.fold_on,
               "eigh_device": None if self.eigh_device is None else str(self.eigh_device),
               "device_budget": self.device_budget, "fold_defer": self.fold_defer,
               "async_updates": self.async_updates,
               "mc_share_raised": self.mc_share_raised,
               "sequences_per_update": self.sequences_per_update}
        if self.window is not None:
            out["window"] = asdict(self.window)
        out["final_refresh"] = {"on": self.refresh.on, "reason": self.refresh.reason}
        return out

    def manifest_config(self) -> dict[str, Any]:
        """The resolved config as every snapshot's manifest (``config``) and tracker state
        record it: `KFACConfig.to_dict` and the held-out options under their old names."""
        return {**self.config.to_dict(), **self.heldout_config.manifest_entries()}

    def describe(self) -> str:
        """The plan's part of the train-begin line."""
        budget = ("decided at the first update" if self.device_budget is None
                  else f"{self.device_budget / 2**30:.3g} GiB")
        fold = f"fold on {self.fold_on}" + (
            f" (device budget {budget}, rows of up to {self.fold_defer} updates per fold)"
            if self.fold_on == "device" else "")
        eigh = "eigh on " + ("the CPU (float64)" if self.eigh_device is None
                             else str(self.eigh_device))
        refresh = f"final-weight refresh: {'on' if self.refresh.on else 'off'} " \
                  f"({self.refresh.reason})"
        return (f"{'async' if self.async_updates else 'inline'} updates, {fold}, {eigh}, "
                f"{self.sequences_per_update} sequences per update, {refresh}")


def _sharding_engine(model: nn.Module | None) -> str | None:
    """The name of the engine that shards ``model``'s parameters (ZeRO-3, FSDP2), else None."""
    if model is None:
        return None
    from ..distributed.engines import engine_for  # the engines import the capture package

    engine = engine_for(model)
    return engine.name if engine.is_sharded(model) else None


def plan_refresh(config: KFACConfig, window: WindowPlan | None, max_steps: int,
                 sharded_by: str | None = None) -> RefreshPlan:
    """Whether train end refreshes the factors at the final weights (``final_refresh``).

    ``"on"`` always, ``"off"`` never. ``"auto"`` (the rule, fixed before any measurement):
    on when the planned final window (`plan_window`) starts in the first half of the run
    (``restart_step < max_steps / 2``: its mean holds over half the run's updates, so it
    averages weights far from the final ones; typically a short fine-tune whose window
    ``min_window_sequences`` pushed back, up to step 0), off otherwise, and off without a
    window (``final_window=0``, ``ema_decay=1``, or ``max_steps`` unknown). Off under an
    engine that shards the parameters (``sharded_by``: DeepSpeed ZeRO-3, FSDP2), where the
    refresh is not supported, and with ``ekfac`` (its correction is streamed on the previous
    snapshot's basis); ``"on"`` there raises.

    Raises:
        KFACConfigError: ``"on"`` under a sharding engine (``ekfac``: the config refuses it).
    """
    mode = config.final_refresh
    if sharded_by is not None:
        if mode == "on":
            raise KFACConfigError(
                f"KFACConfig.final_refresh='on' is not supported under {sharded_by} (the "
                "parameters are sharded across ranks): use 'auto' or 'off'")
        return RefreshPlan(False, f"not supported under {sharded_by}")
    if mode == "off":
        return RefreshPlan(False, "final_refresh='off'")
    if mode == "on":
        return RefreshPlan(True, "final_refresh='on'")
    if config.ekfac:
        return RefreshPlan(False, "the EK-FAC correction streams on the previous basis")
    if window is None or max_steps <= 0:
        return RefreshPlan(False, "no final window: the EMA throughout")
    share = 100 * (max_steps - window.restart_step) / max_steps
    if window.restart_step < max_steps / 2:
        return RefreshPlan(True, f"the final window spans {share:.0f}% of the run: factors "
                                 "averaged over weights far from the final ones")
    return RefreshPlan(False, f"the final window spans the last {share:.0f}% of the run")


def plan_heldout(heldout: HeldoutConfig, world: int, eval_set: EvalBatches | None
                 ) -> HeldoutPlan:
    """Whether train end fits ``τ`` and the link on ``eval_set`` (``heldout.prior_precision``):
    never for ``False``; not with several ranks (the fit runs in one process), nor without an
    eval set handed (None), nor when its dataset is None or empty (`_empty`); else on, for
    ``True`` and for ``"auto"`` alike (which differ only in how loudly an eval set's absence
    is said)."""
    mode = heldout.prior_precision
    if mode is False:
        return HeldoutPlan(False, "off")
    auto = heldout.prior_precision == "auto"  # True: asked for, said louder
    asked = not auto
    world = max(int(world), 1)
    if world > 1:
        return HeldoutPlan(False, "ranks", asked, world)
    if eval_set is None:
        return HeldoutPlan(False, "no front end", asked)
    dataset = eval_set.dataset
    if dataset is None:
        return HeldoutPlan(False, "no eval set", asked)
    if _empty(dataset):
        return HeldoutPlan(False, "empty", asked)
    return HeldoutPlan(True, "on", asked)


def _empty(dataset) -> bool:
    """The eval set has no example: a sized dataset of length 0, or a dict of them (several
    named eval sets) all empty; one without a length (an iterable dataset) is not judged."""
    if isinstance(dataset, dict):
        return bool(dataset) and all(_empty(d) for d in dataset.values())
    try:
        return len(dataset) == 0
    except TypeError:
        return False


def _host_standin_budget() -> int:
    """``"auto"`` when the "device" is the CPU itself (``fold_on="device"`` forced on CPU, the
    tests' stand-in): a quarter of physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4)
    except (ValueError, OSError, AttributeError):  # pragma: no cover (non-POSIX)
        return 4 * 2**30


# -- the MC share and the sequences of an update ---------------------------------------------------


def mc_sequences_of(spec: int | float | str, batch: int) -> int:
    """The most sequences of one micro-batch of ``batch`` that the MC pass runs on (``1 ≤ b ≤
    B`` for ``batch ≥ 1``): all of them for ``"all"``, ``min(k, B)`` for an int, and for a
    share ``f`` the most systematic sampling can draw from it, ``ceil(f·B)`` (it draws
    ``f·B`` on average; a micro-batch may also get none)."""
    if mc_full_batch(spec):
        return batch
    if isinstance(spec, float):
        return max(1, min(batch, math.ceil(round(spec * batch, 9))))
    return min(int(spec), batch)


def sequences_per_update(config: KFACConfig, batch: int, accumulation: int, world: int
                         ) -> int:
    """Sequences one factor update's statistics come from, over ``accumulation``
    micro-batches of ``batch`` sequences and ``world`` ranks: all of them with the empirical
    Fisher or ``mc_sequences="all"``, ``min(k, batch)`` per micro-batch for an int ``k``, and
    for a share ``f`` the expected ``f·batch·accumulation·world`` rounded (at least 1 when
    ``batch ≥ 1``; the final window counts each step's own draw, `update_sequences`)."""
    spec = config.mc_sequences
    acc, world = max(int(accumulation), 1), max(int(world), 1)
    replayed = Curvature.of(config).sampled_labels  # the MC replay's share, else every one
    if not replayed or mc_full_batch(spec) or isinstance(spec, int):
        per = mc_sequences_of(spec, batch) if replayed else batch
        return max(int(per), 0) * acc * world
    if batch <= 0:
        return 0
    return max(1, round(float(spec) * batch * acc * world))


def update_sequences(config: KFACConfig, batch: int, accumulation: int, world: int
                     ) -> Callable[[int], int]:
    """``sequences_at(step)``: the sequences the factor update of optimizer step ``step`` takes
    its statistics from, over all ranks, for ``accumulation`` full micro-batches of ``batch``
    sequences on each of ``world`` ranks. `sequences_per_update` for
    every step, except for a share ``f`` of the MC replay: that step's own draw
    (`replay_counts`, seeded by ``(seed, step)`` and the same on every rank),
    ``⌊u + f·batch·accumulation⌋`` on each rank, which the final window is planned on
    (`plan_window`): the expectation, rounded, would count ``round(4.27) = 4`` sequences for
    steps that draw 4 or 5 (``f·8`` with ``f = 256/480``), and 1 for steps that draw 0 or 1
    (``0.05·8``)."""
    spec = config.mc_sequences
    per = sequences_per_update(config, batch, accumulation, world)
    if (not Curvature.of(config).sampled_labels or not isinstance(spec, float)
            or mc_full_batch(spec) or batch <= 0):
        return lambda step: per
    return functools.partial(_share_draws, float(spec), [int(batch)] * max(int(accumulation), 1),
                             int(config.seed), max(int(world), 1))


def _share_draws(share: float, batches: list[int], seed: int, world: int, step: int) -> int:
    counts, _ = replay_counts(share, batches, seed, step, at_least_one=step == 0)
    return world * sum(counts)


def window_mc_share(config: KFACConfig, batch: int, accumulation: int, world: int,
                    max_steps: int) -> float | None:
    """The MC share a short run needs for its final window to reach
    ``min_window_sequences``, or None when ``config.mc_sequences`` already gets there.

    Only for ``fisher="mc"`` with a share ``f`` in ``(0, 1)``, a final window (``final_window >
    0`` and ``ema_decay < 1``) and ``min_window_sequences > 0``: the run's
    ``U = ⌊(max_steps − 1)/update_every⌋ + 1`` update steps offer
    ``C = U·batch·accumulation·world`` sequences. Extending the window (`plan_window`) costs
    nothing and comes first: None when the update steps' own draws at ``f``
    (`update_sequences`, full micro-batches) hold at least ``min_window_sequences`` over the
    whole run. Otherwise the share is raised to ``k/(batch·accumulation)`` with ``k =
    ⌈min_window_sequences/(U·world)⌉``: every update step then replays exactly ``k``
    sequences on each rank (a systematic draw of a whole number ``f·batch·accumulation``
    never rounds), so the window holds at least ``min_window_sequences`` whenever ``C`` does,
    at most one sequence per rank and update step more than the minimum needs (the share
    ``min_window_sequences/C`` reaches it only on average: 4 or 5 of 8 sequences a step, 240
    to 300 over 60 steps for 256). ``1`` (every sequence of an update step,
    ``mc_sequences="all"``) when ``C`` is at most the minimum. This trades replay cost for
    samples only on runs too short to reach the minimum otherwise; a long run keeps ``f`` and
    its cost.
    """
    spec, need = config.mc_sequences, int(config.min_window_sequences)
    if (not Curvature.of(config).sampled_labels or not isinstance(spec, float)
            or mc_full_batch(spec)
            or config.final_window <= 0 or config.ema_decay == 1.0  # no window: see
            or need <= 0 or max_steps <= 0 or batch <= 0):  # plan_window
        return None
    every, per_rank = int(config.update_every), int(batch) * max(int(accumulation), 1)
    world = max(int(world), 1)
    updates = (int(max_steps) - 1) // every + 1
    sequences_at, held = update_sequences(config, batch, accumulation, world), 0
    for step in range(0, updates * every, every):
        held += sequences_at(step)
        if held >= need:
            return None
    k = -(-need // (updates * world))
    if k >= per_rank:
        return 1.0
    share = k / per_rank
    while share * per_rank < k:  # k/C·C may round below k: the draw would then miss one
        share = math.nextafter(share, 1.0)
    return share


def plan_window(config: KFACConfig, max_steps: int, sequences_per_update: int = 0,
                sequences_at: Callable[[int], int] | None = None) -> WindowPlan | None:
    """The final window of a run of ``max_steps`` optimizer steps (``final_window``): the
    restart step is the first update step (a multiple of ``update_every``) at or after
    ``ceil((1 − final_window)·max_steps)``, or the last update step when none is (a short
    run), moved back by whole updates until the window's updates hold at least
    ``min_window_sequences`` sequences, ``sequences_at(step)`` for the update of ``step``
    (`update_sequences`: an MC share's own draw of that step), else ``sequences_per_update``
    each (0: unknown, no move), at most to step 0; None (the EMA throughout) when
    ``final_window`` is 0, ``max_steps`` unknown (``≤ 0``) or ``ema_decay`` is 1 (the exact
    running mean over every update, which a restart would cut short)."""
    fw, every = config.final_window, config.update_every
    if not (fw > 0 and max_steps > 0 and config.ema_decay < 1.0):
        return None
    start = math.ceil((1.0 - fw) * max_steps - 1e-9)
    restart = -(-start // every) * every
    if restart >= max_steps:
        restart = ((max_steps - 1) // every) * every
    last = ((max_steps - 1) // every) * every  # the run's last update step
    need = config.min_window_sequences
    held = 0
    if sequences_per_update > 0:
        count = sequences_at or (lambda step: sequences_per_update)
        held = sum(count(s) for s in range(restart, last + 1, every))
        while need > 0 and held < need and restart > 0:
            restart -= every
            held += count(restart)
    updates = (last - restart) // every + 1
    return WindowPlan(restart, updates, held, sequences_per_update)
