"""EK-FAC on several ranks (`kfac_stream.ekfac`): the correction summed across ranks at a
snapshot, and every snapshot's eigenbasis brought to every rank.

Sums (`sum_to_owners`, the training thread, at the snapshot's capture). Each rank accumulates
``Σ_n w·(Q_Gᵀ ∇_W L_n Q_A)²`` and ``N`` over its own sequences; ``λ = Σ_ranks num / Σ_ranks N``
is what one process gives on the concatenated data. First one ``all_gather`` of a small JSON
table over the plan group (gloo, host: every rank's ``N`` per layer and window counts), so
every rank takes the same decisions; then one ``reduce`` per layer with ``N > 0`` of its
``[d_out, d_A]`` accumulator to the owner of the layer's G factor, which alone stores ``λ``
(in its shard, as the snapshot's other tensors of that layer's G). The reductions run on the
EXCHANGE group with the accumulators where they are (NCCL over NVLink on a GPU run, gloo on
CPU): at the snapshot's capture every rank's training thread is at the same point of the same
step, the point where the group's own collectives are issued, so no second thread drives it;
only the owner copies ``λ`` to the host (host memory per rank falls as 1/world), and no
weights-sized tensor crosses a gloo TCP link on a GPU run.

Bases (`RankedSink`, the snapshot's thread). Each rank eigendecomposes only the factors it
owns; after the shard is written (every rank reaches that point, or every rank fails the
snapshot) the ranks check that each owner holds its factors' eigenvectors (one ``all_gather``
on the snapshot group), then every dense factor's owner broadcasts them, factor by factor in
the plan's order, on the snapshot group (gloo, CPU buffers of one factor at a time), and a
second ``all_gather`` confirms that every rank received every factor (else all drop it). The
snapshot group is driven only by the snapshot's thread, in the same order on every rank.

Switching (`kfac_stream.ekfac.EkfacState` with ``lockstep``): a basis that arrived goes into
use only at an update step every rank agreed on. Each update step's exchange already gathers
a host table on the plan group (`kfac_stream.distributed.exchange`); every rank adds the step
of the basis it holds ready (`EkfacState.ready_step`), and when all ranks report the same one
it goes into use at the next step on every rank (`EkfacState.agree`). A snapshot finished on
the training thread (``background_snapshots=False``) is already at the same point on every
rank: its confirmation puts the basis into use at the next step directly, as one process does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.context import JsonComm

logger = logging.getLogger("kfac_stream")


def sum_to_owners(window, dims: Mapping[str, tuple[int, int]], owner: Mapping[str, int],
                  ctx) -> tuple[dict[str, tuple[Tensor, float]], dict[str, Any]]:
    """Every rank's correction of one window summed on the owner of each layer's G factor.

    Collective (the training thread, every rank with the same ``dims``, in the same order).

    Args:
        window: This rank's `kfac_stream.ekfac.EkfacWindow`.
        dims: ``{layer: (d_out, d_A)}`` of every tracked layer.
        owner: ``{layer: rank}`` that stores its ``λ`` (its G factor's owner).
        ctx: The `kfac_stream.distributed.context.DistContext`.

    Returns:
        ``({layer: (Σ_ranks num [d_out, d_A], Σ_ranks N)}, entry)`` of the layers this rank
        stores with ``N > 0``, and the window's manifest counts (empty: no correction).
    """
    names = list(dims)
    has = window.basis_step is not None and bool(window.num)
    mine = {"basis": window.basis_step if has else None, "updates": window.updates,
            "first": window.first_step, "last": window.last_step,
            "den": window.dens(names) if has else [0.0] * len(names)}
    every = JsonComm(ctx.rank, ctx.world_size, ctx.plan_group).all_gather(mine)
    bases = {r["basis"] for r in every if r["basis"] is not None}
    if len(bases) != 1:
        if len(bases) > 1:  # cannot happen with the agreed switch; said, never summed
            logger.error("kfac_stream: ranks accumulated the EK-FAC correction on different "
                         "bases (snapshot steps %s); this snapshot carries no correction",
                         sorted(bases))
        return {}, {}
    held = [r for r in every if r["basis"] is not None]
    entry = {"basis_step": int(bases.pop()), "updates": max(r["updates"] for r in held),
             "first_step": min(r["first"] for r in held),
             "last_step": max(r["last"] for r in held)}
    out: dict[str, tuple[Tensor, float]] = {}
    for i, name in enumerate(names):
        total = sum(r["den"][i] for r in every)  # rank order: the same float on every rank
        if total <= 0:
            continue
        num = window.num.get(name) if has else None
        if num is None:
            num = torch.zeros(dims[name], dtype=window.dtype, device=window.device)
        dist.reduce(num, dst=owner[name], op=dist.ReduceOp.SUM, group=ctx.exchange_group)
        if ctx.rank == owner[name]:
            out[name] = (num, total)
    return out, entry


class RankedSink:
    """Where snapshot ``step``'s eigenvectors go with several ranks: called with this rank's
    own results as they are computed (`kfac_stream.snapshot.eigen_stream.EigenStream`'s
    ``on_result``), then `share` brings every other factor from its owner (module docstring).

    Args:
        state: The tracker's `kfac_stream.ekfac.EkfacState` (``lockstep``).
        step: The snapshot's step.
        keys: ``{factor key: (d, diagonal)}`` of the basis, in the plan's order.
        owner: ``{factor key: rank}``.
        rank: This rank.
    """

    def __init__(self, state, step: int, keys: Mapping[str, tuple[int, bool]],
                 owner: Mapping[str, int], rank: int) -> None:
        self.state, self.step, self.rank = state, int(step), int(rank)
        self.keys, self.owner = dict(keys), dict(owner)
        self._receive = state.sink(step)

    def __call__(self, key: str, q: Tensor | None) -> None:
        self._receive(key, q)

    def share(self, comm: JsonComm) -> None:
        """Broadcast every dense factor's eigenvectors from its owner and confirm the basis
        on every rank (collective on ``comm``'s group: every rank, after the write)."""
        state, step = self.state, self.step
        own = [k for k in self.keys if self.owner[k] == self.rank]
        if not all(comm.all_gather(bool(state.holds(step, own)))):
            state.confirm(step, False)  # an owner lacks its own: nobody can use the basis
            return
        for key, (d, diagonal) in self.keys.items():
            src = self.owner[key]
            if diagonal:
                if src != self.rank:
                    self._receive(key, None)
                continue
            mine = state.pending_tensor(step, key) if src == self.rank else None
            if mine is not None:
                buf = mine.to("cpu", copy=True).contiguous()
            else:  # a receiver, or an owner that lost it meanwhile (the check below fails)
                buf = torch.empty(d, d, dtype=state.dtype)
            dist.broadcast(buf, src=src, group=comm.group)
            if src != self.rank:
                self._receive(key, buf)
        everywhere = all(comm.all_gather(bool(state.holds(step, list(self.keys)))))
        state.confirm(step, everywhere, now=threading.current_thread() is state.trainer)
        if not everywhere:
            logger.warning("kfac_stream: the EK-FAC basis of snapshot %d did not reach every "
                           "rank; the next snapshot carries no correction", step)
