"""Spectra and tracker scalars of `KFACStreamCallback`, sent through the Trainer's reporting.

`KFACStreamCallback` reports by itself (``report_spectra=True``, the default): nothing to bind,
nothing else in ``callbacks``. On the main process, for every snapshot it finishes it sends
`snapshot_metrics` (read from the manifest's per-factor ``spectrum``) and, every ``log_every``
steps, `step_metrics`, to each reporter of the Trainer: the callbacks ``report_to`` made
(W&B, TensorBoard, MLflow, Comet, ...; the same classes added by hand count too). With an
active W&B run it also logs the log10-eigenvalue histograms and the spectra PNG there.
``report_spectra=False`` turns all of it off (no ``kfac`` key is logged at all).

Metric names. The name column is what the callback logs; the reporters of W&B and TensorBoard
(and the others that use transformers' ``rewrite_logs``: Comet, ClearML, SwanLab, trackio, ...)
show every Trainer metric under ``train/``, the Trainer's ``loss`` as ``train/loss``, so these
as ``train/kfac/...`` (e.g. ``train/kfac/transformer.h.0.mlp.c_fc/A/max``); MLflow shows the
names as written. The media rows go straight to the W&B run: their names arrive as written.
``<layer>`` is the module name, ``<F>`` is ``A`` or ``G``:

=========================================  =========================  =========================
name                                       when                       value
=========================================  =========================  =========================
``kfac/<layer>/<F>/max``                   every snapshot             largest eigenvalue
``kfac/<layer>/<F>/trace``                 every snapshot             sum of the eigenvalues
``kfac/<layer>/<F>/log10_cond``            every snapshot             log10 of the condition
                                                                      number (see below)
``kfac/<layer>/<F>/eff_rank``              every snapshot             exp of the entropy of the
                                                                      normalised eigenvalues
``kfac/summary/<F>/<stat>_<agg>``          every snapshot             ``<agg>`` in ``min``,
                                                                      ``median``, ``max`` of
                                                                      ``<stat>`` over layers
``kfac/snapshot_step``                     every snapshot             the snapshot's step
``kfac/spectra_estimated``                 every snapshot             1: the statistics above
                                                                      are Lanczos estimates (a
                                                                      periodic snapshot whose
                                                                      eigendecomposition is
                                                                      deferred), 0: exact
``kfac_hist/<layer>/<F>``                  every snapshot, W&B only   ``wandb.Histogram`` of
                                                                      log10 eigenvalues > 0
                                                                      (estimated: the density's
                                                                      quantiles)
``kfac_media/spectra``                     every snapshot, W&B only   ``wandb.Image`` of the
                                                                      spectra PNG
``kfac/<layer>/<F>/live_trace``            every ``log_every`` steps  trace of the stored
                                                                      factor (this rank's)
``kfac/tracker/<counter>``                 every ``log_every`` steps  ``tokens_seen``,
                                                                      ``positions_sampled``,
                                                                      ``updates``,
                                                                      ``skipped_updates``,
                                                                      ``ms_per_step``
=========================================  =========================  =========================

``log_every``: ``None`` (the default) logs the step scalars with the Trainer's own logs (the
steps where it logs its loss, ``logging_steps``), ``N`` every ``N`` steps, ``0`` never.

Conventions:

* The condition number is logged as ``log10_cond`` only: it spans 1 to 1e12 (eigenvalues
  below ``1e-12·max`` do not count, so ``0 ≤ log10_cond < 12``), which a linear chart cannot
  show, and a zero factor's is infinite, which W&B and TensorBoard chart poorly; for a zero
  factor the key is left out of that row (and out of the summaries).
* Reporters are called directly (their ``on_log``), as ``Trainer.log`` calls them, at the
  Trainer's ``global_step``: the Trainer's console printer and ``state.log_history`` do not
  get the (many) per-layer keys, and the Trainer's own loss logs are unaffected. Media rows
  carry ``train/global_step``, the W&B step axis the Trainer's W&B reporter defines. Without
  a W&B reporter but with an active W&B run (the user's ``wandb.init``), the scalars go to
  that run too, names as written.
* A snapshot is written on a background thread, so it is usually logged at a later step
  than its own: ``kfac/snapshot_step`` says which snapshot a row describes. Snapshots up to
  the last step are reported before the reporters end their runs; one written in
  ``on_train_end`` (the last step is not a multiple of ``snapshot_every``, or a callback stopped
  training) comes after, and reaches W&B and TensorBoard only. The PNG is written next to the
  snapshot directory as ``<snapshot dir>.spectra.png``. Histograms and PNG are made on the
  snapshot thread (``spectra_media=True``, matplotlib for the PNG; ``report_media=False``
  keeps them out of W&B), so the training thread reads only the manifest.
* The reporters are found on the call stack of the Trainer's ``on_train_begin`` event (the
  Trainer's callback handler; callbacks are not given the Trainer). Where there is none
  (callback events called by hand), the scalars go only to an active W&B run.
"""

