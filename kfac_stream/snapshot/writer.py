"""Write a snapshot atomically: shards and manifest into a temporary directory, then rename.

One process or many: each owner rank writes its own shard, rank 0 writes the manifest once
every shard is on disk and verified (see `write_snapshot`). With ``gather`` (snapshot
directories local to each machine) the ranks send their shards' bytes to rank 0, which writes
them all.

A shard is written in one pass (`write_safetensors_chunked`: the safetensors format, streamed
tensor by tensor, hashed as the bytes go to the file, one sha256 per `files.HASH_CHUNK_BYTES`
chunk on a few threads; never the whole shard in memory, never re-read by the process that
wrote it). Every file is fsynced before the manifest (which lists each shard's chunk digests
and their root, `manifest_types.ShardEntry`) is written, and the manifest is fsynced before
the rename; the parent directory is fsynced after it. A crash at any point leaves either the
previous snapshots or a hidden ``.step-*.tmp-*`` directory that readers ignore and the next
writer removes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

import torch
from safetensors.torch import save

from ..distributed.context import LOCAL
from ..exceptions import SnapshotError
from ..utils.files import (
    ChunkDigests,
    file_chunk_digests,
    fsync_path,
    hash_chunked,
    sha256_of,
    write_chunk_hashed,
    write_hashed,
)
from .layout import (
    EARLIER_RUNS_DIR,
    FORMAT_NAME,
    MANIFEST,
    STEP_DIR_RE,
    TMP_DIR_RE,
    shard_name,
    step_dir_name,
    tmp_dir_name,
)
from .manifest import validate_manifest
from .manifest_json import parse_json
from .manifest_types import Manifest, ShardEntry, to_json
from .snapshot import Snapshot, read_manifest, read_manifest_json

#: safetensors' dtype names in the order of its ``Dtype`` enum (safetensors 0.4-0.8): the file
#: lists the tensors by this rank descending, then by name, and lays their data out in that
#: order (checked byte for byte against ``safetensors.torch.save`` in
#: tests/unit/snapshot/test_writer.py). Packed float4 is left out.
_ST_DTYPES: dict[torch.dtype, str] = {
    dt: name for dt, name in (
        (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"),
        (getattr(torch, "float8_e5m2", None), "F8_E5M2"),
        (getattr(torch, "float8_e4m3fn", None), "F8_E4M3"),
        (getattr(torch, "float8_e8m0fnu", None), "F8_E8M0"),
        (getattr(torch, "float8_e4m3fnuz", None), "F8_E4M3FNUZ"),
        (getattr(torch, "float8_e5m2fnuz", None), "F8_E5M2FNUZ"),
        (torch.int16, "I16"), (getattr(torch, "uint16", None), "U16"),
        (torch.float16, "F16"), (torch.bfloat16, "BF16"),
        (torch.int32, "I32"), (getattr(torch, "uint32", None), "U32"),
        (torch.float32, "F32"), (torch.complex64, "C64"), (torch.float64, "F64"),
        (torch.int64, "I64"), (getattr(torch, "uint64", None), "U64"))
    if dt is not None}
_ST_RANK = {dt: i for i, dt in enumerate(_ST_DTYPES)}
#: Bytes per write (and per sha256 update) of a tensor's data.
WRITE_CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A tensor the writer asks for only when its bytes are due: the header is laid out from
    ``dtype`` and ``shape``, then ``get()`` is called once, in the file's order (so a
    producer can compute the tensors while the ones before them are written, and nothing is
    held longer than its write: `kfac_stream.snapshot.eigen_stream`)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    get: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)


def resolved(t: torch.Tensor | Deferred) -> torch.Tensor:
    """``t``'s tensor (a `Deferred` is computed now), checked against the dtype and shape the
    header promised."""
    if not isinstance(t, Deferred):
        return t
    out = t.get()
    if out.dtype != t.dtype or tuple(out.shape) != tuple(t.shape):
        raise ValueError(f"a deferred tensor promised {t.dtype} {list(t.shape)} and gave "
                         f"{out.dtype} {list(out.shape)}")
    return out


def write_order(tensors: dict[str, torch.Tensor | Deferred]) -> list[str]:
    """The order safetensors lays the tensors' data out: dtype rank descending, then name."""
    return sorted(tensors, key=lambda k: (-_ST_RANK[tensors[k].dtype], k))


