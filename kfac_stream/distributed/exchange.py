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

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..stats.covariance import gram
from ..stats.fp16 import FP16_TARGET
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
        extra: Every rank's ``ExchangeRequest.extra`` (``[W][E]`` host ints, rank order),
            known when the exchange is issued.
    """

    ok: bool
    owned: dict[str, tuple[str, object]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    bytes_rows: int = 0
    bytes_stats: int = 0
    extra: list[list[int]] = field(default_factory=list)


def _default_gram(rows: Tensor, diagonal: bool) -> Tensor:
    """Partial ``Σ rowsᵀ rows`` summed in float64 whatever the rows' dtype."""
    return gram(rows.double(), diagonal).to(rows.dtype)


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


_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _dtype_code(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else _DTYPES.index(dtype) + 1


def _agreed_dtype(codes: Sequence[int]) -> torch.dtype:
    """The rows' dtype every rank uses on the wire: that of the ranks holding rows (promoted if
    they differ), float32 when none does. A rank without rows never decides it."""
    out = None
    for c in codes:
        if c:
            dt = _DTYPES[c - 1]
            out = dt if out is None else torch.promote_types(out, dt)
    return out or torch.float32


def _as_device(value, device: torch.device) -> Tensor:
    """A 0-dim float64 tensor on ``device`` from a number or a tensor (no host read: a device
    tensor is converted on the device)."""
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


@dataclass
class PendingExchange:
    """An exchange whose collectives are all issued (`start_exchange`) but maybe not finished;
    `finish_exchange` waits for them and cuts out what this rank owns.

    Attributes:
        result: Byte counts and totals, known when the exchange was issued.
        works: The asynchronous collectives' handles.
        table: Every rank's ``[3K + 1]`` float64 device table (weights | positions | transport
            exponents | ok), filled when ``works`` are done.
        keys: The factor keys, in table order.
        rows_plans, stats_plans: The factors moved as rows / as partial statistics.
        recv: The rows ``all_to_all``'s receive buffer (None: no rows factor).
        reduced: ``[(owner, plans, shapes, flat buffer)]`` of the statistics reductions.
        dtype: The rows' dtype agreed by all ranks; ``scaled``: fp16 transport.
        rank, world: This process's place.
        wide: The partial statistics' dtype agreed by all ranks.
    """

    result: Exchanged
    works: list
    table: list[Tensor]
    keys: list[str]
    rows_plans: list
    stats_plans: list
    recv: Tensor | None
    reduced: list
    dtype: torch.dtype
    scaled: bool
    rank: int
    world: int
    wide: torch.dtype = torch.float32  # the partial statistics' dtype, agreed by all ranks
    keep: list = field(default_factory=list)  # send buffers, alive until the works finish


@dataclass
class ExchangeRequest:
    """One exchange, as every rank issues it (`start_exchange`).

    Attributes:
        local: ``{key: rows [m_r, d]}`` on this rank (a missing key means ``m_r = 0``); A rows
            already carry their bias column and every row its sampling weight; one float
            dtype, on ``device``.
        dims: ``{key: (d, diagonal)}`` for every factor.
        ownership: Who owns which key.
        rank, world_size: This process's place.
        group: The process group of the payload (default: the default group).
        strategy: Force ``"rows"`` or ``"stats"`` (tests, benchmarks); default per factor.
        ok: This rank's statistics are usable (a bool or a 0-dim device tensor); if any rank
            says False, every rank skips the update (the payload still moves: deciding first
            would need a host read).
        transport: ``torch.float16`` sends float32/float64 rows as fp16 scaled by a power of
            two per rank and factor (relative rounding 2^-11 per entry, the storage's own);
            16-bit rows, and None, travel in their dtype. Partial statistics always travel in
            float32 (float64 when any rank's rows or sums are float64: agreed over ranks).
        dtype: This rank's rows' dtype (default: that of ``local``). The wire dtype is agreed
            over ranks from those holding rows, so a rank with none sends buffers of the
            others' dtype whatever it passes here.
        weights: ``{key: Σ weights}`` of this rank's rows, numbers or 0-dim device tensors
            (default ``m_r``: unweighted).
        positions: ``{key: sampled positions}`` (default ``m_r``).
        device: Where the buffers live (the group's backend must serve it; default CPU).
        gram_fn: ``(rows, diagonal) -> Σ rowsᵀrows`` for the partial statistics (default:
            summed in float64, returned in the rows' dtype).
        sums: ``{key: partial statistic}`` already reduced on this rank (diagonal factors:
            ``Σ w x⊙x``, ``[d]``); such keys always take the statistics strategy, and their
            table count is 1 per contributing rank instead of rows.
        plan_group: A gloo group for the host table (default: ``group``, which must then be
            gloo; the tracker passes its own for an NCCL ``group``).
        extra: Host ints this rank adds to the host table (the same count on every rank),
            handed back from every rank in ``Exchanged.extra`` (the EK-FAC basis each rank
            holds ready, `kfac_stream.ekfac.sync`).
    """

    local: dict[str, Tensor]
    dims: dict[str, tuple[int, bool]]
    ownership: Ownership
    rank: int
    world_size: int
    group: object = None
    strategy: str | None = None
    ok: bool | Tensor = True
    transport: torch.dtype | None = None
    dtype: torch.dtype | None = None
    weights: dict[str, float | Tensor] | None = None
    positions: dict[str, int | Tensor] | None = None
    device: torch.device | None = None
    gram_fn: Callable[[Tensor, bool], Tensor] | None = None
    sums: dict[str, Tensor] | None = None
    plan_group: object = None
    extra: tuple[int, ...] = ()


@dataclass
class _Agreed:
    """What every rank agreed from the host table (the same on every rank)."""

    slots: Tensor  # [W, 2K + 2 + E]: slots | summed | rows' dtype | float64 sums | extra
    summed_any: Tensor  # [K]: some rank sent a reduced sum
    wire_rows: torch.dtype  # the rows' dtype
    wide: torch.dtype  # the partial statistics' dtype
    scaled: bool  # fp16 transport of the rows
    wire: torch.dtype  # the rows' dtype on the wire
    esize: int  # its bytes per entry


def exchange_to_owners(*args, **kwargs) -> Exchanged:
    """Bring every factor's rows (or partial sums) to its owner: `start_exchange` then
    `finish_exchange` on the calling thread (the arguments are `ExchangeRequest`'s fields)."""
    return finish_exchange(start_exchange(ExchangeRequest(*args, **kwargs)))


def start_exchange(request: ExchangeRequest) -> PendingExchange:
    """Issue every collective of one exchange (`ExchangeRequest`), reading no device value on
    the host.

    Collective: every rank calls it with the same keys (``dims``), in the same order, from
    the same thread relative to the training's own collectives (the tracker issues it from the
    training thread at the end of an update step, so NCCL kernels of this group and of
    DDP/ZeRO are launched in the same order on every rank). First one blocking ``all_gather``
    of a small host table over ``plan_group`` (gloo: row counts and dtypes, which the host
    knows from the tensors' shapes), so all ranks agree on the strategy, the padding and the
    wire dtype; then, all asynchronous on ``group``: an ``all_gather`` of a ``[3K + 1]``
    device table (weights, positions, fp16 transport exponents, ``ok``), **one**
    ``all_to_all`` of every rows-strategy factor (each rank's piece for an owner is that
    owner's factors' rows, padded to the largest ``m_r``, flattened) and one ``reduce`` per
    owner of the statistics-strategy factors' partial sums. The same code runs on gloo with
    CPU tensors and on NCCL with device tensors (``device``); on CUDA the collectives run
    after the current stream's work (issue it under the stream that may wait for them).
    """
    req = dataclasses.replace(
        request, device=request.device or torch.device("cpu"),
        gram_fn=request.gram_fn or _default_gram, weights=request.weights or {},
        positions=request.positions or {}, sums=request.sums or {})
    keys = list(req.dims)
    agreed = _agree(req, keys)
    row, exps = _device_row(req, keys, agreed)
    table = [torch.zeros_like(row) for _ in range(req.world_size)]
    works = [dist.all_gather(table, row, group=req.group, async_op=True)]
    result = Exchanged(ok=True, extra=agreed.slots[:, 2 * len(keys) + 2:].tolist())
    plans = _plan_factors(req, keys, agreed, result)
    pending = PendingExchange(
        result=result, works=works, table=table, keys=keys,
        rows_plans=[p for p in plans if p.how == "rows"],
        stats_plans=[p for p in plans if p.how == "stats"], recv=None, reduced=[],
        dtype=agreed.wire_rows, scaled=agreed.scaled, rank=req.rank, world=req.world_size,
        wide=agreed.wide)
    if pending.rows_plans:
        _issue_rows(pending, exps, agreed.wire, req.group, agreed.esize, req.device)
    if pending.stats_plans:
        _issue_stats(pending, req.group, req.gram_fn)
    return pending


def _agree(req: ExchangeRequest, keys: list[str]) -> _Agreed:
    """The blocking ``all_gather`` of the host table (row counts and dtypes of every rank)
    and what all ranks decide from it."""
    local, sums = req.local, req.sums
    k = len(keys)
    counts = [0] * (2 * k + 2)  # host table: slots | summed | rows' dtype | float64 sums
    for j, key in enumerate(keys):
        counts[j] = 1 if key in sums else (local[key].shape[0] if key in local else 0)
        counts[k + j] = int(key in sums)
    mine_dtype = req.dtype or next((t.dtype for t in local.values()), None)
    counts[2 * k] = _dtype_code(mine_dtype) if any(key in local for key in keys) else 0
    counts[2 * k + 1] = int(any(t.dtype == torch.float64 for t in sums.values()))
    host = torch.tensor(counts + [int(x) for x in req.extra], dtype=torch.int64)
    every = [torch.zeros_like(host) for _ in range(req.world_size)]
    dist.all_gather(every, host,
                    group=req.plan_group if req.plan_group is not None else req.group)
    slots = torch.stack(every)  # [W, 2K + 2]
    summed_any = slots[:, k:2 * k].amax(0) > 0  # [K]: some rank sent a reduced sum
    wire_rows = _agreed_dtype(slots[:, 2 * k].tolist())
    # partial statistics: float32 (bf16/fp16/fp32 rows), float64 if any rank's are
    wide = torch.float64 if wire_rows == torch.float64 or bool(slots[:, 2 * k + 1].max()) \
        else torch.float32
    scaled = req.transport is not None and wire_rows in (torch.float32, torch.float64)
    wire = req.transport if scaled else wire_rows
    esize = torch.tensor([], dtype=wire).element_size()
    return _Agreed(slots=slots, summed_any=summed_any, wire_rows=wire_rows, wide=wide,
                   scaled=scaled, wire=wire, esize=esize)


def _device_row(req: ExchangeRequest, keys: list[str], agreed: _Agreed
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """This rank's ``[3K + 1]`` device table (weights | positions | exponents | ok), filled
    with device ops only, and the fp16 transport exponents ``{key: e}``."""
    local, sums, device = req.local, req.sums, req.device
    k = len(keys)
    row = torch.zeros(3 * k + 1, dtype=torch.float64, device=device)
    exps: dict[str, Tensor] = {}
    for j, key in enumerate(keys):
        if key in sums or key in local:
            m = 1 if key in sums else local[key].shape[0]
            row[j] = _as_device(req.weights.get(key, m), device)
            row[k + j] = _as_device(req.positions.get(key, m), device)
        if agreed.scaled and key in local and key not in sums and local[key].numel():
            amax = local[key].detach().abs().max().to(torch.float64)
            e = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP16_TARGET)),
                            torch.zeros_like(amax))
            exps[key] = e
            row[2 * k + j] = e
    row[3 * k] = _as_device(req.ok, device)
    return row, exps


