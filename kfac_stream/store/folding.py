"""Where each update's second moments ``XᵀX`` are formed and where its EMA runs: one place.

=====================  =================================  ==================================
``fold_on``            rows (dense factors)               summed statistics (diagonal
                                                          factors; the "stats" exchange)
=====================  =================================  ==================================
``"device"``           accumulated into the factor's      added into the factor's pending
                       pending statistic on the device    statistic on the device
                       (`FactorStore.push_device`, one
                       fused ``addmm_``; 16-bit rows on
                       CUDA: tensor cores, fp32 output)
``"host"``             copied to the CPU store, folded    divided by ``n`` and folded into
                       there every few updates            the CPU store at once
                       (`FactorStore.push_rows`)          (`FactorStore.update`)
=====================  =================================  ==================================

`Folding` also chooses the dtype the rows are handed over in (`row_dtype`) and the partial
Gram the exchange's statistics strategy reduces (`partial_gram`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..stats.covariance import gram
from .device_fold import gram_mm
from .factor_store import FactorStore


def gram_fp32(rows: Tensor, diagonal: bool) -> Tensor:
    """``Σ rowsᵀrows`` (``[d, d]``) or its diagonal (``[d]``) where the rows are, accumulated
    and returned in float32 (float64 rows: float64). 16-bit rows on CUDA use the tensor cores
    with fp32 accumulation and fp32 output (`device_fold.gram_mm`)."""
    if rows.dtype in (torch.float32, torch.float64):
        return gram(rows, diagonal)
    if diagonal:
        return rows.float().square().sum(0)
    if rows.is_cuda:
        return gram_mm(rows)
    return gram(rows.float(), diagonal)


class Folding:
    """The fold decisions of one tracker (see the module table).

    Args:
        fold_on: ``"device"`` or ``"host"`` (resolved, `kfac_stream.store.device_budget`).
        device: The rows' device.
        wide: The wide dtype of the storage (float32, float64 for float64 storage).
    """

    def __init__(self, fold_on: str, device: torch.device, wide: torch.dtype) -> None:
        if fold_on not in ("device", "host"):
            raise ValueError(f"fold_on must be resolved to 'device' or 'host', not {fold_on!r}")
        self.on, self.device, self.wide = fold_on, device, wide

    def row_dtype(self, captured: torch.dtype | None) -> torch.dtype:
        """The dtype rows are scaled into and handed over in: bfloat16 for rows that came from
        16-bit activations on a GPU (tensor-core Gram with fp32 accumulation), else the wide
        dtype."""
        if self.device.type != "cuda" or self.wide == torch.float64 or captured is None:
            return self.wide
        return torch.bfloat16 if captured.itemsize == 2 \
            else self.wide

    def partial_gram(self, rows: Tensor, diagonal: bool) -> Tensor:
        """A rank's partial ``Σ rowsᵀrows`` for the exchange's statistics strategy."""
        return gram_fp32(rows, diagonal)

    def deliver(self, store: FactorStore, key: str, how: str, payload, *, n: float,
                positions: int, decay: float | None) -> None:
        """Fold one update of factor ``key`` into ``store``.

        Args:
            how: ``"rows"`` (``payload``: rows ``[m, d]``) or ``"stats"`` (``payload``: the
                summed statistic).
            n, positions, decay: The update's total weight, sampled positions and ``λ``.
        """
        if self.on == "device":
            store.push_device(key, payload, how, n, positions, decay)
        elif how == "rows":
            store.push_rows(key, payload.cpu(), n, positions, decay)  # [m, d]
        else:
            store.update(key, payload.cpu().div_(n), n, positions, decay)

    def deliver_group(self, store: FactorStore, keys: tuple[str, ...], rows: Tensor, *,
                      n: float, positions: int, decay: float | None) -> None:
        """Fold one update of the factors ``keys``, whose rows come stacked (``[G, m, d]``,
        the same weight for each): on the device as one group (`FactorStore.push_group`),
        on the host per factor."""
        if self.on == "device":
            store.push_group(keys, rows, n, positions, decay)
            return
        host = rows.cpu()
        for i, key in enumerate(keys):
            store.push_rows(key, host[i], n, positions, decay)

    def end_update(self, store: FactorStore) -> None:
        """After every factor of an update was delivered (device path: read forced folds and
        the live traces, `FactorStore.end_update`)."""
        if self.on == "device":
            store.end_update()