def safetensors_chunks(tensors: dict[str, torch.Tensor | Deferred],
                       metadata: dict[str, str] | None = None,
                       chunk: int | None = None) -> Iterator[bytes | memoryview]:
    """The safetensors file of ``tensors`` as a sequence of buffers, without building it whole:
    the 8-byte little-endian header length, the JSON header (padded with spaces to a multiple
    of 8 bytes), then each tensor's raw bytes in header order, ``chunk`` bytes at a time as
    views of the tensor's memory (a tensor off the CPU or not contiguous is copied, one at a
    time; a `Deferred` is computed when its turn comes; default `WRITE_CHUNK`). The same
    bytes as ``safetensors.torch.save(tensors)`` (``metadata``: its keys are written sorted,
    where safetensors' order varies between calls)."""
    chunk = chunk or WRITE_CHUNK
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine to test on
        raise NotImplementedError("writing safetensors on a big-endian machine")
    for name, t in tensors.items():
        if not isinstance(t, Deferred) and (not isinstance(t, torch.Tensor)
                                            or t.layout != torch.strided):
            raise ValueError(f"tensor {name!r}: expected a dense torch.Tensor, got "
                             f"{type(t).__name__}")
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be written")
    order = write_order(tensors)
    entries = []
    if metadata is not None:
        entries.append('"__metadata__":' + json.dumps(dict(sorted(metadata.items())),
                                                      ensure_ascii=False, separators=(",", ":")))
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.dtype.itemsize
        entries.append(f'{json.dumps(name, ensure_ascii=False)}:{{"dtype":"{_ST_DTYPES[t.dtype]}",'
                       f'"shape":[{",".join(str(int(n)) for n in t.shape)}],'
                       f'"data_offsets":[{offset},{offset + size}]}}')
        offset += size
    header = ("{" + ",".join(entries) + "}").encode()
    header += b" " * (-len(header) % 8)
    yield len(header).to_bytes(8, "little") + header
    for name in order:
        if not tensors[name].numel():
            continue
        t = resolved(tensors[name]).detach()
        t = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        data = memoryview(t.numpy())
        for start in range(0, len(data), chunk):
            yield data[start:start + chunk]
        del data, t