from __future__ import annotations

import inspect
import math
import statistics
import sys
from typing import TYPE_CHECKING, Any

from transformers.integrations import INTEGRATION_TO_CALLBACK, TensorBoardCallback, WandbCallback
from transformers.trainer_callback import CallbackHandler

from ..snapshot.manifest_types import Manifest, Spectrum
from ..snapshot.snapshot import read_manifest
from ..utils.factor_keys import FACTOR_KINDS, split_factor_key

if TYPE_CHECKING:
    from ..tracking.session import TrackingSession

FACTORS = FACTOR_KINDS
STATS = ("max", "trace", "log10_cond", "eff_rank")
AGGREGATES = {"min": min, "median": statistics.median, "max": max}
COUNTERS = ("tokens_seen", "positions_sampled", "updates", "skipped_updates")
#: The Trainer's reporting integrations (``report_to`` names -> callback classes).
REPORTERS = tuple(INTEGRATION_TO_CALLBACK.values())
#: Reporters that still take logs after their own ``on_train_end`` (the final snapshot).
AFTER_END = (WandbCallback, TensorBoardCallback)
#: The keyword arguments the Trainer's callback handler gives every event.
_EVENT_KWARGS = ("model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader",
                 "eval_dataloader")


def factor_stats(spectrum: Spectrum) -> dict[str, float]:
    """The logged statistics of one factor from its manifest ``spectrum`` entry
    (``log10_cond`` in place of ``cond``, absent when ``cond`` is infinite)."""
    out = {stat: float(getattr(spectrum, stat)) for stat in ("max", "trace", "eff_rank")}
    if math.isfinite(spectrum.cond):
        out["log10_cond"] = math.log10(spectrum.cond)
    return out


def snapshot_metrics(manifest: Manifest, prefix: str = "kfac") -> dict[str, float]:
    """Per-factor spectrum statistics, their summaries over layers and the snapshot's step.

    Args:
        manifest: A snapshot's manifest (``Snapshot.manifest``, `read_manifest`).
        prefix: First component of every name (see the module's table).
    """
    per_factor = {(layer, f): factor_stats(getattr(entry, f).spectrum)
                  for layer, entry in manifest.layers.items() for f in FACTORS}
    out = {f"{prefix}/{layer}/{f}/{stat}": value
           for (layer, f), stats in per_factor.items() for stat, value in stats.items()}
    for f in FACTORS:
        for stat in STATS:
            values = [s[stat] for (_, g), s in per_factor.items() if g == f and stat in s]
            if values:
                out.update({f"{prefix}/summary/{f}/{stat}_{name}": float(agg(values))
                            for name, agg in AGGREGATES.items()})
    out[f"{prefix}/snapshot_step"] = float(manifest.step)
    # 1: the snapshot's eigendecomposition was deferred, its statistics are Lanczos estimates
    # (`kfac_stream.snapshot.spectra_estimate`); 0: exact, from its eigenvalues
    eigen = manifest.eigen
    out[f"{prefix}/spectra_estimated"] = float(eigen is not None and not eigen.in_run)
    return out


def step_metrics(tracker, prefix: str = "kfac", steps: int | None = None) -> dict[str, float]:
    """Cheap scalars between snapshots: stored-factor traces and tracker counters.

    ``live_trace`` is ``sum(diag) · scale`` of the factors this rank owns as folded so far
    (updates still pending a fold are not in it; under asynchronous updates, i.e. on GPU, it
    is read without waiting for the update in flight).

    Args:
        tracker: A `kfac_stream.tracking.tracker.Tracker` (``KFACStreamCallback.tracker``).
        prefix: First component of every name.
        steps: Training steps the tracker has timed (``end_step`` calls) since it was made;
            ``ms_per_step`` (``tracker_seconds / steps``) is left out without it.
    """
    record = tracker.export(factors=False)
    out = {}
    for key, trace in record.traces.items():
        layer, f = split_factor_key(key)
        out[f"{prefix}/{layer}/{f}/live_trace"] = trace
    counters = record.counters
    out.update({f"{prefix}/tracker/{name}": float(getattr(counters, name)) for name in COUNTERS})
    if steps:
        out[f"{prefix}/tracker/ms_per_step"] = 1e3 * counters.tracker_seconds / steps
    return out


def find_callback_handler(depth: int = 12) -> CallbackHandler | None:
    """The Trainer's ``CallbackHandler`` on the call stack of the current callback event, or
    None: a ``TrainerCallback`` is not given the Trainer, but each event is called from the
    handler's ``call_event`` (whose callbacks include the reporters)."""
    return find_on_stack(CallbackHandler, depth + 1)


def find_on_stack(kind: type, depth: int) -> object | None:
    """The first ``self`` of type ``kind`` among the ``depth`` callers of the caller, or
    None."""
    frame = inspect.currentframe()
    try:
        frame = frame.f_back if frame is not None else None  # the caller's frame: skipped
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, kind):
                return owner
        return None
    finally:
        del frame  # no reference cycle through the frames


