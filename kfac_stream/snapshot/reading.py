"""Reading a snapshot's files safely (`kfac_stream.snapshot.snapshot.Snapshot.load` and the
eigen cache, `kfac_stream.snapshot.eigen_sidecar`): a directory opened once and its files read
by plain name without following symlinks (`SnapshotDir`), a shard's bytes verified against its
digests as they are read and parsed as safetensors against the tensors the manifest implies
(`read_shard`), and the values checked (`check_values`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch

from ..exceptions import SnapshotError
from ..utils.files import read_verified
from .layout import MANIFEST, MAX_MANIFEST_BYTES, MAX_SAFETENSORS_HEADER_BYTES
from .manifest import TensorSpec, checked_manifest
from .manifest_json import parse_json
from .manifest_types import Manifest, ShardEntry


def read_small_file(path: str, name: str, max_bytes: int) -> bytearray:
    """The bytes of the regular file ``name`` in directory ``path`` (at most ``max_bytes``),
    read as `Snapshot.load` reads a manifest: no symlink followed, `SnapshotError` otherwise
    (the eigen cache's record, `kfac_stream.snapshot.eigen_sidecar`)."""
    fpath = os.path.join(path, name)

    def check_size(size: int) -> None:
        if size > max_bytes:
            raise SnapshotError(f"{fpath}: is {size} bytes; expected at most {max_bytes}")

    with SnapshotDir(path) as d:
        return d.read(name, f"{fpath}: missing", check_size)


def read_tensor_file(path: str, name: str, info: ShardEntry,
                     allowed: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``name`` in directory ``path``, verified as a shard
    is (size and digest as ``info`` says, header against ``allowed`` — every tensor there
    must be present —, finite values, eigenvalues ≥ 0); `SnapshotError` otherwise."""
    with SnapshotDir(path) as d:
        tensors = read_shard(d, name, info, allowed)
    for key, spec in allowed.items():
        if key not in tensors:
            raise SnapshotError(f"{os.path.join(path, name)}: tensor {key!r} is missing; "
                                f"expected it ({spec.source})")
    check_values(tensors, dict.fromkeys(tensors, os.path.join(path, name)))
    return tensors


# ---------------------------------------------------------------- files ----------------------

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: a FIFO put in a file's place would block open(); it is refused by fstat instead
_FILE_FLAGS = os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link")):
        if test(mode):
            return name
    return "special file"


class SnapshotDir:
    """A snapshot directory opened once; its files are read by plain name relative to it."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise SnapshotError(f"{path}: not a directory") from None
        except OSError as e:
            raise SnapshotError(f"{path}: cannot be opened ({e.strerror})") from None

    def __enter__(self) -> SnapshotDir:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    @contextlib.contextmanager
    def open(self, name: str, missing: str, check_size) -> Iterator[tuple[BinaryIO, int]]:
        """``(unbuffered file, size)`` of the regular file ``name`` in this directory, through
        one descriptor opened without following symlinks. ``check_size(size)`` runs before the
        file is opened (it raises to refuse); ``missing``: the message if there is no file."""
        fpath = os.path.join(self.path, name)
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            raise SnapshotError(missing) from None
        except OSError as e:
            raise SnapshotError(f"{fpath}: cannot be read ({e.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise SnapshotError(f"{fpath}: is a symbolic link; expected a regular file inside "
                                "the snapshot directory (links are never followed)")
        if not stat.S_ISREG(st.st_mode):
            raise SnapshotError(f"{fpath}: is a {_kind(st.st_mode)}; expected a regular file")
        check_size(st.st_size)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK):  # became a symlink since the stat
                raise SnapshotError(f"{fpath}: is a symbolic link; expected a regular file "
                                    "inside the snapshot directory") from None
            raise SnapshotError(f"{fpath}: cannot be read ({e.strerror})") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, st.st_size):
                raise SnapshotError(f"{fpath}: changed while being opened; expected a "
                                    "snapshot no one is writing")
            yield f, now.st_size

    def read(self, name: str, missing: str, check_size, digest: Any = None) -> bytearray:
        """The bytes of the regular file ``name`` in this directory, read once (`open`).
        ``digest`` (a hashlib object), when given, is updated with each chunk as it arrives
        (the hash streams with the read: no second pass over the bytes)."""
        with self.open(name, missing, check_size) as (f, size):
            buf = bytearray(size)
            with memoryview(buf) as view:
                n = 0
                while n < len(buf) and (got := f.readinto(view[n:n + _READ_CHUNK])):
                    if digest is not None:
                        digest.update(view[n:n + got])
                    n += got
            if n != len(buf) or f.read(1):
                raise SnapshotError(f"{os.path.join(self.path, name)}: changed size while "
                                    "being read; expected a snapshot no one is writing")
        return buf

    def read_chunked(self, name: str, missing: str, check_size, info: ShardEntry,
                     key: str) -> memoryview:
        """The bytes of the regular file ``name`` (`open`), read into a buffer that is never
        zero-filled, each of the chunks ``info`` lists hashed in parallel as the next is read
        and checked (`files.read_verified`; ``key``: where the manifest lists them)."""
        assert info.chunks is not None and info.chunk_bytes is not None
        with self.open(name, missing, check_size) as (f, size):
            buf = read_verified(f, size, info.chunks, info.chunk_bytes,
                                name=os.path.join(self.path, name), key=key)
        return memoryview(buf.numpy())


