r"""Moving each rank's sampled rows, or its partial statistics, to the owner of every factor.

::

    rank 0: rows_A0 [n0, d]  ─┐                          owner of key (say rank 1):
    rank 1: rows_A1 [n1, d]  ─┼─ "rows":  all_to_all ──▶  cat(rows_A0, rows_A1, ...) [Σn, d]
    rank 2: rows_A2 [n2, d]  ─┘  "stats": reduce ─────▶  Σ_r rows_rᵀ rows_r [d, d], Σ_r n_r

Rows arrive already weighted (each multiplied by the square root of its sampling weight), so
the owner's ``Σ rowsᵀrows`` is ``Σ_s w_s x_s x_sᵀ`` and the exchanged weights give ``n``.

Either way the owner's statistic is exactly what one process would compute on the union of
all ranks' sampled positions (token-weighted: uneven ``n_r``, and ``n_r = 0``, are exact).
Which is cheaper depends on the layer: the rows strategy sends ``(N - n_owner)·d`` numbers to
the owner, the statistics strategy ``(W - 1)·d²`` (``d`` for a diagonal factor): with a few
percent of the tokens sampled, rows win for every factor wider than the sampled row count.
`choose_strategy` picks per factor and update from the row counts all ranks share first.

This module (with ``ownership``) is the only place that calls ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..stats.covariance import gram
from ..stats.fp16 import fp16_exponent
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


@dataclass
class Exchanged:
    """What `exchange_to_owners` delivered to this rank.

    Attributes:
        ok: False if any rank reported ``ok=False`` (nothing was moved then).
        owned: For keys this rank owns with ``M = Σ m_r > 0`` rows: ``("rows", rows [M, d])``
            or ``("stats", (sum [d, d] or [d], n))``; on the rows' device.
        totals: ``{key: M}`` rows (slots) of every key over all ranks (all ranks see the same).
        weights: ``{key: n}`` total sampling weight of every key (the EMA's ``n``).
        positions: ``{key: positions}`` sampled (non-padding) positions of every key.
        bytes_moved: Payload bytes this rank sent to owners for this update (padding included).
        bytes_rows, bytes_stats: What the rows / the statistics strategy would move in total
            over all ranks for this update (counts known to all ranks), for reports.
    """

    ok: bool
    owned: dict[str, tuple[str, object]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    bytes_rows: int = 0
    bytes_stats: int = 0


def _default_gram(rows: Tensor, diagonal: bool) -> Tensor:
    """Partial ``Σ rowsᵀ rows`` summed in float64 whatever the rows' dtype."""
    return gram(rows.double(), diagonal).to(rows.dtype)


def exchange_to_owners(local: dict[str, Tensor], dims: dict[str, tuple[int, bool]],
                       ownership: Ownership, rank: int, world_size: int, group=None,
                       strategy: str | None = None, ok: bool = True,
                       transport: torch.dtype | None = None,
                       dtype: torch.dtype | None = None,
                       weights: dict[str, float] | None = None,
                       positions: dict[str, int] | None = None,
                       device: torch.device | None = None,
                       gram_fn: Callable[[Tensor, bool], Tensor] | None = None,
                       sums: dict[str, Tensor] | None = None) -> Exchanged:
    """Bring every factor's rows (or partial sums) to its owner.

    Collective: every rank calls it with the same keys (``dims``), in the same order. One
    ``all_gather`` of a small float64 table (row counts, weights, positions, transport
    exponents, ``ok``) comes first, so all ranks agree on the strategy, the padding and
    whether to skip; then **one** ``all_to_all`` moves every rows-strategy factor to its owner
    (each rank's piece for an owner is that owner's factors' rows, padded to the largest
    ``m_r``, flattened), and one asynchronous ``reduce`` per owner, all in flight together,
    sums the statistics-strategy factors. The same code runs on gloo with CPU tensors and on
    NCCL with device tensors (``device``).

    Args:
        local: ``{key: rows [m_r, d]}`` on this rank (a missing key means ``m_r = 0``); A rows
            already carry their bias column and every row its sampling weight; one float
            dtype, on ``device``.
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
        weights: ``{key: Σ weights}`` of this rank's rows (default ``m_r``: unweighted).
        positions: ``{key: sampled positions}`` (default ``m_r``).
        device: Where the buffers live (the group's backend must serve it; default CPU).
        gram_fn: ``(rows, diagonal) -> Σ rowsᵀrows`` for the partial statistics (default:
            summed in float64, returned in the rows' dtype).
        sums: ``{key: partial statistic}`` already reduced on this rank (diagonal factors:
            ``Σ w x⊙x``, ``[d]``); such keys always take the statistics strategy, and their
            table count is 1 per contributing rank instead of rows.
    """
    keys = list(dims)
    device = device or torch.device("cpu")
    dtype = dtype or next((t.dtype for t in local.values()), torch.float32)
    gram_fn = gram_fn or _default_gram
    weights, positions, sums = weights or {}, positions or {}, sums or {}
    k = len(keys)
    mine = [0.0] * (5 * k + 1)  # slots | weights | positions | exponents | summed | ok
    amax = {}
    if transport is not None and ok and local:
        present = [key for key in keys if key in local and local[key].numel()]
        if present:  # one host read for all keys
            maxima = torch.stack([local[key].abs().max() for key in present]).tolist()
            amax = dict(zip(present, maxima))
    for j, key in enumerate(keys):
        if key in sums and ok:
            mine[j] = 1
            mine[k + j] = float(weights[key])
            mine[2 * k + j] = positions[key]
            mine[4 * k + j] = 1.0
        elif key in local and ok:
            m = local[key].shape[0]
            mine[j] = m
            mine[k + j] = float(weights.get(key, m))
            mine[2 * k + j] = positions.get(key, m)
            mine[3 * k + j] = fp16_exponent(amax.get(key, 0.0))
    mine[5 * k] = float(ok)
    row = torch.tensor(mine, dtype=torch.float64, device=device)
    every = [torch.zeros_like(row) for _ in range(world_size)]
    dist.all_gather(every, row, group=group)
    table = torch.stack(every).cpu()  # [W, 5K+1]
    slots = table[:, :k].long()
    exps = table[:, 3 * k:4 * k].long()
    summed = table[:, 4 * k:5 * k].amax(0) > 0  # [K]: some rank sent a reduced sum
    result = Exchanged(ok=bool(table[:, 5 * k].min() > 0))
    if not result.ok:
        return result
    wire = transport or dtype
    esize = torch.tensor([], dtype=wire).element_size()
    plans: list[_Plan] = []
    for j, key in enumerate(keys):
        d, diagonal = dims[key]
        owner = ownership.owner[key]
        per_rank = slots[:, j].tolist()
        total = sum(per_rank)
        result.totals[key] = total
        if total == 0:
            continue
        result.weights[key] = float(table[:, k + j].sum())
        result.positions[key] = int(table[:, 2 * k + j].sum())
        if bool(summed[j]):  # already reduced: only the statistics strategy makes sense
            zero = torch.zeros(d if diagonal else (d, d), dtype=torch.float64
                               if dtype == torch.float64 else torch.float32, device=device)
            plans.append(_Plan(key, j, d, diagonal, owner, per_rank, "stats",
                               sums.get(key, zero), summed=True))
            result.bytes_stats += stats_bytes(world_size, d, diagonal, 4)
            continue
        rows = local.get(key, torch.zeros(0, d, dtype=dtype, device=device))
        result.bytes_rows += rows_bytes(per_rank, owner, d, esize)
        result.bytes_stats += stats_bytes(world_size, d, diagonal, max(4, rows.element_size()))
        how = strategy or choose_strategy(per_rank, owner, d, diagonal, esize)
        plans.append(_Plan(key, j, d, diagonal, owner, per_rank, how, rows))
    rows_plans = [p for p in plans if p.how == "rows"]
    if rows_plans:
        _all_to_all_rows(rows_plans, exps, rank, world_size, wire, dtype,
                         transport is not None, group, result, esize, device)
    stats_plans = [p for p in plans if p.how == "stats"]
    if stats_plans:
        _reduce_stats(stats_plans, rank, world_size, dtype, group, result, gram_fn)
    return result


@dataclass
class _Plan:
    """One factor's part of an exchange (the same on every rank but ``rows``)."""

    key: str
    index: int  # column of the shared table
    d: int
    diagonal: bool
    owner: int
    per_rank: list[int]  # m_r of every rank
    how: str  # "rows" | "stats"
    rows: Tensor  # this rank's [m_r, d], or its partial sum when ``summed``
    summed: bool = False


def _all_to_all_rows(plans: list[_Plan], exps: Tensor, rank: int, world: int,
                     wire: torch.dtype, dtype: torch.dtype, scaled: bool, group,
                     result: Exchanged, esize: int, device: torch.device) -> None:
    """One ``all_to_all`` of every rows-strategy factor: the piece for owner ``o`` holds o's
    factors' rows, each padded to the largest ``m_r`` (so every source sends o the same
    number of entries); the owner cuts each source's piece back apart."""
    by_owner = [[p for p in plans if p.owner == o] for o in range(world)]
    size = [sum(max(p.per_rank) * p.d for p in ps) for ps in by_owner]  # entries per piece
    send = torch.zeros(sum(size), dtype=wire, device=device)
    at = 0
    for ps in by_owner:
        for p in ps:
            width, n = max(p.per_rank), p.rows.shape[0]
            view = send[at:at + width * p.d].view(width, p.d)
            if scaled:
                view[:n] = p.rows * 2.0 ** -int(exps[rank, p.index])
            else:
                view[:n] = p.rows
            at += width * p.d
    recv = torch.empty(world * size[rank], dtype=wire, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=[size[rank]] * world,
                           input_split_sizes=size, group=group)
    result.bytes_moved += (sum(size) - size[rank]) * esize
    pieces = recv.split(size[rank]) if size[rank] else []
    offsets, at = {}, 0
    for p in by_owner[rank]:
        offsets[p.key] = at
        at += max(p.per_rank) * p.d
    for p in by_owner[rank]:
        width, lo = max(p.per_rank), offsets[p.key]
        parts = []
        for r, n in enumerate(p.per_rank):
            part = pieces[r][lo:lo + width * p.d].view(width, p.d)[:n].to(dtype)
            if scaled:
                part = part.mul_(2.0 ** int(exps[r, p.index]))
            parts.append(part)
        result.owned[p.key] = ("rows", torch.cat(parts))


def _reduce_stats(plans: list[_Plan], rank: int, world: int, dtype: torch.dtype, group,
                  result: Exchanged, gram_fn: Callable[[Tensor, bool], Tensor]) -> None:
    """Per owner, one ``reduce`` of all its statistics-strategy factors' partial sums (one
    flat buffer); the reductions to all owners are issued together and then awaited."""
    pending = []
    for owner in range(world):
        mine = [p for p in plans if p.owner == owner]
        if not mine:
            continue
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # bf16 rows: fp32 sums
        parts = [(p.rows if p.summed else gram_fn(p.rows, p.diagonal)).to(wide)
                 for p in mine]  # [d, d] or [d]
        flat = torch.cat([x.reshape(-1) for x in parts])
        work = dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((owner, mine, parts, flat, work))
    for owner, mine, parts, flat, work in pending:
        work.wait()
        if rank != owner:
            result.bytes_moved += flat.numel() * flat.element_size()
            continue
        for p, x, piece in zip(mine, parts, flat.split([x.numel() for x in parts])):
            result.owned[p.key] = ("stats", (piece.view(x.shape), result.weights[p.key]))