def write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor | Deferred],
                      metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write ``tensors`` in the safetensors format to the binary file ``f`` in one pass,
    hashing the bytes as they are written; returns ``(hex sha256, bytes written)`` (one
    sha256 of the whole file: the form of shards written before chunked digests)."""
    return write_hashed(f, safetensors_chunks(tensors, metadata))


def write_safetensors_chunked(f: BinaryIO, tensors: dict[str, torch.Tensor | Deferred],
                              metadata: dict[str, str] | None = None) -> ChunkDigests:
    """`write_safetensors` with chunked digests (`files.write_chunk_hashed`: one sha256 per
    `files.HASH_CHUNK_BYTES`, hashed in parallel as the bytes go to the file)."""
    return write_chunk_hashed(f, safetensors_chunks(tensors, metadata))


def shard_record(name: str, digests: ChunkDigests) -> dict[str, object]:
    """A shard's record as the ranks report it: ``{"file", "sha256" (the root), "bytes",
    "chunk_bytes", "chunks"}`` (`manifest_types.ShardEntry`'s keys)."""
    return {"file": name, "sha256": digests.root, "bytes": digests.size,
            "chunk_bytes": digests.chunk_bytes, "chunks": list(digests.chunks)}


def write_shard(tmp_dir: str, tensors: dict[str, torch.Tensor | Deferred], rank: int,
                world_size: int) -> dict[str, object]:
    """Write this rank's shard into ``tmp_dir`` and fsync it; returns its `shard_record`, the
    chunk digests of the bytes as they were written (one pass, no re-read; the file is the
    one ``safetensors.torch.save_file`` would write)."""
    name = shard_name(rank, world_size)
    path = os.path.join(tmp_dir, name)
    with open(path, "wb") as f:
        digests = write_safetensors_chunked(f, tensors)
        f.flush()
        os.fsync(f.fileno())
    return shard_record(name, digests)


def shard_bytes(tensors: dict[str, torch.Tensor | Deferred], rank: int,
                world_size: int) -> tuple[bytes, dict[str, object]]:
    """This rank's shard serialised in memory (to send to rank 0) and its `shard_record`
    (chunk digests hashed in parallel), the same bytes and record `write_shard` would make."""
    data = save({k: resolved(v).contiguous() for k, v in tensors.items()})
    return data, shard_record(shard_name(rank, world_size), hash_chunked([data]))


def _write_gathered(tmp_dir: str, blobs: list[bytes], reports: list[dict]) -> set[str]:
    """Rank 0 with ``gather``: every rank's shard bytes into ``tmp_dir`` (fsynced), each
    hashed as it is written (chunked digests) and checked against the digests its sender
    computed. Returns the files so verified (`_finish` does not read them again)."""
    verified = set()
    for blob, report in zip(blobs, reports):
        if "shard" in report:
            info = report["shard"]
            path = os.path.join(tmp_dir, info["file"])
            with open(path, "wb") as f:
                written = write_chunk_hashed(f, _slices(memoryview(blob), WRITE_CHUNK),
                                             info.get("chunk_bytes"))
                f.flush()
                os.fsync(f.fileno())
            digest, size = written.root, written.size
            if digest != info["sha256"] or size != info["bytes"]:
                raise SnapshotError(f"shard {info['file']} of rank {report['rank']} arrived "
                                    f"altered: root sha256 {digest} ({size} bytes), rank "
                                    f"{report['rank']} sent {info['sha256']} "
                                    f"({info['bytes']} bytes)")
            verified.add(info["file"])
    return verified


def _slices(data: memoryview, chunk: int) -> Iterator[memoryview]:
    for start in range(0, len(data), chunk):
        yield data[start:start + chunk]


def _hashes_as_reported(path: str, info: dict) -> bool:
    """Whether the file at ``path`` has the digests of its report ``info``: its chunk
    digests and their root (hashed in parallel), or the one sha256 of a report without
    chunks."""
    if "chunks" not in info:
        return sha256_of(path) == info["sha256"]
    found = file_chunk_digests(path, info["chunk_bytes"])
    return list(found.chunks) == info["chunks"] and found.root == info["sha256"]


def clean_stale_tmp(root: str) -> None:
    """Tidy up after interrupted writers (rank 0, when training starts).

    A hidden ``.step-S.tmp-*`` directory is removed, except when ``step-S`` is missing and
    the hidden one is a complete snapshot (it verifies): a writer killed between moving an
    old ``step-S`` aside and renaming the new one in. Then the newest complete copy (the new
    ``tmp-<tag>`` over the old ``tmp-replaced``) is put back under ``step-S``.
    """
    if not os.path.isdir(root):
        return
    hidden: dict[str, list[str]] = {}
    for entry in os.listdir(root):
        m = TMP_DIR_RE.match(entry)
        if m:
            hidden.setdefault(m.group(1), []).append(entry)
    for final, entries in hidden.items():
        if not os.path.exists(os.path.join(root, final)):
            for entry in sorted(entries, key=lambda e: e.endswith(".tmp-replaced")):
                try:
                    Snapshot.load(os.path.join(root, entry))
                except SnapshotError:
                    continue
                os.replace(os.path.join(root, entry), os.path.join(root, final))
                fsync_path(root)
                break
        for entry in entries:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def set_aside_other_runs(root: str, run_id: str) -> list[str]:
    """Move every snapshot of another training run out of ``root`` (rank 0, when training
    starts), so that ``root``'s ``step-*`` are this run's only: `Snapshot.latest`, ``kfac-stream
    inspect`` and ``query`` never pair a model with an earlier run's curvature.

    A ``step-*`` directory whose manifest names another ``run_id``, names none (written from a
    tracker record without a run) or does not load moves to ``<root>/earlier-runs/<its run
    id>/step-*`` (``unknown-<time>`` without a readable id), with the files beside it (its
    spectra PNG); nothing is deleted. A resumed run keeps its id (checkpoints carry it), so its
    own snapshots stay.

    Returns:
        The new paths of the snapshots moved.
    """
    if not os.path.isdir(root):
        return []
    moved = []
    stamp = f"unknown-{int(time.time())}"
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if not STEP_DIR_RE.match(entry) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            other = read_manifest(path).run_id
        except SnapshotError:
            other = None
        if other == run_id:
            continue
        target_dir = os.path.join(root, EARLIER_RUNS_DIR, other or stamp)
        os.makedirs(target_dir, exist_ok=True)
        target = os.path.join(target_dir, entry)
        if os.path.exists(target):  # the same run's step twice (cannot happen): keep both
            target += f".{stamp}"
        os.replace(path, target)
        moved.append(target)
        for extra in os.listdir(root):  # files beside it (the spectra PNG, step-S.spectra.png)
            if extra.startswith(entry + ".") and os.path.isfile(os.path.join(root, extra)):
                os.replace(os.path.join(root, extra), os.path.join(target_dir, extra))
    if moved:
        fsync_path(root)
    return moved


def write_snapshot(root: str, step: int, tensors: dict[str, torch.Tensor | Deferred],
                   manifest: Manifest | dict, comm=None,
                   merge: Callable[[list[dict]], dict] | None = None, tag: str = "0",
                   local_error: str | None = None, gather: bool = False) -> str:
    """Write a snapshot: every rank its shard, rank 0 the manifest, then one rename.

    Protocol (``comm`` is a `kfac_stream.distributed.context.JsonComm`; None = one process):

    1. rank 0 creates the temporary directory ``.step-XXXXXXXX.tmp-<tag>``; all ranks wait;
    2. each rank writes and fsyncs its shard (if it owns any factor) and reports
       ``{shard file, sha256, bytes, manifest part}`` or the error it hit;
    3. rank 0, if every rank succeeded, checks every shard against the reports: a shard
       another rank wrote is re-hashed on disk (what rank 0 sees of the shared filesystem);
       rank 0's own shard and, with ``gather``, the shards it wrote from the bytes received
       were hashed as they were written (`write_shard`, `_write_gathered`) and are only
       checked for presence and size;
       merges the manifest parts (``merge``), writes and fsyncs ``manifest.json``, and renames
       the directory to ``step-XXXXXXXX``; on any failure it removes the temporary directory;
    4. all ranks learn the outcome; on failure every rank raises `SnapshotError` naming the
       rank and the error, and no directory exists under the final name (earlier snapshots
       are untouched).

    Args:
        root: Snapshot root (``<output_dir>/kfac``), the same path on every rank.
        step: Optimizer step; the directory is ``step-<8 digits>``.
        tensors: This rank's shard contents (see ``layout``); empty: no shard. A `Deferred`
            entry is computed when the shard's writer reaches it (it may fill in
            ``manifest``: the part is sent to rank 0 only after the shard is written).
        manifest: This rank's manifest part (a `manifest_types.Manifest`, or its JSON);
            ``shards`` is filled in here.
        comm: Collective helper; None for one process.
        merge: Combines the ranks' manifest parts (rank order) into one; default: rank 0's.
        tag: Suffix of the temporary directory name.
        local_error: This rank already failed (e.g. its eigendecomposition): it writes no
            shard but still takes part, so that every rank abandons the snapshot together.
        gather: Ranks other than 0 never touch the filesystem: each sends its shard's bytes
            (and their sha256) to rank 0, which writes every shard, then verifies and
            renames as above. For node-local snapshot directories; rank 0 holds every
            shard's bytes at once while it writes them.

    Returns:
        The final directory path.
    """
    comm = comm or LOCAL
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, tmp_dir_name(step, tag))
    _prepare(root, tmp, step, comm)
    gather = gather and comm.world_size > 1
    report, blob = _write_part(tmp, tensors, manifest, comm, local_error, gather)
    reports = comm.all_gather(report)
    blobs = comm.gather_bytes(blob) if gather else None
    outcome = None
    if comm.rank == 0:
        errors = [r["error"] for r in reports if "error" in r]
        try:
            if not errors:
                # hashed here as they were written: rank 0's own shard, the gathered ones
                written_here = {report["shard"]["file"]} if "shard" in report else set()
                if blobs is not None:
                    written_here |= _write_gathered(tmp, blobs, reports)
                _finish(root, tmp, final, reports, merge, written_here)
        except Exception as e:
            errors.append(f"rank 0: {type(e).__name__}: {e}")
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
        outcome = {"errors": errors}
    outcome = comm.all_gather(outcome)[0]
    if outcome["errors"]:
        raise SnapshotError(f"snapshot of step {step} failed, nothing written under {final}: "
                            + "; ".join(outcome["errors"]))
    return final


