"""Write a snapshot atomically: shards and manifest into a temporary directory, then rename.

Every file is fsynced before the manifest (which lists each shard's sha256) is written, and the
manifest is fsynced before the rename; the parent directory is fsynced after it. A crash at any
point leaves either the previous snapshots or a hidden ``.step-*.tmp-*`` directory that readers
ignore and the next writer removes.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from .layout import MANIFEST, sha256_file, shard_name, step_dir_name, tmp_dir_name


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(tmp_dir: str, tensors: dict[str, torch.Tensor], rank: int,
                world_size: int) -> dict[str, object]:
    """Write this rank's shard into ``tmp_dir``; returns ``{"file", "sha256", "bytes"}``."""
    name = shard_name(rank, world_size)
    path = os.path.join(tmp_dir, name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    _fsync_path(path)
    return {"file": name, "sha256": sha256_file(path), "bytes": os.path.getsize(path)}


def clean_stale_tmp(root: str) -> None:
    """Remove temporary directories left by interrupted writers."""
    if not os.path.isdir(root):
        return
    for entry in os.listdir(root):
        if entry.startswith(".step-") and ".tmp-" in entry:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def write_snapshot(root: str, step: int, tensors: dict[str, torch.Tensor],
                   manifest: dict, tag: str = "0") -> str:
    """Single-writer snapshot: one shard (rank 0 of 1) plus the manifest.

    Args:
        root: Snapshot root (``<output_dir>/kfac``).
        step: Optimizer step; the directory is ``step-<8 digits>``.
        tensors: Shard contents (see ``layout``).
        manifest: Manifest fields; ``shards`` is filled in here.
        tag: Suffix of the temporary directory name.

    Returns:
        The final directory path.
    """
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, tmp_dir_name(step, tag))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        shard = write_shard(tmp, tensors, 0, 1)
        manifest = dict(manifest, shards={shard["file"]: {"sha256": shard["sha256"],
                                                           "bytes": shard["bytes"]}})
        mpath = os.path.join(tmp, MANIFEST)
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # re-snapshot of the same step: replace it whole
            stale = os.path.join(root, tmp_dir_name(step, "replaced"))
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
