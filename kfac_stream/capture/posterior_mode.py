"""The model as the posterior evaluates it, for the tracker's own forwards (the MC replays).

A posterior is queried in eval mode: no dropout, normalisation layers on their running
statistics. The Monte-Carlo Fisher's replay (`kfac_stream.fisher.mc_replay`) runs the same
way (`posterior_mode`), so its factors are the curvature of the function the posterior
describes, not of a dropout-perturbed one, and a replay moves no running statistic of the
training. Where the MC gradient would be taken inside the training forward instead (whole
micro-batches, `mc_replay.mc_grad_in_forward`), a model with active dropout is replayed after
the step instead (`has_active_dropout`, read by the tracker's ``backward_in_forward_ok``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.modules.dropout import _DropoutNd


def has_active_dropout(model: nn.Module) -> bool:
    """Whether a dropout module of ``model`` (`torch.nn.Dropout` and its family) has
    ``p > 0``. Dropout applied functionally without a module (an attention's
    ``dropout_p`` read from a config number) is not seen here; `posterior_mode` still turns
    it off in a replay, through the module's ``training`` flag."""
    return any(isinstance(m, _DropoutNd) and m.p > 0 for m in model.modules())


@contextlib.contextmanager
def posterior_mode(model: nn.Module) -> Iterator[None]:
    """Within the block every module of ``model`` is in eval mode (no dropout, functional or
    not; normalisation layers read their running statistics and leave them alone), except a
    module that checkpoints its forward (``gradient_checkpointing`` True: transformers' decoder
    and encoder layers, and the models holding them), which keeps its flag, so that a
    backward in the block recomputes activations as the training step's does (its children,
    dropouts included, are in eval mode). Every module's flag is restored on exit, also when
    the block raises."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in flags:
            if getattr(m, "gradient_checkpointing", False) is not True:
                m.training = False
        yield
    finally:
        for m, was in flags:
            m.training = was