def _prepare(root: str, tmp: str, step: int, comm) -> None:
    """Step 1 of `write_snapshot`: rank 0 creates the temporary directory ``tmp``; every rank
    learns whether it did and that all were given the same ``root``, else raises."""
    prepared = None
    if comm.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            prepared = f"rank 0: {type(e).__name__}: {e}"
    ready = comm.all_gather({"root": os.path.abspath(root), "error": prepared})
    errors = [r["error"] for r in ready if r["error"]]
    roots = sorted({r["root"] for r in ready})
    if len(roots) > 1:
        errors.append(f"the ranks were given different snapshot directories {roots}: every "
                      "rank must write into the same (shared) directory")
    if errors:
        raise SnapshotError(f"snapshot of step {step} failed: {errors[0]}")


def _write_part(tmp: str, tensors: dict[str, torch.Tensor | Deferred],
                manifest: Manifest | dict, comm, local_error: str | None,
                gather: bool) -> tuple[dict, bytes]:
    """Step 2 of `write_snapshot`: this rank's shard written into ``tmp`` (or, with
    ``gather``, serialised to send to rank 0) and its report ``{"rank", "shard", "manifest"}``
    (the manifest part as JSON, sent after the shard: a `Deferred` may fill it in), or
    ``{"rank", "error"}``; returns ``(report, the shard's bytes to send or b"")``."""
    rank, world = comm.rank, comm.world_size
    report: dict = {"rank": rank}
    blob = b""
    try:
        if local_error:
            raise RuntimeError(local_error)
        if tensors and gather:
            blob, report["shard"] = shard_bytes(tensors, rank, world)
        elif tensors:
            if not os.path.isdir(tmp):
                raise SnapshotError(
                    f"the directory rank 0 created, {tmp}, does not exist on this rank's "
                    "machine: the snapshot directory must be on a filesystem every node "
                    "shares, or pass KFACStreamCallback(gather_shards=True) for node-local "
                    "directories (docs/multinode.md)")
            report["shard"] = write_shard(tmp, tensors, rank, world)
        report["manifest"] = manifest.to_json() if isinstance(manifest, Manifest) else manifest
    except Exception as e:  # reported to rank 0, which abandons the snapshot
        return {"rank": rank, "error": f"rank {rank}: {type(e).__name__}: {e}"}, b""
    return report, blob