def _plan_factors(req: ExchangeRequest, keys: list[str], agreed: _Agreed,
                  result: Exchanged) -> list[_Plan]:
    """Every factor's part of the exchange (its strategy and this rank's rows or sum); counts
    the totals and the bytes of either strategy into ``result``."""
    world_size, device, esize = req.world_size, req.device, agreed.esize
    plans: list[_Plan] = []
    for j, key in enumerate(keys):
        d, diagonal = req.dims[key]
        owner = req.ownership.owner[key]
        per_rank = agreed.slots[:, j].tolist()
        total = sum(per_rank)
        result.totals[key] = total
        if total == 0:
            continue
        common = {"key": key, "index": j, "d": d, "diagonal": diagonal, "owner": owner,
                  "per_rank": per_rank}
        if bool(agreed.summed_any[j]):  # already reduced: only the statistics strategy
            zero = torch.zeros(d if diagonal else (d, d), dtype=agreed.wide, device=device)
            plans.append(_Plan(**common, how="stats", rows=req.sums.get(key, zero),
                               summed=True))
            result.bytes_stats += stats_bytes(world_size, d, diagonal, 4)
            continue
        rows = req.local.get(key, torch.zeros(0, d, dtype=agreed.wire_rows, device=device))
        result.bytes_rows += rows_bytes(per_rank, owner, d, esize)
        result.bytes_stats += stats_bytes(world_size, d, diagonal, max(4, rows.element_size()))
        how = req.strategy or choose_strategy(per_rank, owner, d, diagonal, esize)
        plans.append(_Plan(**common, how=how, rows=rows))
    return plans


