"""`Snapshot.load` of one large shard: one sha256 stream in the reading thread (the form written
before chunked digests) against chunk digests verified in parallel (CPU).

Method: a synthetic snapshot of ``--layers`` linear layers of side ``--dim`` (4096: d_in 4095
plus the bias, d_out 4096; both factors dense, fp16 storage: each factor's fp16 data and its
float32 eigenvectors, random values, 201 MB per layer; 10 layers make one 2.0 GB shard),
written by kfac_stream's own writer (`writer.write_snapshot`, with a hand-made manifest of
`manifest_types` records, as the tests do). The same tensors are written a second time in the
older form: the shard by `writer.write_safetensors` (one sha256 over the whole file, today's
path before chunked digests), its manifest entry without ``chunk_bytes``/``chunks``. Then:

* **load**: `Snapshot.load` of each directory, interleaved (the order alternates), ``--reps``
  (5) times, the page cache warm (each file was just written and is read once before the
  timed loads; the machine has the RAM to hold both); GB/s = shard bytes / seconds, median of
  the repetitions (also the best, and the median of each repetition's ratio: on a shared
  virtual machine the CPU's speed drifts between repetitions). The chunked form hashes on
  ``--threads`` (2) threads (`files.set_hash_threads`). Both loads include the same value
  checks (every tensor finite, eigenvalues ≥ 0);
* **read + verify only**: the read and the digests without parsing or value checks: the
  older path's loop (a zero-filled ``bytearray``, 16 MiB ``readinto`` with one sha256 fed in
  the same thread, as `Snapshot.load` did) against `files.read_verified`;
* **cold-ish**: the load again after ``posix_fadvise(DONTNEED)`` on the shard (the kernel
  drops the file's clean cached pages; an unprivileged process cannot drop the whole page
  cache with ``/proc/sys/vm/drop_caches``), ``--cold-reps`` (2) times each;
* **write**: the shard's write (write, hash, fsync) in each form, interleaved, ``--write-reps``
  (2) times: `writer.write_shard` (chunked, parallel) against ``write_safetensors`` + fsync.

Prints the figures and the ratio (target ≥ 1.5x for the warm load) and writes
``benchmarks/results/snapshot_load.json``. The files are written under ``--dir`` (a temporary
directory by default) and removed at the end; ``--gb`` sizes the shard instead of
``--layers``.

Usage: ``python benchmarks/probes/snapshot_load.py [--gb 2] [--reps 5] [--threads 2]``
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kfac_stream import Snapshot
from kfac_stream.snapshot import writer
from kfac_stream.snapshot.layout import MANIFEST, layer_fingerprint, shard_name
from kfac_stream.snapshot.manifest_types import (
    Counts,
    FactorEntry,
    LayerEntry,
    Manifest,
    Ownership,
    Spectrum,
)
from kfac_stream.utils import files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import machine, write_json  # noqa: E402

TARGET = 1.5
SHARD = shard_name(0, 1)


def synthetic(layers: int, dim: int) -> tuple[dict[str, torch.Tensor], Manifest]:
    """``layers`` dense linear layers of side ``dim`` (bias on): fp16 factors, their scales,
    float32 eigenvalues and eigenvectors (random), and their manifest (shards filled in by the
    writer)."""
    g = torch.Generator().manual_seed(0)
    tensors, entries = {}, {}
    spectrum = Spectrum(max=1.0, trace=float(dim), cond=1.0, eff_rank=float(dim))
    for i in range(layers):
        name = f"model.layers.{i}.mlp"
        for f in ("A", "G"):
            key = f"{name}.{f}"
            tensors[key] = torch.randn(dim, dim, generator=g, dtype=torch.float32).half()
            tensors[f"{key}.scale"] = torch.ones(1)
            tensors[f"{key}.eigvals"] = torch.rand(dim, generator=g)
            tensors[f"{key}.eigvecs"] = torch.randn(dim, dim, generator=g)
        entries[name] = LayerEntry(kind="linear", d_in=dim - 1, d_out=dim, has_bias=True, **{
            f: FactorEntry(key=f"{name}.{f}", dim=dim, diagonal=False, dtype="float16", owner=0,
                           shard=SHARD, weight=1.0, updates=1, positions=1, spectrum=spectrum)
            for f in ("A", "G")})
    manifest = Manifest(
        step=1, epoch=None, created_unix=time.time(), world_size=1,
        ownership=Ownership(bytes_per_rank=[sum(t.nbytes for t in tensors.values())],
                            eigh_flops_per_rank=[0.0]),
        fisher="empirical", ema_decay=0.95, token_fraction=1.0, update_every=1,
        storage_dtype="float16", config={}, counts=Counts(), skipped_steps=[],
        shared_inputs=[], layers=entries,
        fingerprint=layer_fingerprint(dict.fromkeys(entries, (dim - 1, dim, True))))
    return tensors, manifest


def write_old(path: str, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """The shard as written before chunked digests: one sha256 stream, then fsync."""
    with open(path, "wb") as f:
        digest, size = writer.write_safetensors(f, tensors)
        f.flush()
        os.fsync(f.fileno())
    return digest, size


def old_form(new_dir: str, old_dir: str, tensors: dict[str, torch.Tensor]) -> None:
    """``old_dir``: the snapshot of ``new_dir`` in the single-sha256 form (its shard written
    by `write_old`, its manifest entry without chunk digests)."""
    os.makedirs(old_dir)
    digest, size = write_old(os.path.join(old_dir, SHARD), tensors)
    with open(os.path.join(new_dir, MANIFEST)) as f:
        meta = json.load(f)
    entry = meta["shards"][SHARD]
    assert entry["bytes"] == size and "chunks" in entry
    meta["shards"][SHARD] = {"sha256": digest, "bytes": size, "rank": entry["rank"]}
    with open(os.path.join(old_dir, MANIFEST), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def old_read(path: str) -> None:
    """The older read path: zero-filled buffer, 16 MiB reads, one sha256 in this thread."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        with memoryview(buf) as view:
            n = 0
            while n < len(buf) and (got := f.readinto(view[n:n + (16 << 20)])):
                h.update(view[n:n + got])
                n += got
    assert n == len(buf)


