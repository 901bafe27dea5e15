"""Applying the factor updates: the worker thread that exchanges each step's contribution with
the factors' owners and folds it into the CPU store.

The training thread hands one `UpdateJob` per update step to `FactorUpdater.submit` (see
`kfac_stream.tracking.tracker`). Everything in a job is still on the rows' device; the updater
reads its flags once (is it finite, how much weight per factor), on its own thread and CUDA
stream when ``async_updates`` is on (the default on CUDA), after the event recorded at the end of
the step.
With several ranks it exchanges rows or partial statistics with the owners
(`distributed.exchange`; a non-finite statistic on any rank skips the update on all of them),
then folds the second moments where `kfac_stream.store.folding.Folding` says (on the GPU into
pending statistics resident on the device, which reach the FP16 CPU `FactorStore` only when a
reader flushes or the device budget forces it; on CPU the store folds rows itself).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..distributed.context import DistContext
from ..distributed.exchange import (
    ExchangeRequest,
    PendingExchange,
    finish_exchange,
    start_exchange,
)
from ..distributed.ownership import Ownership
from ..store.factor_store import FactorStore
from ..store.folding import Folding, gram_fp32  # noqa: F401 (gram_fp32: re-exported)
from ..store.traffic import Traffic
from .plan import RunPlan, WindowPlan

logger = logging.getLogger("kfac_stream")


@dataclass
class Counters(Traffic):
    """Running totals, written into every snapshot manifest (with the store's `Traffic`)."""

    tokens_seen: int = 0  # usable positions of every training forward pass (read lazily)
    sequences_seen: int = 0  # sequences with a usable position, of the same passes
    target_tokens_seen: int = 0  # usable decoder positions of the same (an encoder-decoder's)
    positions_sampled: int = 0  # positions folded into the factors
    updates: int = 0
    skipped_updates: int = 0  # steps dropped for NaN/Inf statistics or a bad loss scale
    tracker_seconds: float = 0.0  # time spent on the training thread in end_step
    comm_bytes: int = 0  # bytes this rank sent to factor owners (multi-process only)
    exchange_seconds: float = 0.0  # time in the exchange collectives (multi-process only)
    fold_seconds: float = 0.0  # time folding rows/statistics into the owned factors
    flush_seconds: float = 0.0  # time in flushes that readers asked for (snapshots, exports)
    wait_seconds: float = 0.0  # time the training thread waited for the factor worker
    waits: int = 0  # update steps that waited for the factor worker
    snapshot_failures: int = 0  # snapshots abandoned (non-fatal unless fail_on_snapshot_error)
    # bytes the rows / the statistics exchange strategy would move over all ranks, summed
    # over updates (the same on every rank; multi-process only): what `exchange` chooses from
    exchange_bytes_rows: int = 0
    exchange_bytes_stats: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    # the step of the update that restarted the average for the final window (-1: none yet)
    window_start_step: int = -1
    # sequences each update's statistics come from (all ranks; 0: unknown) and how many the
    # planned final window holds (0: no window); see KFACConfig.min_window_sequences
    sequences_per_update: int = 0
    window_sequences: int = 0


@dataclass(frozen=True)
class RowGroup:
    """Rows of dense factors of one side, stacked, with one weight and count (the update's
    ``weights`` / ``positions`` entry of each key is the same 0-dim tensor).

    Attributes:
        keys: The factors, in the order of the first axis.
        rows: ``[G, m, d]`` weighted rows (see `UpdateJob.rows`).
    """

    keys: tuple[str, ...]
    rows: Tensor


@dataclass
class UpdateJob:
    """One update step's local contribution, handed from the training thread to the updater.

    Every tensor is on the rows' device and may still be being computed there (``event``).

    Attributes:
        step: Optimizer step.
        rows: ``{factor key: rows [m, d]}``, each row multiplied by the square root of its
            sampling weight, G rows divided by their pass's loss scale; A rows with the bias
            column. Keys absent: no rows on this rank.
        weights: ``{factor key: 0-dim Σ weights}`` (the EMA's ``n``).
        positions: ``{factor key: 0-dim count of sampled non-padding positions}``.
        ok: 0-dim bool: finite statistics and every pass's loss scale known.
        residual: 0-dim largest loss-scale fit residual (empirical Fisher), or None.
        event: CUDA event recorded after the job's tensors were queued, on the model device's
            current stream (None on CPU).
        exchange: With several ranks, the exchange's collectives as issued by the training
            thread (`FactorUpdater.submit`); the worker waits for them.
        issue_seconds: Time the training thread took to issue them.
        sums: ``{factor key: Σ_s w_s x_s⊙x_s [d]}`` of the diagonal factors (float32, float64
            for float64 storage): reduced in the hooks, they never travel as rows.
        groups: Rows of dense factors of one side stacked (`RowGroup`; their keys are not in
            ``rows``): folded as one group on the device path.
        agree: Host ints for the exchange's table (`ExchangeRequest.extra`: the EK-FAC
            basis this rank holds ready).
        agreed: Every rank's ``agree`` (``[W][E]``), filled in when the exchange is issued.
    """

    step: int
    rows: dict[str, Tensor]
    weights: dict[str, Tensor]
    positions: dict[str, Tensor]
    ok: Tensor
    residual: Tensor | None = None
    event: object = None
    sums: dict[str, Tensor] = field(default_factory=dict)
    exchange: PendingExchange | None = None
    issue_seconds: float = 0.0
    groups: list[RowGroup] = field(default_factory=list)
    agree: tuple[int, ...] = ()
    agreed: list[list[int]] = field(default_factory=list)

    def all_rows(self) -> dict[str, Tensor]:
        """``{factor key: rows [m, d]}`` of every factor with rows, the groups' as views."""
        out = dict(self.rows)
        for group in self.groups:
            out.update(zip(group.keys, group.rows.unbind(0)))
        return out


class FactorUpdater:
    """Applies `UpdateJob` s to this rank's owned factors, on a worker thread or inline.

    Args:
        run: The run's plan (`kfac_stream.tracking.plan.RunPlan`; its resolved config's
            ``storage_dtype``, ``ema_decay``, ``exchange`` and the knobs named in the
            slow-worker warning, ``async_updates`` and the device budget).
        dims: ``{key: (side, diagonal)}`` of every factor (all ranks').
        ownership: Which rank owns each factor.
        dist: Rank and process groups (None: one process).
        device: The rows' device.
        folding: Where second moments are formed and the EMA runs.
        counters: The tracker's running totals, updated here (updates, skips, exchange and
            fold time, bytes, waits).
        reserved: Bytes of the device budget the tracker's EK-FAC state holds (`Residency`).

    Attributes:
        store: The `FactorStore` of the factors this rank owns.
    """

    def __init__(self, run: RunPlan, dims: dict[str, tuple[int, bool]],
                 ownership: Ownership, dist: DistContext | None, device: torch.device,
                 folding: Folding, counters: Counters, reserved: int = 0) -> None:
        config = run.config
        self.config, self.dims, self.ownership, self.dist = config, dims, ownership, dist
        self.rank, self.world_size = (dist.rank, dist.world_size) if dist else (0, 1)
        self.device, self.folding = device, folding
        self.counters = counters
        self.restart_step: int | None = None  # the final window's first step (set_final_window)
        self.window_plan: WindowPlan | None = None
        on_device = folding.on == "device"
        self.store = FactorStore(config.storage_dtype, config.ema_decay,
                                 device=device if on_device else None,
                                 device_budget=run.device_budget, traffic=counters,
                                 defer=run.fold_defer, reserved=reserved)
        for key in ownership.owned_by(self.rank):
            self.store.add(key, *dims[key])
        self._warned_scale = False
        self._warned_wait = False
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._worker_error: BaseException | None = None
        self._task: Future | None = None  # inline: the ordered task in flight (`run_in_order`)
        if run.async_updates:
            self._queue = queue.Queue(maxsize=1)
            self._worker = threading.Thread(target=self._work, name="kfac-stream-ema",
                                            daemon=True)
            self._worker.start()

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream updates run on (None on CPU)."""
        return self._stream

    @property
    def worker(self) -> threading.Thread | None:
        """The worker thread (None without ``async_updates``; stopped after `close`)."""
        return self._worker

    def submit(self, job: UpdateJob, step_seconds: float) -> None:
        """Apply ``job`` (at once without ``async_updates``; else hand it to the worker, waiting
        only while the previous update is still being applied). A wait longer than 2% of a
        step (``step_seconds``, 0: unknown) is counted, and logged the first time.

        With several ranks, call it on the training thread at the same point of every update
        step on every rank: it issues the exchange's collectives here (`start_exchange`,
        asynchronous, on the side stream after ``job.event``), so they are ordered the same
        way relative to the training's own collectives on every rank; the worker only waits
        for them."""
        if self.dist is not None:
            self._raise_worker_error()
            t0 = time.perf_counter()
            job.exchange = self._start_exchange(job)
            job.agreed = job.exchange.result.extra  # every rank's ``agree``, known now
            job.issue_seconds = time.perf_counter() - t0  # counted by the applying thread
        if self._queue is None:
            self.settle()
            self._apply(job)
            return
        self._raise_worker_error()
        t0 = time.perf_counter()
        self._queue.put(job)  # blocks only if the previous update is still being applied
        waited = time.perf_counter() - t0
        if step_seconds > 0 and waited > max(0.02 * step_seconds, 1e-3):
            self.counters.waits += 1
            self.counters.wait_seconds += waited
            if not self._warned_wait:
                self._warned_wait = True
                self._warn_slow(job.step, waited, step_seconds)

    def _warn_slow(self, step: int, waited: float, step_seconds: float) -> None:
        c, every = self.counters, self.config.update_every
        per_update = (c.exchange_seconds + c.fold_seconds) / max(c.updates, 1)
        logger.warning(
            "kfac_stream: step %(step)s waited %(waited).3f s for the factor worker: one update "
            "takes %(per_update).3f s (exchange %(exchange).3f s, fold %(fold).3f s per update) "
            "but arrives every %(every)d step(s) of %(step_seconds).3f s. Raise update_every "
            "(now %(every)d), lower token_fraction (now %(fraction)g) or max_dense_dim (now "
            "%(max_dense)d, larger factors are kept diagonal). Waits are counted in "
            "counts.waits / counts.wait_seconds; logged once.",
            {"step": step, "waited": waited, "per_update": per_update,
             "exchange": c.exchange_seconds / max(c.updates, 1),
             "fold": c.fold_seconds / max(c.updates, 1), "every": every,
             "step_seconds": step_seconds, "fraction": self.config.token_fraction,
             "max_dense": self.config.max_dense_dim})

    def _start_exchange(self, job: UpdateJob) -> PendingExchange:
        """Issue ``job``'s exchange (training thread; no host read of a device value): on CUDA
        under the updater's side stream, which first waits for ``job.event``."""
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:
            if job.event is not None:
                self._stream.wait_event(job.event)
            transport = torch.float16 if self.config.storage_dtype == "float16" else None
            return start_exchange(ExchangeRequest(
                job.all_rows(), self.dims, self.ownership, self.rank, self.world_size,
                group=self.dist.exchange_group,
                strategy=None if self.config.exchange == "auto" else self.config.exchange,
                ok=job.ok, transport=transport, weights=job.weights, positions=job.positions,
                device=self.device, gram_fn=self.folding.partial_gram, sums=job.sums,
                plan_group=self.dist.plan_group, extra=job.agree))

    def _apply(self, job: UpdateJob) -> None:
        """Read the job's flags (the one host read of an update), exchange (several ranks),
        fold this rank's owned factors; skips are shared."""
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:
            if job.event is not None:
                self._stream.wait_event(job.event)
            try:
                self._apply_on_stream(job)
            finally:
                if self._stream is not None:
                    self._stream.synchronize()  # job tensors are free to reuse afterwards

    def _apply_on_stream(self, job: UpdateJob) -> None:
        keys = list(job.rows) + [k for g in job.groups for k in g.keys] + list(job.sums)
        read = _Read(self.device)  # one host read of every flag and weight
        ok_at = read.add(job.ok)
        weight_at = {k: read.add(job.weights[k]) for k in keys}
        position_at = {k: read.add(job.positions[k]) for k in keys}
        residual_at = read.add(job.residual) if job.residual is not None else None
        values = read.values()
        ok = values[ok_at] > 0
        weights = {k: values[i] for k, i in weight_at.items()}
        positions = {k: int(values[i]) for k, i in position_at.items()}
        if residual_at is not None and ok:
            self._warn_scale(values[residual_at])
        t0 = time.perf_counter()
        groups: list[RowGroup] = []
        if self.dist is None:
            if not ok:
                self._skip(job.step)
                return
            delivered = {k: ("rows", v) for k, v in job.rows.items() if k in self.store}
            delivered.update({k: ("stats", (v, weights[k])) for k, v in job.sums.items()
                              if k in self.store})
            for group in job.groups:
                if all(k in self.store for k in group.keys):
                    groups.append(group)
                else:
                    delivered.update((k, ("rows", r)) for k, r in
                                     zip(group.keys, group.rows.unbind(0)) if k in self.store)
            total_pos = max(positions.values(), default=0)
        else:
            assert job.exchange is not None, "submit issues the exchange"
            ex = finish_exchange(job.exchange)
            job.exchange = None
            if not ex.ok:
                self._skip(job.step)
                return
            delivered = ex.owned
            weights, positions = ex.weights, ex.positions
            total_pos = max(ex.positions.values(), default=0)
            self.counters.comm_bytes += ex.bytes_moved
            self.counters.exchange_bytes_rows += ex.bytes_rows
            self.counters.exchange_bytes_stats += ex.bytes_stats
            self.counters.exchange_seconds += time.perf_counter() - t0 + job.issue_seconds
        if not any(w > 0 for w in weights.values()):  # every sampled slot was padding
            return
        self.counters.updates += 1
        self.counters.positions_sampled += int(total_pos)
        t1 = time.perf_counter()
        decay = self.decay_at(job.step)
        if decay == 0.0:  # the final window's restart (every factor of this update)
            self.counters.window_start_step = int(job.step)
        if self.dist is not None:
            groups, delivered = regroup(delivered, weights, positions)
        for group in groups:
            n, pos = weights[group.keys[0]], positions[group.keys[0]]
            if n > 0:
                self.folding.deliver_group(self.store, group.keys, group.rows, n=n,
                                           positions=pos, decay=decay)
        for key, (how, payload) in delivered.items():
            n, pos = weights[key], positions[key]
            if n <= 0:
                continue
            self.folding.deliver(self.store, key, how, payload if how == "rows" else payload[0],
                                 n=n, positions=pos, decay=decay)
        self.folding.end_update(self.store)
        self.counters.fold_seconds += time.perf_counter() - t1

    def set_final_window(self, window: WindowPlan | None) -> int | None:
        """Use the final window ``window`` (`kfac_stream.tracking.plan.plan_window`; None: the
        EMA throughout). Call it after restoring a checkpoint's counters: a window start
        restored from a run planned with another ``max_steps`` before this plan's restart step
        is dropped. Returns the restart step."""
        self.window_plan = window
        self.restart_step = None if window is None else window.restart_step
        # a window restored from a checkpoint counts only if it started within this plan's
        # window (a run resumed with another max_steps plans its own; the restart discards
        # the state before it, so the result is that of an uninterrupted run of this plan)
        started = self.counters.window_start_step
        if started >= 0 and (self.restart_step is None or started < self.restart_step):
            self.counters.window_start_step = -1
        return self.restart_step

    def decay_at(self, step: int) -> float | None:
        """``λ`` of the update at ``step``: None (``ema_decay``) before the final window; in it
        0 for the first update applied (the restart: the factors become that update's
        statistic; `Counters.window_start_step` records its step, and rides with checkpoints),
        1 after it (the exact token-weighted mean over the window's updates)."""
        r = self.restart_step
        if r is None or step < r:
            return None
        return 0.0 if self.counters.window_start_step < 0 else 1.0

    def _skip(self, step: int) -> None:
        self.counters.skipped_updates += 1
        self.counters.skipped_steps.append(step)
        where = f" on at least one of {self.world_size} ranks" if self.world_size > 1 else ""
        logger.warning("kfac_stream: step %s has non-finite statistics (or loss scale)%s; "
                       "skipped for the factors (%d skipped so far)", step, where,
                       self.counters.skipped_updates)

    def run_in_order(self, task: Callable[[], object]) -> Future:
        """Run ``task`` after every update submitted so far and before any submitted later,
        and return its `Future` (its result or its error; the training thread does not wait).

        With ``async_updates`` it is an item of the worker's queue, run on the worker thread
        (the training thread only enqueues it; the updates after it wait in the queue).
        Inline, it runs on a thread of its own, and the next `submit`, `wait` or `flush`
        (anything that touches the store) waits for it first. ``task`` may call `fold_now`
        (not `flush`: that waits for the queue the task is in)."""
        future: Future = Future()

        def on_stream() -> object:  # where the pending statistics were accumulated
            if self._stream is None:
                return task()
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self._stream):
                return task()

        if self._queue is not None:
            self._raise_worker_error()
            self._queue.put(_Task(on_stream, future))
            return future
        self.settle()
        self._task = future
        threading.Thread(target=_Task(on_stream, future).run, name="kfac-stream-capture",
                         daemon=True).start()
        return future

    def settle(self) -> None:
        """Inline: wait for the task `run_in_order` started, if any (its error stays in its
        future, for whoever asked for it)."""
        task, self._task = self._task, None
        if task is not None:
            task.exception()  # waits

    def _work(self) -> None:
        assert self._queue is not None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if isinstance(job, _Task):
                    job.run()
                elif self._worker_error is None:
                    self._apply(job)
            except BaseException as e:  # surfaced on the training thread at the next call
                self._worker_error = e
            finally:
                self._queue.task_done()

    def _raise_worker_error(self) -> None:
        if self._worker_error is not None:
            raise RuntimeError("kfac_stream background update failed") from self._worker_error

    def wait(self) -> None:
        """Wait until every submitted update is in the store (pending folds stay pending)."""
        self.settle()
        if self._queue is not None:
            self._queue.join()
        self._raise_worker_error()

    def flush(self) -> None:
        """Wait until every submitted update is in the store, folded."""
        self.wait()
        self.fold_now()

    def fold_now(self) -> None:
        """Fold every pending statistic into the store now, on this thread (under the
        updater's stream), without waiting for the queue: `flush` after the wait, or a task of
        `run_in_order` (which the queue has reached)."""
        t0 = time.perf_counter()
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:  # the pending statistics were accumulated on the updater's stream
            self.store.flush()
        self.counters.flush_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Flush, then stop the worker thread."""
        try:
            self.flush()
        finally:
            if self._queue is not None and self._worker is not None:
                self._queue.put(None)
                self._worker.join()
                self._queue = None

    def _warn_scale(self, residual: float) -> None:
        if residual > 1e-2 and not self._warned_scale:
            self._warned_scale = True
            logger.warning(
                "kfac_stream: the logits' gradient is not a scaled cross-entropy gradient "
                "(relative residual %.2e): label smoothing or per-token loss weights make the "
                "empirical-Fisher G scale approximate", residual)


@dataclass
class _Task:
    """A `FactorUpdater.run_in_order` task and the future its outcome goes to."""

    fn: Callable[[], object]
    future: Future

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as e:  # for whoever waits on the future
            self.future.set_exception(e)


class _Read:
    """Device scalars read on the host in one go, each distinct tensor once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._at: dict[int, int] = {}
        self._tensors: list[Tensor] = []

    def add(self, t: Tensor) -> int:
        """Queue ``t`` (0-dim); returns its place in `values`."""
        if id(t) not in self._at:
            self._at[id(t)] = len(self._tensors)
            self._tensors.append(t)
        return self._at[id(t)]

    def values(self) -> list[float]:
        return torch.stack([t.to(device=self.device, dtype=torch.float64)
                            for t in self._tensors]).tolist()


def regroup(delivered: dict[str, tuple[str, object]], weights: dict[str, float],
            positions: dict[str, int]) -> tuple[list[RowGroup], dict[str, tuple[str, object]]]:
    """The delivered dense rows (``{key: ("rows", [m, d])}``) of one shape, dtype, weight and
    count stacked into `RowGroup` s (one op per group); the rest as they were."""
    buckets: dict[tuple, list[str]] = {}
    for key, (how, payload) in delivered.items():
        if how == "rows" and payload.dim() == 2:
            sig = (tuple(payload.shape), payload.dtype, weights[key], positions[key])
            buckets.setdefault(sig, []).append(key)
    groups, rest = [], dict(delivered)
    for keys in buckets.values():
        groups.append(RowGroup(tuple(keys), torch.stack([rest.pop(k)[1] for k in keys])))
    return groups, rest
