"""Names of Kronecker factors: ``"<layer>.A"`` and ``"<layer>.G"``, built and parsed here only.

A factor key names one stored factor everywhere it travels: the store, the exchange table,
checkpoint files, snapshot shards and manifests, metric names. A shared A (layers reading the
same input, `capture.sharing`) is stored under its group leader's A key.
"""

from __future__ import annotations

from typing import Literal

FactorKind = Literal["A", "G"]
FACTOR_KINDS: tuple[FactorKind, FactorKind] = ("A", "G")


def factor_key(layer: str, kind: FactorKind) -> str:
    """``"<layer>.<kind>"``: the key of ``layer``'s A (input) or G (output-gradient) factor."""
    if kind not in FACTOR_KINDS:
        raise ValueError(f"factor kind {kind!r} is not one of {FACTOR_KINDS}")
    return f"{layer}.{kind}"


def split_factor_key(key: str) -> tuple[str, FactorKind]:
    """``(layer, kind)`` of a factor key (the inverse of `factor_key`)."""
    layer, _, kind = key.rpartition(".")
    if not layer or kind not in FACTOR_KINDS:
        raise ValueError(f"{key!r} is not a factor key ('<layer>.A' or '<layer>.G')")
    return layer, kind  # type: ignore[return-value]
