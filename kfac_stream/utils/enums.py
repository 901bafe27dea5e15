"""String enums of `KFACConfig`'s options, with membership tests on raw strings
(``"mc" in FisherType``); a config field holds the option's plain string value
(`option_value`)."""

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


def option_values(options: type[Enum]) -> tuple[str, ...]:
    """The allowed strings of an option enum, in declaration order (``('auto', 'on', 'off')``)."""
    return tuple(member.value for member in options)


def option_value(options: type[Enum], value: object) -> object:
    """``value`` as its plain string if it names one of ``options`` (a member or its string:
    ``FoldOn.HOST`` and ``"host"`` both give ``"host"``), else ``value`` unchanged (the caller
    reports it)."""
    return options(value).value if value in options else value


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


class FinalRefresh(str, Enum, metaclass=_MetaEnum):
    """Whether the factors are replaced at train end by a pass at the final weights
    (``KFACConfig.final_refresh``, `kfac_stream.tracking.refresh`).

    ``auto``: when the planned final window starts in the first half of the run.
    ``on``: always (refused under ZeRO-3 / FSDP2 and with EK-FAC). ``off``: never.
    """

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class FoldOn(str, Enum, metaclass=_MetaEnum):
    """Where the second moments are formed and the EMA runs (``KFACConfig.fold_on``,
    `kfac_stream.store.folding`).

    ``device``: on the rows' device, into pending statistics; ``host``: in the CPU store.
    ``auto``: ``device`` on CUDA, ``host`` on CPU.
    """

    AUTO = "auto"
    DEVICE = "device"
    HOST = "host"


class ExchangeMode(str, Enum, metaclass=_MetaEnum):
    """How each update's contributions reach a factor's owner rank (``KFACConfig.exchange``,
    `kfac_stream.distributed.exchange`).

    ``rows``: the sampled rows; ``stats``: each rank's folded statistic; ``auto``: per factor,
    whichever moves fewer bytes.
    """

    AUTO = "auto"
    ROWS = "rows"
    STATS = "stats"


class EighDevice(str, Enum, metaclass=_MetaEnum):
    """Where snapshots eigendecompose the factors (``KFACConfig.eigh_device``).

    ``auto``: the owner's GPU when training on one (float32, float64 CPU fallback per factor),
    else the CPU in float64. ``cpu``: the CPU in float64.
    """

    AUTO = "auto"
    CPU = "cpu"


class Eigendecompose(str, Enum, metaclass=_MetaEnum):
    """When snapshots eigendecompose their factors (``KFACConfig.eigendecompose``,
    `kfac_stream.snapshot.eigen_rule`).

    ``auto``: a periodic snapshot in the run when its predicted share of the snapshot interval
    is at most 1%, else at its first use. ``always``: every snapshot in the run. ``final``: only
    the final snapshot in the run (the final one is always decomposed).
    """

    AUTO = "auto"
    ALWAYS = "always"
    FINAL = "final"
