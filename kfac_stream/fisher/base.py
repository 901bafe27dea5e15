"""The Fisher estimator extension point: what an estimator needs from a training step and
which passes' rows it yields to the factors.

A `FisherEstimator` is chosen once per tracker by ``KFACConfig.fisher`` (`estimator_for`).
Per update step the tracker hands it a `StepContext` (what it may read of the tracker) and
asks it for the hooks' `CaptureMode` of the training passes (`capture_mode`), and after the
optimizer step for the passes whose rows make the factors (`passes`: the training passes
themselves, or replays it runs). A new estimator is one file: a subclass with a ``name`` (the
``KFACConfig.fisher`` value it answers to), decorated with `register_fisher`. Built in:
`EmpiricalFisher` (``"empirical"``), `MCFullBatch` and `MCSubBatch` (``"mc"``, by
``mc_sequences``).

The registry here is the only table of Fisher names: a config or a snapshot's manifest may
carry any name, the run plan refuses one no estimator is registered under
(`registered_fisher`), and a snapshot made with an estimator registered by the user reads
anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..capture.hooks import CaptureHooks, CaptureMode
from ..config import KFACConfig
from ..exceptions import KFACConfigError


@dataclass(frozen=True)
class StepContext:
    """What a Fisher estimator reads of the tracker on one step (the tracker builds it,
    `Tracker.fisher_context`).

    Attributes:
        config: The run's resolved `KFACConfig` (``mc_sequences``, ``seed``,
            ``token_fraction``).
        model: The tracked model (the unwrapped one the hooks are on).
        capture: The capture hooks; a replay's records are taken from them (``take``).
        rank: This process's rank (0 on one process).
        step: The optimizer step, counted from 0.
        mc_generator: The generator of the labels sampled from the model.
        select_generator: The sub-batch replay's sequence sampler (reseeded every update step
            from ``(seed, rank, step)`` by the estimator).
        backward_in_forward_ok: Whether a gradient can be taken inside the training forward
            now (`Tracker.backward_in_forward_ok`: the engine, gradient checkpointing,
            active dropout).
    """

    config: KFACConfig
    model: nn.Module
    capture: CaptureHooks
    rank: int
    step: int
    mc_generator: torch.Generator
    select_generator: torch.Generator
    backward_in_forward_ok: Callable[[], bool]


class FisherEstimator:
    """What one Fisher estimator does on a tracker's update steps.

    Attributes:
        name: The ``KFACConfig.fisher`` value it answers to.
        sampled_labels: G comes from labels sampled from the model (not the training
            backward's); the loss scale is then known, not estimated.
    """

    name: ClassVar[str] = ""
    sampled_labels: ClassVar[bool] = False

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        """Whether this estimator serves ``config`` (several may share a ``name``)."""
        return True

    def capture_mode(self, ctx: StepContext, update_step: bool) -> CaptureMode:
        """The hooks' mode for the training passes of a step (``update_step``: the factors
        are updated after it)."""
        raise NotImplementedError

    def passes(self, ctx: StepContext, model: nn.Module, passes: list,
               inputs: list[dict]) -> list:
        """The pass records whose rows make this update's factors, given the training passes'
        records and their recorded inputs (``CaptureMode.record_inputs``); may run replays of
        ``model`` through ``ctx.capture`` (then returns what it took)."""
        raise NotImplementedError


_ESTIMATORS: list[type[FisherEstimator]] = []


def register_fisher(cls: type[FisherEstimator]) -> type[FisherEstimator]:
    """Register an estimator class (a decorator): its ``name`` becomes a ``KFACConfig.fisher``
    a run can use; the most recently registered that `applies` is chosen."""
    if not cls.name:
        raise KFACConfigError(f"{cls.__name__} has no name: set the KFACConfig.fisher value it "
                              "answers to")
    _ESTIMATORS.insert(0, cls)
    return cls


def unregister_fisher(cls: type[FisherEstimator]) -> None:
    """Remove ``cls``; its name stays usable only if another registered estimator has it."""
    _ESTIMATORS[:] = [c for c in _ESTIMATORS if c is not cls]


def fisher_names() -> tuple[str, ...]:
    """The names registered estimators answer to, sorted."""
    return tuple(sorted({c.name for c in _ESTIMATORS}))


def registered_fisher(name: str) -> type[FisherEstimator]:
    """The most recently registered estimator class named ``name``; a `KFACConfigError`
    naming the registered ones if there is none."""
    for cls in _ESTIMATORS:
        if cls.name == name:
            return cls
    raise KFACConfigError(f"KFACConfig.fisher={name!r} is not allowed: must be one of the "
                          f"registered Fisher estimators {fisher_names()} (an estimator of "
                          "another name is registered with kfac_stream.fisher.register_fisher)")


def estimator_for(config: KFACConfig) -> type[FisherEstimator]:
    """The estimator class of ``config`` (its ``fisher``, then `FisherEstimator.applies`)."""
    for cls in _ESTIMATORS:
        if cls.name == config.fisher and cls.applies(config):
            return cls
    raise KFACConfigError(f"KFACConfig.fisher={config.fisher!r}: no registered estimator "
                          f"serves it (registered: {list(fisher_names())})")
