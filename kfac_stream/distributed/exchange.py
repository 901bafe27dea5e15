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
    first, so all ranks agree on the strategy, the padding and whether to skip; then, per
    owner, one ``gather`` of all its rows-strategy factors and one ``reduce`` of all its
    statistics-strategy factors, each as one flat buffer (at most ``2·W`` collectives per
    update, not one per factor: the exchange is latency-bound).

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
    esize = torch.tensor([], dtype=wire).element_size()
    plans: list[_Plan] = []
    for j, key in enumerate(keys):
        d, diagonal = dims[key]
        owner = ownership.owner[key]
        per_rank = table[:, j].tolist()
        total = sum(per_rank)
        result.totals[key] = total
        if total == 0:
            continue
        rows = local.get(key, torch.zeros(0, d, dtype=dtype))
        result.bytes_rows += rows_bytes(per_rank, owner, d, esize)
        result.bytes_stats += stats_bytes(world_size, d, diagonal, rows.element_size())
        how = strategy or choose_strategy(per_rank, owner, d, diagonal, esize)
        plans.append(_Plan(key, j, d, diagonal, owner, per_rank, how, rows))
    for owner in range(world_size):  # every rank walks the owners and plans in one order
        to_owner = [p for p in plans if p.owner == owner]
        rows_plans = [p for p in to_owner if p.how == "rows"]
        stats_plans = [p for p in to_owner if p.how == "stats"]
        if rows_plans:
            _gather_rows(rows_plans, table, k, rank, owner, wire, dtype, transport is not None,
                         group, result, esize)
        if stats_plans:
            _reduce_stats(stats_plans, rank, owner, dtype, group, result)
    return result


@dataclass
class _Plan:
    """One factor's part of an exchange (the same on every rank but ``rows``)."""

    key: str
    index: int  # column of the shared table
    d: int
    diagonal: bool
    owner: int
    per_rank: list[int]  # n_r of every rank
    how: str  # "rows" | "stats"
    rows: Tensor  # this rank's [n_r, d]


def _gather_rows(plans: list[_Plan], table: Tensor, k: int, rank: int, owner: int,
                 wire: torch.dtype, dtype: torch.dtype, scaled: bool, group,
                 result: Exchanged, esize: int) -> None:
    """One ``gather`` to ``owner`` of every planned factor's rows, each padded to the largest
    ``n_r`` and flattened into one buffer; the owner cuts every rank's buffer back apart."""
    chunks = []
    for p in plans:
        padded = torch.zeros(max(p.per_rank), p.d, dtype=wire)
        n = p.rows.shape[0]
        if scaled:
            padded[:n] = p.rows * 2.0 ** -int(table[rank, k + p.index])
        else:
            padded[:n] = p.rows
        chunks.append(padded.reshape(-1))
    flat = torch.cat(chunks)
    bucket = [torch.empty_like(flat) for _ in range(len(table))] if rank == owner else None
    dist.gather(flat, bucket, dst=owner, group=group)
    if rank != owner:
        result.bytes_moved += flat.numel() * esize
        return
    sizes = [c.numel() for c in chunks]
    per_rank_parts = [b.split(sizes) for b in bucket]  # [W][len(plans)] flat pieces
    for j, p in enumerate(plans):
        width = max(p.per_rank)
        parts = []
        for r, n in enumerate(p.per_rank):
            part = per_rank_parts[r][j].view(width, p.d)[:n].to(dtype)
            if scaled:
                part = part.mul_(2.0 ** int(table[r, k + p.index]))
            parts.append(part)
        result.owned[p.key] = ("rows", torch.cat(parts))


def _reduce_stats(plans: list[_Plan], rank: int, owner: int, dtype: torch.dtype, group,
                  result: Exchanged) -> None:
    """One ``reduce`` to ``owner`` of every planned factor's partial ``Σ rowsᵀ rows`` (summed
    locally in float64 whatever the rows' dtype, sent in the rows' dtype), flattened."""
    parts = [gram(p.rows.double(), p.diagonal).to(dtype) for p in plans]  # [d, d] or [d]
    flat = torch.cat([x.reshape(-1) for x in parts])
    dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, group=group)
    if rank != owner:
        result.bytes_moved += flat.numel() * flat.element_size()
        return
    for p, x, piece in zip(plans, parts, flat.split([x.numel() for x in parts])):
        result.owned[p.key] = ("stats", (piece.view(x.shape), sum(p.per_rank)))
