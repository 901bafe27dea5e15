"""A deferred snapshot's eigendecomposition, computed at its first use and cached beside it.

A periodic snapshot whose eigendecomposition was deferred (`kfac_stream.snapshot.eigen_rule`)
holds the factors only. Its first use (``Snapshot.load(..., eigen=True)``, a posterior, the
CLI; `Snapshot.eigen`) decomposes every factor with the snapshot's own routine
(`kfac_stream.stats.spectrum.eigh_stored`: float32 on a GPU, float64 on the CPU) and caches
the result in the snapshot directory::

    step-00000500/
        manifest.json, shard-*.safetensors     the snapshot (never changed)
        eigen/eigen.safetensors                ``<key>.eigvals`` [d], ``<key>.eigvecs`` [d, d]
        eigen/eigen.json                       the record: the manifest's sha256 it belongs
                                               to, the tensors' size and digest, the device,
                                               when, how long, and each factor's exact spectrum

Safe against concurrent first uses and kill -9:

- the writer holds an exclusive ``flock`` on ``.eigen.lock`` (a second process waits, then
  finds the cache and reads it: one cache, computed once);
- it writes into ``.eigen.tmp-<pid>-<random>/`` (every file fsynced), renames that directory
  to ``eigen/`` (atomic) and fsyncs the snapshot directory; a crash leaves at most a temporary
  directory, which readers ignore and the next writer removes (under the lock no other
  writer is active);
- a reader verifies the record against the snapshot (the manifest's sha256), and the tensors
  as a shard is verified (size, digest, header, finite, eigenvalues ≥ 0): a cache that fails
  is an error naming the file, never used silently (remove ``eigen/`` to recompute it).

The snapshot itself is untouched: a cache lost or removed is computed again. A snapshot whose
directory is not writable is decomposed in memory (logged once), uncached.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..exceptions import SnapshotError
from ..stats.spectrum import eigh_stored
from ..utils.enums import StorageDtype
from ..utils.files import fsync_path
from .layout import MANIFEST, MAX_MANIFEST_BYTES
from .manifest import check_chunks, eigen_tensors, wide_dtype_name
from .manifest_json import parse_json
from .manifest_types import (
    Manifest,
    ShardEntry,
    Spectrum,
    from_json,
    json_field,
    record_of,
    to_json,
)
from .reading import read_small_file, read_tensor_file
from .schema import HEX64, NONNEG, Ctx, Int, MapOf, Str, layer_name_problem
from .snapshot import Snapshot
from .writer import write_shard

logger = logging.getLogger("kfac_stream")

CACHE_DIR = "eigen"
RECORD = "eigen.json"
LOCK = ".eigen.lock"
TMP_PREFIX = ".eigen.tmp-"
FORMAT = "kfac_stream.eigen"


@dataclass(kw_only=True)
class EigenCacheRecord:
    """``eigen/eigen.json``: what the cached tensors are and where they come from."""

    WHAT: ClassVar[str] = "an eigendecomposition cache record"
    format: str = json_field(Str(choices=(FORMAT,)))
    version: int = json_field(Int(1, 1))
    manifest_sha256: str = json_field(HEX64)
    device: str = json_field(Str(what="a device name"))
    finished_unix: float = json_field(NONNEG)
    seconds: float = json_field(NONNEG)
    file: str = json_field(Str(what="the tensors' file name"))
    tensors: ShardEntry = json_field()
    spectra: dict[str, Spectrum] = json_field(
        MapOf(record_of(Spectrum), layer_name_problem, "a factor key",
              what="an object of spectra"))


def cached_or_computed(path: str, manifest: Manifest, stored: dict[str, tuple],
                       device: torch.device | str | None = None, threads: int | None = None
                       ) -> tuple[dict[str, torch.Tensor], EigenCacheRecord]:
    """``({<key>.eigvals / <key>.eigvecs: tensor}, record)`` of snapshot ``path``: read from its
    cache, else computed (``stored``: ``{key: (data, scale)}``, the snapshot's stored factors,
    decomposed on ``device``, None: the CPU in float64) and cached (module docstring). A
    record whose ``file`` is empty was not cached (an unwritable snapshot directory): its
    ``tensors`` entry holds no digest."""
    digest = hashlib.sha256(read_small_file(path, MANIFEST, MAX_MANIFEST_BYTES)).hexdigest()
    found = read_cache(path, manifest, digest)
    if found is not None:
        return found
    try:
        lock = os.open(os.path.join(path, LOCK),
                       os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise
        logger.warning("kfac_stream: %s is not writable (%s): its eigendecomposition is "
                       "computed in memory and not cached", path, e.strerror)
        return _compute(manifest, stored, digest, device, threads)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; a second first use waits here
        found = read_cache(path, manifest, digest)  # written while this process waited
        if found is not None:
            return found
        tensors, record = _compute(manifest, stored, digest, device, threads)
        _write(path, tensors, record)
        return tensors, record
    finally:
        os.close(lock)  # releases the lock


def read_cache(path: str, manifest: Manifest, digest: str
               ) -> tuple[dict[str, torch.Tensor], EigenCacheRecord] | None:
    """The verified cache of snapshot ``path`` (its manifest's sha256 ``digest``), or None if
    there is none; `SnapshotError` if there is one that does not verify."""
    where = os.path.join(path, CACHE_DIR)
    if not os.path.lexists(where):
        return None
    if os.path.islink(where) or not os.path.isdir(where):
        raise SnapshotError(f"{where}: is not a directory; expected the eigendecomposition "
                            f"cache (remove it to recompute)")
    rpath = os.path.join(where, RECORD)
    meta = parse_json(read_small_file(where, RECORD, MAX_MANIFEST_BYTES), rpath)
    record_of(EigenCacheRecord).check(meta, "", Ctx(rpath))
    record = from_json(EigenCacheRecord, meta)
    check_chunks("tensors", record.tensors, Ctx(rpath))  # the root over the chunk digests
    if record.tensors.chunks is None:
        raise SnapshotError(f"{rpath}: tensors.chunks is missing; expected the chunk digests "
                            "the cache is written with")
    if record.manifest_sha256 != digest:
        raise SnapshotError(f"{rpath}: manifest_sha256 is {record.manifest_sha256}; expected "
                            f"{digest}, the sha256 of {os.path.join(path, MANIFEST)} (a cache "
                            "of another snapshot: remove it to recompute)")
    if os.path.basename(record.file) != record.file or not record.file.endswith(".safetensors"):
        raise SnapshotError(f"{rpath}: file is {record.file!r}; expected a plain "
                            "*.safetensors name in the same directory")
    allowed = implied_eigen(manifest, record.file)
    try:
        tensors = read_tensor_file(where, record.file, record.tensors, allowed)
    except SnapshotError as e:
        raise SnapshotError(f"{e} (the eigendecomposition cache: remove {where} to "
                            "recompute it)") from None
    return tensors, record


def implied_eigen(manifest: Manifest, file: str) -> dict[str, Any]:
    """The cache's tensors: ``K.eigvals`` and (dense) ``K.eigvecs`` of every stored factor."""
    wide, out = wide_dtype_name(manifest), {}
    for name, entry in manifest.layers.items():
        for factor in ("A", "G"):
            f = getattr(entry, factor)
            out.update(eigen_tensors(f.key, f.dim, f.diagonal, wide, file,
                                     f"layers[{name!r}].{factor}"))
    return out


def _compute(manifest: Manifest, stored: dict[str, tuple], digest: str,
             device: torch.device | str | None, threads: int | None
             ) -> tuple[dict[str, torch.Tensor], EigenCacheRecord]:
    """Every stored factor's eigendecomposition, as a snapshot's would be, and its record."""
    wide = StorageDtype(manifest.storage_dtype).wide_dtype
    t0 = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    spectra: dict[str, Spectrum] = {}
    items = ((k, data, float(scale)) for k, (data, scale) in sorted(stored.items()))
    for key, w, q, stats in eigh_stored(items, wide, device, threads):
        tensors[f"{key}.eigvals"] = w
        if q is not None:
            tensors[f"{key}.eigvecs"] = q
        spectra[key] = from_json(Spectrum, stats)
    where = "cpu" if device is None else str(torch.device(device))
    record = EigenCacheRecord(format=FORMAT, version=1, manifest_sha256=digest, device=where,
                              finished_unix=time.time(), seconds=time.perf_counter() - t0,
                              file="", tensors=ShardEntry(sha256="0" * 64, bytes=0, rank=0),
                              spectra=spectra)
    return tensors, record


def _write(path: str, tensors: dict[str, torch.Tensor], record: EigenCacheRecord) -> None:
    """Write the cache atomically (module docstring); called under the lock."""
    for entry in os.listdir(path):  # a crashed writer's leftovers (no writer is active)
        if entry.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
    tmp = os.path.join(path, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    try:
        report = write_shard(tmp, tensors, 0, 1)
        record.file = str(report.pop("file"))
        record.tensors = from_json(ShardEntry, {**report, "rank": 0})
        with open(os.path.join(tmp, RECORD), "w") as f:
            json.dump(to_json(record), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        os.rename(tmp, os.path.join(path, CACHE_DIR))
        fsync_path(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


Snapshot.eigen_source = staticmethod(cached_or_computed)  # `Snapshot.eigen` calls it
