"""String enums with membership tests on raw strings (``"mc" in FisherType``)."""

from __future__ import annotations

from enum import Enum, EnumMeta


class _MetaEnum(EnumMeta):
    def __contains__(cls, item: object) -> bool:  # noqa: D105
        try:
            cls(item)
        except ValueError:
            return False
        return True


class FisherType(str, Enum, metaclass=_MetaEnum):
    """Which Fisher the G factor estimates.

    ``empirical``: gradients of the observed labels (reuses the training backward, free).
    ``mc``: one label per position sampled from the model (own forward + backward on update steps).
    """

    EMPIRICAL = "empirical"
    MC = "mc"


class StorageDtype(str, Enum, metaclass=_MetaEnum):
    """CPU storage dtype of the factors (float16 is kept with a float32 scale per factor)."""

    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
