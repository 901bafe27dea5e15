"""`TrackingSession`: one training run's tracking, from train begin to the last snapshot.

It owns the run: the `RunPlan` (resolved once, `start`), the `Tracker`, resume and the
checkpoint protocol (`kfac_stream.tracking.checkpoints`), snapshot scheduling and its error
handling, the final snapshot, the held-out fit and the spectra media. A front end (the HF
`KFACStreamCallback`) only translates its events into these calls:

==========================  ====================================================================
event                       session call
==========================  ====================================================================
train begin                 `start` (plan, tracker, resume, final window, log lines)
step begin / end            `begin_step` / `end_step` (factor update, snapshot when due)
before a checkpoint         `before_checkpoint` (the tracker state beside it)
checkpoint saved            `checkpoint_saved` (the state moved into it)
train end                   `reloaded` (``load_best_model_at_end``'s checkpoint), then
                            `finish` (final-weight refresh, final snapshot, held-out fit,
                            close)
==========================  ====================================================================
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..config import KFACConfig
from ..distributed.context import LOCAL, DistContext, release_process_groups_at_exit
from ..exceptions import KFACConfigError, SnapshotError
from ..snapshot.adequacy import mark_said, said_scope, sampling_warning
from ..snapshot.background import SnapshotWorker
from ..snapshot.eigen_rule import EighRate
from ..snapshot.layout import step_dir_name
from ..snapshot.manifest_types import WeightsFrom, to_json
from ..snapshot.media import make_media
from ..snapshot.sequence import EigenPlan, finish_snapshot, queue_capture
from ..snapshot.snapshot import read_manifest
from ..snapshot.weights import weights_fingerprint
from ..snapshot.writer import clean_stale_tmp, relabel_weights, set_aside_other_runs
from ..stats.spectrum import default_eigh_threads
from .checkpoints import CheckpointProtocol
from .heldout_config import HeldoutConfig
from .heldout_fit import fit_heldout_prior, heldout_lines
from .lines import (
    raised_share_line,
    refresh_end_line,
    refresh_start_line,
    reloaded_weights_line,
    tracking_summary,
    window_lines,
)
from .plan import EvalBatches, RunPlan, RunShape
from .refresh import (
    RefreshResult,
    refresh_budget,
    refresh_draws,
    refresh_factors,
    sequence_cost_ratio,
)
from .tracker import Tracker, plan_tracking

logger = logging.getLogger("kfac_stream")


@dataclass(frozen=True)
class SessionOptions:
    """How a session runs (the `KFACStreamCallback` arguments besides the config).

    Attributes:
        background_snapshots: Finish snapshots (eigendecomposition, write) on a thread.
        resume_from: Checkpoint directory whose ``kfac_stream/`` state to restore when the
            Trainer resumes (default: the checkpoint of the resumed step).
        spectra_media: On rank 0, after each snapshot: histograms of log10 eigenvalues and a
            PNG ``<snapshot>.spectra.png`` (`kfac_stream.snapshot.media`).
        missing_state: ``"error"`` or ``"fresh"``: a resume from a checkpoint without a
            complete tracker state raises, or starts the factors from zero.
        earlier_runs: ``"set_aside"`` or ``"keep"`` another run's snapshots in the directory.
        gather_shards: Rank 0 writes every shard (node-local disks).
    """

    background_snapshots: bool = True
    resume_from: str | None = None
    spectra_media: bool = True
    missing_state: str = "error"
    earlier_runs: str = "set_aside"
    gather_shards: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("missing_state", ("error", "fresh")),
                              ("earlier_runs", ("set_aside", "keep"))):
            value = getattr(self, name)
            if value not in allowed:
                raise KFACConfigError(
                    f"KFACStreamCallback({name}={value!r}) is not allowed: must be "
                    + " or ".join(repr(a) for a in allowed))
        object.__setattr__(self, "gather_shards", bool(self.gather_shards))


def _with_entry(contents, key: str, value: dict):
    """``contents`` (`queue_capture`'s call) whose manifest records ``value`` under ``key``
    (``weights_from``: the reloaded weights' origin; ``final_refresh``)."""
    def captured_with_entry():
        captured = contents()
        captured.manifest[key] = value
        return captured

    return captured_with_entry


class TrackingSession:
    """One training run's tracking (the module docstring).

    Attributes:
        config: The user's configuration.
        heldout: The held-out fit's and the queries' options (`HeldoutConfig`: the one
            handed over, else those ``config`` carries in their old place, else defaults).
        plan: The run's `RunPlan` (None before `start`).
        tracker: The live `Tracker` (None before `start`; kept after `finish` for inspection).
        output_dir: The snapshot directory (None before `start`).
        snapshots: Paths of the snapshots written, in order.
        media: ``{snapshot path: histograms and PNG}`` (rank 0).
        snapshot_hold_seconds: Seconds each snapshot held the training thread.
        refreshed: What the final-weight refresh did (`RefreshResult`; None: none ran).
    """

    def __init__(self, config: KFACConfig | None = None,
                 options: SessionOptions | None = None,
                 heldout: HeldoutConfig | None = None) -> None:
        self.config = config or KFACConfig()
        self.heldout = HeldoutConfig.of_run(self.config, heldout)
        self.options = options or SessionOptions()
        self.plan: RunPlan | None = None
        self.tracker: Tracker | None = None
        self.output_dir: str | None = None
        self.snapshots: list[str] = []
        self.media: dict[str, dict] = {}
        self.snapshot_hold_seconds: list[float] = []
        self._worker = SnapshotWorker()
        self._comm = LOCAL
        self._checkpoints = CheckpointProtocol(self)
        self._eval_set: EvalBatches | None = None  # the held-out fit's (`start`, `finish`)
        self._final_step = 0  # the run's last step: its snapshot is checked for sample size
        self._basis_step: int | None = None  # an extension's extra snapshot (`start`)
        self._last_snapshot_step: int | None = None
        self._lent: dict = {}  # the stored factors the last snapshot holds (released next)
        self._eigh_rate = EighRate(None)  # this run's eigendecomposition rate (`start`)
        self._weights_from: WeightsFrom | None = None  # the checkpoint reloaded at train end
        self.refreshed: RefreshResult | None = None  # the final-weight refresh (`finish`)

    # -- the run -------------------------------------------------------------------------------

    def start(self, model, args, state, answers: dict | None = None,
              eval_set: EvalBatches | None = None) -> None:
        """Train begin: plan the run, build the tracker (collective with several processes),
        restore a resumed run's state, use the final window and say what is tracked.
        ``answers``: the resolved answer tokens (``heldout.answer_tokens``,
        `kfac_stream.query.answer_tokens`);
        ``eval_set``: the eval set the held-out fit reads at train end (None: no fit)."""
        self.close()
        cfg = KFACConfig(**self.config.to_dict())  # re-validate (the config may be a copy)
        specs, factor_plan = plan_tracking(model, cfg)  # collective under ZeRO-3 (probe)
        modules = dict(model.named_modules())
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        dist_ctx = DistContext.from_torch(device)  # collective with several processes
        if dist_ctx is not None:  # no gloo worker may outlive the interpreter
            release_process_groups_at_exit()
        world = dist_ctx.world_size if dist_ctx else 1
        self.plan = run = RunPlan.resolve(cfg, model, device=device,
                                          shape=RunShape.of_trainer(args, state, world),
                                          eval_set=eval_set, heldout=self.heldout)
        self._eval_set = eval_set if run.heldout.on else None
        rank0 = dist_ctx is None or dist_ctx.rank == 0
        if run.mc_share_raised is not None and rank0:
            logger.info("%s", raised_share_line(run))
        self.tracker = Tracker(model, {n: modules[n] for n in specs}, specs, run.config,
                               dist_ctx=dist_ctx, plan=factor_plan, run=run)
        self.tracker.answer_tokens = answers
        self._comm = dist_ctx.snapshot_comm if dist_ctx else LOCAL
        self.output_dir = run.config.output_dir or os.path.join(args.output_dir, "kfac")
        self._last_snapshot_step = None
        self._weights_from = None
        self.refreshed = None
        self._eigh_rate = EighRate(run.eigh_device, run.config.eigh_threads
                                   or default_eigh_threads())
        if state.global_step > 0:  # resuming from a checkpoint
            self._checkpoints.resume(args, state)
        self.tracker.use_window(run.window)
        self._final_step = run.shape.max_steps
        # a snapshot an extension needs beyond the periodic ones (e.g. an eigenbasis to measure in)
        self._basis_step = self.tracker.extra_snapshot_step(run.shape.max_steps)
        if rank0:
            self._prepare_directory()
            logger.info("%s", tracking_summary(self.tracker, self.output_dir, model))
            for level, line in heldout_lines(run.heldout):
                getattr(logger, level)("%s", line)
            self._say_window()
            for level, line in self.tracker.extension_lines(run.shape.max_steps):
                getattr(logger, level)("%s", line)

    def _prepare_directory(self) -> None:
        clean_stale_tmp(self.output_dir)
        moved = set_aside_other_runs(self.output_dir, self.tracker.run_id) \
            if self.options.earlier_runs == "set_aside" else []
        if moved:
            logger.warning("kfac_stream: %s held %d snapshot(s) of another training run; "
                           "moved to %s (this run's snapshots go to %s, and "
                           "Snapshot.latest / kfac-stream inspect / query read this "
                           "run's)", self.output_dir, len(moved),
                           os.path.dirname(moved[0]), self.output_dir)

    def _say_window(self) -> None:
        for level, line in window_lines(self.plan):
            getattr(logger, level)("%s", line)
            if level == "warning":
                mark_said(self.tracker.run_id, self._final_step)
        # with several ranks the ownership table follows the summary (one rank: DEBUG)
        logger.log(logging.INFO if self.tracker.world_size > 1 else logging.DEBUG,
                   "kfac_stream: factor owners (bytes of the stored factors, eigh cost)"
                   "\n%s", self.tracker.ownership)

    def begin_step(self, step: int) -> None:
        if self.tracker is not None:
            self.tracker.begin_step(step)

    def end_step(self, model, step: int, epoch: float | None) -> None:
        """The step's factor update, and its snapshot when one is due (not at the planned last
        step of a run that refreshes its factors at train end: `finish` writes that one, once,
        after the refresh)."""
        if self.tracker is None:
            return
        self.tracker.end_step(model)
        if step == self._basis_step:  # waited for: its eigenbasis in use from the next step
            self.save_snapshot(step, epoch, wait=True)
        elif step % self.config.snapshot_every == 0 and not (
                self.plan.refresh.on and step == self._final_step):
            self.save_snapshot(step, epoch)

    def before_checkpoint(self, args, step: int) -> None:
        """The Trainer writes a checkpoint after this event: the tracker state goes first."""
        if self.tracker is not None:
            self._checkpoints.before_checkpoint(args, step)

    def checkpoint_saved(self, args, step: int) -> None:
        """The Trainer has written its checkpoint: the tracker state moves into it."""
        if self.tracker is not None:
            self._checkpoints.saved(args, step)

    def reloaded(self, origin: WeightsFrom | None) -> None:
        """Train end, before `finish`: the checkpoint whose weights the Trainer loaded into the
        model (``load_best_model_at_end``, `kfac_stream.integrations.best_model`), or None."""
        self._weights_from = origin

    def finish(self, model, step: int, epoch: float | None,
               batches: Iterable[dict] | None = None) -> None:
        """Train end: the final-weight refresh where the plan says so (over ``batches``, this
        rank's training batches; None: no refresh), the final snapshot (unless this step's
        exists and nothing was refreshed), the held-out fit, then `close`. When the Trainer
        reloaded another step's weights (`reloaded`), the final snapshot records their
        fingerprint and ``weights_from`` (this step's snapshot, if written already, is
        relabelled: `_relabel`), so its fingerprint and the held-out fit describe those
        weights (and a refresh ran at them), and rank 0 says so (`reloaded_weights_line`)."""
        if self.tracker is None:
            return
        self.refreshed = self._refresh(model, step, batches)
        if self._last_snapshot_step != step or self.refreshed is not None:
            self.save_snapshot(step, epoch, final=True)
        elif self._weights_from is not None:
            self._relabel(step)
        if self._weights_from is not None and self.tracker.rank == 0:
            self._worker.wait()
            path = os.path.join(self.output_dir, step_dir_name(step))
            if path in self.snapshots:  # written
                logger.info("%s", reloaded_weights_line(path, read_manifest(path)))
        if self._eval_set is not None:  # the plan's held-out fit
            self._worker.wait()
            with said_scope("train"):  # told once in training; the user's posterior too
                fit_heldout_prior(self.snapshots, model, self._eval_set,
                                  self.tracker.answer_tokens)
        self.close()

    def _refresh(self, model, step: int, batches: Iterable[dict] | None
                 ) -> RefreshResult | None:
        """The final-weight refresh (`kfac_stream.tracking.refresh`) when the plan asks for it
        and ``batches`` are given; its start and end logged on rank 0."""
        if not self.plan.refresh.on or batches is None:
            return None
        self._worker.wait()  # the snapshot in flight is written before the factors change
        budget = refresh_budget(self.plan, sequence_cost_ratio(
            model, self.tracker.plan.dims, refresh_draws(self.tracker)))
        rank0 = self.tracker.rank == 0
        if rank0:
            logger.info("%s", refresh_start_line(self.plan, budget))
        result = refresh_factors(self.tracker, model, batches, step, budget)
        if rank0:
            logger.info("%s", refresh_end_line(result))
        return result if result.batches > 0 else None

    def _relabel(self, step: int) -> None:
        """This step's snapshot, written with the last step's weights, relabelled with the
        reloaded ones (`kfac_stream.snapshot.writer.relabel_weights`; every rank reads the
        fingerprint, collective under ZeRO-3 and FSDP2, rank 0 writes). A failure is handled as
        a snapshot's (`_finish_snapshot`)."""
        self._worker.wait()
        weights = weights_fingerprint(self.tracker.layers)
        path, error = os.path.join(self.output_dir, step_dir_name(step)), None
        if self._comm.rank == 0 and path in self.snapshots:
            try:
                relabel_weights(path, weights, to_json(self._weights_from))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if self._comm.world_size > 1:  # every rank learns the outcome once it is written
            error = self._comm.all_gather(error)[0]
        if error is None:
            return
        failures = self.tracker.count_snapshot_failure()
        message = (f"relabelling {path} with the reloaded weights failed: {error}; its "
                   "fingerprint is still the last step's")
        if self.config.fail_on_snapshot_error:
            raise SnapshotError(message)
        if self._comm.rank == 0:
            logger.error("kfac_stream: %s (%d failed so far)", message, failures)

    # -- snapshots -------------------------------------------------------------------------------

    def save_snapshot(self, step: int, epoch: float | None = None, wait: bool = False,
                      final: bool = False) -> str:
        """Snapshot the factors now as ``<output_dir>/step-<step>/`` and return that path
        (`KFACStreamCallback.save_snapshot`). ``final``: the run's last (always
        eigendecomposed; so is the snapshot of the planned last step)."""
        if self.tracker is None or self.output_dir is None:
            raise RuntimeError("KFACStreamCallback.save_snapshot: training has not started")
        # one snapshot in flight at a time: the one before holds the stored factors it was
        # lent until it is written, then they are released here
        self._worker.wait()
        held = time.perf_counter()
        # the training thread reads this step's weights and counters and queues the fold
        # behind this step's update; the snapshot's thread waits for it
        contents = queue_capture(self.tracker, step, epoch, release=self.released())
        if final and self._weights_from is not None:  # the reloaded weights' origin
            contents = _with_entry(contents, "weights_from", to_json(self._weights_from))
        if final and self.refreshed is not None:  # factors at the final weights
            contents = _with_entry(contents, "final_refresh", self.refreshed.manifest_entry())
        self.snapshot_hold_seconds.append(time.perf_counter() - held)
        self._last_snapshot_step = step
        cfg = self.tracker.config
        eigen = EigenPlan("always" if self.tracker.needs_eigenbasis else cfg.eigendecompose,
                          final=final or step == self._final_step,
                          step_seconds=self.tracker.step_seconds,
                          snapshot_every=cfg.snapshot_every, rate=self._eigh_rate)
        if self.options.background_snapshots:
            self._worker.submit(lambda: self._finish_snapshot(contents, step, eigen))
            if wait:
                self._worker.wait()
        else:
            self._finish_snapshot(contents, step, eigen)
        return os.path.join(self.output_dir, step_dir_name(step))

    def _finish_snapshot(self, contents, step: int, eigen: EigenPlan) -> None:
        """Every rank: its own factors' capture (``contents()``: the queued fold), the
        eigendecomposition or the spectra estimates, and the write; then rank 0's report,
        sample-size warning and media. A failure is counted and logged (training goes on)
        unless ``fail_on_snapshot_error``."""
        comm = self._comm
        try:
            captured = contents()
            self._lent = captured.lent  # released by the next snapshot, once this is written
            path, eigvals = finish_snapshot(captured, self.output_dir, comm,
                                            self.tracker.run.eigh_device,
                                            self.tracker.config.eigh_threads,
                                            gather=self.options.gather_shards, eigen=eigen)
        except Exception as e:
            failures = self.tracker.count_snapshot_failure()
            if self.config.fail_on_snapshot_error:
                raise
            logger.error("kfac_stream: %s; training goes on, earlier snapshots are intact "
                         "(%d failed so far; fail_on_snapshot_error=True makes this fatal)",
                         e, failures)
            return
        if comm.rank == 0:
            logger.info("kfac_stream: snapshot %s", path)
            few = sampling_warning("kfac_stream", read_manifest(path), once=True,
                                   scope="train") if step == self._final_step else None
            if few is not None:
                logger.warning(few)
            if self.options.spectra_media:
                self._media(path, eigvals)
        self.snapshots.append(path)  # last: the monitor sees the path with its media

    def _media(self, path: str, eigvals) -> None:
        # training on a GPU: the plot in a child process, off the GIL the training thread
        # needs to keep the GPU fed (on a CPU the child's start-up would cost more)
        detached = getattr(self.tracker.store.device, "type", None) == "cuda"
        try:
            # the eigenvalues just written (rank 0's factors; with others' missing,
            # make_media loads the snapshot instead)
            self.media[path] = make_media(path, eigvals=eigvals, detached=detached)
        except Exception as e:  # monitoring extras never fail a run
            logger.warning("kfac_stream: spectra media of %s failed: %s", path, e)

    def released(self) -> dict:
        """The stored factors the last snapshot was lent, to release: call it only after
        ``wait_for_snapshot`` (that snapshot is written)."""
        lent, self._lent = self._lent, {}
        return lent

    def wait_for_snapshot(self) -> None:
        """Until the snapshot in flight is written (re-raises a fatal snapshot error)."""
        self._worker.wait()

    @property
    def snapshot_in_flight(self) -> bool:
        """Whether a snapshot is still being eigendecomposed or written in the background."""
        return self._worker.busy

    @property
    def comm(self):
        """The snapshot process group's communicator (`LOCAL` with one process)."""
        return self._comm

    def factors(self):
        """``{layer: (A, G)}`` of the live tracker (dequantised); with several ranks only the
        layers whose A and G this rank both owns (snapshots hold every factor)."""
        if self.tracker is None:
            raise RuntimeError("KFACStreamCallback.factors: training has not started")
        return self.tracker.factors()

    def close(self) -> None:
        """Finish the snapshot in flight, remove hooks, stop the background worker and release
        the private process groups; re-raises a fatal snapshot error only after all of that."""
        self._eval_set = None  # no reference to the front end's data past the run
        try:
            self._worker.wait()
        finally:
            if self.tracker is not None:
                try:
                    self.tracker.close()
                finally:
                    if self.tracker.dist is not None:
                        self.tracker.dist.destroy()
        # keep the tracker object for inspection (factors(), counters); its hooks are gone
