"""The Trainer's eval set, handed to the session for the held-out fit
(`kfac_stream.tracking.plan.EvalBatches`, `kfac_stream.tracking.heldout_fit`).

A ``TrainerCallback`` is not given the Trainer: `trainer_eval_set` finds it once, at train
begin, as the first ``self`` on the call stack of the callback's event that is one."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from transformers import Trainer

from .spectrum_monitor import find_on_stack


class TrainerEvalSet:
    """A Trainer's eval set as `EvalBatches`: its ``eval_dataset``, read when asked (at train
    begin and at train end), and one pass of its ``get_eval_dataloader()`` (its collator,
    sampler and workers). Holds the Trainer weakly: the callback keeps no Trainer alive."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = weakref.ref(trainer)

    @property
    def dataset(self) -> Any:
        """The Trainer's ``eval_dataset`` (None: none, or the Trainer is gone)."""
        trainer = self._trainer()
        return None if trainer is None else trainer.eval_dataset

    def batches(self) -> Iterable[Mapping[str, Any]]:
        """The Trainer's eval dataloader: collated batches ``{name: tensor [B, ...]}``."""
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError("the Trainer of this run is gone")
        return trainer.get_eval_dataloader()


def trainer_eval_set(depth: int = 16) -> TrainerEvalSet | None:
    """The eval set of the `transformers.Trainer` whose callback event is running (the
    first ``self`` among the caller's ``depth`` callers that is one), or None when there is
    none (the callback's events called by hand)."""
    trainer = find_on_stack(Trainer, depth)
    return None if trainer is None else TrainerEvalSet(trainer)
