"""The EK-FAC state's per-window and per-pass parts (`kfac_stream.ekfac`): what one rank
accumulated over a window (`EkfacWindow`, summed across ranks by
`kfac_stream.ekfac.sync`) and one forward pass's corrections, squared once per layer
over its calls (`PassCorrections`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class EkfacWindow:
    """One rank's accumulated correction at a snapshot (`kfac_stream.ekfac.EkfacState.take`).

    Attributes:
        basis_step: The snapshot the basis is from (None: no basis, nothing accumulated).
        updates, first_step, last_step: The update steps added.
        num: ``{layer: Σ w·(…)² [d_out, d_A]}`` on ``device`` in ``dtype``.
        den: ``{layer: 0-dim N}``.
    """

    basis_step: int | None
    updates: int
    first_step: int | None
    last_step: int | None
    num: dict[str, Tensor]
    den: dict[str, Tensor]
    dtype: torch.dtype
    device: torch.device

    def entry(self) -> dict[str, Any]:
        """The manifest entry's counts (``basis_step``, ``updates``, first and last step)."""
        return {"basis_step": int(self.basis_step), "updates": int(self.updates),
                "first_step": int(self.first_step), "last_step": int(self.last_step)}

    def dens(self, names: Sequence[str]) -> list[float]:
        """``N`` of ``names`` (0 where nothing was added), one host read."""
        have = [n for n in names if n in self.den]
        got = dict(zip(have, torch.stack([self.den[n] for n in have]).tolist())) \
            if have else {}
        return [float(got.get(n, 0.0)) for n in names]

    def own(self) -> tuple[dict[str, tuple[Tensor, float]], dict[str, Any]]:
        """``({layer: (num, N)}, entry)`` of the layers with ``N > 0`` (one process)."""
        if not self.num or self.basis_step is None:
            return {}, {}
        names = list(self.num)
        return {n: (self.num[n], d) for n, d in zip(names, self.dens(names)) if d > 0}, \
            self.entry()


class PassCorrections:
    """One forward pass's EK-FAC corrections (`kfac_stream.capture.hooks`), squared once per
    layer over all its calls in the pass (`kfac_stream.ekfac.EkfacState.correction`).

    A call's ``(input, output gradient)`` is held from its gradient until the layer's calls
    of the pass are all in: as many as the layer's earlier passes had
    (`kfac_stream.ekfac.EkfacState.calls`; one for most layers, so nothing is held), else
    until `settle` at the end of the pass (the first pass after a start or a new layer: each
    call's output gradient ``[B, T, d_out]`` stays until then, the memory of one backward's
    activation gradients).

    Attributes:
        sums: ``{layer: [(Σ_n (Q_Gᵀ ∇_W L_n Q_A)² [d_out, d_A], calls)]}`` (``g`` still
            scaled by the pass's loss scale ``c``).
    """

    def __init__(self, state, batch: int) -> None:
        self.state, self.batch = state, int(batch)
        self.sums: dict[str, list[tuple[Tensor, int]]] = {}
        self._held: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self._how: dict[str, tuple[Tensor, tuple[Tensor | None, Tensor | None]]] = {}

    def add_call(self, layer: str, x: Tensor, grad: Tensor, usable: Tensor,
                 basis: tuple[Tensor | None, Tensor | None]) -> None:
        """One call's input ``x`` and output gradient ``grad``
        (`kfac_stream.ekfac.EkfacState.correction`), with the pass's usable rows and the
        layer's basis."""
        held = self._held.setdefault(layer, [])
        held.append((x, grad))
        self._how.setdefault(layer, (usable, basis))
        known = self.state.calls.get(layer)
        if known is not None and len(held) >= known:
            self._square(layer)

    def _square(self, layer: str) -> None:
        held = self._held.pop(layer)
        usable, basis = self._how.pop(layer)
        num = self.state.correction(layer, held, usable, self.batch, basis)
        self.sums.setdefault(layer, []).append((num, len(held)))

    def settle(self) -> dict[str, list[tuple[Tensor, int]]]:
        """Square what is still held (the pass's backward is over) and return `sums`."""
        for layer in list(self._held):
            self._square(layer)
        return self.sums
