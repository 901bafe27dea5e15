"""Where this process stands in a multi-process run, and the two process groups kfac_stream
talks on.

Private groups, created collectively when training starts:

* ``exchange_group`` — the per-update exchange of rows/statistics, ISSUED ONLY BY THE
  TRAINING THREAD at the end of an update step (asynchronous collectives; the factor worker
  only waits for them). On the training backend: NCCL when the model is on a CUDA device
  (rows and statistics stay on the GPU and move over NVLink/InfiniBand, after the updater's
  side stream), gloo for CPU training. Issued from one thread at a fixed point of the step,
  its NCCL kernels are launched in the same order relative to DDP's all-reduce and
  DeepSpeed's gathers on every rank: two communicators driven from two threads could launch
  them in different orders on different ranks, which NCCL documents as able to deadlock.
  The NCCL communicator is created and warmed up in `DistContext.from_torch` (train begin),
  not inside the first update;
* ``plan_group`` — gloo, the exchange's small host table (row counts, dtypes), also from the
  training thread (the ``exchange_group`` itself when that is gloo);
* ``snapshot_group`` — used only by the snapshot thread: shard records and the outcome
  (always gloo: small JSON records in CPU tensors).

Objects are exchanged as JSON in byte tensors (`JsonComm`): no Python object
serialisation, nothing a peer sends can run code here.
"""

from __future__ import annotations

import atexit
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class JsonComm:
    """``all_gather`` of JSON-serialisable objects over one process group."""

    def __init__(self, rank: int, world_size: int, group=None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (collective)."""
        if self.world_size == 1:
            return [json.loads(json.dumps(obj))]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: data.numel()] = data
        bucket = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(bucket, padded, group=self.group)
        return [json.loads(bytes(b[: int(s.item())].tolist()).decode())
                for b, s in zip(bucket, sizes)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0, in rank order; None on the other ranks
        (collective). The bytes (a safetensors shard) travel as a uint8 tensor and come back
        as ``bytes``: no object serialisation on either side."""
        if self.world_size == 1:
            return [data]
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        width = max(int(s.item()) for s in sizes)
        padded = torch.zeros(max(width, 1), dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        root = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        bucket = [torch.zeros_like(padded) for _ in range(self.world_size)] \
            if self.rank == 0 else None
        dist.gather(padded, bucket, dst=root, group=self.group)
        if self.rank != 0:
            return None
        return [b[: int(s.item())].numpy().tobytes() for b, s in zip(bucket, sizes)]


LOCAL = JsonComm(0, 1)


@dataclass
class DistContext:
    """This process's rank and the tracker's private groups (see module docstring)."""

    rank: int
    world_size: int
    exchange_group: Any
    snapshot_group: Any
    plan_group: Any = None

    @classmethod
    def from_torch(cls, device: torch.device | None = None) -> DistContext | None:
        """The context of the initialised default process group, or None for one process.

        Collective when ``world_size > 1``: every rank must call it at the same point (the
        callback does so in ``on_train_begin``).

        Args:
            device: The model's device; CUDA gives an NCCL exchange group (if NCCL is
                available), anything else gloo.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if world == 1:
            return None
        on_gpu = device is not None and device.type == "cuda" and dist.is_nccl_available()
        exchange = dist.new_group(backend="nccl" if on_gpu else "gloo")
        snapshot = dist.new_group(backend="gloo")
        plan = dist.new_group(backend="gloo") if on_gpu else exchange
        if on_gpu:  # NCCL creates its communicator at the first collective: do it now
            warm = torch.zeros(1, device=device)
            dist.all_reduce(warm, group=exchange)
            torch.cuda.synchronize(device)
        return cls(dist.get_rank(), world, exchange, snapshot, plan)

    def destroy(self) -> None:
        """Release the private groups (idempotent; at the end of training, on every rank,
        so no gloo thread outlives the run)."""
        done = []
        for name in ("exchange_group", "snapshot_group", "plan_group"):
            group = getattr(self, name)
            if group is not None and dist.is_initialized() and \
                    not any(group is g for g in done):
                dist.destroy_process_group(group)
                done.append(group)
            setattr(self, name, None)

    @property
    def snapshot_comm(self) -> JsonComm:
        """`JsonComm` over the snapshot group."""
        return JsonComm(self.rank, self.world_size, self.snapshot_group)


def agree_with_rank0(value: str) -> str:
    """Rank 0's ``value`` on every rank (e.g. a run directory named after the start time);
    ``value`` itself without an initialised multi-process group.

    Collective: opens a short-lived gloo group (CPU tensors work whatever the training backend)
    and exchanges the strings as JSON through `JsonComm`.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    group = dist.new_group(backend="gloo")
    try:
        return str(JsonComm(dist.get_rank(), dist.get_world_size(), group).all_gather(value)[0])
    finally:
        dist.destroy_process_group(group)


def release_process_groups() -> None:
    """Destroy every process group of this process (the default one included), while the
    interpreter is still whole; a no-op without one. Call it last in a script that trains
    on several processes (the app does): local, no collective, so each rank may call it when
    it is done.

    Why: gloo's worker threads free a finished collective's work (and the tensors it holds,
    with their Python references) after waking the caller. A rank that exits at once can be
    in interpreter shutdown by then; the worker's GIL acquire then ends the thread and the
    process aborts ("terminate called without an active exception", SIGABRT), seen on a
    loaded 2-core machine at the end of a ZeRO-3 run. Destroying the groups shuts their
    backends down (the workers finish) before the shutdown begins.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_RELEASE_REGISTERED = False


def release_process_groups_at_exit() -> None:
    """Register `release_process_groups` to run at interpreter exit (once per process): before
    shutdown begins, while every thread may still take the GIL. The callback does it at train
    begin with several processes, so a user's script (the quickstart under ZeRO-3, whose other
    ranks return from `gather_model` and exit at once) is safe without calling it itself."""
    global _RELEASE_REGISTERED
    if not _RELEASE_REGISTERED:
        atexit.register(release_process_groups)
        _RELEASE_REGISTERED = True
