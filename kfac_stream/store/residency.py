"""The device path's residency plan: which factors keep their pending statistic resident on the
device between updates, within a byte budget (largest first, after the accumulation's work
space and the bytes reserved for the EK-FAC state), the resident bytes counted, and the budget
halved when the device runs out of memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .device_budget import cuda_budget
from .fold_cost import CHUNK_ENTRIES
from .stored_factor import StoredFactor
from .traffic import Traffic

logger = logging.getLogger("kfac_stream")


class Residency:
    """The residency plan of one store's factors.

    Args:
        factors: The store's factors (``{key: StoredFactor}``, the store's own dict: factors it
            adds later are planned after `planned` is cleared).
        device: The device of the device path (None: host path only, nothing resident).
        budget: Bytes of device memory the resident pending statistics and the work space may
            take; None: decided from the CUDA device's memory at the first plan.
        compute_dtype: The dtype of the pending statistics.
        traffic: Where the budget and the resident bytes are counted.
        reserved: Bytes of the budget held by other device-resident state of the tracker
            before any pending statistic (the EK-FAC bases and accumulators,
            `kfac_stream.ekfac.ekfac_device_bytes`).
    """

    def __init__(self, factors: dict[str, StoredFactor], device: torch.device | None,
                 budget: int | None, compute_dtype: torch.dtype, traffic: Traffic,
                 reserved: int = 0) -> None:
        self.reserved = int(reserved)
        self.factors = factors
        self.device = device
        self.budget = budget
        self.compute_dtype = compute_dtype
        self.traffic = traffic
        self.planned = False  # residency planned (`plan`)
        self.spare = 0  # budget bytes left after the resident statistics and the work space

    def plan(self) -> None:
        """Decide once (and again after factors are added) which factors keep their pending
        statistic on the device: largest first, while their bytes and the accumulation's
        work space (`work_space`) fit the budget."""
        if self.planned or self.device is None:
            return
        if self.budget is None:
            self.budget = cuda_budget(self.device) if self.device.type == "cuda" \
                else 0
        budget = int(self.budget) - self.work_space() - self.reserved
        if self.reserved and budget < 0:
            logger.warning(
                "kfac_stream: the device budget (%d bytes) cannot hold the EK-FAC bases and "
                "accumulators (%d bytes) with the accumulation's work space (%d bytes); no "
                "factor keeps its pending statistic on the device (each update folds into the "
                "host store at once). Set KFACConfig.device_memory_budget higher, or "
                "max_dense_dim lower (diagonal factors hold no basis)", int(self.budget),
                self.reserved, self.work_space())
        esize = self.compute_dtype.itemsize
        used = 0
        for f in sorted(self.factors.values(), key=lambda f: -f.data.numel()):
            need = f.data.numel() * esize
            f.resident = used + need <= budget
            used += need if f.resident else 0
        self.spare = max(0, budget - used)  # what held rows may take (`FactorStore.defer`)
        self.traffic.device_budget = int(self.budget)
        self.planned = True

    def work_space(self) -> int:
        """Device bytes the accumulation and flush use beyond the resident statistics: the
        largest factor's float32 Gram (16-bit rows) and the flush's buffer slots."""
        largest = max((f.data.numel() for f in self.factors.values()), default=0)
        return 4 * largest + 4 * CHUNK_ENTRIES * 4

    def count(self) -> None:
        """Count the bytes of the pending statistics now on the device (and their peak)."""
        esize = self.compute_dtype.itemsize
        now = sum(f.device.data.numel() * esize for f in self.factors.values()
                  if f.device is not None)
        self.traffic.resident_bytes = now
        self.traffic.peak_resident_bytes = max(self.traffic.peak_resident_bytes, now)

    def shrink(self, key: str, flush: Callable[[], None]) -> None:
        """The device ran out of memory while accumulating ``key``: fold every pending
        statistic into the host store (``flush``), free them, halve the budget and plan again
        (logged)."""
        flush()
        for f in self.factors.values():
            f.device = None
        self.count()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        old = int(self.budget or 0)
        self.budget = old // 2
        self.planned = False
        self.plan()
        logger.warning("kfac_stream: the device ran out of memory while accumulating %s; its "
                       "pending statistics were folded into the host store and the device "
                       "budget halved (%d -> %d bytes); set KFACConfig.device_memory_budget "
                       "to fix it", key, old, self.budget)
