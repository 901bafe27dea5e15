"""`Tracker`: capture → step statistics → EMA store, independent of the HF Trainer.

Per optimizer step ``k`` (counted from 0): ``begin_step(k)`` arms the hooks if ``k`` is an
update step (``k % update_every == 0``); the micro-batches' forward/backward passes collect
rows; ``end_step(model)`` runs the MC passes (``fisher="mc"``), checks every row for NaN/Inf
(a non-finite step is skipped whole and counted), divides the gradient rows by the pass's loss
scale ``c``, and folds ``S_A = ĀᵀĀ/n``, ``S_G = GᵀG/n`` (``n`` = positions of the update,
union over micro-batches) into the EMA of every factor this rank owns — on a background thread
when ``async_updates`` is on, so the step waits only when the tracker is a whole update behind.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .capture.hooks import CaptureHooks
from .capture.selection import LayerSpec
from .config import KFACConfig
from .distributed.ownership import Ownership, assign_owners
from .mc import mc_fisher_pass
from .stats.covariance import all_finite, with_bias_column
from .store.factor_store import FactorStore

logger = logging.getLogger("kfac_stream")

_BYTES = {"float16": 2, "float32": 4, "float64": 8}


@dataclass
class Counters:
    """Running totals, written into every snapshot manifest."""

    tokens_seen: int = 0  # usable positions of every training forward pass
    positions_sampled: int = 0  # positions folded into the factors
    updates: int = 0
    skipped_updates: int = 0  # steps dropped for NaN/Inf statistics or a bad loss scale
    tracker_seconds: float = 0.0  # time spent on the training thread in end_step
    skipped_steps: list[int] = field(default_factory=list)


class Tracker:
    """Streams K-FAC factors of the tracked layers of ``model`` into a CPU store."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module],
                 specs: dict[str, LayerSpec], config: KFACConfig, rank: int = 0,
                 world_size: int = 1) -> None:
        self.config = config
        self.specs = specs
        self.rank, self.world_size = rank, world_size
        self.row_dtype = torch.float64 if config.storage_dtype == "float64" else torch.float32
        self.capture = CaptureHooks(model, layers, config.token_fraction, config.seed,
                                    self.row_dtype)
        self.capture.scale_warning = self._warn_scale
        self.mc_generator = torch.Generator().manual_seed(config.seed + 1)
        self.counters = Counters()
        self.step: int | None = None
        self.is_update_step = False
        self._warned_scale = False
        dims = {}
        for name, s in specs.items():
            dims[f"{name}.A"] = (s.a_dim, s.a_dim > config.max_dense_dim)
            dims[f"{name}.G"] = (s.g_dim, s.g_dim > config.max_dense_dim)
        self.ownership: Ownership = assign_owners(dims, world_size, _BYTES[config.storage_dtype])
        self.store = FactorStore(config.storage_dtype, config.ema_decay)
        for key in self.ownership.owned_by(rank):
            self.store.add(key, *dims[key])
        self._async = bool(config.async_updates)
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._worker_error: BaseException | None = None
        if self._async:
            self._queue = queue.Queue(maxsize=1)
            self._worker = threading.Thread(target=self._work, name="kfac-stream-ema",
                                            daemon=True)
            self._worker.start()

    # -- step protocol -------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Arm the hooks for optimizer step ``step`` (0-based) if it is an update step."""
        self.step = step
        self.is_update_step = step % self.config.update_every == 0
        mc = self.config.fisher == "mc"
        self.capture.take()
        self.capture.capturing = self.is_update_step and not mc
        self.capture.record_inputs = self.is_update_step and mc

    def end_step(self, model: nn.Module) -> bool:
        """Finish the step; returns True if the factors were updated."""
        t0 = time.perf_counter()
        try:
            if not self.is_update_step:
                self.capture.take()
                return False
            if self.config.fisher == "mc":
                _, inputs = self.capture.take()
                self.capture.record_inputs = False
                for kwargs in inputs:
                    mc_fisher_pass(model, self.capture, kwargs, self.mc_generator)
            passes, _ = self.capture.take()
            self.capture.capturing = self.capture.record_inputs = False
            job = self._collect(passes)
            if job is None:
                return False
            self._submit(job)
            return True
        finally:
            self.is_update_step = False
            self.counters.tokens_seen = self.capture.tokens_seen
            self.counters.tracker_seconds += time.perf_counter() - t0

    def _collect(self, passes) -> dict[str, tuple[Tensor, Tensor]] | None:
        a_rows: dict[str, list[Tensor]] = {}
        g_rows: dict[str, list[Tensor]] = {}
        bad_scale = False
        for rec in passes:
            if not rec.rows:
                continue
            c = rec.scale
            if c is None and all(not bool(g.any()) for pairs in rec.rows.values()
                                 for _, g in pairs):
                c = 1.0  # no loss term reached this micro-batch: g = 0, any c will do
            if c is None or not (c > 0.0) or c == float("inf"):
                bad_scale = True
                continue
            for name, pairs in rec.rows.items():
                for a, g in pairs:
                    a_rows.setdefault(name, []).append(a)
                    g_rows.setdefault(name, []).append(g.div_(c) if c != 1.0 else g)
        if not a_rows and not bad_scale:
            return None
        job = {name: (_cat(a_rows[name]), _cat(g_rows[name])) for name in a_rows}
        tensors = [t for pair in job.values() for t in pair]
        if bad_scale or not all_finite(tensors):
            self.counters.skipped_updates += 1
            self.counters.skipped_steps.append(int(self.step or 0))
            logger.warning("kfac_stream: step %s has non-finite statistics (or loss scale); "
                           "skipped for the factors (%d skipped so far)", self.step,
                           self.counters.skipped_updates)
            return None
        return job

    # -- factor arithmetic (training thread or worker) -------------------------------------------

    def _submit(self, job: dict[str, tuple[Tensor, Tensor]]) -> None:
        n = next(iter(job.values()))[0].shape[0]
        self.counters.updates += 1
        self.counters.positions_sampled += int(n)
        if self._queue is None:
            self._apply(job)
            return
        self._raise_worker_error()
        if any(t.is_cuda for pair in job.values() for t in pair):
            job = _to_pinned_cpu(job)
        self._queue.put(job)  # blocks only if the previous update is still being applied

    def _apply(self, job) -> None:
        owned = self.store.factors
        for name, (a, g) in job.items():
            spec = self.specs[name]
            for key, rows, bias in ((f"{name}.A", a, spec.has_bias), (f"{name}.G", g, False)):
                if key not in owned:
                    continue
                if isinstance(rows, tuple):  # (pinned tensor, cuda event)
                    rows[1].synchronize()
                    rows = rows[0]
                self.store.push_rows(key, with_bias_column(rows) if bias else rows)  # [n, d]

    def _work(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._worker_error is None:
                    self._apply(job)
            except BaseException as e:  # surfaced on the training thread at the next call
                self._worker_error = e
            finally:
                self._queue.task_done()

    def _raise_worker_error(self) -> None:
        if self._worker_error is not None:
            raise RuntimeError("kfac_stream background update failed") from self._worker_error

    def flush(self) -> None:
        """Wait until every submitted update is in the store."""
        if self._queue is not None:
            self._queue.join()
        self._raise_worker_error()
        self.store.flush()

    def close(self) -> None:
        """Flush, stop the worker and remove every hook."""
        try:
            self.flush()
        finally:
            if self._queue is not None and self._worker is not None:
                self._queue.put(None)
                self._worker.join()
                self._queue = None
            self.capture.remove()

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer: (A, G)}`` dequantised (float32, float64 for float64 storage); owned only."""
        self.flush()
        vals = self.store.values()
        return {n: (vals[f"{n}.A"], vals[f"{n}.G"]) for n in self.specs
                if f"{n}.A" in vals and f"{n}.G" in vals}

    def _warn_scale(self, residual: float) -> None:
        if not self._warned_scale:
            self._warned_scale = True
            logger.warning(
                "kfac_stream: the logits' gradient is not a scaled cross-entropy gradient "
                "(relative residual %.2e): label smoothing or per-token loss weights make the "
                "empirical-Fisher G scale approximate", residual)


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _to_pinned_cpu(job):
    """Start non-blocking device→host copies into pinned buffers; the worker waits on events."""
    out = {}
    for name, pair in job.items():
        moved = []
        for t in pair:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            moved.append((buf, event))
        out[name] = tuple(moved)
    return out
