r"""Moving each rank's sampled rows, or its partial statistics, to the owner of every factor.

::

    rank 0: rows_A0 [n0, d]  ─┐                       owner of key (say rank 1):
    rank 1: rows_A1 [n1, d]  ─┼─ "rows":  gather ───▶  cat(rows_A0, rows_A1, ...) [Σn, d]
    rank 2: rows_A2 [n2, d]  ─┘  "stats": reduce ──▶  Σ_r rows_rᵀ rows_r [d, d], Σ_r n_r

Either way the owner's statistic is exactly what one process would compute on the union of
all ranks' sampled positions (token-weighted: uneven ``n_r``, and ``n_r = 0``, are exact).
Which is cheaper depends on the layer: the rows strategy sends ``(N - n_owner)·d`` numbers to
the owner, the statistics strategy ``(W - 1)·d²`` (``d`` for a diagonal factor): with a few
percent of the tokens sampled, rows win for every factor wider than the sampled row count.
`choose_strategy` picks per factor and update from the row counts all ranks share first.

This module (with ``ownership``) is the only place that calls ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..stats.covariance import gram
from .ownership import Ownership


def rows_bytes(counts: Sequence[int], owner: int, d: int, elem_bytes: int) -> int:
    """Bytes the rows strategy moves to ``owner``: every other rank's ``[n_r, d]`` rows."""
    return sum(n for r, n in enumerate(counts) if r != owner) * d * elem_bytes


def stats_bytes(world_size: int, d: int, diagonal: bool, elem_bytes: int) -> int:
    """Bytes the statistics strategy moves: ``W - 1`` partial sums of ``d²`` (or ``d``)."""
    return (world_size - 1) * (d if diagonal else d * d) * elem_bytes


def choose_strategy(counts: Sequence[int], owner: int, d: int, diagonal: bool,
                    elem_bytes: int) -> str:
    """``"rows"`` or ``"stats"``, whichever moves fewer bytes (ties: rows)."""
    rb = rows_bytes(counts, owner, d, elem_bytes)
    sb = stats_bytes(len(counts), d, diagonal, elem_bytes)
    return "rows" if rb <= sb else "stats"


