"""`Tracker`: capture → step statistics → EMA store, independent of the HF Trainer.

Per optimizer step ``k`` (counted from 0): ``begin_step(k)`` arms the hooks if ``k`` is an
update step (``k % update_every == 0``); the micro-batches' forward/backward passes collect
rows; ``end_step(model)`` runs the MC passes (``fisher="mc"``), checks every row for NaN/Inf
(a non-finite step is skipped whole and counted), divides the gradient rows by the pass's loss
scale ``c``, and folds ``S_A = ĀᵀĀ/n``, ``S_G = GᵀG/n`` (``n`` = positions of the update,
union over micro-batches) into the EMA of every factor this rank owns — on a background thread
when ``async_updates`` is on, so the step waits only when the tracker is a whole update behind.

With several ranks (``dist_ctx``), each factor has one owner (`distributed.ownership`); at every
update step each rank hands its local rows to `distributed.exchange`, which brings the rows (or
partial sums) of all ranks to each owner, so the owner folds exactly the union of all ranks'
sampled positions. A non-finite statistic on any rank skips the update on all of them.
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
from .distributed.context import DistContext
from .distributed.exchange import exchange_to_owners
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
    comm_bytes: int = 0  # bytes this rank sent to factor owners (multi-process only)
    exchange_seconds: float = 0.0  # time in the exchange collectives (multi-process only)
    fold_seconds: float = 0.0  # time folding rows/statistics into the owned factors
    snapshot_failures: int = 0  # snapshots abandoned (non-fatal unless fail_on_snapshot_error)
    skipped_steps: list[int] = field(default_factory=list)


@dataclass
class UpdateJob:
    """One update step's local contribution, handed from the training thread to `_apply`.

    Attributes:
        step: Optimizer step.
        rows: ``{layer: (a [n, d_in], g [n, d_out])}`` with ``g`` divided by the loss scale;
            ``n`` may be 0 on this rank (then the layer is absent).
        ok: This rank's statistics are finite and every pass's loss scale is known.
    """

    step: int
    rows: dict[str, tuple[Tensor, Tensor]]
    ok: bool = True


class Tracker:
    """Streams K-FAC factors of the tracked layers of ``model`` into a CPU store."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module],
                 specs: dict[str, LayerSpec], config: KFACConfig,
                 dist_ctx: DistContext | None = None) -> None:
        self.config = config
        self.specs = specs
        self.dist = dist_ctx
        self.rank, self.world_size = (dist_ctx.rank, dist_ctx.world_size) if dist_ctx else (0, 1)
        self.row_dtype = torch.float64 if config.storage_dtype == "float64" else torch.float32
        seed = config.seed + 1_000_003 * self.rank  # independent streams per rank
        self.capture = CaptureHooks(model, layers, config.token_fraction, seed, self.row_dtype)
        self.capture.scale_warning = self._warn_scale
        self.mc_generator = torch.Generator().manual_seed(seed + 1)
        self.counters = Counters()
        self.step: int | None = None
        self.is_update_step = False
        self._warned_scale = False
        dims = {}
        for name, s in specs.items():
            dims[f"{name}.A"] = (s.a_dim, s.a_dim > config.max_dense_dim)
            dims[f"{name}.G"] = (s.g_dim, s.g_dim > config.max_dense_dim)
        self.dims: dict[str, tuple[int, bool]] = dims  # {key: (side, diagonal)}, every factor
        self.ownership: Ownership = assign_owners(dims, self.world_size,
                                                  _BYTES[config.storage_dtype])
        self.store = FactorStore(config.storage_dtype, config.ema_decay)
        for key in self.ownership.owned_by(self.rank):
            self.store.add(key, *dims[key])
        self.exchange_strategy: str | None = None  # None: per factor by bytes (tests force)
        self.last_exchange = None  # the latest `Exchanged` report (multi-process; benchmarks)
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
        """Finish the step; returns True if an update was handed to the store.

        With several ranks every rank hands one over on every update step (possibly with no
        rows of its own): the exchange is collective, and the skip decision is shared.
        """
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

    def _collect(self, passes) -> UpdateJob | None:
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
        if not a_rows and not bad_scale and self.world_size == 1:
            return None
        rows = {name: (_cat(a_rows[name]), _cat(g_rows[name])) for name in a_rows}
        ok = not bad_scale and all_finite([t for pair in rows.values() for t in pair])
        return UpdateJob(int(self.step or 0), rows if ok else {}, ok)

    # -- factor arithmetic (training thread or worker) -------------------------------------------

    def _submit(self, job: UpdateJob) -> None:
        if self._queue is None:
            self._apply(job)
            return
        self._raise_worker_error()
        if any(t.is_cuda for pair in job.rows.values() for t in pair):
            job.rows = _to_pinned_cpu(job.rows)
        self._queue.put(job)  # blocks only if the previous update is still being applied

    def _apply(self, job: UpdateJob) -> None:
        """Exchange (several ranks), then fold this rank's owned factors; skips are shared."""
        rows = {name: tuple(_on_cpu(t) for t in pair) for name, pair in job.rows.items()}
        local: dict[str, Tensor] = {}  # {factor key: rows [n, d]}, A with its bias column
        for name, (a, g) in rows.items():
            local[f"{name}.A"] = with_bias_column(a) if self.specs[name].has_bias else a
            local[f"{name}.G"] = g
        t0 = time.perf_counter()
        if self.dist is None:
            if not job.ok:
                self._skip(job.step)
                return
            delivered = {k: ("rows", v) for k, v in local.items() if k in self.store.factors}
            total = max((v.shape[0] for v in local.values()), default=0)
        else:
            transport = torch.float16 if self.config.storage_dtype == "float16" else None
            ex = exchange_to_owners(local, self.dims, self.ownership, self.rank,
                                    self.world_size, self.dist.exchange_group,
                                    self.exchange_strategy, job.ok, transport, self.row_dtype)
            if not ex.ok:
                self._skip(job.step)
                return
            self.last_exchange = ex
            delivered = ex.owned
            total = max(ex.totals.values(), default=0)
            self.counters.comm_bytes += ex.bytes_moved
            self.counters.exchange_seconds += time.perf_counter() - t0
        if total == 0:
            return
        self.counters.updates += 1
        self.counters.positions_sampled += int(total)
        t1 = time.perf_counter()
        for key, (how, payload) in delivered.items():
            if how == "rows":
                self.store.push_rows(key, payload)  # [n, d]
            else:
                stat, n = payload
                self.store.update(key, stat.div_(n), n)
        self.counters.fold_seconds += time.perf_counter() - t1

    def _skip(self, step: int) -> None:
        self.counters.skipped_updates += 1
        self.counters.skipped_steps.append(step)
        where = f" on at least one of {self.world_size} ranks" if self.world_size > 1 else ""
        logger.warning("kfac_stream: step %s has non-finite statistics (or loss scale)%s; "
                       "skipped for the factors (%d skipped so far)", step, where,
                       self.counters.skipped_updates)

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
        t0 = time.perf_counter()
        self.store.flush()
        self.counters.fold_seconds += time.perf_counter() - t0

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


def _on_cpu(t) -> Tensor:
    """A CPU tensor from a CPU tensor, a device tensor, or a (pinned buffer, event) pair."""
    if isinstance(t, tuple):
        t[1].synchronize()
        return t[0]
    return t.cpu()


def _to_pinned_cpu(rows):
    """Start non-blocking device→host copies into pinned buffers; the worker waits on events."""
    out = {}
    for name, pair in rows.items():
        moved = []
        for t in pair:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            moved.append((buf, event))
        out[name] = tuple(moved)
    return out
