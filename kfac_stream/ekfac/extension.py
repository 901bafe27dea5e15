"""`EkfacExtension`: EK-FAC attached to the tracker (`kfac_stream.extensions`), enabled by
``KFACConfig(ekfac=True)``. It owns the `EkfacState` and maps the tracker's extension points
onto it: the basis switch at each step's begin (in lockstep across ranks through the update's
exchange table), each tracked call's whole input and output gradient in a captured pass, each
update's squared rotated gradients, the correction handed to every snapshot with the sink of
its eigenvectors (several ranks: `kfac_stream.ekfac.sync`), the state in every checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..config import KFACConfig
from ..exceptions import KFACConfigError
from ..extensions import ExtensionExport, TrackerExtension, register_extension
from .schedule import basis_snapshot_step, train_begin_line
from .state import EkfacState, ekfac_device_bytes
from .sync import RankedSink, sum_to_owners


@register_extension
class EkfacExtension(TrackerExtension):
    """The EK-FAC correction streamed next to the factors (`kfac_stream.ekfac`).

    Attributes:
        state: The `EkfacState` (the basis in use, the accumulators, the pending basis).
        bytes: ``{"basis", "accumulators", "total"}`` device bytes it holds at most
            (`ekfac_device_bytes`), kept out of the fold's device budget.
    """

    name = "ekfac"
    needs_eigenbasis = True  # each snapshot's eigenbasis is the next correction's
    summed_state = ("ekfac.num.", "ekfac.den.")

    def extra_snapshot_step(self, max_steps: int) -> int | None:
        """A run no longer than ``snapshot_every``: the snapshot whose eigenbasis the update
        steps after it measure the final snapshot's correction in (`basis_snapshot_step`)."""
        cfg = self.tracker.config
        return basis_snapshot_step(max_steps, cfg.snapshot_every, cfg.update_every)

    def train_begin_line(self, max_steps: int) -> tuple[str, str] | None:
        """The extra snapshot, or a final snapshot left without a correction and why
        (`schedule.train_begin_line`)."""
        return train_begin_line(self.tracker.config, max_steps)

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        return bool(config.ekfac)

    def __init__(self, tracker: Any) -> None:
        super().__init__(tracker)
        keys_of = {n: tracker.plan.keys_of(n) for n in tracker.specs}
        # several ranks: bases switched in lockstep (`kfac_stream.ekfac.sync`)
        self.state = EkfacState(tracker.specs, keys_of, tracker.device, tracker.row_dtype,
                                lockstep=tracker.world_size > 1)
        self.bytes = ekfac_device_bytes(keys_of, tracker.plan.dims, tracker.row_dtype)
        check_budget(tracker.run, self.bytes)  # before any hook goes on the model

    def reserved_bytes(self) -> int:
        return self.bytes["total"]

    def memory_line(self) -> str:
        b = self.bytes  # on every rank's device, counted in the device budget
        return (f"; EK-FAC {_mib(b['total'])} on the model's device of each rank "
                f"({_mib(b['basis'])} eigenvectors, {_mib(b['accumulators'])} accumulators)")

    # -- each optimizer step ---------------------------------------------------------------------

    def begin_step(self) -> None:
        self.state.begin_step()  # a snapshot's eigenbasis that has arrived goes into use

    def step_table(self) -> tuple[int, ...]:
        return (self.state.ready_step(),)  # this rank's ready basis, in the exchange's table

    def agree(self, rows: list[list[int]]) -> None:
        self.state.agree([row[0] for row in rows])

    def plan_changed(self, plan: Any) -> None:
        # the basis in use is per layer: unchanged
        self.state.keys_of = {n: plan.keys_of(n) for n in self.tracker.specs}

    # -- each captured pass ----------------------------------------------------------------------

    def keep_call(self, layer: str) -> tuple[Tensor | None, Tensor | None] | None:
        """The layer's basis in use (the whole input is kept for the per-sequence gradients),
        or None (no basis: nothing to accumulate)."""
        return self.state.basis_of(layer)

    def add_call(self, rec: Any, layer: str, x: Tensor, grad: Tensor, usable: Tensor,
                 token: Any) -> None:
        """Squared once over the layer's calls of the pass (`PassCorrections`, in
        ``rec.extensions["ekfac"]``); ``token``: the basis `keep_call` gave."""
        part = rec.extensions.get(self.name)
        if part is None:
            part = rec.extensions[self.name] = self.state.new_pass(rec.batch)
        part.add_call(layer, x, grad, usable, token)

    # -- each update step ------------------------------------------------------------------------

    def collect_pass(self, rec: Any, c: Any, acc: Any) -> Any:
        """The pass's squares ``(c·g)² / c²``, each sequence weighted, and their count (``N``
        once per call of the layer, as its factors count its rows), added to ``acc``
        (``({layer: Σ w·(Q_Gᵀ ∇L_n Q_A)² [d_out, d_A]}, {layer: 0-dim N})``); notes each
        layer's calls that received a gradient (`EkfacState.learn_calls`)."""
        self.state.learn_calls({name: len(found) for by in (rec.g_rows, rec.g_sums)
                                for name, found in by.items()})
        part = rec.extensions.get(self.name)
        if part is None:
            return acc
        nums, dens = acc if acc is not None else ({}, {})
        for name, found in part.settle().items():
            if name in rec.seq_layers:  # N: the sequences (with their weights)
                n = rec.seq_total if rec.seq_total is not None else rec.sequence_weight().sum()
            else:  # the usable positions, as the factors' n
                _, total, usable = rec.stream(rec.space_of(name))
                n = total if total is not None else usable.sum() * rec.seq_scale
            num = torch.stack([t for t, _ in found]).sum(0) * (rec.seq_scale / (c * c))
            nums[name] = nums[name] + num if name in nums else num
            n = n * sum(calls for _, calls in found)
            dens[name] = dens[name] + n if name in dens else n
        return nums, dens

    def add_update(self, step: int, acc: Any, ok: Tensor) -> None:
        if acc is not None and acc[0]:
            self.state.add(step, acc[0], acc[1], ok)

    # -- snapshots and checkpoints ---------------------------------------------------------------

    def export(self, step: int) -> ExtensionExport:
        """The correction accumulated on the previous snapshot's eigenbasis (``{layer: λ}``,
        ``{layer: manifest entry}``; empty for the first snapshot) and the sink this
        snapshot's eigenvectors go to (`EkfacState.take`, `EkfacState.sink`; several ranks:
        summed on each layer's G owner and shared, `kfac_stream.ekfac.sync`)."""
        tr = self.tracker
        keys_of = {n: tr.plan.keys_of(n) for n in tr.specs}
        if tr.world_size == 1:
            tensors, entries = self.state.take(step, keys_of)
            return ExtensionExport(tensors, entries, self.state.sink(step))
        owner = tr.ownership.owner
        dims = {n: (tr.dims[g][0], tr.dims[a][0]) for n, (a, g) in keys_of.items()}
        tensors, entries = self.state.take(step, keys_of, combine=lambda window: sum_to_owners(
            window, dims, {n: owner[g] for n, (_, g) in keys_of.items()}, tr.dist))
        keys = {k: tr.dims[k] for pair in keys_of.values() for k in pair}
        return ExtensionExport(tensors, entries, RankedSink(self.state, step, keys, owner,
                                                            tr.rank))

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """`EkfacState.state_dict`: this rank's accumulators, the eigenvectors of the factors
        it owns."""
        owner, rank = self.tracker.ownership.owner, self.tracker.rank
        return self.state.state_dict(keep=lambda key: owner.get(key, 0) == rank)

    def load_state_dict(self, meta: Mapping[str, Any],
                        get: Callable[[str], Tensor | None]) -> None:
        self.state.load_state_dict(meta, get)


def check_budget(run: Any, need: dict[str, int]) -> None:
    """An explicit device budget of the device fold must hold the EK-FAC state's bytes and
    the accumulation's work space (`kfac_stream.store.residency.Residency`); an ``"auto"``
    budget (decided at the first update) that cannot says so there and keeps no pending
    statistic on the device."""
    budget = run.device_budget
    if run.fold_on != "device" or budget is None or budget >= need["total"]:
        return
    raise KFACConfigError(
        f"KFACConfig(ekfac=True) holds {need['total']} bytes on the model's device "
        f"({need['basis']} of eigenvectors, {need['accumulators']} of accumulators) but "
        f"device_memory_budget={budget}; raise the budget, lower max_dense_dim (diagonal "
        "factors hold no basis) or track fewer layers")


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"
