"""The Fisher estimator extension point: what an estimator needs from a training step and
which passes' rows it yields to the factors.

A `FisherEstimator` is chosen once per tracker by ``KFACConfig.fisher`` (`estimator_for`).
Per update step the tracker asks it for the hooks' `CaptureMode` of the training passes
(`capture_mode`), and after the optimizer step for the passes whose rows make the factors
(`passes`: the training passes themselves, or replays it runs). A new estimator is one file:
a subclass with a ``name`` (the ``KFACConfig.fisher`` value it answers to), decorated with
`register_fisher`. Built in: `EmpiricalFisher` (``"empirical"``), `MCFullBatch` and
`MCSubBatch` (``"mc"``, by ``mc_sequences``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..capture.hooks import CaptureMode
from ..config import KFACConfig
from ..curvature import FISHER_LABELS
from ..exceptions import KFACConfigError


class FisherEstimator:
    """What one Fisher estimator does on a tracker's update steps.

    Attributes:
        name: The ``KFACConfig.fisher`` value it answers to.
        sampled_labels: G comes from labels sampled from the model (not the training
            backward's); the loss scale is then known, not estimated.
        tracker: The `Tracker` it serves (its model, capture hooks, generators, rank, step).
    """

    name: ClassVar[str] = ""
    sampled_labels: ClassVar[bool] = False

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    @classmethod
    def applies(cls, config: KFACConfig) -> bool:
        """Whether this estimator serves ``config`` (several may share a ``name``)."""
        return True

    def capture_mode(self, update_step: bool) -> CaptureMode:
        """The hooks' mode for the training passes of a step (``update_step``: the factors
        are updated after it)."""
        raise NotImplementedError

    def passes(self, model, passes: list, inputs: list[dict]) -> list:
        """The pass records whose rows make this update's factors, given the training passes'
        records and their recorded inputs (``CaptureMode.record_inputs``); may run replays
        through ``tracker.capture`` (then returns what it took)."""
        raise NotImplementedError


_ESTIMATORS: list[type[FisherEstimator]] = []


def register_fisher(cls: type[FisherEstimator]) -> type[FisherEstimator]:
    """Register an estimator class (a decorator): its ``name`` becomes a valid
    ``KFACConfig.fisher``; the most recently registered that `applies` is chosen."""
    if not cls.name:
        raise KFACConfigError(f"{cls.__name__} has no name: set the KFACConfig.fisher value it "
                              "answers to")
    _ESTIMATORS.insert(0, cls)
    FISHER_LABELS[cls.name] = bool(cls.sampled_labels)
    return cls


def unregister_fisher(cls: type[FisherEstimator]) -> None:
    """Remove ``cls``; its name stays valid only if another registered estimator has it."""
    _ESTIMATORS[:] = [c for c in _ESTIMATORS if c is not cls]
    if cls.name not in {c.name for c in _ESTIMATORS}:
        FISHER_LABELS.pop(cls.name, None)


def estimator_for(config: KFACConfig) -> type[FisherEstimator]:
    """The estimator class of ``config`` (its ``fisher``, then `FisherEstimator.applies`)."""
    for cls in _ESTIMATORS:
        if cls.name == config.fisher and cls.applies(config):
            return cls
    raise KFACConfigError(f"KFACConfig.fisher={config.fisher!r}: no registered estimator "
                          f"serves it (registered: {sorted({c.name for c in _ESTIMATORS})})")
