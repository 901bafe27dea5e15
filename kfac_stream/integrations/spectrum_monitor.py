"""Spectrum monitoring: curvature statistics of every snapshot to W&B, TensorBoard, MLflow...

`SpectrumMonitor` is a ``TrainerCallback`` placed after the `KFACStreamCallback` in the
Trainer's callback list. For each snapshot the K-FAC callback finishes it logs
`snapshot_metrics` (from the manifest's per-factor ``spectrum``) through ``Trainer.log``
(every reporter of the Trainer receives them) and, when a W&B run is active, histograms of the
log10 eigenvalues and a PNG of the spectra. Only the main process logs.

Metric names (``prefix="kfac"``; ``<layer>`` is the module name, ``<F>`` is ``A`` or ``G``):

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
``kfac_hist/<layer>/<F>``                  every snapshot, W&B only   ``wandb.Histogram`` of
                                                                      log10 eigenvalues > 0
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

Conventions:

* The condition number is logged as ``log10_cond`` only: it spans 1 to 1e12 (eigenvalues
  below ``1e-12·max`` do not count, so ``0 ≤ log10_cond < 12``), which a linear chart cannot
  show, and a zero factor's is infinite, which W&B and TensorBoard chart poorly; for a zero
  factor the key is left out of that row (and out of the summaries).
* The Trainer's W&B and TensorBoard reporters prefix every key with ``train/``
  (``train/kfac/...``); W&B rows written here directly (media; scalars when the Trainer does
  not report to W&B or no Trainer is bound) use the names above, media rows with the
  Trainer's ``train/global_step`` axis when the Trainer reports to W&B.
* A snapshot is written on a background thread, so it is usually logged at a later step
  than its own: ``kfac/snapshot_step`` says which snapshot a row describes. The PNG is written
  next to the snapshot directory as ``<snapshot dir>.spectra.png``. Histograms and PNG are
  made by `KFACStreamCallback` on its snapshot thread (``spectra_media=True``, matplotlib for
  the PNG), so this callback reads only the manifest on the training thread.
"""

from __future__ import annotations

import math
import statistics
import sys
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback, WandbCallback

from ..factor_keys import FACTOR_KINDS, split_factor_key
from ..snapshot.snapshot import read_manifest

if TYPE_CHECKING:
    from .hf_callback import KFACStreamCallback

FACTORS = FACTOR_KINDS
STATS = ("max", "trace", "log10_cond", "eff_rank")
AGGREGATES = {"min": min, "median": statistics.median, "max": max}
COUNTERS = ("tokens_seen", "positions_sampled", "updates", "skipped_updates")


def factor_stats(spectrum: dict[str, float]) -> dict[str, float]:
    """The logged statistics of one factor from its manifest ``spectrum`` entry
    (``log10_cond`` in place of ``cond``, absent when ``cond`` is infinite)."""
    out = {stat: float(spectrum[stat]) for stat in ("max", "trace", "eff_rank")}
    if math.isfinite(spectrum["cond"]):
        out["log10_cond"] = math.log10(spectrum["cond"])
    return out


def snapshot_metrics(meta: dict[str, Any], prefix: str = "kfac") -> dict[str, float]:
    """Per-factor spectrum statistics, their summaries over layers and the snapshot's step.

    Args:
        meta: A snapshot manifest (``Snapshot.meta``).
        prefix: First component of every name (see the module's table).
    """
    per_factor = {(layer, f): factor_stats(entry[f]["spectrum"])
                  for layer, entry in meta["layers"].items() for f in FACTORS}
    out = {f"{prefix}/{layer}/{f}/{stat}": value
           for (layer, f), stats in per_factor.items() for stat, value in stats.items()}
    for f in FACTORS:
        for stat in STATS:
            values = [s[stat] for (_, g), s in per_factor.items() if g == f and stat in s]
            if values:
                out.update({f"{prefix}/summary/{f}/{stat}_{name}": float(agg(values))
                            for name, agg in AGGREGATES.items()})
    out[f"{prefix}/snapshot_step"] = float(meta["step"])
    return out


