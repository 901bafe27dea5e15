"""Per-operation cost formulas of the factor store, from shapes alone.

The store counts its work with these (`Traffic`) as it runs, from the actual row counts and
dtypes; the cost model (`store.cost_model`) sums the same formulas over a model's layer shapes
and an update's expected row counts. One formula per operation, so the two cannot drift.
"""

from __future__ import annotations

import math

#: Gaussian probes per dense factor for its spread (`FactorState.spread`): the sketch's
#: relative error is about ``sqrt(2 / (p · effective rank))``
PROBES = 8

#: Entries of one chunk of a factor streamed through the device by a flush (4 Mi: 8 MiB of
#: float16 each way, 16 MiB of float32 work space per buffer slot).
CHUNK_ENTRIES = 1 << 22


def probe_columns(d: int) -> int:
    """Columns ``p`` of a dense factor's probes: ``d`` (the identity, exact) when ``d ≤
    4·PROBES``, else ``PROBES``."""
    return d if d <= 4 * PROBES else PROBES


def chunk_rows(d: int, diagonal: bool) -> int:
    """Rows of a factor per flush chunk (a diagonal factor is one chunk)."""
    return d if diagonal else max(1, min(d, CHUNK_ENTRIES // d))


def flush_chunks(d: int, diagonal: bool) -> int:
    """Chunks one factor's flush streams through the device."""
    return math.ceil(d / chunk_rows(d, diagonal))


def entries(d: int, diagonal: bool) -> int:
    """Stored entries of a factor: ``d²`` or ``d``."""
    return d if diagonal else d * d


def flush_bytes(d: int, diagonal: bool, itemsize: int) -> int:
    """Bytes one factor's flush moves each way (the stored entries, ``itemsize`` each)."""
    return entries(d, diagonal) * itemsize


def accumulate_flops(how: str, d: int, diagonal: bool, m: int) -> int:
    """FLOPs of one accumulation into a pending statistic (`device_fold.accumulate`).

    ``how="rows"`` (``m`` rows): the Gram ``XᵀX`` (``2·m·d²``, ``2·m·d`` diagonal), the
    scaled add into the pending sum (``2·d²``) and the sketch ``Xᵀ(XZ)`` (``4·m·d·p``);
    ``how="stats"`` (a summed statistic): the scaled add and the sketch ``S Z``
    (``2·d²·p``; a diagonal's is exact, ``2·d``)."""
    n = entries(d, diagonal)
    if diagonal:
        gram = 2 * m * d if how == "rows" else 0
        return gram + 2 * n + 2 * d
    p = probe_columns(d)
    if how == "rows":
        return 2 * m * n + 2 * n + 4 * m * d * p
    return 2 * n + 2 * n * p


def pending_rmw_bytes(d: int, diagonal: bool, acc_bytes: int) -> int:
    """Device bytes of one read-modify-write of a pending sum (``2·acc_bytes·entries``)."""
    return 2 * acc_bytes * entries(d, diagonal)


def accumulate_bytes(how: str, d: int, diagonal: bool, m: int, in_bytes: int,
                     acc_bytes: int, fused: bool, deferred: bool = False) -> int:
    """Device memory traffic of one accumulation: the pending sum read and written once
    (``2·acc_bytes·entries``), the payload read (rows ``m·d``, twice for ``XᵀX``; a summed
    statistic once), unless the Gram is fused into the pending sum (``fused``: a float32
    ``addmm_``) its float32 result written and read back (``8·entries``), and the sketch:
    16-bit rows copied to float32 (``m·d·(in_bytes + 4)``) and read twice (``8·m·d``) for
    ``Xᵀ(XZ)``, or a summed statistic read once more for ``S Z``. ``deferred`` (rows held
    for a later fold, `device_groups`): no read-modify-write now (`pending_rmw_bytes`, counted
    once per held fold) but the held rows read, scaled and written once more
    (``2·m·d·in_bytes``) and their norms read (``m·d·4``)."""
    n = entries(d, diagonal)
    if deferred:
        held = 2 * m * d * in_bytes + 4 * m * d
        return accumulate_bytes(how, d, diagonal, m, in_bytes=in_bytes, acc_bytes=acc_bytes,
                                fused=fused) \
            - pending_rmw_bytes(d, diagonal, acc_bytes) + held
    payload = 2 * m * d * in_bytes if how == "rows" else n * in_bytes
    temp = 0 if (fused or how != "rows") else 8 * n
    if how == "rows":
        sketch = (0 if in_bytes >= 4 else m * d * (in_bytes + 4)) + 8 * m * d
    else:
        sketch = n * in_bytes
    return 2 * acc_bytes * n + payload + temp + sketch


def host_fold_entries(d: int, diagonal: bool) -> int:
    """Stored entries one host fold reads and writes (the host path's per-fold work)."""
    return entries(d, diagonal)
