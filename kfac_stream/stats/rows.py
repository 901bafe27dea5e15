"""The canonical row format: every captured tensor becomes ``[n, d]`` rows.

A layer input or output gradient of shape ``[B, T, d]`` (or any ``[..., d]``) is flattened to
``[B*T, d]`` (position ``s = b*T + t``), and the rows of the sampled positions are gathered.
Usable positions are those with ``attention_mask == 1`` that can carry the loss's gradient
(`gradient_positions`: with labels, none after a sequence's last loss-bearing position);
padding rows are never gathered. An encoder-decoder's decoder positions are a second stream
of positions (the *target* row space), usable where the decoder's labels say so. A layer
applied once per sequence (``[B, d]``) is in the *sequence* row space: all ``B`` rows are
taken, a sequence without a usable position weighted 0 (`ROW_SPACES`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def usable_positions(attention_mask: Tensor | None, batch_shape: tuple[int, int],
                     device: torch.device) -> Tensor:
    """Boolean mask of usable positions.

    Args:
        attention_mask: ``[B, T]`` (1 = real token, 0 = padding) or None (all real).
        batch_shape: ``(B, T)``.
        device: Device of the returned mask.

    Returns:
        ``[B*T]`` bool.
    """
    if attention_mask is None:
        return torch.ones(batch_shape[0] * batch_shape[1], dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:  # 4-D custom masks: fall back to "every position"
        return torch.ones(batch_shape[0] * batch_shape[1], dtype=torch.bool, device=device)
    return attention_mask.reshape(-1).to(device=device) != 0


def slots_per_pass(fraction: float, n_positions: int) -> int:
    """Fixed number of sampled slots of a pass: ``ceil(fraction · N)``, in ``[1, N]``."""
    return max(1, min(n_positions, math.ceil(fraction * n_positions)))


def sample_positions(usable: Tensor, fraction: float, generator: torch.Generator | None,
                     slots: int | None = None) -> tuple[Tensor, Tensor]:
    r"""Draw a fixed number of positions among the usable ones, on ``usable.device``, without
    reading anything on the host (no ``nonzero``, no ``.item()``).

    ``m = ceil(fraction·N)`` slots, or ``slots`` when given (the MC sub-batch replay, which
    takes the slots of a whole micro-batch from a few of its sequences). Every position gets a
    uniform random key, padding gets key 2 (never below a usable one); the ``m`` smallest keys
    win (``topk``): a uniformly random subset of ``min(m, U)`` of the ``U`` usable positions,
    plus ``max(0, m − U)`` padding slots. Each usable slot carries the Horvitz–Thompson weight
    :math:`1/\pi = \max(1, U/m)` (the inverse of its inclusion probability :math:`\pi = \min(1,
    m/U)`), each padding slot weight 0, so the weights of a pass sum to exactly ``U`` and
    :math:`\sum_s w_s x_s x_s^\top / \sum_s w_s` is an unbiased estimate of the pass's mean over
    its usable positions; over several passes it is token-weighted.

    ``fraction == 1`` (or ``slots ≥ N``) takes every position (``arange``, no draw) with weight
    1 on usable and 0 on padding: the exact full-batch statistic.

    Args:
        usable: ``[N]`` bool (N = B*T).
        fraction: Slots per position, in (0, 1].
        generator: Generator on ``usable.device`` (advanced once per pass if ``fraction < 1``).

    Returns:
        ``(index [m] int64 ascending, weight [m] float32)`` on ``usable.device``.
    """
    n = usable.shape[0]
    if (fraction >= 1.0) if slots is None else (slots >= n):
        return torch.arange(n, device=usable.device), usable.to(torch.float32)
    m = slots_per_pass(fraction, n) if slots is None else int(slots)
    keys = torch.rand(n, generator=generator, device=usable.device)
    keys = torch.where(usable, keys, 2.0)
    index = torch.topk(keys, m, largest=False, sorted=False).indices.sort().values  # [m]
    count = usable.sum().to(torch.float32)  # U, stays on the device
    weight = usable.index_select(0, index).to(torch.float32) * (count / m).clamp(min=1.0)
    return index, weight


def gradient_positions(labels: Tensor, shift: bool) -> Tensor:
    """Positions that can carry a gradient of the loss in a causal stack (a causal LM, or an
    encoder-decoder's decoder): those at or before their sequence's last loss-bearing one.

    A position ``t`` bears a loss when its logits are scored: ``labels[:, t+1] != -100`` with
    the causal LM's shift (``shift``), ``labels[:, t] != -100`` without (a decoder). In a
    causal stack position ``s`` reaches the losses at ``t ≥ s`` only, so a position after the
    last loss-bearing one has a zero output gradient (its activations would only dilute the A
    factor and inflate ``N``); one before it, even with an ignored label of its own (a
    prompt), reaches the later losses through attention and is kept. No host read.

    Args:
        labels: ``[B, T]`` int, ``-100`` where no loss is taken.
        shift: The causal LM's shift.

    Returns:
        ``[B*T]`` bool.
    """
    keep = labels != -100  # [B, T]
    if shift:
        keep = torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
    return (keep.flip(1).cumsum(1).flip(1) > 0).reshape(-1)


#: The row spaces of a tracked layer: one row per token position of the input (``[B, T, d]``
#: inputs, the transformer blocks), one per decoder position of an encoder-decoder
#: (``target``: its decoder's blocks, whatever the decoder's length) or one per sequence
#: (``[B, d]``: a pooler or a head that reads one token per sequence, e.g. BERT's
#: ``pooler.dense`` and ``classifier``).
ROW_SPACES = ("position", "target", "sequence")


def sequence_usable(usable: Tensor, batch: int) -> Tensor:
    """Sequences with at least one usable position.

    Args:
        usable: ``[B*T]`` bool.
        batch: ``B``.

    Returns:
        ``[B]`` bool.
    """
    return usable.reshape(batch, -1).any(dim=1)


def row_space_of(name: str, x: Tensor, batch: int, n_positions: int,
                 target: int | None = None, model=None) -> str:
    """Which row space a layer input ``x`` (``[..., d]``) is in: ``"target"`` when ``target``
    is given (a decoder-side layer of an encoder-decoder, not reading the encoder's output)
    and ``x`` has that many rows (``B*T_dec``), ``"position"`` when it has ``B*T`` rows,
    ``"sequence"`` when it has ``B`` (a head on one token per sequence).

    Raises:
        RuntimeError: none of them; the message names the layer, the shapes and the fix.
    """
    rows = x.numel() // max(1, x.shape[-1])
    if target is not None and rows == target:
        return "target"
    if rows == n_positions:
        return "position"
    if rows == batch:
        return "sequence"
    seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    also = f", {target} for one at every decoder position" if target is not None else ""
    if seq2seq and target is None:
        also = ("; the decoder's positions apply to layers under a module named 'decoder' "
                "(or the LM head)")
    raise RuntimeError(
        f"kfac_stream: tracked layer {name!r} got an input of shape {tuple(x.shape)}: "
        f"{rows} rows, where the forward pass has {batch} sequences of "
        f"{n_positions // max(1, batch)} positions: {n_positions} rows for a layer applied at "
        f"every position, {batch} for one applied once per sequence{also}; kfac_stream tracks "
        "layers applied at every position ([batch, seq, features]) or once per sequence "
        f"([batch, features]): exclude this one (KFACConfig(exclude=[{name!r}]))")


def reduce_rows(x: Tensor, usable: Tensor, batch: int, mean: bool,
                dtype: torch.dtype | None) -> Tensor:
    """One row per sequence from a position-space tensor: the sum (``mean=False``, an output
    gradient ``ĝ = Σ_t g_t``) or the mean (``mean=True``, an input ``ā``) over each sequence's
    usable positions (the reduce form, `kfac_stream.fisher.curvature`). A sequence without a usable
    position gives a zero row. One batched matrix product per call (accumulated in float32 by
    the 16-bit kernels), no host read.

    Args:
        x: ``[..., d]`` with ``B*T`` rows.
        usable: ``[B*T]`` bool.
        batch: ``B``.
        mean: Divide by the usable positions of each sequence.
        dtype: Dtype of the returned rows; None keeps the input's.

    Returns:
        ``[B, d]`` detached rows.
    """
    d = x.shape[-1]
    flat = x.detach().reshape(batch, -1, d)  # [B, T, d]
    weight = usable.reshape(batch, 1, -1).to(flat.dtype)  # [B, 1, T]
    rows = torch.bmm(weight, flat)[:, 0]  # [B, d]
    rows = rows if dtype is None else rows.to(dtype)
    if mean:
        rows = rows / weight.sum(2).clamp(min=1).to(rows.dtype)  # [B, 1]
    return rows


def gather_rows(x: Tensor, index: Tensor | None, n_rows: int, dtype: torch.dtype | None
                ) -> Tensor:
    """Rows of the sampled positions (or every row).

    Args:
        x: ``[..., d]`` with ``prod(...) == n_rows`` (e.g. ``[B, T, d]``, or ``[B, d]`` for a
            sequence-space layer).
        index: ``[n]`` flat row indices; None: every row.
        n_rows: Rows ``x`` must have (``B*T`` or ``B``), to check the layout.
        dtype: Dtype of the returned rows; None keeps the input's.

    Returns:
        ``[n, d]`` detached rows (``[n_rows, d]`` with ``index`` None).
    """
    d = x.shape[-1]
    if x.numel() != n_rows * d:
        raise RuntimeError(
            f"kfac_stream: a tracked layer's gradient has {x.numel() // max(d, 1)} rows where "
            f"its input had {n_rows}: kfac_stream needs a layer's output rows to match its "
            "input rows")
    with torch.no_grad():  # one device op per call: the rows, already detached
        if index is None:
            rows = x.detach().reshape(-1, d)
        elif x.dim() == 3:
            rows = x[_batch_and_time(index, x.shape[1])]  # [n, d]
        else:
            rows = x.reshape(-1, d).index_select(0, index)
    return rows if dtype is None else rows.to(dtype)


#: The last flat index split into ``(batch, time)`` indices: ``(index, T, (b, t))`` (every
#: layer of a pass gathers the same positions, so the split is made once per pass).
_SPLIT: list = [None]


def _batch_and_time(index: Tensor, time: int) -> tuple[Tensor, Tensor]:
    """``(index // T, index % T)``: the flat indices into ``B*T`` as batch and time indices."""
    held = _SPLIT[0]
    if held is None or held[0] is not index or held[1] != time:
        held = _SPLIT[0] = (index, time, (index // time, index % time))
    return held[2]