def step_metrics(tracker, prefix: str = "kfac", steps: int | None = None) -> dict[str, float]:
    """Cheap scalars between snapshots: stored-factor traces and tracker counters.

    ``live_trace`` is ``sum(diag) · scale`` of the factors this rank owns as folded so far
    (updates still pending a fold are not in it; under asynchronous updates, i.e. on GPU, it
    is read without waiting for the update in flight).

    Args:
        tracker: A `kfac_stream.tracker.Tracker` (``KFACStreamCallback.tracker``).
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


class SpectrumMonitor(TrainerCallback):
    """Log every snapshot's spectrum statistics (and media) while a Trainer trains.

    Place it after ``kfac`` in the Trainer's callbacks (the final snapshot is finished in the
    K-FAC callback's ``on_train_end``) and bind the Trainer (``bind`` or ``trainer=``) so
    scalars go through ``Trainer.log``; unbound, they go to the active W&B run, if any.

    Args:
        kfac: The `KFACStreamCallback` whose snapshots are logged.
        trainer: The ``transformers.Trainer`` to log through (or call `bind` later).
        log_every: Also log `step_metrics` every this many steps (0: never).
        media: With an active W&B run, log the log10-eigenvalue histograms and the spectra
            PNG that ``kfac`` made on its snapshot thread (``spectra_media``).
        prefix: First component of every metric name.
    """

    def __init__(self, kfac: KFACStreamCallback, trainer=None, log_every: int = 0,
                 media: bool = True, prefix: str = "kfac") -> None:
        self.kfac = kfac
        self.trainer = trainer
        self.log_every = int(log_every)
        self.media = media
        self.prefix = prefix
        self.logged = 0  # how many of kfac.snapshots have been handled
        self._steps = 0

    def bind(self, trainer) -> SpectrumMonitor:
        """Log through ``trainer.log`` from now on; returns ``self``."""
        self.trainer = trainer
        return self

    # -- Trainer events --------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self._steps = 0
        if self.trainer is not None:
            callbacks = self.trainer.callback_handler.callbacks
            if self.kfac in callbacks and self in callbacks and (
                    callbacks.index(self) < callbacks.index(self.kfac)):
                raise ValueError("SpectrumMonitor must come after its KFACStreamCallback in "
                                 "the Trainer's callbacks (it logs the snapshots that one "
                                 "finishes, the last one in its on_train_end)")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._steps += 1
        self._log_new_snapshots(state, control)
        tracker = self.kfac.tracker
        if (self.log_every > 0 and state.global_step % self.log_every == 0
                and tracker is not None and state.is_world_process_zero):
            self._emit(state, control, step_metrics(tracker, self.prefix, self._steps), {})
        return control

    def on_train_end(self, args, state, control, **kwargs):
        # TensorBoardCallback closed its writer in its own on_train_end (reporters run before
        # user callbacks); Trainer.log re-opens it: close it again once logged.
        closed = [cb for cb in self._callbacks() if isinstance(cb, TensorBoardCallback)
                  and cb.tb_writer is None]
        self._log_new_snapshots(state, control)
        for cb in closed:
            cb.on_train_end(args, state, control)
        return control

    # -- logging ---------------------------------------------------------------------------------

    def _callbacks(self) -> list:
        return [] if self.trainer is None else list(self.trainer.callback_handler.callbacks)

    def _log_new_snapshots(self, state, control) -> None:
        paths = self.kfac.snapshots[self.logged:]  # appended by the snapshot thread
        self.logged += len(paths)
        if state.is_world_process_zero:
            for path in paths:
                self._log_snapshot(state, control, path)

    def _log_snapshot(self, state, control, path: str) -> None:
        meta = read_manifest(path)  # the manifest only: cheap on the training thread
        media = self._snapshot_media(meta, self.kfac.media.get(path)) if self.media else {}
        self._emit(state, control, snapshot_metrics(meta, self.prefix), media)

    def _snapshot_media(self, meta: dict[str, Any], made: dict | None) -> dict[str, Any]:
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
                                                              caption=f"step {meta['step']}")
        return out

    def _emit(self, state, control, scalars: dict[str, float], media: dict[str, Any]) -> None:
        """Scalars through the Trainer; media (and scalars the Trainer does not send to W&B)
        straight to the active W&B run."""
        trainer_to_wandb = False
        if self.trainer is not None:
            should_log = control.should_log
            self.trainer.log(dict(scalars))  # Trainer.log adds "epoch" to the dict it gets
            # CallbackHandler.on_log clears should_log, which would drop the Trainer's own
            # (loss) log of this step, decided in DefaultFlowCallback.on_step_end
            control.should_log = should_log
            trainer_to_wandb = any(isinstance(cb, WandbCallback) for cb in self._callbacks())
        run = _active_wandb_run()
        if run is None:
            return
        row = dict(media)
        if not trainer_to_wandb:
            row.update(scalars)
        elif row:
            row["train/global_step"] = state.global_step
        if row:
            run.log(row)


def _active_wandb_run():
    """``wandb.run`` if wandb is imported and a run is active (never imports wandb)."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None
