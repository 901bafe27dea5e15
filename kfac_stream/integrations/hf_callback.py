"""`KFACStreamCallback`: ``transformers.Trainer`` events → the calls of a `TrackingSession`
(`kfac_stream.tracking.session`, which owns the run). Here: the Trainer-specific checks at
train begin, the reporters (`spectrum_monitor`), and the callback's time on the training thread.
"""

from __future__ import annotations

import logging
import time

from torch import Tensor
from transformers import TrainerCallback

from ..config import KFACConfig
from ..exceptions import KFACConfigError
from ..tracking.heldout_config import HeldoutConfig
from ..tracking.lines import cost_line
from ..tracking.plan import RunPlan
from ..tracking.session import SessionOptions, TrackingSession
from ..tracking.tracker import Tracker
from ..utils.log_setup import show_info_by_default
from ..utils.own_rng import kept_generators
from .best_model import reloaded_best_model
from .eval_set import trainer_eval_set
from .spectrum_monitor import SpectraReporter, find_callback_handler
from .train_begin import (
    check_engine_start,
    check_train_begin,
    run_devices,
    timed,
    training_batches,
    warn_engines_not_applied,
)

logger = logging.getLogger("kfac_stream")


class KFACStreamCallback(TrainerCallback):
    """Track streaming EMA K-FAC factors during ``Trainer.train()``.

    Args:
        config: A `KFACConfig` (defaults if None).
        heldout: A `HeldoutConfig`: the held-out fit's and the queries' options (the prior
            precision fitted on the eval set, the answer tokens); None: the defaults, or
            those ``config`` was given in their old place (not both).
        report_spectra: Report each snapshot's spectra and the tracker's scalars through the
            Trainer's reporters (``report_to``), media to an active W&B run; False: no
            ``kfac`` key is logged (`kfac_stream.integrations.spectrum_monitor`).
        log_every: The tracker's scalars every this many steps; None: with the Trainer's own
            logs (``logging_steps``); 0: never.
        report_media: With ``report_spectra``, also the ``spectra_media`` to W&B.
        **options: The session's `SessionOptions`: ``background_snapshots``, ``resume_from``,
            ``spectra_media``, ``missing_state`` (``"error"`` / ``"fresh"``),
            ``earlier_runs`` (``"set_aside"`` / ``"keep"``), ``gather_shards``.

    Attributes:
        session: The `TrackingSession` that owns the run; the properties below are its
            (``callback.session.<name>`` for the rest).
        train_seconds: From ``on_train_begin`` to ``on_train_end`` (after the engine's
            start-up, which ``Trainer.train()``'s own time includes; None before the end).
        callback_seconds: The training thread's time inside this callback's events from
            ``on_train_begin`` to the end of ``on_train_end`` (not the hooks' row capture nor
            the snapshot thread's work); ``callback_parts`` splits it into ``"set-up"``,
            ``"steps"`` and ``"end"``; ``train_end_seconds`` is its base (the end-of-train
            cost line).
    """

    def __init__(self, config: KFACConfig | None = None, report_spectra: bool = True,
                 log_every: int | None = None, report_media: bool = True,
                 heldout: HeldoutConfig | None = None, **options) -> None:
        if log_every is not None and int(log_every) < 0:
            raise KFACConfigError(f"KFACStreamCallback(log_every={log_every!r}) is not allowed: "
                                  "must be None (with the Trainer's logs), 0 (never) or > 0")
        self.session = TrackingSession(config, SessionOptions(**options), heldout)
        self.report_spectra = report_spectra
        self._reporter = SpectraReporter(log_every, media=report_media)
        self.train_started: float | None = None
        self.train_seconds: float | None = None
        self.train_end_seconds: float | None = None
        self.callback_seconds = 0.0
        self.callback_parts = dict.fromkeys(("set-up", "steps", "end"), 0.0)

    # -- the session's, read here -----------------------------------------------------------

    @property
    def tracker(self) -> Tracker | None:
        """The live `Tracker` (None before train begin; kept after train end)."""
        return self.session.tracker

    @property
    def plan(self) -> RunPlan | None:
        """The run's `RunPlan` (None before train begin)."""
        return self.session.plan

    @property
    def snapshots(self) -> list[str]:
        """Paths of the snapshots written, in order."""
        return self.session.snapshots

    @property
    def output_dir(self) -> str | None:
        """The snapshot directory (None before train begin)."""
        return self.session.output_dir

    @property
    def media(self) -> dict[str, dict]:
        """``{snapshot path: histograms and PNG}`` (rank 0, ``spectra_media``)."""
        return self.session.media

    @property
    def snapshot_hold_seconds(self) -> list[float]:
        """Seconds each snapshot held the training thread."""
        return self.session.snapshot_hold_seconds

    def save_snapshot(self, step: int, epoch: float | None = None, wait: bool = False) -> str:
        """Snapshot the factors now as ``<output_dir>/step-<step>/`` and return that path
        (``wait``: until it is written; `TrackingSession.save_snapshot`)."""
        return self.session.save_snapshot(step, epoch, wait)

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer: (A [d_A, d_A], G [d_out, d_out])}`` of the live tracker, dequantised (a
        diagonal factor's a vector); with several ranks only the layers whose A and G this
        rank owns (`TrackingSession.factors`)."""
        return self.session.factors()

    def close(self) -> None:
        """Finish the snapshot in flight, remove the hooks, stop the snapshot thread
        (`TrackingSession.close`)."""
        self.session.close()

    # -- the Trainer's events ----------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        """Refuse DeepSpeed on CPU without ``use_cpu`` before its engine fails on every rank."""
        check_engine_start(args)
        return control

    @timed("set-up")
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.callback_seconds, self.train_end_seconds = 0.0, None  # `_timed` adds this event
        self.callback_parts = dict.fromkeys(self.callback_parts, 0.0)
        self.train_started = time.perf_counter()  # after the engine's start-up
        if model is None:
            raise ValueError("KFACStreamCallback needs the model (Trainer passes it)")
        handler = find_callback_handler()  # the Trainer's reporters (not given to callbacks)
        if handler is None and self.report_spectra:
            logger.info("kfac_stream: not called by a Trainer's callback handler: spectra "
                        "go only to an active W&B run")
        show_info_by_default()  # the summary below reaches a script that set up no logging
        answers = check_train_begin(self.session.config, args, model,
                                    kwargs.get("processing_class"),
                                    self.session.heldout.answer_tokens)
        self.session.close()
        self._reporter.start(handler, len(self.session.snapshots))  # not earlier runs'
        warn_engines_not_applied(model)
        self.session.start(model, args, state, answers, trainer_eval_set())
        return control

    @timed("steps")
    def on_step_begin(self, args, state, control, **kwargs):
        self.session.begin_step(state.global_step)
        return control

    @timed("steps")
    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.session.tracker is None:
            return control
        self.session.end_step(model, state.global_step, state.epoch)
        if control.should_save:
            self.session.before_checkpoint(args, state.global_step)
        if self.report_spectra:
            if control.should_training_stop:  # last step: the snapshot in flight reaches
                self.session.wait_for_snapshot()  # every reporter before they end their runs
            self._reporter.step(self.session, args, state, control)
        return control

    @timed("steps")
    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self.session.before_checkpoint(args, state.global_step)
        return control

    @timed("steps")
    def on_save(self, args, state, control, **kwargs):
        self.session.checkpoint_saved(args, state.global_step)
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        entered = time.perf_counter()  # this event's time is added below
        if self.train_started is not None:
            self.train_seconds = entered - self.train_started
        if self.session.tracker is None:
            return control
        self.session.reloaded(reloaded_best_model(args, state))  # load_best_model_at_end
        batches = training_batches(kwargs.get("train_dataloader"))  # the refresh's data
        with kept_generators(run_devices(args)):  # what runs after train() draws the same
            self.session.finish(model, state.global_step, state.epoch, batches)
        if self.report_spectra:  # the reporters ended their runs before this event
            self._reporter.snapshots(self.session, args, state, control, after_end=True)
        now = time.perf_counter()
        self.callback_seconds += now - entered
        self.callback_parts["end"] += now - entered
        self.train_end_seconds = now - (self.train_started or entered)
        if self.session.tracker.rank == 0:
            logger.info("%s", cost_line(self.callback_seconds, self.train_end_seconds,
                                        self.callback_parts, self.session.refreshed))
        return control
