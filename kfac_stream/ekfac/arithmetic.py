"""The EK-FAC correction's arithmetic per layer (`kfac_stream.ekfac`, whose module docstring
derives it): which order of products is cheaper, their FLOPs and device bytes, and the sum of
the squared rotated per-sequence gradients. Device ops only."""

from __future__ import annotations

import torch
from torch import Tensor

#: Entries of the ``[b, d_out, d_A]`` rotated per-sequence gradients formed at once (float32:
#: 64 MiB); at least one sequence.
CHUNK_ENTRIES = 1 << 24


def correction_order(d_out: int, d_a: int, tokens: int, rotate_g: bool = True,
                     rotate_a: bool = True) -> str:
    """``"rotate_first"`` or ``"gradient_first"``: the cheaper order for sequences of
    ``tokens`` positions (module docstring); ``rotate_g`` / ``rotate_a`` False: that factor is
    diagonal (identity basis, no rotation)."""
    first = tokens * (d_out * d_out * rotate_g + d_a * d_a * rotate_a)
    after = d_out * d_a * (d_out * rotate_g + d_a * rotate_a)
    return "rotate_first" if first <= after else "gradient_first"


def correction_flops(d_out: int, d_a: int, tokens: int, sequences: int = 1,
                     rotate_g: bool = True, rotate_a: bool = True) -> int:
    """FLOPs of one layer's correction over ``sequences`` sequences of ``tokens`` positions, in
    the order `correction_order` picks (what `sequence_correction` runs)."""
    first = tokens * (d_out * d_out * rotate_g + d_a * d_a * rotate_a)
    after = d_out * d_a * (d_out * rotate_g + d_a * rotate_a)
    per = 2 * tokens * d_out * d_a + 2 * min(first, after) + 2 * d_out * d_a
    return int(sequences) * per


def correction_bytes(d_out: int, d_a: int, sequences: float, rotate_g: bool = True,
                     rotate_a: bool = True, itemsize: int = 2) -> float:
    """Device bytes one layer's correction moves per update (module docstring): the basis
    read once (``itemsize`` per entry: 2 for a 16-bit run, 4 in float32), the float32
    accumulator read and written, each sequence's ``[d_out, d_A]`` product written and read
    (``itemsize``); the inputs and gradients it reads are the training's own."""
    basis = itemsize * (d_out * d_out * rotate_g + d_a * d_a * rotate_a)
    return basis + 8 * d_out * d_a + 2 * itemsize * d_out * d_a * sequences


def sequence_correction(a: Tensor, g: Tensor, q_a: Tensor | None, q_g: Tensor | None,
                        chunk: int = CHUNK_ENTRIES) -> Tensor:
    """``Σ_n (Q_Gᵀ (Σ_t g_nt a_ntᵀ) Q_A)²`` over the ``B`` sequences of ``a [B, T, d_A]`` (bias
    column included, padding rows zero) and ``g [B, T, d_out]``: ``[d_out, d_A]``.

    ``q_a`` / ``q_g`` None: the identity (a diagonal factor). The order of the products is
    `correction_order`'s; the per-sequence matrices are formed ``chunk`` entries at a time.
    16-bit inputs: the products in that dtype, the squares summed in float32 (the result's
    dtype). Device ops only."""
    B, T, d_a = a.shape
    d_out = g.shape[-1]
    wide = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    out = torch.zeros(d_out, d_a, dtype=wide, device=a.device)
    first = correction_order(d_out, d_a, T, q_g is not None, q_a is not None) == "rotate_first"
    if first:
        a = a if q_a is None else a @ q_a
        g = g if q_g is None else g @ q_g
    step = max(1, chunk // max(d_out * d_a, 1))
    for s in range(0, B, step):
        m = torch.bmm(g[s:s + step].transpose(1, 2), a[s:s + step])  # [b, d_out, d_A]
        if not first:
            m = m if q_g is None else q_g.T @ m
            m = m if q_a is None else m @ q_a
        out += m.to(wide).square_().sum(0)
    return out