def _finish(root: str, tmp: str, final: str, reports: list[dict],
            merge: Callable[[list[dict]], dict] | None,
            written_here: set[str] | frozenset[str] = frozenset()) -> None:
    """Rank 0: verify every shard on disk, write the manifest last, rename. A shard in
    ``written_here`` (this process wrote it and hashed the bytes as they went to disk) is
    checked for presence and size only; every other shard is re-hashed on disk
    (`_hashes_as_reported`)."""
    shards = {}
    for r in reports:
        if "shard" not in r:
            continue
        info = r["shard"]
        path = os.path.join(tmp, info["file"])
        if not os.path.isfile(path) or (
                os.path.getsize(path) != info["bytes"] if info["file"] in written_here
                else not _hashes_as_reported(path, info)):
            raise SnapshotError(f"shard {info['file']} of rank {r['rank']} is missing or "
                                f"differs from what rank {r['rank']} wrote")
        shards[info["file"]] = ShardEntry(sha256=info["sha256"], bytes=info["bytes"],
                                          rank=r["rank"], chunk_bytes=info.get("chunk_bytes"),
                                          chunks=info.get("chunks"))
    parts = [r["manifest"] for r in reports]
    manifest = dict(merge(parts) if merge else parts[0], shards=to_json(shards))
    if manifest.get("format") == FORMAT_NAME:  # the reader's schema, checked before writing:
        try:  # writer and reader share one definition of a manifest (snapshot/manifest.py)
            validate_manifest(parse_json(json.dumps(manifest).encode(), MANIFEST), MANIFEST)
        except SnapshotError as e:
            raise SnapshotError(f"the manifest this writer made would not load (a kfac_stream "
                                f"bug; nothing written): {e}") from e
    _publish(root, tmp, final, manifest)


