"""`DeepSpeedZero3`: DeepSpeed's ZeRO-3, the one ZeRO stage that partitions parameters.

Under ZeRO-1 and ZeRO-2 DeepSpeed partitions optimizer states (and gradients) only: every rank
holds every parameter whole, so such a model is a plain one (`PlainEngine`). Under ZeRO-3 each
rank holds 1/world of every parameter; the engine gathers them only inside its own forward
and partitions them again after it. A partitioned parameter carries ``ds_numel`` (the whole
number of values) and ``ds_shape`` (the whole shape); its local tensor is a placeholder
(``numel`` 0 between forwards). Reading one outside the forward takes
``deepspeed.zero.GatheredParameters`` (collective: every rank at the same point).

The whole copy after training (`kfac_stream.gather_model`) goes through the Trainer's
``save_model``, which gathers the 16-bit weights into files when the DeepSpeed config has
``stage3_gather_16bit_weights_on_model_save`` (``whole_copy = "save"``).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager

from torch import Tensor, nn

from .base import EngineAdapter

#: The weight files transformers' ``save_pretrained`` writes (one of them, at least).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
#: What makes ZeRO-3's ``save_model`` (and accelerate's ``get_state_dict``) gather the weights.
GATHER_16BIT_HINT = ("set stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed "
                     "config (accelerate yaml: zero3_save_16bit_model: true, as launch/'s ZeRO-3 "
                     "configs do)")


def is_zero3_partitioned(model: nn.Module) -> bool:
    """True if DeepSpeed ZeRO-3 manages any parameter of ``model`` (it sets ``ds_numel``)."""
    return any(hasattr(p, "ds_numel") for p in model.parameters())


def hf_zero3_enabled() -> bool:
    """True while transformers' global ZeRO-3 flag is set (a Trainer with a ZeRO-3 DeepSpeed
    config sets it; `DeepSpeedZero3.before_local_load` clears it)."""
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())


def only_empty_weights(save_dir: str) -> bool:
    """True if the saved weight files hold no values (what ``save_model`` writes under ZeRO-3
    without the 16-bit gather)."""
    files = glob.glob(os.path.join(save_dir, "*.safetensors"))
    if not files:
        return False
    from safetensors import safe_open

    for path in files:
        with safe_open(path, "pt") as f:
            if any(f.get_slice(k).get_shape() not in ([], [0]) for k in f.keys()):
                return False
    return True


class DeepSpeedZero3(EngineAdapter):
    """DeepSpeed ZeRO-3: parameters with ``ds_numel`` are partitioned (module docstring)."""

    name = "ZeRO-3"
    whole_copy = "save"
    manual_copy_hint = ("save it with trainer.save_model(dir) and load it in a process without "
                        "DeepSpeed with its own loader")
    save_gather_hint = GATHER_16BIT_HINT

    def matches(self, model: nn.Module) -> bool:
        """A parameter of ``model`` is partitioned, or transformers' ZeRO-3 flag is set."""
        return is_zero3_partitioned(model) or hf_zero3_enabled()

    def is_sharded_parameter(self, param: Tensor) -> bool:
        return hasattr(param, "ds_numel")

    def full_shape(self, param: Tensor) -> tuple[int, ...]:
        """``ds_shape`` keeps the whole shape of a placeholder."""
        return tuple(getattr(param, "ds_shape", None) or param.shape)

    def full_numel(self, param: Tensor) -> int:
        return int(getattr(param, "ds_numel", param.numel()))

    def gathered(self, params: Iterable[Tensor]) -> AbstractContextManager:
        """``GatheredParameters`` of the partitioned ones among ``params`` (collective)."""
        parts = [p for p in params if hasattr(p, "ds_numel")]
        if not parts:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(parts, modifier_rank=None)

    def sharded_parameter_problem(self, where: str, name: str, param: Tensor) -> str | None:
        """Any parameter DeepSpeed manages: even when gathered right after
        ``trainer.train()``, the engine partitions it again after the next forward."""
        if not hasattr(param, "ds_numel"):
            return None
        return (
            f"{where}: the model's weights are partitioned across ranks by DeepSpeed ZeRO-3 "
            f"({name!r} holds {param.numel()} of its {param.ds_numel} values in this process, "
            "and the engine gathers them only inside its own forward): query a whole copy: "
            "model = kfac_stream.gather_model(trainer, save_dir) on every rank (it saves the "
            "model and loads it on the main process), or save it with "
            "trainer.save_model(dir) and load it with from_pretrained(dir) in a process "
            "without DeepSpeed")

    def allows_backward_in_forward(self, model: nn.Module) -> bool:
        """Not while transformers' ZeRO-3 flag is set: the engine gathers and releases the
        parameters through hooks on its own forward and backward."""
        return not hf_zero3_enabled()

    def saved_weights_problem(self, save_dir: str) -> str | None:
        """No weight file in ``save_dir``, or only empty ones (no 16-bit gather)."""
        found = [f for f in WEIGHT_FILES if os.path.exists(os.path.join(save_dir, f))]
        if found and not only_empty_weights(save_dir):
            return None
        return f"wrote no whole weights: {GATHER_16BIT_HINT}"

    def before_local_load(self) -> None:
        """Clear transformers' global ZeRO-3 flag, or ``from_pretrained`` would partition the
        copy again (a collective call on one rank)."""
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
