r"""A cheap fingerprint of the tracked weights, to tie a snapshot to the model it came from.

Per tracked layer, over a few fixed windows of its weight's entries (the stored parameter
flattened in its own layout: ``[d_out, d_in]`` for ``nn.Linear``, ``[d_in, d_out]`` for
transformers' ``Conv1D``): ``numel`` (of the whole weight), and the float64 ``sum`` and
``sumsq`` (sum of squares) of the `WINDOWS` windows of `WINDOW` entries that start at
``i·numel/WINDOWS`` (the whole weight when it has at most ``WINDOWS·WINDOW`` entries).
Writing it costs one host read per snapshot; a weight a distributed engine shards is gathered
for the read by the layer's engine adapter (`kfac_stream.distributed.engines`: under
DeepSpeed ZeRO-3 collectively, one layer at a time, as a forward does; an FSDP2 ``DTensor``
weight with ``full_tensor()``).

`compare_weights` tells a model from the one a snapshot was taken at: a weight that moved by
one optimizer step changes the sum of squares of 256 entries by far more than `WEIGHTS_RTOL`,
the same weights read on another device or from a partitioned copy agree to ~1e-15.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..distributed.engines import engine_for

#: Windows per layer, and entries per window.
WINDOWS, WINDOW = 4, 64
#: Relative tolerance of `compare_weights`: float64 sums of the same float32 (or bf16) entries
#: in another order differ by ~1e-15 relative; a model re-cast to fp16/bf16 differs by ~1e-3
#: (and is reported: it is not the model the posterior was fitted to, to that precision).
WEIGHTS_RTOL = 1e-6


def _windows(numel: int) -> list[tuple[int, int]]:
    if numel <= WINDOWS * WINDOW:
        return [(0, numel)]
    return [(i * numel // WINDOWS, i * numel // WINDOWS + WINDOW) for i in range(WINDOWS)]


def _sums(weight: Tensor) -> Tensor:
    """``[sum, sumsq]`` (float64, on the weight's device) of ``weight``'s windows."""
    flat = weight.detach().reshape(-1)
    vals = torch.cat([flat[a:b] for a, b in _windows(flat.numel())]).double()
    return torch.stack([vals.sum(), vals.square().sum()])


def weights_fingerprint(layers: Mapping[str, nn.Module]) -> dict[str, dict[str, float | int]]:
    """``{layer: {"numel", "sum", "sumsq"}}`` of the tracked ``layers``' weights (module
    docstring). Collective under a sharding engine (ZeRO-3, FSDP2): every rank calls it at the
    same point; each layer's weight is read whole inside its engine's ``gathered``."""
    sums, numels = [], []
    for module in layers.values():
        w = module.weight
        engine = engine_for(module)
        with engine.gathered([w]):
            numels.append(engine.full_numel(w))
            sums.append(_sums(engine.full_tensor(w)))
    values = torch.stack([s.to(sums[0].device) for s in sums]).cpu().tolist() if sums \
        else []  # one host read for all layers
    return {name: {"numel": n, "sum": v[0], "sumsq": v[1]}
            for name, n, v in zip(layers, numels, values)}


def compare_weights(recorded: Mapping[str, Mapping[str, float]],
                    layers: Mapping[str, nn.Module]) -> list[str]:
    """The layers of ``layers`` whose weights differ from a snapshot's ``recorded``
    fingerprint (`weights_fingerprint`), each as ``"<layer> (<what differs>)"``; layers the
    fingerprint does not hold are not compared. Whole weights only (no ZeRO-3 placeholder)."""
    have = {n: m for n, m in layers.items() if n in recorded}
    now = weights_fingerprint(have)
    out = []
    for name, got in now.items():
        want = recorded[name]
        if got["numel"] != want["numel"]:
            out.append(f"{name} ({got['numel']} weights, the snapshot's {want['numel']})")
            continue
        scale = max(abs(want["sumsq"]), 1e-300)
        d_sq = abs(got["sumsq"] - want["sumsq"]) / scale
        d_sum = abs(got["sum"] - want["sum"]) / math.sqrt(scale * min(got["numel"],
                                                                       WINDOWS * WINDOW))
        if d_sq > WEIGHTS_RTOL or d_sum > WEIGHTS_RTOL:
            out.append(f"{name} (relative difference {max(d_sq, d_sum):.2g} in the sampled "
                       "weights)")
    return out