class SpectraReporter:
    """Sends one `KFACStreamCallback`'s snapshot and step metrics to the Trainer's reporters
    (see the module's docstring); the callback drives it from its events.

    Args:
        log_every: Step metrics every this many steps; None: at the Trainer's logging steps
            (``control.should_log`` as the K-FAC callback's ``on_step_end`` sees it); 0: never.
        media: With an active W&B run, log the histograms and PNG the K-FAC callback made.
        prefix: First component of every metric name.
    """

    def __init__(self, log_every: int | None = None, media: bool = True,
                 prefix: str = "kfac") -> None:
        self.log_every = None if log_every is None else int(log_every)
        self.media = media
        self.prefix = prefix
        self.handler: CallbackHandler | None = None
        self.logged = 0  # how many of the callback's snapshots have been handled
        self.steps = 0  # training steps since start (for ms_per_step)

    def start(self, handler: CallbackHandler | None, logged: int) -> None:
        """A new ``Trainer.train()``: report through ``handler`` (None: to W&B only); the first
        ``logged`` snapshots are older ones, not reported again."""
        self.handler, self.logged, self.steps = handler, logged, 0

    def reporters(self, after_end: bool = False) -> list:
        """The handler's reporting callbacks (``after_end``: those that take logs after their
        ``on_train_end``)."""
        callbacks = [] if self.handler is None else list(self.handler.callbacks)
        return [cb for cb in callbacks
                if isinstance(cb, AFTER_END if after_end else REPORTERS)]

    def step(self, session: TrackingSession, args, state, control) -> None:
        """``on_step_end``: the snapshots finished since the last call, then maybe
        `step_metrics`."""
        self.steps += 1
        self.snapshots(session, args, state, control)
        every = self.log_every
        due = (control.should_log if every is None
               else every > 0 and state.global_step % every == 0)
        if (due and session.tracker is not None and state.is_world_process_zero
                and (self.reporters() or _active_wandb_run() is not None)):
            self.emit(args, state, control,
                      step_metrics(session.tracker, self.prefix, self.steps), {})

    def snapshots(self, session: TrackingSession, args, state, control,
                  after_end: bool = False) -> None:
        """Report each snapshot of ``session`` finished since the last call (main process)."""
        paths = session.snapshots[self.logged:]  # appended by the snapshot thread
        self.logged += len(paths)
        if not paths or not state.is_world_process_zero or (
                not self.reporters(after_end) and _active_wandb_run() is None):
            return  # nowhere to report: not even the manifest is read
        for path in paths:
            manifest = read_manifest(path)  # the manifest only: cheap on the training thread
            media = self._snapshot_media(manifest, session.media.get(path)) if self.media else {}
            self.emit(args, state, control, snapshot_metrics(manifest, self.prefix), media,
                      after_end=after_end)

    def _snapshot_media(self, manifest: Manifest, made: dict | None) -> dict[str, Any]:
        """W&B objects for the histograms and PNG the K-FAC callback made on its snapshot
        thread (``KFACStreamCallback.media``); nothing without an active W&B run."""
        if made is None or _active_wandb_run() is None:
            return {}
        import wandb

        out: dict[str, Any] = {
            f"{self.prefix}_hist/{key}": wandb.Histogram(np_histogram=hist)
            for key, hist in made["histograms"].items()}
        if made["png"]:
            out[f"{self.prefix}_media/spectra"] = wandb.Image(made["png"],
                                                              caption=f"step {manifest.step}")
        return out

    def emit(self, args, state, control, scalars: dict[str, float], media: dict[str, Any],
             after_end: bool = False) -> None:
        """Scalars to every reporter (their ``on_log``, as ``Trainer.log`` calls it); media
        (and the scalars, when no reporter writes to W&B) to the active W&B run."""
        reporters = self.reporters(after_end)
        # after the reporters' on_train_end: TensorBoard re-opens the writer it closed there
        reopened = [cb for cb in reporters
                    if after_end and isinstance(cb, TensorBoardCallback) and cb.tb_writer is None]
        kwargs = {name: getattr(self.handler, name, None) for name in _EVENT_KWARGS}
        should_log = control.should_log  # the Trainer's own (loss) log of this step
        for cb in reporters:
            cb.on_log(args, state, control, logs=dict(scalars), **kwargs)
        control.should_log = should_log
        for cb in reopened:
            cb.on_train_end(args, state, control)
        run = _active_wandb_run()
        if run is None:
            return
        row = dict(media)
        if not any(isinstance(cb, WandbCallback) for cb in reporters):
            row.update(scalars)
        if row and self.handler is not None:
            row["train/global_step"] = state.global_step
        if row:
            run.log(row)


def _active_wandb_run():
    """``wandb.run`` if wandb is imported and a run is active (never imports wandb)."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None