def _publish(root: str, tmp: str, final: str, manifest: dict) -> None:
    """Write and fsync ``manifest`` into ``tmp`` (a complete snapshot but for it), then rename
    ``tmp`` to ``final``, replacing a snapshot of the same step there."""
    mpath = os.path.join(tmp, MANIFEST)
    with open(mpath, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    stale = None
    if os.path.exists(final):  # re-snapshot of the same step: move the old one aside first,
        stale = os.path.join(root, tmp_dir_name(int(manifest["step"]), "replaced"))
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)  # deleted only once the new one is in place (a kill between
    os.replace(tmp, final)  # the renames leaves two complete hidden copies: clean_stale_tmp
    fsync_path(root)  # puts the newer one back under the final name)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def relabel_weights(path: str, weights: dict[str, dict], weights_from: dict) -> str:
    """Snapshot ``path`` again with another weight fingerprint ``weights``
    (`kfac_stream.snapshot.weights.weights_fingerprint`) and its ``weights_from``
    (`manifest_types.WeightsFrom` as JSON): the Trainer reloaded another step's weights after
    the step's snapshot was written (``load_best_model_at_end``). One process (rank 0, after
    every rank read the fingerprint); returns ``path``.

    Its shards are the same files (hard links into a hidden directory, copies where the file
    system has none: no tensor is read or written again) beside the new manifest, checked as
    the writer checks one; the directory replaces the old one as a re-snapshot of the step
    does (`write_snapshot`). The eigendecomposition cache of a deferred snapshot, keyed to the
    old manifest (`kfac_stream.snapshot.eigen_sidecar`), is not carried over: it is computed
    again at the first use."""
    manifest = dict(read_manifest_json(path), weights=weights, weights_from=weights_from)
    try:
        validate_manifest(parse_json(json.dumps(manifest).encode(), MANIFEST), MANIFEST)
    except SnapshotError as e:
        raise SnapshotError(f"the manifest relabelled for {path} would not load (a kfac_stream "
                            f"bug; nothing changed): {e}") from e
    root, name = os.path.split(os.path.normpath(path))
    tmp = os.path.join(root, tmp_dir_name(int(manifest["step"]), "relabel"))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for file in manifest["shards"]:
            source, target = os.path.join(path, file), os.path.join(tmp, file)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
                fsync_path(target)
        _publish(root, tmp, os.path.join(root, name), manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
