"""Tracker state in Trainer checkpoints: written before the Trainer marks a checkpoint complete,
verified by checksums on resume.

Each rank writes ``state-rank-<r>-of-<W>.safetensors``: its owned factors (flushed, exactly as
stored: ``<key>`` in the storage dtype plus their scale, EMA weight and counts), the token
sampler's and the MC sampler's generator states (uint8 tensors), and, in the safetensors
header metadata, JSON with the counters, the config and the tracked layers' shapes. Then rank 0
writes ``index.json`` listing every rank's file with its size and sha256: a state directory is
complete exactly when its index is there and every file matches it. Loading reads safetensors
tensors and JSON only, so nothing in a checkpoint can run code.

**Order against the Trainer** (`KFACStreamCallback`): the Trainer writes a checkpoint's model,
optimizer and RNG state, then ``trainer_state.json`` (from then on it treats the checkpoint as
complete and may rotate older ones away), and only then calls ``on_save``. So the state is
written earlier, in ``on_step_end`` / ``on_epoch_end`` when the Trainer has decided to save,
into ``<output_dir>/kfac_stream-pending/checkpoint-<N>/`` (not a ``checkpoint-*`` directory, so
the Trainer's ``resume_from_checkpoint=True`` never picks it), and moved into
``checkpoint-<N>/kfac_stream/`` by one rename in ``on_save``. A crash anywhere leaves the
complete state in one of the two places for every checkpoint that has ``trainer_state.json``
(`find_tracker_state` looks in both).

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
import shutil
from collections.abc import Mapping

from safetensors import safe_open
from safetensors.torch import save_file

from ..capture.hooks import CaptureState
from ..distributed.context import LOCAL, JsonComm
from ..exceptions import TrackerStateError
from ..store.factor_store import FactorState
from ..utils.factor_keys import split_factor_key
from ..utils.files import fsync_path, sha256_of, write_json_atomic

STATE_DIR = "kfac_stream"  # inside a checkpoint
PENDING_ROOT = "kfac_stream-pending"  # beside the checkpoints: states not yet moved in
INDEX_FILE = "index.json"
INDEX_FORMAT = "kfac_stream.tracker_state"  # the format's name, not the module's path
_SEEN = ("tokens_seen", "sequences_seen", "target_tokens_seen")  # the capture's counts
_FILE_RE = re.compile(r"^state-rank-(\d{5})-of-(\d{5})\.safetensors$")
_FIELDS = ("scale", "amax", "weight", "updates", "positions", "diagonal", "sq_norm_sum",
           "weight_sq", "sq_frob")  # each factor's scalars beside its tensor


def state_file(rank: int, world_size: int) -> str:
    """``state-rank-00000-of-00002.safetensors``."""
    return f"state-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def pending_state_dir(checkpoint: str) -> str:
    """Where the state of ``<run dir>/checkpoint-<N>`` waits until ``on_save`` moves it in:
    ``<run dir>/kfac_stream-pending/checkpoint-<N>``."""
    checkpoint = os.path.normpath(checkpoint)
    return os.path.join(os.path.dirname(checkpoint), PENDING_ROOT, os.path.basename(checkpoint))


def save_tracker_state(record, directory: str, comm: JsonComm = LOCAL,
                       step: int | None = None,
                       extensions: Mapping[str, tuple[dict, dict]] | None = None) -> str:
    """Write this rank's state into ``directory`` (created); rank 0 then writes the index.

    Collective over ``comm`` (every rank calls it with the same ``directory``); returns once
    the index is on disk, so the state is complete on every rank's return.

    Args:
        record: A `kfac_stream.tracking.tracker.TrackerRecord` with factors (``Tracker.export()``).
        directory: The state directory (a checkpoint's ``kfac_stream/`` or its pending twin).
        comm: The ranks' JSON communicator (`DistContext.snapshot_comm`).
        step: The checkpoint's step (the Trainer's ``global_step``), written into the index
            (default: the last step the tracker began).
        extensions: ``{name: (meta, tensors)}`` of the tracker extensions' states
            (`Tracker.extension_states`: meta under the key ``<name>``, tensors named
            ``<name>.*``; EK-FAC's: this rank's accumulators, the eigenvectors of the factors
            it owns), or None.
    """
    if comm.rank == 0 and os.path.isdir(directory):  # a stale state of the same step
        shutil.rmtree(directory)
    comm.all_gather(None)
    os.makedirs(directory, exist_ok=True)
    tensors = {"rng.sampler": record.capture.sampler, "rng.mc": record.mc_sampler}
    factors = {}
    for key, f in record.factors.items():
        split_factor_key(key)  # every stored name is a factor key
        tensors[f"factor.{key}"] = f.data.contiguous()
        if f.sketch is not None:  # F Z [d, p] float64: the sampling error's sketch
            tensors[f"sketch.{key}"] = f.sketch.contiguous()
        factors[key] = {name: getattr(f, name) for name in _FIELDS}
    counters = vars(record.counters)
    meta = {"rank": record.rank, "world_size": record.world_size,
            "dims": {k: list(v) for k, v in record.dims.items()},
            "shared_inputs": record.plan.describe(), "run_id": record.run_id,
            "storage_dtype": record.config.storage_dtype,
            "config": dict(record.config_json or record.config.to_dict()),
            "counters": dict(counters), "tokens_seen": record.capture.tokens_seen,
            "sequences_seen": record.capture.sequences_seen,
            "target_tokens_seen": record.capture.target_tokens_seen,
            "factors": factors, "step": record.step}
    for ext_name, (ext_meta, ext_tensors) in (extensions or {}).items():
        meta[ext_name] = ext_meta
        tensors.update(ext_tensors)
    name = state_file(record.rank, record.world_size)
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"kfac_stream": json.dumps(meta)})
    fsync_path(tmp)
    os.replace(tmp, path)
    entry = {"file": name, "bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    entries = comm.all_gather(entry)
    if comm.rank == 0:
        fsync_path(directory)
        write_json_atomic(os.path.join(directory, INDEX_FILE),
                          {"format": INDEX_FORMAT, "world_size": record.world_size,
                           "step": record.step if step is None else int(step),
                           "files": entries})
    comm.all_gather(None)  # the index exists before any rank goes on
    return path


def check_state_dir(directory: str) -> str | None:
    """Why ``directory`` is not a complete tracker state (None: it is): the index is missing or
    unreadable, or a file it lists is missing, of another size or another sha256."""
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.isfile(index_path):
        return f"{index_path} is missing"
    try:
        with open(index_path) as f:
            index = json.load(f)
        files = index["files"]
        if index.get("format") != INDEX_FORMAT or len(files) != int(index["world_size"]):
            return f"{index_path} is not a complete kfac_stream state index"
        for entry in files:
            path = os.path.join(directory, os.path.basename(str(entry["file"])))
            if not os.path.isfile(path):
                return f"{path} is missing"
            if os.path.getsize(path) != entry["bytes"] or sha256_of(path) != entry["sha256"]:
                return f"{path} does not match its size and sha256 in {index_path}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{index_path} is unreadable ({type(e).__name__}: {e})"
    return None


def find_tracker_state(checkpoint: str) -> tuple[str | None, list[str]]:
    """The complete tracker state of ``checkpoint``: ``(directory or None, reasons)``.

    Looks in ``<checkpoint>/kfac_stream`` (moved in by ``on_save``), then in its pending twin
    (`pending_state_dir`: a crash between the Trainer's ``trainer_state.json`` and ``on_save``);
    ``reasons`` says why each place that was looked at is not complete.
    """
    reasons = []
    for directory in (os.path.join(checkpoint, STATE_DIR), pending_state_dir(checkpoint)):
        why = check_state_dir(directory)
        if why is None:
            return directory, reasons
        reasons.append(why)
    return None, reasons


def commit_pending_state(checkpoint: str) -> str | None:
    """Move the pending state of ``checkpoint`` into it (one rename; rank 0 only). Returns the
    new location, or None if nothing was pending."""
    pending = pending_state_dir(checkpoint)
    if not os.path.isdir(pending):
        return None
    target = os.path.join(checkpoint, STATE_DIR)
    if os.path.isdir(target):  # an incomplete or older copy: the pending one is verified
        shutil.rmtree(target)
    os.replace(pending, target)
    fsync_path(checkpoint)
    root = os.path.dirname(pending)
    try:
        os.rmdir(root)  # only if no other state is pending
    except OSError:
        pass
    return target


def _read(path: str) -> tuple[dict, safe_open]:
    handle = safe_open(path, framework="pt")
    meta = handle.metadata() or {}
    if "kfac_stream" not in meta:
        raise TrackerStateError(f"{path}: not a kfac_stream tracker state")
    return json.loads(meta["kfac_stream"]), handle


def load_tracker_state(tracker, directory: str) -> str:
    """Restore ``tracker`` (this rank) from the state files in ``directory``.

    Raises:
        TrackerStateError: no state files, an index that does not match the files (checksums),
            files from different world sizes, tracked layers of other shapes, another storage
            dtype, or a factor no file holds.

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
    why = check_state_dir(directory)  # the index and the files' checksums
    if why is not None:
        raise TrackerStateError(f"{directory}: {why}")
    worlds = {w for _, w in files.values()}
    old_world = worlds.pop()
    if worlds or sorted(files) != list(range(old_world)):
        raise TrackerStateError(f"{directory}: incomplete or mixed state files "
                                f"{sorted(os.path.basename(p) for p, _ in files.values())}")
    metas = {r: _read(p) for r, (p, _) in files.items()}
    first = metas[0][0]
    if "shared_inputs" in first:  # groups dissolved in training before the checkpoint
        kept = {tuple(g) for g in first["shared_inputs"]}
        gone = [g for g in tracker.plan.groups if g not in kept]
        if gone and all(n in tracker.specs for g in gone for n in g):
            tracker.dissolve_groups(gone, copy_state=False)
    if first.get("run_id"):
        tracker.run_id = str(first["run_id"])
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
        sketch = f"sketch.{key}"  # absent for a diagonal factor or before its first update
        factors[key] = FactorState(
            handle.get_tensor(f"factor.{key}"), **meta["factors"][key],
            sketch=handle.get_tensor(sketch) if sketch in handle.keys() else None)
    same_world = old_world == tracker.world_size
    if same_world:
        own, handle = metas[tracker.rank]
        counters = {k: v for k, v in own["counters"].items()
                    if k not in _SEEN}
        capture = CaptureState(handle.get_tensor("rng.sampler"), int(own["tokens_seen"]),
                               int(own.get("sequences_seen", 0)),
                               int(own.get("target_tokens_seen", 0)))
        tracker.load_state(factors, counters, capture, handle.get_tensor("rng.mc"))
    else:
        def total(name: str) -> int:  # counted per rank: rank 0 carries the sum on
            return sum(m.get(name, 0) for m, _ in metas.values()) if tracker.rank == 0 else 0

        counters = {**first["counters"], **{name: total(name) for name in _SEEN}}
        tracker.load_state(factors, counters, reseed_step=int(first["step"] or 0))
    for ext in getattr(tracker, "extensions", ()):
        _load_extension(ext, tracker.rank, metas, same_world)
    how = "same world size" if same_world else f"re-sharded from {old_world} to " \
        f"{tracker.world_size} ranks (token samplers reseeded)"
    return (f"restored {len(factors)} factors, {tracker.counters.updates} updates "
            f"from {directory} ({how})")


def _load_extension(ext, rank: int, metas: dict[int, tuple[dict, safe_open]],
                    same_world: bool) -> None:
    """Restore a tracker extension's state (`TrackerExtension.load_state_dict`; EK-FAC's:
    `kfac_stream.ekfac.EkfacState.load_state_dict`): each tensor from whichever file holds
    it; those named by ``ext.summed_state`` (per-rank sums: EK-FAC's accumulators) from this
    rank's own file, or, with another world size, their sum over every file on rank 0 (the
    snapshot's ``λ`` sums over ranks anyway). A state written without the extension (an older
    checkpoint, or the extension off) leaves it as it starts (EK-FAC: the next snapshot carries
    no correction)."""
    if ext.name not in metas[0][0]:
        return
    prefix = f"{ext.name}."
    where: dict[str, list[int]] = {}
    for r in sorted(metas):
        for name in metas[r][1].keys():
            if name.startswith(prefix):
                where.setdefault(name, []).append(r)

    def get(name: str):
        ranks = where.get(name, [])
        if ext.summed_state and name.startswith(tuple(ext.summed_state)):
            ranks = ([rank] if rank in ranks else []) if same_world else (
                ranks if rank == 0 else [])
            out = None
            for r in ranks:
                t = metas[r][1].get_tensor(name)
                out = t if out is None else out + t
            return out
        return metas[ranks[0]][1].get_tensor(name) if ranks else None

    ext.load_state_dict(metas[rank if same_world else 0][0][ext.name], get)