def read_manifest_in(d: SnapshotDir) -> tuple[dict[str, Any], Manifest]:
    """The directory's checked manifest: its JSON dict and its `Manifest`."""
    mpath = os.path.join(d.path, MANIFEST)

    def check_size(size: int) -> None:
        if size > MAX_MANIFEST_BYTES:
            raise SnapshotError(f"{mpath}: is {size} bytes; expected at most "
                                f"{MAX_MANIFEST_BYTES} (layout.MAX_MANIFEST_BYTES)")

    data = d.read(MANIFEST, f"{mpath}: missing (snapshot incomplete)", check_size)
    meta = parse_json(data, mpath)
    return meta, checked_manifest(meta, mpath)


# ---------------------------------------------------------------- shards ---------------------

_READ_CHUNK = 16 << 20  # bytes per read (and hash update) of a shard
_CHECK_CHUNK = 1 << 22  # elements per finiteness check (bounds its temporary)

_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def read_shard(d: SnapshotDir, fname: str, info: ShardEntry,
                implied: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors of shard ``fname`` (listed in the manifest with ``info``), verified."""
    fpath = os.path.join(d.path, fname)
    ipath = f"shards[{fname!r}]"
    allowed = {k: s for k, s in implied.items() if s.shard == fname}  # what it may hold
    placed = sum(s.nbytes for s in allowed.values())
    lo, hi = 8 + 2 + placed, 8 + MAX_SAFETENSORS_HEADER_BYTES + placed
    if not lo <= info.bytes <= hi:
        raise SnapshotError(f"{d.path}: {ipath}.bytes is {info.bytes}; expected {lo} to "
                            f"{hi}: the {placed} bytes of the tensors the manifest "
                            "places in it, plus a safetensors header")

    def check_size(size: int) -> None:
        if size != info.bytes:
            raise SnapshotError(f"{fpath}: size/sha256 mismatch (file altered or truncated): "
                                f"it has {size} bytes; expected {ipath}.bytes = "
                                f"{info.bytes}")

    missing = f"{d.path}: shard {fname!r} listed in the manifest is missing"
    if info.chunks is not None:  # chunked digests: hashed in parallel as it is read
        return _safetensors(d.read_chunked(fname, missing, check_size, info, f"{ipath}.chunks"),
                            fpath, allowed)
    hasher = hashlib.sha256()  # one sha256 of the whole file (written before chunked digests)
    buf = d.read(fname, missing, check_size, hasher)
    digest = hasher.hexdigest()
    if digest != info.sha256:
        raise SnapshotError(f"{fpath}: sha256 mismatch (file altered or truncated): it is "
                            f"{digest}; expected {ipath}.sha256 = {info.sha256}")
    return _safetensors(buf, fpath, allowed)


def _safetensors(buf: bytearray | memoryview, fpath: str, allowed: dict[str, TensorSpec]
                 ) -> dict[str, torch.Tensor]:
    """Tensors of the safetensors file in ``buf`` (views of it), each checked against
    ``allowed`` (dtype, shape) before it is made; the data offsets must tile the data section
    exactly."""
    bad = f"{fpath}: not a readable safetensors file"
    if len(buf) < 10:
        raise SnapshotError(f"{bad}: {len(buf)} bytes; expected at least 10 (header length "
                            "and header)")
    n = int.from_bytes(buf[:8], "little")
    if n > len(buf) - 8 or n > MAX_SAFETENSORS_HEADER_BYTES:
        raise SnapshotError(f"{bad}: its header length is {n} bytes; expected at most "
                            f"{min(len(buf) - 8, MAX_SAFETENSORS_HEADER_BYTES)} (the rest of "
                            "the file)")
    header = parse_json(memoryview(buf)[8:8 + n], f"{fpath} (safetensors header)")
    if not isinstance(header, dict):
        raise SnapshotError(f"{bad}: its header is not a JSON object")
    extra = header.pop("__metadata__", {})
    if not isinstance(extra, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise SnapshotError(f"{bad}: its __metadata__ is not an object of strings")
    start, size = 8 + n, len(buf) - 8 - n
    spans = []
    for name, entry in sorted(header.items()):  # by name: a factor before its parts
        spec = allowed.get(name)
        if spec is None:
            raise SnapshotError(f"{fpath}: tensor {name!r} is in this shard; expected only "
                                "the tensors the manifest places in it")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise SnapshotError(f"{bad}: the header entry of {name!r} is not an object with "
                                "dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(_is_int(x) and x >= 0 for x in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(_is_int(x) for x in offsets)):
            raise SnapshotError(f"{bad}: the header entry of {name!r} has a malformed shape "
                                "or data_offsets")
        if _ST_DTYPES.get(dtype) != spec.dtype or tuple(shape) != spec.shape:
            raise SnapshotError(f"{fpath}: tensor {name!r} is {dtype} {shape}, manifest says "
                                f"{spec.dtype} {list(spec.shape)} ({spec.source})")
        b, e = offsets
        if not 0 <= b <= e <= size or e - b != spec.nbytes:
            raise SnapshotError(f"{bad}: tensor {name!r} has data_offsets [{b}, {e}]; "
                                f"expected {spec.nbytes} bytes inside the {size}-byte data")
        spans.append((b, e, name))
    pos = 0
    for b, e, name in sorted(spans):
        if b != pos:
            raise SnapshotError(f"{bad}: tensor {name!r} starts at byte {b} of the data; "
                                f"expected {pos} (tensors tile the data without gaps)")
        pos = e
    if pos != size:
        raise SnapshotError(f"{bad}: its tensors end at byte {pos} of the data; expected "
                            f"{size} (the end of the file)")
    out = {}
    for b, e, name in spans:
        spec = allowed[name]
        dtype = getattr(torch, spec.dtype)
        if (start + b) % dtype.itemsize:  # unaligned (not as safetensors writes): a copy
            t = torch.frombuffer(bytearray(buf[start + b:start + e]), dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype, count=math.prod(spec.shape),
                                 offset=start + b)
        if sys.byteorder == "big":  # safetensors is little-endian
            t = torch.from_numpy(t.numpy().byteswap())
        out[name] = t.view(spec.shape)
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: Per stored float dtype: the integer of its width, the mask of every bit but the sign, and
#: the bits of +Infinity (the exponent all ones). A value is finite exactly when its bits
#: without the sign are below +Infinity's (Infinity and every NaN are at or above them).
_FLOAT_BITS = {torch.float16: (torch.int16, 0x7FFF, 0x7C00),
               torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
               torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
               torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000)}


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite, checked in chunks of the stored values (a
    bounded temporary): on their bits as integers (`_FLOAT_BITS`; ``torch.isfinite`` on
    float16 runs at a tenth of the speed on a CPU), ``torch.isfinite`` for other dtypes."""
    flat = t.reshape(-1)
    if t.dtype not in _FLOAT_BITS:
        return all(bool(torch.isfinite(flat[i:i + _CHECK_CHUNK]).all())
                   for i in range(0, flat.numel(), _CHECK_CHUNK))
    ints, magnitude, inf = _FLOAT_BITS[t.dtype]
    bits = flat.view(ints)
    return all(int((bits[i:i + _CHECK_CHUNK] & magnitude).max()) < inf
               for i in range(0, bits.numel(), _CHECK_CHUNK))


def check_values(tensors: dict[str, torch.Tensor], origin: dict[str, str]) -> None:
    """Every tensor finite (`_all_finite`: no float copy); every scale and eigenvalue ≥ 0."""
    for name, t in tensors.items():
        if not _all_finite(t):
            raise SnapshotError(f"{origin[name]}: tensor {name!r} has non-finite values; "
                                "expected finite numbers")
        if name.endswith((".scale", ".eigvals", ".ekfac")) and bool((t < 0).any()):
            raise SnapshotError(f"{origin[name]}: tensor {name!r} has negative values "
                                f"(min {float(t.min()):g}); expected ≥ 0")
