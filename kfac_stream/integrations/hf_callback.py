"""`KFACStreamCallback`: wires the tracker into ``transformers.Trainer``. No math here.

Event order in a Trainer step: ``on_step_begin`` → per micro-batch forward/backward (hooks
collect rows) → optimizer step → ``on_step_end`` (MC pass, EMA update, maybe a snapshot; when
the Trainer is about to save a checkpoint, the tracker state, see `kfac_stream.tracker_state`)
→ the Trainer's checkpoint → ``on_save`` (the state moves into the checkpoint). Each finished
snapshot's spectra (and every ``log_every`` steps the tracker's scalars) go to the Trainer's
reporters, see `kfac_stream.integrations.spectrum_monitor` for the names.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from transformers import TrainerCallback

from ..capture.graphs import compile_mode_error
from ..capture.presets import block_stack
from ..config import KFACConfig, sequences_per_update, update_sequences
from ..distributed.context import LOCAL, DistContext, release_process_groups_at_exit
from ..distributed.fsdp import is_fsdp_sharded
from ..exceptions import KFACConfigError, TrackerStateError
from ..log_setup import show_info_by_default
from ..settings import Settings, resolve_settings
from ..snapshot.adequacy import mark_said, said_scope, sampling_warning
from ..snapshot.background import SnapshotWorker
from ..snapshot.layout import step_dir_name
from ..snapshot.media import make_media
from ..snapshot.sequence import capture_snapshot, finish_snapshot
from ..snapshot.snapshot import read_manifest
from ..snapshot.writer import clean_stale_tmp, set_aside_other_runs
from ..tracker import Tracker, plan_tracking
from ..tracker_state import (
    STATE_DIR,
    commit_pending_state,
    find_tracker_state,
    load_tracker_state,
    pending_state_dir,
    save_tracker_state,
)
from .answer_tokens import check_eval_answer_tokens, resolve_answer_tokens, text_tokenizer
from .heldout import fit_heldout_prior, plan_heldout_fit
from .spectrum_monitor import SpectraReporter, find_callback_handler
from .zero3 import check_deepspeed_device, deepspeed_requested

logger = logging.getLogger("kfac_stream")


def _warn_fsdp_not_applied(model) -> None:
    """accelerate launched with an FSDP config, yet no parameter is an FSDP2 shard: accelerate
    1.x drops its FSDP plugin on CPU (``use_cpu``: the Trainer then wraps the model in DDP),
    and FSDP1 (``fsdp_version: 1``) wraps parameters into flat ones kfac_stream does not
    support. Say so once instead of letting a user believe the run was sharded."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or \
            is_fsdp_sharded(model):
        return
    logger.warning("kfac_stream: accelerate was launched with an FSDP config, but no parameter "
                   "of the model is an FSDP2 (fully_shard) shard: on CPU accelerate ignores "
                   "FSDP and trains with DDP, and FSDP1 (fsdp_version: 1) is not supported; "
                   "use fsdp_version: 2 (docs/multinode.md)")


