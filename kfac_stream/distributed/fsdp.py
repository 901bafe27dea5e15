"""PyTorch FSDP2 (``fully_shard``): what the tracker needs to know about sharded parameters.

FSDP2 shards every parameter of a ``fully_shard``-ed module along dim 0 as a ``DTensor``
(``Shard(0)`` over the data-parallel mesh) and gathers it only around that module's forward and
backward. Activations and output gradients are never sharded: each rank's hooks see the whole
``[B, T, d]`` tensors of its own micro-batch, exactly as under DDP, and the layer's shape
(``weight.shape``, ``in_features``) is the global one. So capture and the exchange need
nothing FSDP-specific; only code that reads parameter *values* outside the forward does: the
weight fingerprint of a snapshot (`full_weight`, collective) and queries, which refuse a
sharded model (`is_fsdp_sharded`) and take a whole copy instead
(`kfac_stream.whole_model`, `gather_full_state_dict`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def is_dtensor(t: object) -> bool:
    """True if ``t`` is a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_fsdp_sharded(model: nn.Module) -> bool:
    """True if any parameter of ``model`` is a ``DTensor`` (FSDP2 ``fully_shard``, or tensor
    parallelism): its values live across ranks and only a collective reads them whole."""
    return any(is_dtensor(p) for p in model.parameters())


def full_weight(weight: Tensor) -> Tensor:
    """``weight`` as a plain, whole tensor: a ``DTensor`` is gathered (``full_tensor()``,
    collective: every rank of its mesh calls it at the same point), anything else is returned
    as it is."""
    if is_dtensor(weight):
        return weight.detach().full_tensor()
    return weight


def gather_full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole state dict of an FSDP2 ``model`` on CPU, on every rank (collective;
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``: rank 0 receives the tensors, the others an
    empty dict). Keys are the unwrapped model's (``fully_shard`` renames nothing)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unsharded_class(model: nn.Module) -> type:
    """The class ``fully_shard`` replaced: FSDP2 swaps a module's class for a dynamic
    ``FSDP<Name>(FSDPModule, <Name>)``; this returns ``<Name>`` (``type(model)`` otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if not issubclass(cls, FSDPModule):
        return cls
    return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
