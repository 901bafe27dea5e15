"""Which model a snapshot was taken on: its architecture, recorded in the manifest.

Every snapshot's manifest records the model's architecture (``"model": {"class",
"model_type"}``, `model_identity`: the class name and ``config.model_type`` of the model under
any wrapper, a ``peft.PeftModel``'s base model included, so an adapter model, its merge and its
base share one). When a model's layers do not match a snapshot's (a tracked layer missing, or
of another shape), `kfac_stream.query.peft_layers.other_architecture` says first whether the
snapshot is of another architecture, naming both (`describe`), before any finer hint (a merged
LoRA model): a snapshot without the field (written without a model) is judged from its layer
names (none of them, nor their base layers, in the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

#: Wrappers whose ``.module`` is the model (DDP, DataParallel, a DeepSpeed engine).
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine")


def _unwrapped(model: nn.Module) -> nn.Module:
    """``model`` under DDP / DeepSpeed wrappers and a ``peft.PeftModel`` (its base model)."""
    for _ in range(8):
        if type(model).__name__ in _WRAPPERS and isinstance(getattr(model, "module", None),
                                                            nn.Module):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)):
            base = model.get_base_model()
            if base is model or not isinstance(base, nn.Module):
                break
            model = base
        else:
            break
    return model


def model_identity(model: nn.Module | None) -> dict[str, Any] | None:
    """``{"class": name, "model_type": config.model_type or None}`` of ``model`` (unwrapped:
    `_unwrapped`), as a snapshot's manifest records it; None for no model."""
    if model is None:
        return None
    m = _unwrapped(model)
    model_type = getattr(getattr(m, "config", None), "model_type", None)
    return {"class": type(m).__name__,
            "model_type": model_type if isinstance(model_type, str) and model_type else None}


def describe(identity: Mapping[str, Any]) -> str:
    """``GPT2LMHeadModel (model_type 'gpt2')``."""
    mt = identity.get("model_type")
    return f"{identity['class']}" + (f" (model_type {mt!r})" if mt else "")
