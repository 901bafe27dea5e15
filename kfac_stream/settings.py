"""Every ``"auto"`` setting of a `KFACConfig`, resolved once, in one place.

`resolve_settings` turns the user's configuration and what the run is (the model's device,
the micro-batch shape, the number of ranks, the run length) into `Settings`: the tracker, the
factor updater and the store take only these resolved values, never ``"auto"``.

==========================  ===============================================================
setting                     resolved to
==========================  ===============================================================
``fold_on``                 ``"device"`` on CUDA, ``"host"`` on CPU
``async_updates``           on when the model is on CUDA (the CPU is idle during a step),
                            off on CPU training (a second thread competes for its cores)
``eigh_device``             the model's device for ``"auto"``, None (CPU float64) for
                            ``"cpu"``
``device_memory_budget``    bytes, or None for ``"auto"`` on CUDA: decided by
                            `device_budget_from_memory` at the first update, after the first
                            optimizer step has allocated its state (see its docstring)
``mc_sequences``            the configured share, raised on a run too short for its final
                            window (`kfac_stream.config.window_mc_share`)
==========================  ===============================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from .config import KFACConfig, window_mc_share

#: Share of the device's total memory the pending statistics may take at most ("auto").
AUTO_BUDGET_SHARE_OF_TOTAL = 0.25
#: Share of what the training run left free (total minus its peak reserved memory so far).
AUTO_BUDGET_SHARE_OF_FREE = 0.5


@dataclass(frozen=True)
class Settings:
    """The resolved settings of one tracker (see the module table).

    Attributes:
        config: The configuration with ``async_updates`` and ``mc_sequences`` resolved (as
            snapshot manifests record it).
        fold_on: ``"device"`` or ``"host"``.
        eigh_device: Where snapshots eigendecompose (None: the CPU in float64).
        device_budget: Bytes of device memory for the resident pending statistics; None:
            decided from the device's memory at the first update
            (`device_budget_from_memory`).
        mc_share_raised: The configured MC share when this run raised it, else None.
    """

    config: KFACConfig
    fold_on: str
    eigh_device: torch.device | None
    device_budget: int | None
    mc_share_raised: float | None = None

    @property
    def async_updates(self) -> bool:
        """Factor updates on the worker thread."""
        return bool(self.config.async_updates)


def resolve_settings(config: KFACConfig, device: torch.device, *, batch: int = 0,
                     accumulation: int = 1, world: int = 1, max_steps: int = 0) -> Settings:
    """Resolve every ``"auto"`` of ``config`` for a model on ``device``.

    Args:
        config: The user's configuration.
        device: The model's (the captured rows') device.
        batch, accumulation, world, max_steps: The run's micro-batch size, gradient
            accumulation steps, ranks and optimizer steps (0: unknown; the MC share is then
            kept as configured).
    """
    on_gpu = device.type == "cuda"
    async_updates = on_gpu if config.async_updates is None else config.async_updates
    fold_on = config.fold_on if config.fold_on != "auto" else ("device" if on_gpu else "host")
    share = window_mc_share(config, batch, accumulation, world, max_steps)
    raised = None
    if share is not None:
        raised, config = config.mc_sequences, replace(config, mc_sequences=share)
    config = replace(config, async_updates=async_updates)
    budget = config.device_memory_budget
    if fold_on != "device":
        budget = 0
    elif budget == "auto":
        budget = None if on_gpu else _host_standin_budget()
    eigh = device if config.eigh_device == "auto" else None
    return Settings(config, fold_on, eigh, budget, raised)


def _host_standin_budget() -> int:
    """``"auto"`` when the "device" is the CPU itself (``fold_on="device"`` forced on CPU, the
    tests' stand-in): a quarter of physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4)
    except (ValueError, OSError, AttributeError):  # pragma: no cover (non-POSIX)
        return 4 * 2**30


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
