"""`PlainEngine`: one process, DDP, and DeepSpeed ZeRO-1/2: every rank holds every parameter
whole, so there is nothing to gather and every `EngineAdapter` hook keeps its default.

It is the registry's fallback (`engine_for` returns it for a model no registered engine
matches): registered with ``fallback=True`` rather than asked in turn.
"""

from __future__ import annotations

from torch import nn

from .base import EngineAdapter


class PlainEngine(EngineAdapter):
    """Whole parameters in every process (one process, DDP, ZeRO-1/2)."""

    name = "plain"

    def matches(self, model: nn.Module) -> bool:
        """Every model: a plain model needs no adapter of its own."""
        return True

