"""`Tracker`: capture → step statistics → EMA store, independent of the HF Trainer.

Per optimizer step ``k`` (counted from 0): ``begin_step(k)`` arms the hooks if ``k`` is an
update step (``k % update_every == 0``); the micro-batches' forward/backward passes collect
rows; ``end_step(model)`` runs the MC passes (``fisher="mc"``: a replay on a random sub-batch
of each micro-batch's sequences, or the whole micro-batch with ``mc_sequences="all"``), weights
and scales the rows (sampling weights, the pass's loss scale ``c``) and hands an `UpdateJob` to
the `FactorUpdater` (`kfac_stream.tracking.factor_updates`: exchange with the owners, fold into the
store).

The training thread never reads a device value on the host (tests/unit/tracking/test_host_syncs.py
counts): every decision that needs one (is the update finite? is ``c`` known? how many positions?)
is a device tensor in the job, read by the updater's worker (``async_updates``, the default on CUDA)
on its own CUDA stream after an event recorded at the end of the step. The step waits only when the
worker is a whole update behind; then the wait is counted and logged once.

The tracker's state leaves it only as a frozen `TrackerRecord` (`Tracker.export`: snapshots,
checkpoints, monitoring) and comes back through `Tracker.load_state` (checkpoints).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..capture.hooks import IDLE, CaptureHooks, CaptureState
from ..capture.posterior_mode import has_active_dropout, posterior_mode
from ..capture.selection import LayerSpec, select_layers
from ..capture.sharing import FactorPlan, plan_factors, probe_shared_inputs
from ..config import KFACConfig
from ..distributed.context import DistContext
from ..distributed.engines import engine_for
from ..distributed.ownership import Ownership, assign_owners
from ..extensions import ExtensionExport, TrackerExtension, extensions_for
from ..fisher import StepContext, estimator_for
from ..fisher.replay_draws import replay_seed
from ..store.factor_store import FactorState
from ..store.folding import Folding
from ..store.traffic import Traffic
from ..utils.enums import StorageDtype
from ..utils.own_rng import own_draws
from .collect import collect_update
from .factor_updates import Counters, FactorUpdater, UpdateJob
from .plan import RunPlan

logger = logging.getLogger("kfac_stream")


@dataclass(frozen=True)
class TrackerRecord:
    """What a `Tracker` exports (`Tracker.export`) for snapshots, checkpoints and monitoring:
    copies, consistent with each other, that the tracker never changes afterwards.

    Attributes:
        step: The last optimizer step begun (None before the first).
        rank, world_size: This process's place.
        config: The tracker's configuration.
        specs: ``{layer: LayerSpec}`` of the tracked layers.
        plan: Factor keys, sides and shared-A groups.
        ownership: Which rank owns (stores, decomposes) each factor.
        counters: A copy of the running totals, device counters read.
        factors: ``{key: FactorState}`` of the factors this rank owns, flushed (empty when
            exported with ``factors=False``).
        traces: ``{key: trace}`` of this rank's factors as folded so far (no flush).
        capture: The token sampler's state and ``tokens_seen``.
        mc_sampler: The MC label sampler's generator state.
        run_id: The training run's id (`Tracker.run_id`).
        row_space: ``{layer: "sequence" | "target"}`` for the layers whose rows are sequences
            (a pooler or head on ``[B, d]``, `capture.hooks`) or an encoder-decoder's decoder
            positions; the others' rows are the input's token positions.
        answer_tokens: ``{"ids": [K], "texts": [K] or None}``: ``HeldoutConfig.answer_tokens``
            resolved at train begin, or None.
        run_plan: The run's `RunPlan` as plain JSON (`RunPlan.to_dict`).
        config_json: ``config`` as manifests and tracker states record it, the held-out
            options included (`RunPlan.manifest_config`; None: ``config.to_dict()``).
    """

    step: int | None
    rank: int
    world_size: int
    config: KFACConfig
    specs: Mapping[str, LayerSpec]
    plan: FactorPlan
    ownership: Ownership
    counters: Counters
    factors: Mapping[str, FactorState]
    traces: Mapping[str, float]
    capture: CaptureState
    mc_sampler: Tensor
    run_id: str = ""
    row_space: Mapping[str, str] = field(default_factory=dict)
    answer_tokens: Mapping[str, list] | None = None
    run_plan: Mapping[str, Any] | None = None
    config_json: Mapping[str, Any] | None = None

    @property
    def dims(self) -> dict[str, tuple[int, bool]]:
        """``{key: (side, diagonal)}`` of every factor (all ranks')."""
        return self.plan.dims


def plan_tracking(model: nn.Module, config: KFACConfig
                  ) -> tuple[dict[str, LayerSpec], FactorPlan]:
    """The tracked layers of ``model`` and its factor plan (shared-input A groups found by a
    2-token probe forward when ``config.share_inputs``). Reads no weight data: works on a
    model built on the ``meta`` device (cost models) and under ZeRO-3 (collective there)."""
    specs = select_layers(model, config.include, config.exclude, config.preset)
    groups = []
    if config.share_inputs:
        modules = dict(model.named_modules())
        groups = probe_shared_inputs(model, {n: modules[n] for n in specs})
    return specs, plan_factors(specs, config.max_dense_dim, groups)


class Tracker:
    """Streams K-FAC factors of the tracked layers of ``model`` into a CPU store.

    Args:
        model: The model (its hooks are installed here).
        layers: ``{name: module}`` of the tracked layers.
        specs: Their `LayerSpec`.
        config: The configuration.
        dist_ctx: Rank and process groups (None: one process).
        plan: The factor plan (default: no shared A; `plan_tracking` finds the sharing).
        run: The run's plan, ``config`` with every ``"auto"`` resolved (default:
            `RunPlan.resolve` for the model, without the run's shape; the tracking session
            passes the run's).
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module],
                 specs: dict[str, LayerSpec], config: KFACConfig,
                 dist_ctx: DistContext | None = None, plan: FactorPlan | None = None,
                 run: RunPlan | None = None) -> None:
        self.device = _model_device(model)
        self.run = run or RunPlan.resolve(config, model, device=self.device)
        config = self.config = self.run.config
        self.specs = specs
        self.plan = plan or plan_factors(specs, config.max_dense_dim)
        self.dist = dist_ctx
        self.rank, self.world_size = (dist_ctx.rank, dist_ctx.world_size) if dist_ctx else (0, 1)
        # the run's id (32 hex digits): in every snapshot's manifest, restored from checkpoints
        # (`tracker_state`), so a resumed run keeps it; rank 0's on every rank
        self.run_id = uuid.uuid4().hex
        # the answer options resolved at train begin (`query.answer_tokens`): {"ids",
        # "texts"} or None, in every snapshot's manifest
        self.answer_tokens: dict[str, list] | None = None
        if dist_ctx is not None:  # before any hook goes on the model
            _check_same_plan(dist_ctx, self.plan)
            self.run_id = dist_ctx.snapshot_comm.all_gather(self.run_id)[0]
        on_gpu = self.device.type == "cuda"
        self.fold_on = self.run.fold_on
        storage = StorageDtype(config.storage_dtype)
        wide = storage.wide_dtype
        self.row_dtype = wide  # rows scaled in this dtype, handed over in `folding.row_dtype`
        self.folding = Folding(self.fold_on, self.device, wide)
        self._model, self._layers = model, layers
        self.curvature = self.run.curvature  # the Fisher type and the factor form
        seed = config.seed + 1_000_003 * self.rank  # independent streams per rank
        # on a GPU the rows stay in the activations' dtype until `_collect` scales them
        self._capture_kwargs = dict(token_fraction=config.token_fraction, seed=seed,
                                    row_dtype=None if on_gpu else wide, device=self.device,
                                    sum_dtype=wide, reduce=self.curvature.reduces)
        # the extensions the configuration enables (`kfac_stream.extensions`), built before any
        # hook goes on the model (one may refuse the configuration); none: nothing else runs
        self.extensions: list[TrackerExtension] = [cls(self) for cls in extensions_for(config)]
        self.fisher = estimator_for(config)()  # what the steps capture, which rows count
        self.capture = self._make_capture()
        self._backward_in_forward = engine_for(model).allows_backward_in_forward(model)
        self._dropout: bool | None = None  # `has_active_dropout`, read once
        self.mc_generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        # the MC sub-batch's sequence sampler: reseeded every update step from (seed, rank,
        # step), so it has no state to checkpoint
        self.select_generator = torch.Generator(device=self.device)
        self.counters = Counters()
        self.step: int | None = None
        self.is_update_step = False
        self._last_end: float | None = None
        self._step_seconds = 0.0  # EMA of the wall time between end_step calls
        self.dims: dict[str, tuple[int, bool]] = self.plan.dims  # {key: (side, diagonal)}
        self.a_has_bias = {self.plan.a_key[n]: s.has_bias for n, s in specs.items()}
        self.a_members = _a_members(self.plan)
        self.ownership: Ownership = assign_owners(self.dims, self.world_size, storage.itemsize)
        self.updater = FactorUpdater(self.run, self.dims, self.ownership, dist_ctx,
                                     device=self.device, folding=self.folding,
                                     counters=self.counters,
                                     reserved=sum(e.reserved_bytes() for e in self.extensions))
        self.store = self.updater.store  # this rank's factors

    @property
    def layers(self) -> dict[str, nn.Module]:
        """``{name: module}`` of the tracked layers."""
        return dict(self._layers)

    @property
    def model(self) -> nn.Module:
        """The model whose layers are tracked (its architecture goes into every snapshot's
        manifest, `kfac_stream.snapshot.architecture.model_identity`)."""
        return self._model

    def _make_capture(self) -> CaptureHooks:
        hooks = CaptureHooks(self._model, self._layers, self.plan, **self._capture_kwargs)
        hooks.extensions = self.extensions
        return hooks

    # -- step protocol -------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Arm the hooks for optimizer step ``step`` (0-based) if it is an update step."""
        self.step = step
        self.is_update_step = step % self.config.update_every == 0
        for ext in self.extensions:
            ext.begin_step()
        self.capture.take()
        self.capture.set_mode(self.fisher.capture_mode(self.fisher_context(),
                                                       self.is_update_step))

    def fisher_context(self) -> StepContext:
        """What the Fisher estimator reads of this tracker at the current step."""
        return StepContext(config=self.config, model=self._model, capture=self.capture,
                           rank=self.rank, step=int(self.step or 0),
                           mc_generator=self.mc_generator,
                           select_generator=self.select_generator,
                           backward_in_forward_ok=self.backward_in_forward_ok)

    def backward_in_forward_ok(self) -> bool:
        """A gradient can be taken inside the training forward (the MC Fisher's on whole
        micro-batches): not under an engine that forbids it (DeepSpeed ZeRO-3), not with
        gradient checkpointing, not with active dropout (the training forward's masks would
        be in the Fisher; a replay runs without them, `posterior_mode`)."""
        if not self._backward_in_forward:  # the engine's (`allows_backward_in_forward`)
            return False
        model = self._model
        if self._dropout is None:  # the modules' p do not change during a run
            self._dropout = has_active_dropout(model)
        if self._dropout:
            return False
        for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            try:
                if getattr(model, attr):
                    return False
                break
            except AttributeError:
                continue
        return True

    @property
    def step_seconds(self) -> float:
        """The step time as `end_step` measures it (an EMA of the time between its calls;
        0.0 before two steps)."""
        return self._step_seconds

    def end_step(self, model: nn.Module) -> bool:
        """Finish the step; returns True if an update was handed to the worker.

        With several ranks every rank hands one over on every update step (possibly with no
        rows of its own): the exchange is collective, and the skip decision is shared.
        """
        t0 = time.perf_counter()
        if self._last_end is not None:
            dt = t0 - self._last_end
            self._step_seconds = dt if self._step_seconds == 0.0 else (
                0.9 * self._step_seconds + 0.1 * dt)
        try:
            if not self.is_update_step:
                self.capture.take()
                return False
            passes, inputs = self.capture.take()
            self.capture.set_mode(IDLE)
            # a replay runs as the posterior will (eval mode: no dropout), and whatever it
            # draws comes from the tracker's stream, the training's untouched
            with own_draws(replay_seed(self.config.seed, self.rank, self.step or 0),
                           [self.device]), posterior_mode(model):
                passes = self.fisher.passes(self.fisher_context(), model, passes, inputs)
            self.dissolve_groups(self.capture.dissolved)
            job = self._collect(passes)
            if job is None:
                return False
            if self.updater.stream is not None:  # on the model device's training stream
                job.event = torch.cuda.Event()  # (not the current device's, which may differ)
                job.event.record(torch.cuda.current_stream(self.device))
            tables = [ext.step_table() for ext in self.extensions]  # in the exchange's table
            job.agree = tuple(v for table in tables for v in table)
            self.updater.submit(job, self._step_seconds)
            if job.agreed:
                _agree(self.extensions, tables, job.agreed)
            return True
        finally:
            self.is_update_step = False
            self._last_end = time.perf_counter()
            self.counters.tracker_seconds += self._last_end - t0

    def _collect(self, passes) -> UpdateJob | None:
        """The update job of ``passes`` (`kfac_stream.tracking.collect.collect_update`)."""
        return collect_update(self, passes)

    def dissolve_groups(self, groups: list[tuple[str, ...]] | tuple = (),
                        copy_state: bool = True) -> None:
        """Stop sharing the A factor of each of ``groups`` (shared-input groups of the plan
        whose members received different inputs in training, `capture.hooks`): every member
        gets its own A key, starting as a copy of the shared factor (``copy_state``; exact:
        the members' A factors were equal until now), and the plan, the factor dimensions and
        the ownership follow. Consumes ``capture.dissolved``.

        Raises:
            RuntimeError: with several ranks (the exchange needs the same plan on every rank at
                every update, and ranks see their inputs independently): set
                ``KFACConfig(share_inputs=False)`` for such a model.
        """
        groups = [tuple(g) for g in groups if tuple(g) in self.plan.groups]
        self.capture.dissolved = []
        if not groups:
            return
        if self.world_size > 1:
            raise RuntimeError(
                f"kfac_stream: layers {list(groups[0])} were planned to share one A factor "
                "(same input in the probe forward) but received different inputs in training; "
                "with several ranks the plan cannot change during the run: set "
                "KFACConfig(share_inputs=False)")
        self.updater.wait()  # no fold here: the copies fold as they would have apart
        old = self.plan
        plan = plan_factors(self.specs, self.config.max_dense_dim,
                            [g for g in old.groups if g not in groups])
        for key in plan.dims:
            if key not in old.dims and copy_state:
                layer = next(n for n, k in plan.a_key.items() if k == key)
                self.store.copy_factor(old.a_key[layer], key)
            elif key not in old.dims:
                self.store.add(key, *plan.dims[key])
        self.capture.forget_groups(groups)
        self.plan, self.dims = plan, plan.dims
        self.a_has_bias = {plan.a_key[n]: s.has_bias for n, s in self.specs.items()}
        self.a_members = _a_members(plan)
        self.ownership = assign_owners(self.dims, self.world_size,
                                       StorageDtype(self.config.storage_dtype).itemsize)
        self.updater.dims, self.updater.ownership = self.dims, self.ownership
        for ext in self.extensions:
            ext.plan_changed(plan)

    # -- factor arithmetic (worker thread, or the training thread without async_updates) -------

    def use_window(self, window, sequences_per_update: int | None = None) -> int | None:
        """Use the final window ``window`` (a `WindowPlan`, None: the EMA throughout; the run
        plan's, `RunPlan.window`); returns the step whose update restarts the average (None:
        the EMA throughout); the plan is in ``updater.window_plan`` and its sequences, with
        ``sequences_per_update`` (None: the run plan's), in the counters. See
        `FactorUpdater.set_final_window`."""
        restart = self.updater.set_final_window(window)
        self.counters.sequences_per_update = int(self.run.sequences_per_update
                                                 if sequences_per_update is None
                                                 else sequences_per_update)
        self.counters.window_sequences = window.sequences if window is not None else 0
        return restart

    def extension(self, name: str) -> TrackerExtension | None:
        """The extension registered as ``name`` that this run enabled, else None."""
        return next((ext for ext in self.extensions if ext.name == name), None)

    def extra_snapshot_step(self, max_steps: int) -> int | None:
        """The first step an extension asks a snapshot at beyond the periodic ones
        (`TrackerExtension.extra_snapshot_step`), None: none asks."""
        steps = [s for s in (e.extra_snapshot_step(max_steps) for e in self.extensions)
                 if s is not None]
        return min(steps, default=None)

    def extension_lines(self, max_steps: int) -> list[tuple[str, str]]:
        """``[(log level, line)]`` the extensions add at train begin."""
        return [said for said in (e.train_begin_line(max_steps) for e in self.extensions)
                if said is not None]

    @property
    def needs_eigenbasis(self) -> bool:
        """An extension takes every snapshot's eigenvectors: each snapshot eigendecomposes in
        the run (`TrackerExtension.needs_eigenbasis`)."""
        return any(ext.needs_eigenbasis for ext in self.extensions)

    def export_extensions(self, step: int) -> dict[str, ExtensionExport]:
        """For snapshot ``step`` (`kfac_stream.snapshot.sequence.capture_snapshot`): ``{name:
        what the extension stores}`` (`TrackerExtension.export`; collective with several
        ranks); empty without extensions."""
        out = {}
        for ext in self.extensions:
            export = ext.export(step)
            if export is not None:
                out[ext.name] = export
        return out

    def extension_states(self) -> dict[str, tuple[dict[str, Any], dict[str, Tensor]]]:
        """``{name: (meta, tensors)}`` of the extensions' states for a checkpoint
        (`TrackerExtension.state_dict`)."""
        out = {}
        for ext in self.extensions:
            state = ext.state_dict()
            if state is not None:
                out[ext.name] = state
        return out

    def read_counters(self) -> Counters:
        """The counters with the device-side ones read (snapshot, checkpoint, log time)."""
        self.counters.tokens_seen = self.capture.tokens_seen
        self.counters.sequences_seen = self.capture.sequences_seen
        self.counters.target_tokens_seen = self.capture.target_tokens_seen
        return self.counters

    def count_snapshot_failure(self) -> int:
        """Count one abandoned snapshot (``counts.snapshot_failures`` in later manifests);
        returns the count so far."""
        self.counters.snapshot_failures += 1
        return self.counters.snapshot_failures

    # -- state -----------------------------------------------------------------------------------

    def export(self, factors: bool = True, lend: bool = False) -> TrackerRecord:
        """A frozen `TrackerRecord` of the tracker now.

        Args:
            factors: Flush (wait for the worker, fold every pending update) and copy this
                rank's factors into the record; False: only the cheap parts (counters, live
                traces as folded so far), for monitoring between snapshots.
            lend: The record holds the stored factor tensors themselves instead of copies
                (a snapshot's: `FactorStore.state_dict`); they stay unchanged until passed to
                `release` (the store writes elsewhere meanwhile).
        """
        if factors:
            self.flush()
        else:
            self.updater.settle()
        return self._record(factors=self.store.state_dict(lend) if factors else {})

    def queue_export(self, release: Mapping[str, Tensor] | None = None) -> Future:
        """A lending `export` (a snapshot's) queued behind the updates submitted so far: the
        training thread reads the counters and samplers now and returns; the updater
        (`FactorUpdater.run_in_order`: its worker, or a thread of its own inline) then
        releases ``release`` (the previous snapshot's lent factors, written), folds every
        pending update and lends the stored factors. The future's `TrackerRecord` equals
        ``export(lend=True)`` at this point of the run; later updates wait for it."""
        record = self._record(factors={})  # the training thread's state, now

        def fold_and_lend() -> TrackerRecord:
            if release:
                self.store.release(release)
            self.updater.fold_now()
            now = self.counters  # the fold's traffic and time, as `export` would count them
            folded = {f.name: getattr(now, f.name) for f in fields(Traffic)}
            return replace(record, factors=self.store.state_dict(True),
                           traces=self.store.traces(),
                           counters=replace(record.counters, **folded,
                                            flush_seconds=now.flush_seconds))

        return self.updater.run_in_order(fold_and_lend)

    def _record(self, factors: dict) -> TrackerRecord:
        counters = self.read_counters()
        return TrackerRecord(
            step=self.step, rank=self.rank, world_size=self.world_size, config=self.config,
            specs=dict(self.specs), plan=self.plan, ownership=self.ownership,
            counters=replace(counters, skipped_steps=list(counters.skipped_steps)),
            factors=factors, traces=self.store.traces(),
            capture=self.capture.state_dict(), mc_sampler=self.mc_generator.get_state(),
            run_id=self.run_id, row_space={n: space for n, space in
                                           self.capture.row_space.items()
                                           if space != "position"},
            answer_tokens=self.answer_tokens, run_plan=self.run.to_dict(),
            config_json=self.run.manifest_config())

    def release(self, lent: Mapping[str, Tensor]) -> None:
        """Give back ``{key: tensor}`` a lending `export` handed out, no longer read (its
        snapshot is written), once the worker is idle: call it before the next flush, which
        then writes those factors in place instead of into spares."""
        if lent:
            self.updater.wait()  # the worker is idle from here: nothing writes the store
            self.store.release(lent)

    def load_state(self, factors: Mapping[str, FactorState], counters: Mapping[str, Any],
                   capture: CaptureState | None = None, mc_sampler: Tensor | None = None,
                   reseed_step: int = 0) -> None:
        """Restore this rank's factors, counters and samplers (a checkpoint's state).

        Args:
            factors: Holds at least every factor this rank owns (`FactorStore.load_state_dict`).
            counters: ``{name: value}``; fields of `Counters` not in it stay as they are.
            capture: The token sampler's state and ``tokens_seen``; None (a checkpoint of
                another world size): ``tokens_seen`` from ``counters`` and both samplers
                reseeded from ``reseed_step``, differently per rank.
            mc_sampler: The MC sampler's state (with ``capture``).
            reseed_step: The step the samplers are reseeded from when ``capture`` is None.
        """
        self.flush()
        self.store.load_state_dict(factors)
        names = {f.name for f in fields(Counters)}
        for name, value in counters.items():
            if name in names:
                setattr(self.counters, name, list(value) if name == "skipped_steps" else value)
        if capture is None:
            self.capture.set_counts(counters.get("tokens_seen", 0),
                                    counters.get("sequences_seen", 0),
                                    counters.get("target_tokens_seen", 0))
            self.capture.reseed(self.config.seed + 7919 * (reseed_step + 1) + self.rank)
            self.mc_generator.manual_seed(self.config.seed + 7927 * (reseed_step + 1)
                                          + self.rank + 1)
        else:
            self.capture.set_counts(capture.tokens_seen, capture.sequences_seen,
                                    capture.target_tokens_seen)
            _set_rng(self.capture.generator, capture.sampler, self.config.seed + self.rank)
            _set_rng(self.mc_generator, mc_sampler, self.config.seed + self.rank + 1)
        self.read_counters()

    def detach(self) -> None:
        """Take every hook off the model (training steps are then plain); `attach` puts them
        back. The sampler's state and ``tokens_seen`` carry over."""
        self.capture.remove()

    def attach(self) -> None:
        """Put the hooks back on the model after `detach` (a no-op while attached)."""
        if self.capture.handles:
            return
        old = self.capture
        self.capture = self._make_capture()
        self.capture.carry_over(old)

    def flush(self) -> None:
        """Wait until every submitted update is in the store, folded."""
        self.updater.flush()

    def close(self) -> None:
        """Flush, stop the worker and remove every hook."""
        try:
            self.updater.close()
        finally:
            self.capture.remove()

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer: (A, G)}`` dequantised (float32, float64 for float64 storage); only the
        layers whose A and G this rank both owns."""
        self.flush()
        vals = self.store.values()
        out = {}
        for n in self.specs:
            a_key, g_key = self.plan.keys_of(n)
            if a_key in vals and g_key in vals:
                out[n] = (vals[a_key], vals[g_key])
        return out

def _a_members(plan: FactorPlan) -> dict[str, list[str]]:
    """``{A key: the layers using it}`` (in plan order)."""
    out: dict[str, list[str]] = {}
    for name, key in plan.a_key.items():
        out.setdefault(key, []).append(name)
    return out


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _check_same_plan(ctx: DistContext, plan: FactorPlan) -> None:
    """Every rank must have found the same shared-A groups (the exchange layout needs it)."""
    plans = ctx.snapshot_comm.all_gather(plan.describe())
    if any(p != plans[0] for p in plans):
        raise RuntimeError("kfac_stream: ranks found different shared-input groups "
                           f"(rank 0: {plans[0]}, rank {ctx.rank}: {plan.describe()}); "
                           "set KFACConfig(share_inputs=False)")


def _agree(extensions: list[TrackerExtension], tables: list[tuple[int, ...]],
           agreed: list[list[int]]) -> None:
    """Hand each extension its columns of every rank's exchange table (``agreed``:
    ``[world][Σ len(table)]``, the extensions' `step_table` s side by side)."""
    start = 0
    for ext, table in zip(extensions, tables):
        ext.agree([row[start:start + len(table)] for row in agreed])
        start += len(table)


def _set_rng(generator: torch.Generator, state: Tensor, fallback_seed: int) -> None:
    """Restore a sampler's state; a state from another device type (CPU ↔ CUDA generators
    have different state formats) reseeds instead, with a warning."""
    try:
        generator.set_state(state)
    except RuntimeError:
        logger.warning("kfac_stream: the checkpoint's sampler state is from another device "
                       "type; the sampler is reseeded (factors and counters are restored)")
        generator.manual_seed(fallback_seed)