def all_ranks_agree(flag: bool, group=None) -> bool:
    """True only if ``flag`` is True on every rank (e.g. "my statistics are finite")."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


_FP16_TARGET = 2.0**14  # largest transported magnitude (fp16 overflows at 65504)


def transport_exponent(rows: Tensor) -> int:
    """``e`` such that ``rows · 2^-e`` has its largest magnitude in ``(2^13, 2^14]`` (0 if all
    zero): a power of two, so scaling is exact and only the fp16 rounding remains."""
    amax = float(rows.abs().max()) if rows.numel() else 0.0
    return math.ceil(math.log2(amax / _FP16_TARGET)) if amax > 0 else 0


@dataclass
class Exchanged:
    """What `exchange_to_owners` delivered to this rank.

    Attributes:
        ok: False if any rank reported ``ok=False`` (nothing was moved then).
        owned: For keys this rank owns with ``N = Σ n_r > 0``: ``("rows", rows [N, d])`` or
            ``("stats", (sum [d, d] or [d], N))``.
        totals: ``{key: N}`` for every key (all ranks see the same).
        bytes_moved: Payload bytes this rank sent to owners for this update (padding included).
        bytes_rows, bytes_stats: What the rows / the statistics strategy would move in total
            over all ranks for this update (counts known to all ranks), for reports.
    """

    ok: bool
    owned: dict[str, tuple[str, object]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    bytes_rows: int = 0
    bytes_stats: int = 0


def exchange_to_owners(local: dict[str, Tensor], dims: dict[str, tuple[int, bool]],
                       ownership: Ownership, rank: int, world_size: int, group=None,
                       strategy: str | None = None, ok: bool = True,
                       transport: torch.dtype | None = None,
                       dtype: torch.dtype | None = None) -> Exchanged:
    """Bring every factor's rows (or partial sums) to its owner.

    Collective: every rank calls it with the same keys (``dims``), in the same order. One
    ``all_gather`` of a small int64 table (row counts, transport exponents, ``ok``) comes
    first, so all ranks agree on the strategy, the padding and whether to skip; then one
    ``gather`` (rows) or ``reduce`` (statistics) per factor.

    Args:
        local: ``{key: rows [n_r, d]}`` on this rank (a missing key means ``n_r = 0``); A rows
            already carry their bias column; CPU tensors, one float dtype.
        dims: ``{key: (d, diagonal)}`` for every factor.
        ownership: Who owns which key.
        rank, world_size: This process's place.
        strategy: Force ``"rows"`` or ``"stats"`` (tests, benchmarks); default per factor.
        ok: This rank's statistics are usable (finite, loss scale known); if any rank says
            False, every rank skips the update and nothing else is sent.
        transport: ``torch.float16`` sends rows as fp16 scaled by a power of two per rank and
            factor (relative rounding 2^-11 per entry, the storage's own); None sends them in
            their dtype. Partial statistics always travel in the rows' dtype (sums of
            squares need its range and precision).
        dtype: The rows' dtype on every rank (default: that of ``local``, else float32). Pass
            it: a rank with no rows at all must still send buffers of the others' dtype.
    """
    keys = list(dims)
    dtype = dtype or next((t.dtype for t in local.values()), torch.float32)
    k = len(keys)
    mine = torch.zeros(2 * k + 1, dtype=torch.int64)  # counts | exponents | ok
    for j, key in enumerate(keys):
        if key in local and ok:
            mine[j] = local[key].shape[0]
            if transport is not None:
                mine[k + j] = transport_exponent(local[key])
    mine[2 * k] = int(ok)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every)  # [W, 2K+1]
    result = Exchanged(ok=bool(table[:, 2 * k].min().item()))
    if not result.ok:
        return result
    wire = transport or dtype
    for j, key in enumerate(keys):
        d, diagonal = dims[key]
        owner = ownership.owner[key]
        per_rank = table[:, j].tolist()
        total = sum(per_rank)
        result.totals[key] = total
        if total == 0:
            continue
        rows = local.get(key, torch.zeros(0, d, dtype=dtype))
        esize = torch.tensor([], dtype=wire).element_size()
        result.bytes_rows += rows_bytes(per_rank, owner, d, esize)
        result.bytes_stats += stats_bytes(world_size, d, diagonal, rows.element_size())
        how = strategy or choose_strategy(per_rank, owner, d, diagonal, esize)
        if how == "rows":
            width = max(per_rank)
            padded = torch.zeros(width, d, dtype=wire)
            exps = table[:, k + j].tolist()
            if transport is not None:
                padded[: rows.shape[0]] = rows * 2.0 ** -exps[rank]
            else:
                padded[: rows.shape[0]] = rows
            bucket = [torch.zeros_like(padded) for _ in range(world_size)] if rank == owner else None
            dist.gather(padded, bucket, dst=owner, group=group)
            if rank != owner:
                result.bytes_moved += padded.numel() * esize
            else:
                parts = [b[:n].to(dtype) for b, n in zip(bucket, per_rank)]
                if transport is not None:
                    parts = [p.mul_(2.0 ** e) for p, e in zip(parts, exps)]
                result.owned[key] = ("rows", torch.cat(parts))
        else:
            # summed in float64 whatever the rows' dtype (order-independent to its rounding)
            part = gram(rows.double(), diagonal).to(dtype)  # [d] or [d, d]
            dist.reduce(part, dst=owner, op=dist.ReduceOp.SUM, group=group)
            if rank != owner:
                result.bytes_moved += part.numel() * part.element_size()
            else:
                result.owned[key] = ("stats", (part, total))
    return result
