"""The tracker's cost from layer shapes: what one update and one flush do, counted with the
store's own per-operation formulas (`kfac_stream.store.fold_cost`).

`update_cost` and `flush_cost` return a `Traffic` (the fields the store counts as it runs),
so a prediction and a run's counters compare field by field
(``tests/unit/store/test_cost_model.py``).
``benchmarks/scale.py`` turns them into seconds for a 7B model on 8 GPUs with named device
rates.
"""

from __future__ import annotations

from collections.abc import Mapping

from .fold_cost import (
    accumulate_bytes,
    accumulate_flops,
    flush_bytes,
    flush_chunks,
    host_fold_entries,
    pending_rmw_bytes,
)
from .traffic import Traffic

#: The fields that add up over operations (the rest are gauges).
ADDITIVE = ("device_folds", "fold_flops", "fold_device_bytes", "bytes_to_host",
            "bytes_to_device", "host_entries", "flushes", "factor_flushes", "budget_flushes",
            "flush_chunks", "flush_copies", "flush_syncs", "deferred_folds", "group_folds")


def add(total: Traffic, part: Traffic, times: int = 1) -> Traffic:
    """``total`` plus ``times`` × ``part`` (additive fields), in place; returns ``total``."""
    for name in ADDITIVE:
        setattr(total, name, getattr(total, name) + times * getattr(part, name))
    return total


def flush_cost(dims: Mapping[str, tuple[int, bool]], itemsize: int) -> Traffic:
    """One flush of every factor in ``dims`` (``{key: (d, diagonal)}``, each with pending
    statistics) through the device: chunks, two copies per chunk, the stored bytes each way,
    one host read, no host arithmetic (a snapshot's flush too: it lends the stored tensors
    instead of copying them, `FactorStore.state_dict`)."""
    out = Traffic()
    for d, diagonal in dims.values():
        chunks = flush_chunks(d, diagonal)
        out.flush_chunks += chunks
        out.flush_copies += 2 * chunks
        out.bytes_to_device += flush_bytes(d, diagonal, itemsize)
        out.bytes_to_host += flush_bytes(d, diagonal, itemsize)
        out.factor_flushes += 1
    if dims:
        out.flushes, out.flush_syncs = 1, 1
    return out


def held_fold_cost(dims: Mapping[str, tuple[int, bool]], acc_bytes: int = 4) -> Traffic:
    """One fold of held rows into the pending sums of the dense factors in ``dims`` (the
    deferred Gram, `kfac_stream.store.device_groups`): one read-modify-write of each."""
    out = Traffic()
    for d, diagonal in dims.values():
        if not diagonal:
            out.deferred_folds += 1
            out.fold_device_bytes += pending_rmw_bytes(d, diagonal, acc_bytes)
    return out


def update_cost(dims: Mapping[str, tuple[int, bool]], rows: Mapping[str, int], *,
                fold_on: str = "device", resident: Mapping[str, bool] | None = None,
                itemsize: int = 2, in_bytes: int = 2, acc_bytes: int = 4,
                fused: bool = False, summed: Mapping[str, bool] | None = None,
                host_folds: Mapping[str, bool] | None = None, defer: int = 1,
                kinds_apart: bool = True) -> Traffic:
    """One update of the factors in ``dims`` this rank owns.

    Args:
        dims: ``{key: (d, diagonal)}``.
        rows: ``{key: m}`` rows folded per factor (a factor with ``m = 0`` gets no update).
        fold_on: ``"device"`` (accumulations; a factor not ``resident`` is flushed at once)
            or ``"host"`` (a host fold over the factor's entries when ``host_folds[key]``:
            the host path folds every ``flush_every`` updates or when its pending rows reach
            ``d``).
        resident: ``{key: bool}`` (default: all resident).
        itemsize: Bytes per stored entry (2: float16).
        in_bytes, acc_bytes: Bytes per row entry and per pending-statistic entry.
        fused: The Gram goes straight into the pending sum (float32 rows; 16-bit rows on CUDA
            are not fused).
        summed: ``{key: True}`` for factors whose payload is a summed statistic (diagonal
            factors; the exchange's statistics strategy) instead of rows.
        defer: Updates per deferred fold (`RunPlan.fold_defer`): above 1 a resident dense
            factor's rows are held, their read-modify-write counted by `held_fold_cost`
            once per fold instead of here.
        kinds_apart: The resident dense factors with rows fold as groups of one side and
            kind (A or G: one process, where `tracking.collect` stacks them), or of one side
            (False: several ranks, where the owner stacks what the exchange delivered):
            ``group_folds`` counts them.
    """
    out = Traffic()
    resident = resident or {}
    summed = summed or {}
    forced = {}
    for key, (d, diagonal) in dims.items():
        m = int(rows.get(key, 0))
        if m <= 0:
            continue
        if fold_on == "host":
            if (host_folds or {}).get(key, False):
                out.host_entries += host_fold_entries(d, diagonal)
            continue
        how = "stats" if summed.get(key, diagonal) else "rows"
        out.device_folds += 1
        out.fold_flops += accumulate_flops(how, d, diagonal, m if how == "rows" else 0)
        held = defer > 1 and how == "rows" and not diagonal and resident.get(key, True)
        out.fold_device_bytes += accumulate_bytes(
            how, d, diagonal, m if how == "rows" else 0,
            in_bytes=in_bytes if how == "rows" else acc_bytes, acc_bytes=acc_bytes,
            fused=fused or held, deferred=held)
        if not resident.get(key, True):
            forced[key] = (d, diagonal)
    out.group_folds = len({(key[-1] if kinds_apart else "", d) for key, (d, diagonal)
                           in dims.items() if int(rows.get(key, 0)) > 0 and not diagonal
                           and not summed.get(key, False) and resident.get(key, True)
                           and fold_on == "device"})
    if forced:
        add(out, flush_cost(forced, itemsize))
        out.budget_flushes += len(forced)
    return out
