"""`FSDP2Engine`: PyTorch FSDP2 (``fully_shard``), whose parameters are ``DTensor`` shards.

FSDP2 shards every parameter of a ``fully_shard``-ed module along dim 0 as a ``DTensor``
(``Shard(0)`` over the data-parallel mesh) and gathers it only around that module's forward and
backward. Activations and output gradients are never sharded: each rank's hooks see the whole
``[B, T, d]`` tensors of its own micro-batch, exactly as under DDP, and the layer's shape
(``weight.shape``, ``in_features``) is the global one. So capture and the exchange need
nothing FSDP-specific; only code that reads parameter *values* outside the forward does: the
weight fingerprint of a snapshot (`FSDP2Engine.full_tensor`, collective) and queries, which
refuse a sharded model and take a whole copy instead (`kfac_stream.gather_model`, through
`gather_full_state_dict` and `unsharded_class`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from .base import EngineAdapter

#: What `FSDP2Engine.launch_not_applied` logs: accelerate was launched with an FSDP config, yet
#: no parameter is an FSDP2 shard.
NOT_APPLIED = ("kfac_stream: accelerate was launched with an FSDP config, but no parameter "
               "of the model is an FSDP2 (fully_shard) shard: on CPU accelerate ignores "
               "FSDP and trains with DDP, and FSDP1 (fsdp_version: 1) is not supported; "
               "use fsdp_version: 2 (docs/multinode.md)")


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


class FSDP2Engine(EngineAdapter):
    """FSDP2 ``fully_shard`` (and any model whose parameters are ``DTensor`` shards)."""

    name = "FSDP2"
    whole_copy = "state_dict"
    manual_copy_hint = ("gather its weights with torch.distributed.checkpoint's "
                        "get_model_state_dict(model, options=StateDictOptions("
                        "full_state_dict=True)) and load them into an unsharded instance")

    def matches(self, model: nn.Module) -> bool:
        return is_fsdp_sharded(model)

    def is_sharded_parameter(self, param: Tensor) -> bool:
        return is_dtensor(param)

    def full_tensor(self, param: Tensor) -> Tensor:
        """``DTensor.full_tensor()`` (collective); the shape is the global one already."""
        return full_weight(param)

    def sharded_parameter_problem(self, where: str, name: str, param: Tensor) -> str | None:
        if not is_dtensor(param):
            return None
        return (
            f"{where}: the model's weights are sharded across ranks by FSDP2 (fully_shard): "
            f"{name!r} is a DTensor whose values this process holds only in part, gathered "
            "inside the model's own forward and backward on every rank at once: query a "
            "whole copy: model = kfac_stream.gather_model(trainer, save_dir) on every rank "
            "(it gathers the weights and returns a plain model on the main process)")

    def launch_not_applied(self, model: nn.Module) -> str | None:
        """accelerate launched with an FSDP config (``ACCELERATE_USE_FSDP``), yet no
        parameter is an FSDP2 shard: accelerate 1.x drops its FSDP plugin on CPU (``use_cpu``:
        the Trainer then wraps the model in DDP), and FSDP1 (``fsdp_version: 1``) wraps
        parameters into flat ones kfac_stream does not support."""
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or \
                is_fsdp_sharded(model):
            return None
        return NOT_APPLIED

    def unsharded_class(self, model: nn.Module) -> type:
        return unsharded_class(model)

    def gather_full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        return gather_full_state_dict(model)