def new_read(path: str, entry: dict) -> None:
    with open(path, "rb", buffering=0) as f:
        files.read_verified(f, entry["bytes"], entry["chunks"], entry["chunk_bytes"],
                            name=path)


def evict(path: str) -> None:
    """Drop the file's clean pages from the page cache (``POSIX_FADV_DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    del out
    gc.collect()
    return seconds


def interleaved(runs: dict, reps: int, before=None) -> dict[str, list[float]]:
    """Seconds of each of ``runs`` (name -> callable), interleaved, the order alternating."""
    out: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(reps):
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            if before is not None:
                before(name)
            out[name].append(timed(runs[name]))
    return out


def summary(seconds: dict[str, list[float]], size: int) -> dict:
    """Medians (GB/s from them), bests, the ratio of the medians and the median of the paired
    ratios (each repetition's two runs back to back: robust to the machine's drift)."""
    med = {k: statistics.median(v) for k, v in seconds.items()}
    best = {k: min(v) for k, v in seconds.items()}
    return {"seconds": seconds, "median_s": med, "best_s": best,
            "GB_per_s": {k: size / 1e9 / s for k, s in med.items()},
            "best_GB_per_s": {k: size / 1e9 / s for k, s in best.items()},
            "ratio": med["single_sha256"] / med["chunked"],
            "paired_ratio": statistics.median(
                a / b for a, b in zip(seconds["single_sha256"], seconds["chunked"]))}


def measure(a, work: str) -> dict:
    """Build both forms under ``work`` and time loads, reads, cold loads and writes."""
    tensors, manifest = synthetic(a.layers, a.dim)
    new_dir = writer.write_snapshot(os.path.join(work, "kfac"), 1, tensors, manifest)
    old_dir = os.path.join(work, "old", "step-00000001")
    old_form(new_dir, old_dir, tensors)
    paths = {"single_sha256": os.path.join(old_dir, SHARD),
             "chunked": os.path.join(new_dir, SHARD)}
    size = os.path.getsize(paths["chunked"])
    with open(os.path.join(new_dir, MANIFEST)) as f:
        entry = json.load(f)["shards"][SHARD]
    print(f"shard: {size / 1e9:.2f} GB, {len(entry['chunks'])} chunks of "
          f"{entry['chunk_bytes'] >> 20} MiB; hash threads {files.HASH_THREADS}", flush=True)
    dirs = {"single_sha256": old_dir, "chunked": new_dir}
    loads = {k: (lambda d=d: Snapshot.load(d, show_progress=False)) for k, d in dirs.items()}
    for fn in loads.values():  # warm the page cache and check both load
        assert len(fn()) == a.layers
    out = {"bytes": size, "chunks": len(entry["chunks"]), "chunk_bytes": entry["chunk_bytes"]}
    out["load_warm"] = summary(interleaved(loads, a.reps), size)
    out["read_verify_warm"] = summary(interleaved(
        {"single_sha256": lambda: old_read(paths["single_sha256"]),
         "chunked": lambda: new_read(paths["chunked"], entry)}, a.reps), size)
    out["load_cold"] = summary(interleaved(loads, a.cold_reps,
                                           before=lambda k: evict(paths[k])), size)
    tmp = os.path.join(work, "writes")
    os.makedirs(tmp)

    def write_new() -> None:
        writer.write_shard(tmp, tensors, 0, 1)
        os.remove(os.path.join(tmp, SHARD))

    def write_single() -> None:
        write_old(os.path.join(tmp, SHARD), tensors)
        os.remove(os.path.join(tmp, SHARD))

    shutil.rmtree(os.path.join(work, "old"))  # room on the disk for the writes
    out["write"] = summary(interleaved({"single_sha256": write_single, "chunked": write_new},
                                       a.write_reps), size)
    return out


def report(out: dict) -> None:
    for key, what in (("load_warm", "Snapshot.load, page cache warm"),
                      ("read_verify_warm", "read + verify only, warm"),
                      ("load_cold", "Snapshot.load, file evicted (posix_fadvise DONTNEED)"),
                      ("write", "shard write (write + hash + fsync)")):
        r = out[key]
        print(f"{what}: single sha256 {r['GB_per_s']['single_sha256']:.2f} GB/s "
              f"({r['median_s']['single_sha256']:.2f} s; best "
              f"{r['best_GB_per_s']['single_sha256']:.2f}), chunked "
              f"{r['GB_per_s']['chunked']:.2f} GB/s ({r['median_s']['chunked']:.2f} s; best "
              f"{r['best_GB_per_s']['chunked']:.2f}): {r['ratio']:.2f}x (paired "
              f"{r['paired_ratio']:.2f}x)")
    verdict = "meets" if out["load_warm"]["ratio"] >= TARGET else "misses"
    print(f"warm load ratio {out['load_warm']['ratio']:.2f}x {verdict} the target "
          f"{TARGET}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--gb", type=float, default=None, help="shard size; sets --layers")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold-reps", type=int, default=2)
    p.add_argument("--write-reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    p.add_argument("--no-save", action="store_true", help="do not write the results JSON")
    a = p.parse_args()
    if a.gb is not None:
        a.layers = max(1, round(a.gb * 1e9 / (12 * a.dim**2)))
    files.set_hash_threads(a.threads)
    work = tempfile.mkdtemp(prefix="kfac-snapshot-load-", dir=a.dir)
    try:
        free = shutil.disk_usage(work).free
        need = 2.2 * 12 * a.dim**2 * a.layers
        if free < need:
            raise SystemExit(f"{work}: {free / 1e9:.1f} GB free; the benchmark needs "
                             f"{need / 1e9:.1f} GB (pass a smaller --gb)")
        out = measure(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(out)
    out.update(method=__doc__.split("\n\n")[1].replace("\n", " "),
               settings={k: v for k, v in vars(a).items() if k not in ("dir", "no_save")},
               hash_threads=a.threads, page_cache="warm (files just written and read once); "
               "cold-ish: the shard evicted with posix_fadvise(DONTNEED) before each load",
               machine=machine())
    if not a.no_save:
        print(f"wrote {write_json('snapshot_load', out)}")


if __name__ == "__main__":
    main()
