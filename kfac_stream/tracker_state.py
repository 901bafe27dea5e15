"""Tracker state in Trainer checkpoints: save with every checkpoint, restore on resume.

Each rank writes ``<checkpoint>/kfac_stream/state-rank-<r>-of-<W>.safetensors``: its owned
factors (flushed, exactly as stored: ``<key>`` in the storage dtype plus their scale, EMA
weight and counts), the token sampler's and the MC sampler's generator states (uint8
tensors), and, in the safetensors header metadata, JSON with the counters, the config and the
tracked layers' shapes. Loading reads safetensors tensors and JSON metadata only, so
nothing in a checkpoint can run code.

Resume with the same world size restores every rank bit for bit (same factors, same RNG
streams: an interrupted and resumed run ends equal to an uninterrupted one). With another
world size the factors are re-sharded: each rank reads the files that hold the factors it now
owns (ownership is a pure function of the shapes and the world size); the samplers then
restart from a seed derived from the step, and ``tokens_seen`` is summed onto rank 0.
"""

from __future__ import annotations

import glob
import json
import os
import re

from safetensors import safe_open
from safetensors.torch import save_file

from .capture.hooks import CaptureState
from .exceptions import TrackerStateError
from .factor_keys import split_factor_key
from .store.factor_store import FactorState

STATE_DIR = "kfac_stream"
_FILE_RE = re.compile(r"^state-rank-(\d{5})-of-(\d{5})\.safetensors$")
_FIELDS = ("scale", "amax", "weight", "updates", "positions", "diagonal")


def state_file(rank: int, world_size: int) -> str:
    """``state-rank-00000-of-00002.safetensors``."""
    return f"state-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def save_tracker_state(record, directory: str) -> str:
    """Write this rank's state into ``directory`` (created); returns the file path.

    Args:
        record: A `kfac_stream.tracker.TrackerRecord` with factors (``Tracker.export()``).
        directory: The checkpoint's ``kfac_stream/`` directory.
    """
    os.makedirs(directory, exist_ok=True)
    tensors = {"rng.sampler": record.capture.sampler, "rng.mc": record.mc_sampler}
    factors = {}
    for key, f in record.factors.items():
        split_factor_key(key)  # every stored name is a factor key
        tensors[f"factor.{key}"] = f.data.contiguous()
        factors[key] = {name: getattr(f, name) for name in _FIELDS}
    counters = vars(record.counters)
    meta = {"rank": record.rank, "world_size": record.world_size,
            "dims": {k: list(v) for k, v in record.dims.items()},
            "storage_dtype": record.config.storage_dtype, "config": record.config.to_dict(),
            "counters": dict(counters), "tokens_seen": record.capture.tokens_seen,
            "factors": factors, "step": record.step}
    path = os.path.join(directory, state_file(record.rank, record.world_size))
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"kfac_stream": json.dumps(meta)})
    os.replace(tmp, path)
    return path


def _read(path: str) -> tuple[dict, safe_open]:
    handle = safe_open(path, framework="pt")
    meta = handle.metadata() or {}
    if "kfac_stream" not in meta:
        raise TrackerStateError(f"{path}: not a kfac_stream tracker state")
    return json.loads(meta["kfac_stream"]), handle


def load_tracker_state(tracker, directory: str) -> str:
    """Restore ``tracker`` (this rank) from the state files in ``directory``.

    Raises:
        TrackerStateError: no state files, files from different world sizes, tracked layers
            of other shapes, another storage dtype, or a factor no file holds.

    Returns:
        A one-line description of what was restored (logged by the callback).
    """
    files = {}
    for path in glob.glob(os.path.join(directory, "state-rank-*.safetensors")):
        m = _FILE_RE.match(os.path.basename(path))
        if m:
            files[int(m.group(1))] = (path, int(m.group(2)))
    if not files:
        raise TrackerStateError(f"{directory}: no kfac_stream state files")
    worlds = {w for _, w in files.values()}
    old_world = worlds.pop()
    if worlds or sorted(files) != list(range(old_world)):
        raise TrackerStateError(f"{directory}: incomplete or mixed state files "
                                f"{sorted(os.path.basename(p) for p, _ in files.values())}")
    metas = {r: _read(p) for r, (p, _) in files.items()}
    first = metas[0][0]
    want = {k: list(v) for k, v in tracker.plan.dims.items()}
    if first["dims"] != want:
        diff = [k for k in sorted(set(first["dims"]) | set(want))
                if first["dims"].get(k) != want.get(k)]
        raise TrackerStateError(f"{directory}: the checkpoint tracked other layers or shapes "
                                f"(first difference: {diff[0]!r}); resume with the same model "
                                "and include/exclude, or start the factors afresh")
    if first["storage_dtype"] != tracker.config.storage_dtype:
        raise TrackerStateError(
            f"{directory}: state stored as {first['storage_dtype']}, this run uses "
            f"storage_dtype={tracker.config.storage_dtype!r}; set it back to resume")
    where = {key: r for r, (meta, _) in metas.items() for key in meta["factors"]}
    owned = tracker.ownership.owned_by(tracker.rank)
    factors = {}
    for key in owned:
        if key not in where:
            raise TrackerStateError(f"{directory}: factor {key!r} is in no state file")
        meta, handle = metas[where[key]]
        factors[key] = FactorState(handle.get_tensor(f"factor.{key}"),
                                   **meta["factors"][key])
    same_world = old_world == tracker.world_size
    if same_world:
        own, handle = metas[tracker.rank]
        counters = {k: v for k, v in own["counters"].items() if k != "tokens_seen"}
        capture = CaptureState(handle.get_tensor("rng.sampler"), int(own["tokens_seen"]))
        tracker.load_state(factors, counters, capture, handle.get_tensor("rng.mc"))
    else:
        tokens = sum(m["tokens_seen"] for m, _ in metas.values()) if tracker.rank == 0 else 0
        counters = {**first["counters"], "tokens_seen": tokens}
        tracker.load_state(factors, counters, reseed_step=int(first["step"] or 0))
    how = "same world size" if same_world else f"re-sharded from {old_world} to " \
        f"{tracker.world_size} ranks (token samplers reseeded)"
    return (f"restored {len(factors)} factors, {tracker.counters.updates} updates "
            f"from {directory} ({how})")
