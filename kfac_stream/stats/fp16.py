"""Power-of-two scaling for float16 storage and transport.

A tensor whose largest magnitude is ``amax`` is stored as ``q = x · 2^-e`` with ``e`` chosen so
``amax · 2^-e`` lands in ``(2^13, 2^14]``: below float16's overflow (65504) with headroom for
the next update, and a power of two, so the scaling itself is exact and only the float16
rounding of ``q`` remains (relative ``2^-11``).
"""

from __future__ import annotations

import math

FP16_TARGET = 2.0**14  # largest stored or transported magnitude after scaling


def fp16_exponent(amax: float) -> int:
    """``e`` with ``amax · 2^-e`` in ``(2^13, 2^14]``; 0 when ``amax ≤ 0`` (nothing to scale)."""
    return math.ceil(math.log2(amax / FP16_TARGET)) if amax > 0 else 0
