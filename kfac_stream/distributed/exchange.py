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

from collections.abc import Sequence

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


def exchange_to_owners(local: dict[str, Tensor], dims: dict[str, tuple[int, bool]],
                       ownership: Ownership, rank: int, world_size: int, group=None,
                       strategy: str | None = None) -> dict[str, tuple[str, object]]:
    """Bring every factor's rows (or partial sums) to its owner.

    Collective: every rank calls it with the same keys (``dims``), in the same order.

    Args:
        local: ``{key: rows [n_r, d]}`` on this rank (a missing key means ``n_r = 0``); A rows
            already carry their bias column; CPU tensors, one float dtype.
        dims: ``{key: (d, diagonal)}`` for every factor.
        ownership: Who owns which key.
        rank, world_size: This process's place.
        strategy: Force ``"rows"`` or ``"stats"`` (tests, benchmarks); default per factor.

    Returns:
        For the keys this rank owns and that have ``N = Σ n_r > 0`` rows in total:
        ``("rows", rows [N, d])`` or ``("stats", (sum [d, d] or [d], N))``.
    """
    keys = list(dims)
    dtype = next((t.dtype for t in local.values()), torch.float32)
    counts = torch.tensor([local[k].shape[0] if k in local else 0 for k in keys],
                          dtype=torch.int64)
    every = [torch.zeros_like(counts) for _ in range(world_size)]
    dist.all_gather(every, counts, group=group)
    table = torch.stack(every)  # [W, keys]
    out: dict[str, tuple[str, object]] = {}
    for j, key in enumerate(keys):
        d, diagonal = dims[key]
        owner = ownership.owner[key]
        per_rank = table[:, j].tolist()
        total = sum(per_rank)
        if total == 0:
            continue
        rows = local.get(key, torch.zeros(0, d, dtype=dtype))
        how = strategy or choose_strategy(per_rank, owner, d, diagonal, rows.element_size())
        if how == "rows":
            width = max(per_rank)
            padded = torch.zeros(width, d, dtype=dtype)
            padded[: rows.shape[0]] = rows
            bucket = [torch.zeros_like(padded) for _ in range(world_size)] if rank == owner else None
            dist.gather(padded, bucket, dst=owner, group=group)
            if rank == owner:
                out[key] = ("rows", torch.cat([b[:n] for b, n in zip(bucket, per_rank)]))
        else:
            part = gram(rows, diagonal)  # [d] or [d, d]
            dist.reduce(part, dst=owner, op=dist.ReduceOp.SUM, group=group)
            if rank == owner:
                out[key] = ("stats", (part, total))
    return out
