"""String enums with membership tests on raw strings (``"mc" in FisherType``)."""

from __future__ import annotations

from enum import Enum, EnumMeta

import torch


class _MetaEnum(EnumMeta):
    def __contains__(cls, item: object) -> bool:  # noqa: D105
        try:
            cls(item)
        except (ValueError, TypeError):  # TypeError: an unhashable value (a list)
            return False
        return True


class FisherType(str, Enum, metaclass=_MetaEnum):
    """Which Fisher the G factor estimates.

    ``empirical``: gradients of the observed labels (reuses the training backward, free).
    ``mc``: one label per position sampled from the model (own forward + backward on update steps).
    """

    EMPIRICAL = "empirical"
    MC = "mc"


class FactorForm(str, Enum, metaclass=_MetaEnum):
    """How a layer applied at every token position turns positions into factor rows
    (`kfac_stream.fisher.curvature`).

    ``expand``: every sampled position is a row; ``N`` counts token positions.
    ``reduce``: one row per sequence (mean input, summed output gradient); ``N`` counts
    sequences.
    ``auto``: ``reduce`` for a model with a sequence-level loss (a classifier), else
    ``expand``.
    """

    EXPAND = "expand"
    REDUCE = "reduce"
    AUTO = "auto"


class StorageDtype(str, Enum, metaclass=_MetaEnum):
    """CPU storage dtype of the factors (float16 is kept with a float32 scale per factor)."""

    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The stored tensors' dtype."""
        return getattr(torch, self.value)

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return self.torch_dtype.itemsize

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the EMA arithmetic: float32 for float16 storage (its rounding dominates),
        float64 otherwise (a float32 factor is the exact EMA rounded once)."""
        return torch.float32 if self is StorageDtype.FLOAT16 else torch.float64

    @property
    def wide_dtype(self) -> torch.dtype:
        """Dtype of captured rows and step statistics: float64 for float64 storage (exact
        tests with float64 models), else float32."""
        return torch.float64 if self is StorageDtype.FLOAT64 else torch.float32


class LayerPreset(str, Enum, metaclass=_MetaEnum):
    """Named layer selections (``KFACConfig.preset``), resolved by
    `kfac_stream.capture.presets.preset_layers`.

    ``last_layer``: the output head (LM head, or a sequence classifier's head).
    ``lora``: the PEFT LoRA adapters (``lora_A``/``lora_B``).
    ``attention``: the attention projections inside the transformer blocks.
    ``mlp``: the feed-forward layers inside the transformer blocks.
    ``all_linear``: every trainable Linear/Conv1D inside the blocks (the default selection).
    """

    LAST_LAYER = "last_layer"
    LORA = "lora"
    ATTENTION = "attention"
    MLP = "mlp"
    ALL_LINEAR = "all_linear"
