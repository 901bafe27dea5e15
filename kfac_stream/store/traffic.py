"""What the factor store did, counted where it happens: device work of the folds, bytes and
copies across the host–device link, host work over factor entries, host reads.

`Traffic` is a base of the tracker's `Counters` (so every field rides in snapshot manifests
and checkpoints); the store counts into the object it is given. The cost model
(`cost_model`) predicts the same fields from layer shapes with the same per-operation
formulas; ``tests/unit/store/test_cost_model.py`` checks that they agree on a real run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Traffic:
    """Running totals of the store's work (all ints; ``device_budget`` -1 until decided).

    Attributes:
        device_folds: Factor updates accumulated into pending statistics on the device.
        fold_flops: FLOPs of those accumulations (`kfac_stream.store.cost_model.accumulate_flops`).
        fold_device_bytes: Device memory traffic of those accumulations
            (`kfac_stream.store.cost_model.accumulate_bytes`).
        bytes_to_host, bytes_to_device: Bytes copied across the host–device link (the CPU
            stand-in counts the same copies).
        host_entries: Stored factor entries the host touched arithmetically (the host fold
            path: each fold reads and writes every entry of its factor; 0 on the device path).
        flushes: Flush calls that folded at least one factor's pending statistics into the
            host store; ``factor_flushes``: factors folded by them; ``budget_flushes``: those
            forced by the budget (factors not resident on the device).
        flush_chunks, flush_copies: Chunks streamed through the device and copies issued for
            them (one host→device and one device→host per chunk).
        flush_syncs: Host reads of device values made by flushes (one per flush call).
        resident_bytes: Bytes of pending statistics resident on the device now
            (``peak_resident_bytes``: the most so far).
        device_budget: The budget the residency was planned under (bytes; -1: not decided).
        group_folds: Updates of factor groups (`device_groups`: a fixed number of device ops
            each, however many factors the group holds; `device_folds` counts the factors).
        deferred_folds: Factors whose held rows were folded into their pending sums (one
            read-modify-write of the factor's entries each; one GEMM per group,
            `device_groups`).
    """

    device_folds: int = 0
    fold_flops: int = 0
    fold_device_bytes: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    host_entries: int = 0
    flushes: int = 0
    factor_flushes: int = 0
    budget_flushes: int = 0
    flush_chunks: int = 0
    flush_copies: int = 0
    flush_syncs: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    device_budget: int = -1
    deferred_folds: int = 0
    group_folds: int = 0

    def traffic(self) -> dict[str, int]:
        """The fields above as a dict (a copy)."""
        return {name: getattr(self, name) for name in Traffic.__dataclass_fields__}