def finish_exchange(pending: PendingExchange) -> Exchanged:
    """Wait for an exchange's collectives (on CUDA: the current stream waits, then one host
    read of the gathered table) and return what this rank owns (`Exchanged`)."""
    for work in pending.works:
        work.wait()
    k, result = len(pending.keys), pending.result
    table = torch.stack(pending.table).cpu()  # [W, 3K + 1]: the one host read
    result.ok = bool(table[:, 3 * k].min() > 0)
    if not result.ok:
        result.owned.clear()
        return result
    for j, key in enumerate(pending.keys):
        if result.totals.get(key, 0):
            result.weights[key] = float(table[:, j].sum())
            result.positions[key] = int(table[:, k + j].sum())
    if pending.rows_plans:
        _finish_rows(pending, table[:, 2 * k:3 * k].long())
    for owner, mine, shapes, flat in pending.reduced:
        if pending.rank != owner:
            continue
        for p, shape, piece in zip(mine, shapes, flat.split([math.prod(s) for s in shapes])):
            result.owned[p.key] = ("stats", (piece.view(shape), result.weights[p.key]))
    return result


def _issue_rows(pending: PendingExchange, exps: dict[str, Tensor], wire: torch.dtype, group,
                esize: int, device: torch.device) -> None:
    """One asynchronous ``all_to_all`` of every rows-strategy factor: the piece for owner ``o``
    holds o's factors' rows, each padded to the largest ``m_r`` (so every source sends o the
    same number of entries); `_finish_rows` cuts each source's piece back apart."""
    world, rank = pending.world, pending.rank
    by_owner = [[p for p in pending.rows_plans if p.owner == o] for o in range(world)]
    size = [sum(max(p.per_rank) * p.d for p in ps) for ps in by_owner]  # entries per piece
    send = torch.zeros(sum(size), dtype=wire, device=device)
    at = 0
    for ps in by_owner:
        for p in ps:
            width, n = max(p.per_rank), p.rows.shape[0]
            view = send[at:at + width * p.d].view(width, p.d)
            if n and p.key in exps:  # fp16 transport: scaled by 2^-e on the device
                view[:n] = p.rows * torch.exp2(-exps[p.key]).to(p.rows.dtype)
            elif n:
                view[:n] = p.rows
            at += width * p.d
    recv = torch.empty(world * size[rank], dtype=wire, device=device)
    pending.works.append(dist.all_to_all_single(
        recv, send, output_split_sizes=[size[rank]] * world, input_split_sizes=size,
        group=group, async_op=True))
    pending.keep.append(send)
    pending.recv = recv
    pending.result.bytes_moved += (sum(size) - size[rank]) * esize


