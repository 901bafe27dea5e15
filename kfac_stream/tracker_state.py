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
import logging
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .exceptions import TrackerStateError

logger = logging.getLogger("kfac_stream")

STATE_DIR = "kfac_stream"
_FILE_RE = re.compile(r"^state-rank-(\d{5})-of-(\d{5})\.safetensors$")
_FIELDS = ("scale", "amax", "weight", "updates", "positions", "diagonal")


def state_file(rank: int, world_size: int) -> str:
    """``state-rank-00000-of-00002.safetensors``."""
    return f"state-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def save_tracker_state(tracker, directory: str) -> str:
    """Write this rank's state into ``directory`` (created); returns the file path."""
    tracker.flush()
    tracker.read_counters()
    os.makedirs(directory, exist_ok=True)
    tensors = {"rng.sampler": tracker.capture.generator.get_state(),
               "rng.mc": tracker.mc_generator.get_state()}
    factors = {}
    for key, f in tracker.store.factors.items():
        tensors[f"factor.{key}"] = f.data.contiguous()
        factors[key] = {name: getattr(f, name) for name in _FIELDS}
    meta = {"rank": tracker.rank, "world_size": tracker.world_size,
            "dims": {k: list(v) for k, v in tracker.dims.items()},
            "storage_dtype": tracker.config.storage_dtype, "config": tracker.config.to_dict(),
            "counters": {k: v for k, v in vars(tracker.counters).items()},
            "tokens_seen": tracker.capture.tokens_seen, "factors": factors,
            "step": tracker.step}
    path = os.path.join(directory, state_file(tracker.rank, tracker.world_size))
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"kfac_stream": json.dumps(meta)})
    os.replace(tmp, path)
    return path


def _set_rng(generator: torch.Generator, state: torch.Tensor, fallback_seed: int) -> None:
    """Restore a sampler's state; a state from another device type (CPU ↔ CUDA generators
    have different state formats) reseeds instead, with a warning."""
    try:
        generator.set_state(state)
    except RuntimeError:
        logger.warning("kfac_stream: the checkpoint's sampler state is from another device "
                       "type; the sampler is reseeded (factors and counters are restored)")
        generator.manual_seed(fallback_seed)


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
    want = {k: list(v) for k, v in tracker.dims.items()}
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
    for key, f in tracker.store.factors.items():
        if key not in where:
            raise TrackerStateError(f"{directory}: factor {key!r} is in no state file")
        meta, handle = metas[where[key]]
        f.data.copy_(handle.get_tensor(f"factor.{key}"))
        for name in _FIELDS:
            setattr(f, name, meta["factors"][key][name])
        f.pending = []
    counters = dict(first["counters"])
    same_world = old_world == tracker.world_size
    own = metas[tracker.rank][0] if same_world else None
    for name, value in counters.items():
        if name == "tokens_seen":
            continue
        setattr(tracker.counters, name, own["counters"][name] if own else value)
    if same_world:
        tokens = own["tokens_seen"]
        handle = metas[tracker.rank][1]
        _set_rng(tracker.capture.generator, handle.get_tensor("rng.sampler"),
                 tracker.config.seed + tracker.rank)
        _set_rng(tracker.mc_generator, handle.get_tensor("rng.mc"),
                 tracker.config.seed + tracker.rank + 1)
    else:
        tokens = sum(m["tokens_seen"] for m, _ in metas.values()) if tracker.rank == 0 else 0
        step = int(first["step"] or 0)
        tracker.capture.generator.manual_seed(tracker.config.seed + 7919 * (step + 1)
                                              + tracker.rank)
        tracker.mc_generator.manual_seed(tracker.config.seed + 7927 * (step + 1)
                                         + tracker.rank + 1)
    tracker.capture.tokens_seen = tracker.counters.tokens_seen = tokens
    how = "same world size" if same_world else f"re-sharded from {old_world} to " \
        f"{tracker.world_size} ranks (token samplers reseeded)"
    return (f"restored {len(tracker.store.factors)} factors, {tracker.counters.updates} updates "
            f"from {directory} ({how})")
