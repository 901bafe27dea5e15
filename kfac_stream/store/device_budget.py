"""The ``"auto"`` device budget, decided at the first factor update from the device's memory
(the one setting that needs the run's own memory use; every other ``"auto"`` is resolved by
`kfac_stream.tracking.plan.RunPlan.resolve` at train begin).
"""

from __future__ import annotations

import torch

#: Share of the device's total memory the pending statistics may take at most ("auto").
AUTO_BUDGET_SHARE_OF_TOTAL = 0.25
#: Share of what the training run left free (total minus its peak reserved memory so far).
AUTO_BUDGET_SHARE_OF_FREE = 0.5


def device_budget_from_memory(total: int, peak_reserved: int) -> int:
    """The ``"auto"`` budget of a device with ``total`` bytes on which the training run has
    reserved at most ``peak_reserved`` bytes so far.

    Decided at the first factor update, which runs after the first optimizer step (the
    optimizer's state exists by then, and the step's forward and backward have reached their
    peak): ``min(AUTO_BUDGET_SHARE_OF_TOTAL · total, AUTO_BUDGET_SHARE_OF_FREE · (total −
    peak_reserved))``. Half of what training left free stays free for what it may still
    allocate (longer batches, fragmentation); a quarter of the device at most. If the device
    later runs out of memory while the tracker accumulates, the store moves its pending
    statistics to the host and halves the budget (`FactorStore`), so a run never fails for
    the tracker's sake.
    """
    free = max(0, int(total) - int(peak_reserved))
    return int(min(AUTO_BUDGET_SHARE_OF_TOTAL * total, AUTO_BUDGET_SHARE_OF_FREE * free))


def cuda_budget(device: torch.device) -> int:
    """`device_budget_from_memory` of a CUDA device, from its allocator's statistics (host
    reads of counters, no device synchronisation)."""
    total = torch.cuda.get_device_properties(device).total_memory
    return device_budget_from_memory(total, torch.cuda.max_memory_reserved(device))