def _finish_rows(pending: PendingExchange, exps: Tensor) -> None:
    """This rank's owned rows-strategy factors from the received buffer (``exps``: ``[W, K]``
    transport exponents)."""
    mine = [p for p in pending.rows_plans if p.owner == pending.rank]
    if not mine:
        return
    width_of = {p.key: max(p.per_rank) * p.d for p in mine}
    pieces = pending.recv.split(sum(width_of.values()))
    at = 0
    for p in mine:
        width, lo = max(p.per_rank), at
        at += width * p.d
        parts = []
        for r, n in enumerate(p.per_rank):
            part = pieces[r][lo:lo + width * p.d].view(width, p.d)[:n].to(pending.dtype)
            if pending.scaled:
                part = part.mul_(2.0 ** int(exps[r, p.index]))
            parts.append(part)
        pending.result.owned[p.key] = ("rows", torch.cat(parts))


def _issue_stats(pending: PendingExchange, group,
                 gram_fn: Callable[[Tensor, bool], Tensor]) -> None:
    """Per owner, one asynchronous ``reduce`` of all its statistics-strategy factors' partial
    sums (one flat buffer in the agreed ``pending.wide``)."""
    wide = pending.wide
    for owner in range(pending.world):
        mine = [p for p in pending.stats_plans if p.owner == owner]
        if not mine:
            continue
        parts = [(p.rows if p.summed else gram_fn(p.rows, p.diagonal)).to(wide)
                 for p in mine]  # [d, d] or [d]
        flat = torch.cat([x.reshape(-1) for x in parts])
        pending.works.append(dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, group=group,
                                         async_op=True))
        pending.reduced.append((owner, mine, [tuple(x.shape) for x in parts], flat))
        if pending.rank != owner:
            pending.result.bytes_moved += flat.numel() * flat.element_size()
