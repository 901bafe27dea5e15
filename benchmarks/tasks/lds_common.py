"""What the LDS tasks share (`lds_tasks`, `mnist_task`): stacking examples into batches and the
copies of the weights at given steps of a Trainer run."""

from __future__ import annotations

import torch
from transformers import TrainerCallback


def collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def batches(examples: list[dict], size: int) -> list[dict[str, torch.Tensor]]:
    return [collate(examples[i:i + size]) for i in range(0, len(examples), size)]


class Checkpoints(TrainerCallback):
    """Copies of the weights and the learning rate at the given optimizer steps."""

    def __init__(self, model: torch.nn.Module, steps: set[int]):
        self.model, self.steps = model, steps
        self.states: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []
        self.at: list[int] = []

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
        if state.global_step in self.steps:
            self.states.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
            self.lrs.append(float(lr_scheduler.get_last_lr()[0]) if lr_scheduler is not None
                            else float("nan"))
            self.at.append(state.global_step)
