"""The snapshot's eigenvalues and eigenbases as the queries use them: converted lazily, per
layer, at first use, and cached per stored tensor (an A factor several layers share once)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..snapshot.manifest import stored_key
from ..snapshot.snapshot import Snapshot


class LazyEigen(Mapping):
    """``{layer: (Q_A, α, Q_G, γ)}`` in float64 on the CPU (None for a diagonal factor's Q),
    each converted from the snapshot's tensors at its first use and cached per stored tensor
    (an A shared by several layers is widened once; the snapshot's own fp32 tensors are never
    copied before a query needs them)."""

    def __init__(self, snapshot: Snapshot, names: Sequence[str]) -> None:
        self._snap, self._names = snapshot, list(names)
        self._cache: dict[tuple, Tensor] = {}

    def _get(self, name: str, factor: str, part: str, device=None) -> Tensor | None:
        t = getattr(self._snap[name], f"{factor}_{part}")
        if t is None:
            return None
        dev = torch.device("cpu") if device is None else torch.device(device)
        key = (source_key(self._snap, name, factor), part, str(dev))
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = t.to(dev, torch.float64)
        return out

    def eigvals(self, name: str, device=None) -> tuple[Tensor, Tensor]:
        """``(α, γ)`` float64 on ``device`` (default the CPU)."""
        return self._get(name, "A", "eigvals", device), self._get(name, "G", "eigvals", device)

    def __getitem__(self, name: str) -> tuple:
        if name not in self._names:
            raise KeyError(name)
        return (self._get(name, "A", "eigvecs"), self._get(name, "A", "eigvals"),
                self._get(name, "G", "eigvecs"), self._get(name, "G", "eigvals"))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class LazyBases(Mapping):
    """``{layer: (Q_A, Q_G)}`` in the feature dtype on the model's device, each converted at
    its first use and cached per stored tensor (a shared A once)."""

    def __init__(self, snapshot: Snapshot, names: Sequence[str], device: torch.device,
                 dtype: torch.dtype) -> None:
        self._snap, self._names = snapshot, list(names)
        self._device, self._dtype = device, dtype
        self._cache: dict[str, Tensor] = {}

    def _get(self, name: str, factor: str) -> Tensor | None:
        t = getattr(self._snap[name], f"{factor}_eigvecs")
        if t is None:
            return None
        key = source_key(self._snap, name, factor)
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = t.to(self._device, self._dtype)
        return out

    def __getitem__(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        if name not in self._names:
            raise KeyError(name)
        return self._get(name, "A"), self._get(name, "G")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def source_key(snapshot: Snapshot, name: str, factor: str) -> str:
    """The stored tensor a layer's factor is read from (an A shared by several layers: the
    one key they share, manifest ``shared_inputs``); the layer's own name when the manifest
    does not say (a hand-built snapshot)."""
    try:
        return stored_key(snapshot.manifest, name, factor)
    except (KeyError, TypeError, AttributeError):
        return f"{name}/{factor}"