def _timed(part: str):
    """Add the wall time of a Trainer event handler to ``callback_seconds`` and to its
    ``part`` of ``callback_parts``."""
    def wrap(handler):
        @functools.wraps(handler)
        def timed(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return handler(self, *args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                self.callback_seconds += spent
                self.callback_parts[part] += spent
        return timed
    return wrap


class KFACStreamCallback(TrainerCallback):
    """Track streaming EMA K-FAC factors during ``Trainer.train()``.

    Args:
        config: A `KFACConfig` (defaults if None).
        background_snapshots: Finish snapshots (eigendecomposition, write) on a thread.
        resume_from: Checkpoint directory whose ``kfac_stream/`` state to restore when the
            Trainer resumes. Default: ``<output_dir>/checkpoint-<resumed step>``, where the
            Trainer saved it (every checkpoint carries the state, see `on_save`).
        spectra_media: On rank 0, after each snapshot (on the snapshot thread): histograms of
            log10 eigenvalues into ``media[path]`` and a PNG ``<snapshot>.spectra.png`` (needs
            matplotlib); reported to an active W&B run with the spectra.
        missing_state: What a resume from a checkpoint without a complete tracker state does:
            ``"error"`` (raise `TrackerStateError` naming the checkpoint and the ways out) or
            ``"fresh"`` (start the factors from zero, with a warning): an explicit opt-in,
            e.g. to resume a run that was trained without kfac_stream.
        report_spectra: Report each snapshot's spectrum statistics and the tracker's scalars
            through the Trainer's reporters (``report_to``: W&B, TensorBoard, MLflow, ...),
            media to an active W&B run; False: no ``kfac`` key is logged. Names and
            conventions: `kfac_stream.integrations.spectrum_monitor`.
        log_every: The tracker's scalars (``step_metrics``) every this many steps; None: with
            the Trainer's own logs (``logging_steps``); 0: never.
        report_media: With ``report_spectra``, also log the ``spectra_media`` (histograms,
            PNG) to an active W&B run; False: scalars only (the PNG is still written).
        earlier_runs: What a run does with snapshots of another training run (another
            ``run_id``, or none) it finds in its snapshot directory when it starts:
            ``"set_aside"`` (default: move them to ``<dir>/earlier-runs/<run id>/``, with a
            warning, so that ``Snapshot.latest`` and the CLI read this run's only) or
            ``"keep"`` (leave them: this run's snapshots replace those of the same steps and
            sit beside the others, as earlier versions did; queries still warn when the model's
            weights are not a snapshot's). A run resumed from a checkpoint keeps its run id,
            so its own snapshots are never set aside.
        gather_shards: Several processes on machines that do not share the snapshot
            directory (node-local disks): every rank sends its shard's bytes to rank 0, which
            writes the whole snapshot on its machine; the other ranks never touch the
            directory. Rank 0 holds every shard at once while writing. Default False: each
            rank writes its own shard into one directory all ranks share
            (docs/multinode.md).

    Attributes:
        tracker: The live `Tracker` during training (None before ``on_train_begin``).
        snapshots: Paths of the snapshots written by this callback.
        train_seconds: Wall time from ``on_train_begin`` to ``on_train_end``: the training
            loop, without the engine's start-up before it (DeepSpeed init, ZeRO-3
            partitioning), which ``Trainer.train()``'s own time includes (None before the end).
        callback_seconds: Wall time the training thread spent inside this callback's Trainer
            events from ``on_train_begin`` to the end of ``on_train_end`` (`perf_counter`, no
            device sync): tracking set-up, factor updates, snapshots' hold on the thread,
            checkpoint state, the end-of-train snapshot (with the wait for the snapshot
            thread) and held-out fit. Not counted: the forward/backward hooks' row capture and
            the background snapshot thread's work while training runs.
        train_end_seconds: Wall time from ``on_train_begin`` to the end of ``on_train_end``
            (``train_seconds`` plus the callback's own end-of-train work): the base of the
            end-of-train cost line, ``callback_seconds / train_end_seconds`` (None before).
        callback_parts: ``callback_seconds`` split into ``"set-up"`` (``on_train_begin``),
            ``"steps"`` (the events of the training steps) and ``"end"`` (``on_train_end``).
    """

    def __init__(self, config: KFACConfig | None = None, background_snapshots: bool = True,
                 resume_from: str | None = None, spectra_media: bool = True,
                 missing_state: str = "error", report_spectra: bool = True,
                 log_every: int | None = None, report_media: bool = True,
                 earlier_runs: str = "set_aside", gather_shards: bool = False) -> None:
        if missing_state not in ("error", "fresh"):
            raise KFACConfigError(f"KFACStreamCallback(missing_state={missing_state!r}) is not "
                                  "allowed: must be 'error' or 'fresh'")
        if log_every is not None and int(log_every) < 0:
            raise KFACConfigError(f"KFACStreamCallback(log_every={log_every!r}) is not allowed: "
                                  "must be None (with the Trainer's logs), 0 (never) or > 0")
        if earlier_runs not in ("set_aside", "keep"):
            raise KFACConfigError(f"KFACStreamCallback(earlier_runs={earlier_runs!r}) is not "
                                  "allowed: must be 'set_aside' or 'keep'")
        self.missing_state = missing_state
        self.earlier_runs = earlier_runs
        self.gather_shards = bool(gather_shards)
        self.config = config or KFACConfig()
        self.tracker: Tracker | None = None
        self.output_dir: str | None = None
        self.snapshots: list[str] = []
        self.background_snapshots = background_snapshots
        self.resume_from = resume_from
        self.spectra_media = spectra_media
        self.media: dict[str, dict] = {}  # snapshot path -> histograms and PNG (rank 0)
        self.report_spectra = report_spectra
        self._reporter = SpectraReporter(log_every, media=report_media)
        self._worker = SnapshotWorker()
        self._fit_heldout = False  # the end of training fits tau and link (`plan_heldout_fit`)
        self._comm = LOCAL
        self._final_step = 0  # the run's last step: its snapshot is checked for sample size
        self._last_snapshot_step: int | None = None
        self._pending_step: int | None = None  # step whose state waits beside its checkpoint
        self.train_started: float | None = None  # perf_counter() at on_train_begin
        self.train_seconds: float | None = None
        self.callback_seconds = 0.0  # the training thread's time in this callback's events
        self.callback_parts = dict.fromkeys(("set-up", "steps", "end"), 0.0)
        self.train_end_seconds: float | None = None
        # the last snapshot's factor copies, reused by the next one (pinned on CUDA)
        self._lent: dict = {}  # the stored factors the last snapshot held (released next)
        #: seconds each snapshot held the training thread (flush, copy, contents, weights)
        self.snapshot_hold_seconds: list[float] = []

    # -- Trainer events --------------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        """At the end of ``Trainer.__init__``: refuse DeepSpeed on CPU without ``use_cpu``
        (`zero3.check_deepspeed_device`) before its engine fails on every rank."""
        check_deepspeed_device(args)
        if deepspeed_requested(args) and getattr(args, "process_index", 0) == 0:
            show_info_by_default()
            logger.info("kfac_stream: DeepSpeed starts its engine inside trainer.train() before "
                        "the first step (ZeRO-3: partitioning the model over the processes), "
                        "often tens of seconds without output; tracking begins after it")
        return control

    @_timed("set-up")
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.callback_seconds, self.train_end_seconds = 0.0, None  # `_timed` adds this event
        self.callback_parts = dict.fromkeys(self.callback_parts, 0.0)
        self.train_started = time.perf_counter()  # after the engine's start (accelerate's
        # prepare: DeepSpeed init, ZeRO-3 partitioning), which is not training time
        if model is None:
            raise ValueError("KFACStreamCallback needs the model (Trainer passes it)")
        handler = find_callback_handler()  # the Trainer's reporters (not given to callbacks)
        if handler is None and self.report_spectra:
            logger.info("kfac_stream: not called by a Trainer's callback handler: spectra "
                        "go only to an active W&B run")
        show_info_by_default()  # the summary below reaches a script that set up no logging
        cfg = KFACConfig(**self.config.to_dict())  # re-validate (the config may be a copy)
        error = compile_mode_error(args)  # CUDA graphs would replay stale hooks
        if error is not None:
            raise error
        answers = resolve_answer_tokens(  # fails here, before any collective
            cfg.answer_tokens, model, text_tokenizer(kwargs.get("processing_class")))
        check_eval_answer_tokens(cfg.eval_prior_precision, answers, model)
        self.close()
        self._reporter.start(handler, len(self.snapshots))  # earlier runs' are not reported
        _warn_fsdp_not_applied(model)
        specs, plan = plan_tracking(model, cfg)  # collective under ZeRO-3 (probe forward)
        modules = dict(model.named_modules())
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        dist_ctx = DistContext.from_torch(device)  # collective with several processes
        if dist_ctx is not None:  # no gloo worker may outlive the interpreter (the docstring)
            release_process_groups_at_exit()
        batch, accumulation = _micro_batches(args)
        settings = resolve_settings(
            cfg, device, batch=batch, accumulation=accumulation,
            world=dist_ctx.world_size if dist_ctx else 1,
            max_steps=int(getattr(state, "max_steps", 0) or 0))
        if settings.mc_share_raised is not None and (dist_ctx is None or dist_ctx.rank == 0):
            _log_raised_share(cfg, settings, state)
        cfg = settings.config
        self.tracker = Tracker(model, {n: modules[n] for n in specs}, specs, cfg, dist_ctx, plan,
                               settings)
        self.tracker.answer_tokens = answers
        self._comm = dist_ctx.snapshot_comm if dist_ctx else LOCAL
        self.output_dir = cfg.output_dir or os.path.join(args.output_dir, "kfac")
        self._last_snapshot_step = None
        if state.global_step > 0:  # resuming from a checkpoint
            self._resume(args, state)
        seqs = sequences_per_update(cfg, *_micro_batches(args), self.tracker.world_size)
        restart = self.tracker.set_final_window(  # each update step's own MC draw counted
            int(getattr(state, "max_steps", 0) or 0), seqs,
            update_sequences(cfg, *_micro_batches(args), self.tracker.world_size))
        plan = self.tracker.updater.window_plan
        self._final_step = int(getattr(state, "max_steps", 0) or 0)
        if self.tracker.rank == 0:
            clean_stale_tmp(self.output_dir)
            moved = set_aside_other_runs(self.output_dir, self.tracker.run_id) \
                if self.earlier_runs == "set_aside" else []
            if moved:
                logger.warning("kfac_stream: %s held %d snapshot(s) of another training run; "
                               "moved to %s (this run's snapshots go to %s, and "
                               "Snapshot.latest / kfac-stream inspect / query read this "
                               "run's)", self.output_dir, len(moved),
                               os.path.dirname(moved[0]), self.output_dir)
            logger.info("%s", tracking_summary(self.tracker, self.output_dir, model))
        self._fit_heldout = plan_heldout_fit(self.tracker, cfg.eval_prior_precision, answers,
                                             model)
        if self.tracker.rank == 0:
            if cfg.ema_decay == 1.0 and cfg.final_window > 0:
                logger.info("kfac_stream: ema_decay=1 is the mean over every update of the run: "
                            "final_window=%g is off", cfg.final_window)
            if restart is not None:
                logger.info("kfac_stream: final window (final_window=%g, min_window_sequences="
                            "%d): from step %d of %d the factors are the mean of the updates "
                            "(the EMA before): %d updates, %d sequences", cfg.final_window,
                            cfg.min_window_sequences, restart, state.max_steps, plan.updates,
                            plan.sequences)
                if 0 < plan.sequences < cfg.min_window_sequences:
                    logger.warning(
                        "kfac_stream: this run's %d factor updates hold %d sequences in all "
                        "(about %d each), fewer than min_window_sequences=%d: the final "
                        "snapshot's factors will rest on few samples, which matters for its "
                        "posterior only (it may be too wide); lower update_every or raise "
                        "mc_sequences for more (said once)", plan.updates, plan.sequences,
                        plan.sequences_per_update, cfg.min_window_sequences)
                    mark_said(self.tracker.run_id, self._final_step)
            # with several ranks the ownership table follows the summary (one rank: DEBUG)
            logger.log(logging.INFO if self.tracker.world_size > 1 else logging.DEBUG,
                       "kfac_stream: factor owners (bytes of the stored factors, eigh cost)"
                       "\n%s", self.tracker.ownership)
        return control

    def _checkpoint(self, args, step: int) -> str:
        return os.path.join(args.output_dir, f"checkpoint-{step}")

    def _save_pending_state(self, args, state, control) -> None:
        """The Trainer will write a checkpoint after this event: write the tracker state
        first, beside it (`tracker_state.pending_state_dir`), so the checkpoint is never
        complete without it; ``on_save`` moves it in."""
        if self.tracker is not None and control.should_save:
            self._worker.wait()  # the snapshot in flight uses the same process group
            checkpoint = self._checkpoint(args, state.global_step)
            self.tracker.release(self._released())  # the flush below writes in place
            save_tracker_state(self.tracker.export(), pending_state_dir(checkpoint), self._comm,
                               step=state.global_step)
            self._pending_step = state.global_step

    @_timed("steps")
    def on_epoch_end(self, args, state, control, **kwargs):
        self._save_pending_state(args, state, control)
        return control

    @_timed("steps")
    def on_save(self, args, state, control, **kwargs):
        """Move the state written before the Trainer's checkpoint into it (rank 0, one
        rename). A save the Trainer decided after the step's events (``save_strategy="best"``
        after an evaluation) gets its state written here, after ``trainer_state.json``."""
        if self.tracker is None:
            return control
        self._worker.wait()  # the snapshot in flight uses the same process group
        checkpoint = self._checkpoint(args, state.global_step)
        if self._pending_step == state.global_step:
            if self._comm.rank == 0:
                commit_pending_state(checkpoint)
            self._comm.all_gather(None)
        else:
            self.tracker.release(self._released())  # the flush below writes in place
            save_tracker_state(self.tracker.export(), os.path.join(checkpoint, STATE_DIR),
                               self._comm, step=state.global_step)
        self._pending_step = None
        return control

    def _resume(self, args, state) -> None:
        checkpoint = self.resume_from or self._checkpoint(args, state.global_step)
        directory, reasons = find_tracker_state(checkpoint)
        if directory is None:
            if self.missing_state == "fresh":
                logger.warning("kfac_stream: resuming at step %d from %s without a tracker "
                               "state (%s); the factors start from zero (missing_state='fresh')",
                               state.global_step, checkpoint, "; ".join(reasons))
                return
            raise TrackerStateError(
                f"kfac_stream: resuming at step {state.global_step} from {checkpoint}, which "
                f"holds no complete tracker state ({'; '.join(reasons)}). Resume from another "
                "checkpoint (Trainer.train(resume_from_checkpoint=<path>)), or start the factors "
                "afresh with KFACStreamCallback(..., missing_state='fresh')")
        logger.info("kfac_stream: %s", load_tracker_state(self.tracker, directory))
        self._comm.all_gather(None)  # every rank has read it before it moves
        if self._comm.rank == 0 and directory != os.path.join(checkpoint, STATE_DIR):
            commit_pending_state(checkpoint)  # a crash left it beside the checkpoint

    @_timed("steps")
    def on_step_begin(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.begin_step(state.global_step)
        return control

    @_timed("steps")
    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.tracker is None:
            return control
        self.tracker.end_step(model)
        if state.global_step % self.config.snapshot_every == 0:
            self.save_snapshot(state.global_step, state.epoch)
        self._save_pending_state(args, state, control)
        if self.report_spectra:
            if control.should_training_stop:  # last step: the snapshot in flight reaches
                self._worker.wait()  # every reporter before they end their runs
            self._reporter.step(self, args, state, control)
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        entered = time.perf_counter()  # this event's time is counted by `_log_cost`
        if self.train_started is not None:
            self.train_seconds = entered - self.train_started
        if self.tracker is not None:
            if self._last_snapshot_step != state.global_step:
                self.save_snapshot(state.global_step, state.epoch)
            if self._fit_heldout:
                self._worker.wait()
                with said_scope("train"):  # told once in training; the user's posterior too
                    fit_heldout_prior(self, model)
            self.close()
            if self.report_spectra:  # the reporters ended their runs before this event
                self._reporter.snapshots(self, args, state, control, after_end=True)
            self._log_cost(entered)
        return control

    def _log_cost(self, entered: float) -> None:
        """End of ``on_train_end`` (entered at ``entered``): add its time to
        ``callback_seconds`` and log the callback's cost as a share of the training time from
        ``on_train_begin`` to now (rank 0)."""
        if self.train_started is None:
            return
        now = time.perf_counter()
        self.callback_seconds += now - entered
        self.callback_parts["end"] += now - entered
        self.train_end_seconds = now - self.train_started
        if self.tracker is None or self.tracker.rank == 0:
            logger.info("%s", cost_line(self.callback_seconds, self.train_end_seconds,
                                        self.callback_parts))

    # -- public helpers --------------------------------------------------------------------------

    def save_snapshot(self, step: int, epoch: float | None = None, wait: bool = False) -> str:
        """Snapshot the factors now as ``<output_dir>/step-<step>/`` and return that path.

        The training thread only flushes the factors (the device path streams them through
        the GPU), lends the stored tensors to the snapshot (no copy) and reads the weights'
        fingerprint (`snapshot_hold_seconds`); their eigendecomposition and the atomic write
        run on a background thread (``background_snapshots``) unless ``wait``, and the lent
        tensors are released at the next snapshot (a flush in between writes elsewhere). A
        snapshot due while the previous one is still being written waits for it first (one in
        flight at a time).
        With several processes every rank must call it for the same step (the Trainer events
        do): each writes the shard of the factors it owns, rank 0 the manifest.
        """
        if self.tracker is None or self.output_dir is None:
            raise RuntimeError("KFACStreamCallback.save_snapshot: training has not started")
        # one snapshot in flight at a time: the one before holds the stored factors it was
        # lent until it is written, then they are released here
        self._worker.wait()
        held = time.perf_counter()
        captured = capture_snapshot(self.tracker, step, epoch, release=self._released())
        self._lent = captured.lent
        self.snapshot_hold_seconds.append(time.perf_counter() - held)
        root, comm = self.output_dir, self._comm
        eigh_device = self.tracker.settings.eigh_device
        threads = self.tracker.config.eigh_threads
        # training on a GPU: the plot in a child process, off the GIL the training thread
        # needs to keep the GPU fed (on a CPU the child's start-up would cost more)
        detached = getattr(self.tracker.store.device, "type", None) == "cuda"

        def finish() -> None:  # every rank: its own factors, in parallel; then the protocol
            try:
                path, eigvals = finish_snapshot(captured, root, comm, eigh_device, threads,
                                                gather=self.gather_shards)
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
                if self.spectra_media:
                    try:
                        # the eigenvalues just written (rank 0's factors; with others'
                        # missing, make_media loads the snapshot instead)
                        self.media[path] = make_media(path, eigvals=eigvals, detached=detached)
                    except Exception as e:  # monitoring extras never fail a run
                        logger.warning("kfac_stream: spectra media of %s failed: %s", path, e)
            self.snapshots.append(path)  # last: the monitor sees the path with its media

        self._last_snapshot_step = step
        if self.background_snapshots:
            self._worker.submit(finish)
            if wait:
                self._worker.wait()
        else:
            finish()
        return os.path.join(root, step_dir_name(step))

    def _released(self) -> dict:
        """The stored factors the last snapshot was lent, to release: call it only after
        ``self._worker.wait()`` (that snapshot is written)."""
        lent, self._lent = self._lent, {}
        return lent

    @property
    def snapshot_in_flight(self) -> bool:
        """Whether a snapshot is still being eigendecomposed or written in the background
        (never blocks; `save_snapshot` waits for it before the next one)."""
        return self._worker.busy

    def factors(self):
        """``{layer: (A, G)}`` of the live tracker (dequantised); with several ranks only the
        layers whose A and G this rank both owns (snapshots hold every factor)."""
        if self.tracker is None:
            raise RuntimeError("KFACStreamCallback.factors: training has not started")
        return self.tracker.factors()

    def close(self) -> None:
        """Finish the snapshot in flight, remove hooks, stop the background worker and release
        the private process groups (also called by ``on_train_end``); re-raises a fatal
        snapshot error only after all of that."""
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


def _seconds(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def cost_line(callback_seconds: float, train_seconds: float,
              parts: dict[str, float] | None = None) -> str:
    """The end-of-train line: the callback's seconds on the training thread and their share
    of the training time (``KFACStreamCallback.callback_seconds``, ``train_end_seconds``),
    split by ``parts`` (``callback_parts``) when given."""
    share = 100 * callback_seconds / max(train_seconds, 1e-9)
    split = "".join(f"; {_seconds(v)} s {k}" for k, v in (parts or {}).items())
    return (f"kfac_stream: {_seconds(callback_seconds)} s in the callback ({share:.1f}% of "
            f"{_seconds(train_seconds)} s training, from train begin to this line{split}); "
            "counted: the training thread inside its Trainer events (set-up, factor updates, "
            "snapshots' hold, checkpoint state, the end-of-train snapshot with its wait for the "
            "snapshot thread, the held-out fit), not the forward/backward hooks' row capture "
            "nor the snapshot thread's work while training runs")


def tracking_summary(tracker: Tracker, output_dir: str, model=None) -> str:
    """The one line the callback logs at train begin: layers, factors (dense, diagonal), the
    stack of blocks they were chosen in (with ``model``, when the blocks chose them: the
    default selection or a block preset), the Fisher and sampling settings, stored factor
    memory per rank and the snapshot directory."""
    cfg, own = tracker.config, tracker.ownership
    stack = block_stack(model) if model is not None and cfg.include is None and \
        cfg.preset in (None, "all_linear", "attention", "mlp") else None
    where = f" in stack {stack[0]} ({stack[1]} blocks)" if stack is not None else ""
    diagonal = sum(diag for _, diag in tracker.dims.values())
    per_rank = max(own.bytes_per_rank)
    ranks = tracker.world_size
    memory = (f"{_mib(per_rank)} of {cfg.storage_dtype} factors"
              + (f" on the fullest of {ranks} ranks ({_mib(sum(own.bytes_per_rank))} in all)"
                 if ranks > 1 else " on 1 rank"))
    return (f"kfac_stream: tracking {len(tracker.specs)} layers, {len(tracker.dims)} factors "
            f"({len(tracker.dims) - diagonal} dense, {diagonal} diagonal){where}, "
            f"{tracker.curvature.describe()}, token_fraction={cfg.token_fraction:g}, "
            f"ema_decay={cfg.ema_decay:g}, update_every={cfg.update_every}; {memory}; "
            f"snapshots every {cfg.snapshot_every} steps and at the end into {output_dir}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"


def _micro_batches(args) -> tuple[int, int]:
    """``(sequences per micro-batch, micro-batches per optimizer step)`` on one rank, from the
    Trainer's arguments (0 sequences: unknown)."""
    return (int(getattr(args, "per_device_train_batch_size", 0) or 0),
            int(getattr(args, "gradient_accumulation_steps", 1) or 1))


def _log_raised_share(cfg: KFACConfig, settings: Settings, state) -> None:
    """Say that this run raised the MC share (`kfac_stream.config.window_mc_share`; the same
    on every rank: it depends only on the run's arguments, and on resume as well)."""
    logger.info("kfac_stream: mc_sequences %g -> %g for this run: its %d steps at "
                "update_every=%d offer too few sequences for the final window to hold "
                "min_window_sequences=%d at %g (the replay costs more per update step "
                "on this short run; set min_window_sequences=0 to keep %g)",
                cfg.mc_sequences, settings.config.mc_sequences, state.max_steps,
                cfg.update_every, cfg.min_window_sequences, cfg.mc_sequences,
                cfg.mc_sequences)
