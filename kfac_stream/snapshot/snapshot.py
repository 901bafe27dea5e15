"""`Snapshot`: load and verify a snapshot directory (JSON + safetensors only: nothing on this
path can execute code from a file; tests/test_snapshot.py and tests/test_snapshot_fuzz.py
check it).

``Snapshot.load(path)``:

1. opens the directory once (a symlink given as ``path`` is resolved there, once); every file
   is then opened relative to that directory by its plain name without following symlinks,
   and must be a regular file: a symlink (to anywhere, also inside), FIFO, device or
   directory in its place is refused before it is opened;
2. reads ``manifest.json`` (at most `layout.MAX_MANIFEST_BYTES`) and checks it against the
   schema, `manifest.validate_manifest`, before any shard is opened (the checked manifest is
   read as a `manifest_types.Manifest`; ``meta`` keeps the JSON dict);
3. for each shard listed: checks its size against the manifest's ``bytes`` and against the
   size of the tensors the manifest places in it before reading, reads it once and checks the
   digests of exactly the bytes read: with chunked digests (``chunks``, `manifest_types.
   ShardEntry`) into a buffer that is never zero-filled, each chunk hashed on a thread pool
   while the next is read (`files.read_verified`), every chunk's sha256 checked; without
   them (older snapshots), one sha256 streamed with the read. It then parses the safetensors
   header from the same bytes and checks every tensor's dtype and shape against
   `manifest.implied_tensors` (no other tensor may be there), then takes the tensors from
   those bytes (no second open; raw tensor data only, never a Python object);
4. checks the values: every tensor finite, scales and eigenvalues ≥ 0 (on the stored
   values, in chunks).

The tensors are views of the bytes read (no copy); the float32 factors ``A``/``G`` are
dequantised at their first access (`LayerFactors`).

Anything else raises `SnapshotError` naming the file, the key and what was expected (see
`manifest` for the message format).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import stat
import sys
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch

from ..exceptions import SnapshotError
from ..factor_keys import FACTOR_KINDS
from ..files import read_verified
from ..progress import progress
from .layout import MANIFEST, MAX_MANIFEST_BYTES, MAX_SAFETENSORS_HEADER_BYTES, STEP_DIR_RE
from .manifest import TensorSpec, checked_manifest, implied_tensors
from .manifest_json import parse_json
from .manifest_types import Manifest, ShardEntry


class LayerFactors:
    """Factors of one tracked layer.

    Attributes:
        name: Module name.
        A: ``[d_in(+1), d_in(+1)]`` dense or ``[d_in(+1)]`` diagonal; float32 (float64 if
            stored so). The trailing row/column is the bias when ``has_bias``. Dequantised
            from the stored tensor at its first access and kept (an A several layers share:
            once for all of them); `Snapshot.load` makes no float copy.
        G: ``[d_out, d_out]`` dense or ``[d_out]`` diagonal (as ``A``).
        meta: The layer's manifest entry.
        A_eigvals: ``[d_A]`` eigenvalues of A (ascending, ≥ 0).
        A_eigvecs: ``[d_A, d_A]`` orthonormal eigenvectors (columns), None if A is diagonal.
        G_eigvals: ``[d_out]``.
        G_eigvecs: ``[d_out, d_out]`` or None.
        ekfac_eigvals: ``[d_out, d_A]`` EK-FAC eigenvalues (`kfac_stream.ekfac`): the
            per-sequence gradients' second moment in the previous snapshot's eigenbasis, on
            the scale of ``outer(G_eigvals, A_eigvals)``; None when the snapshot has none
            (``KFACConfig(ekfac=False)``, the first snapshot of a run).

    ``A`` and ``G`` may be given as tensors or as zero-argument callables returning one (called
    once, at the first access).
    """

    __slots__ = ("name", "_A", "_G", "meta", "A_eigvals", "A_eigvecs", "G_eigvals",
                 "G_eigvecs", "ekfac_eigvals")

    def __init__(self, name: str, A: Any, G: Any, meta: dict[str, Any],
                 A_eigvals: torch.Tensor | None = None, A_eigvecs: torch.Tensor | None = None,
                 G_eigvals: torch.Tensor | None = None,
                 G_eigvecs: torch.Tensor | None = None,
                 ekfac_eigvals: torch.Tensor | None = None) -> None:
        self.name, self._A, self._G, self.meta = name, A, G, meta
        self.A_eigvals, self.A_eigvecs = A_eigvals, A_eigvecs
        self.G_eigvals, self.G_eigvecs = G_eigvals, G_eigvecs
        self.ekfac_eigvals = ekfac_eigvals

    @property
    def A(self) -> torch.Tensor:
        """The input-side factor (class docstring)."""
        return self._A if isinstance(self._A, torch.Tensor) else self._A()

    @property
    def G(self) -> torch.Tensor:
        """The output-side factor (class docstring)."""
        return self._G if isinstance(self._G, torch.Tensor) else self._G()

    @property
    def has_bias(self) -> bool:
        """Whether ``A`` includes the bias row/column."""
        return bool(self.meta["has_bias"])

    def __repr__(self) -> str:
        return f"LayerFactors({self.name!r})"


class _Dequantised:
    """``data · scale`` in float32 (float64 if stored so), computed at the first call and kept;
    one per stored key, so an A several layers share is dequantised once."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self._data, self._scale = data, scale
        self._value: torch.Tensor | None = None
        self._lock = threading.Lock()

    def __call__(self) -> torch.Tensor:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    out = torch.float64 if self._data.dtype == torch.float64 else torch.float32
                    self._value = self._data.to(out) * self._scale.to(out)
        return self._value


class LayerView:
    """A snapshot's layers by name: ``meta``, ``layer_names``, ``step``, ``view[name]``
    (`Snapshot` with the factors, `kfac_stream.snapshot.media.Spectra` with eigenvalues only)."""

    def __init__(self, path: str, meta: dict[str, Any], layers: dict[str, Any]):
        self.path = path
        self.meta = meta
        self._layers = layers

    @property
    def layer_names(self) -> list[str]:
        """Tracked module names, sorted by name (as the manifest lists them)."""
        return list(self._layers)

    @property
    def step(self) -> int:
        """Optimizer step of the snapshot."""
        return int(self.meta["step"])

    def __getitem__(self, name: str):
        try:
            return self._layers[name]
        except KeyError:
            raise KeyError(f"layer {name!r} is not in snapshot {self.path}") from None


class Snapshot(LayerView):
    """A verified, immutable snapshot: ``snap.meta``, ``snap.layer_names``, ``snap[name]``."""

    @property
    def heldout_prior(self):
        """The prior precision fitted on held-out data and stored beside this snapshot
        (`kfac_stream.snapshot.heldout_prior.HeldoutPrior`: ``.tau``, ``.nll``, ...; written
        with ``KFACConfig(eval_prior_precision=True)``), or None."""
        from .heldout_prior import read_heldout_prior

        return read_heldout_prior(self.path)

    @property
    def answer_tokens(self) -> tuple[int, ...] | None:
        """The answer options' token ids (``KFACConfig.answer_tokens``, resolved at train
        begin), or None when the run set none: the default ``token_ids`` of a language-model
        head's queries and the CLI's ``--options``."""
        answers = self.meta.get("answer_tokens")
        return None if answers is None else tuple(int(i) for i in answers["ids"])

    @property
    def answer_texts(self) -> tuple[str, ...] | None:
        """The answer options as text (as given, or decoded), or None."""
        texts = (self.meta.get("answer_tokens") or {}).get("texts")
        return None if texts is None else tuple(texts)

    def __len__(self) -> int:
        return len(self._layers)

    def __repr__(self) -> str:
        return f"Snapshot({self.path!r}, step={self.step}, layers={len(self)})"

    @classmethod
    def load(cls, path: str | os.PathLike, show_progress: bool | None = None) -> Snapshot:
        """Load and verify a snapshot directory (the steps in the module docstring).

        A progress bar counts the shard bytes read and verified (``show_progress`` as in
        `kfac_stream.progress`: by default on a terminal only); a 7B model's snapshot is
        several GB.

        Raises:
            SnapshotError: missing, invalid or oversized manifest, unknown format version, a
                manifest key of the wrong type or range, a symlink or non-regular file, a
                missing or altered shard, a tensor whose dtype or shape differs from the
                manifest, non-finite values.
        """
        path = _path_arg(path, "Snapshot.load", "path")
        with _SnapshotDir(path) as d:
            meta, manifest = _read_manifest_in(d)
            implied = implied_tensors(manifest)
            tensors: dict[str, torch.Tensor] = {}
            origin: dict[str, str] = {}  # tensor name -> shard path, for messages
            total = sum(info.bytes for info in manifest.shards.values())
            with progress(total=total, desc=f"loading snapshot {os.path.basename(path)}",
                          unit="B", unit_scale=True, unit_divisor=1024,
                          show=show_progress) as bar:
                for fname, info in manifest.shards.items():
                    found = _read_shard(d, fname, info, implied)
                    tensors.update(found)
                    origin.update(dict.fromkeys(found, os.path.join(path, fname)))
                    bar.update(info.bytes)
        for name, spec in implied.items():
            if name not in tensors:
                raise SnapshotError(f"{path}: tensor {name!r} is missing from shard "
                                    f"{spec.shard!r}; expected it, as the manifest says "
                                    f"({spec.source})")
        _check_values(tensors, origin)
        return cls(path, meta, _layers(manifest, meta, tensors))

    @classmethod
    def latest(cls, root: str | os.PathLike, show_progress: bool | None = None) -> Snapshot:
        """The newest snapshot under ``root`` that loads and verifies; incomplete, altered or
        symlinked ``step-*`` entries are skipped (their reasons are in the error if none
        loads). ``show_progress`` as in `load`."""
        root = _path_arg(root, "Snapshot.latest", "root")
        steps = sorted((e for e in (os.listdir(root) if os.path.isdir(root) else [])
                        if STEP_DIR_RE.match(e)), reverse=True)
        errors = []
        for entry in steps:
            full = os.path.join(root, entry)
            if os.path.islink(full):  # nothing inside root is followed out of it
                errors.append(f"{full}: is a symbolic link; expected a snapshot directory")
                continue
            try:
                return cls.load(full, show_progress)
            except SnapshotError as e:
                errors.append(str(e))
        detail = f"; skipped: {'; '.join(errors)}" if errors else ""
        if not steps:
            inner = _snapshot_roots_below(root)
            if inner:
                detail += (f"; snapshots are in {' and '.join(inner)} (a run directory holds "
                           "them in its kfac/ folder): pass that")
        raise SnapshotError(f"{root}: no complete snapshot found{detail}")


def _layers(manifest: Manifest, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
            ) -> dict[str, LayerFactors]:
    """Every layer's `LayerFactors` from the verified ``tensors`` (``meta``: the manifest's
    dict, whose layer entries the layers keep)."""
    layers = {}
    values: dict[str, _Dequantised] = {}  # one per stored key (a shared A: once)
    for name, entry in manifest.layers.items():
        parts: dict[str, Any] = {}
        eigen: dict[str, torch.Tensor | None] = {}
        for factor in FACTOR_KINDS:
            key = getattr(entry, factor).key  # a shared A: its group leader's key
            if key not in values:
                values[key] = _Dequantised(tensors[key], tensors[f"{key}.scale"])
            parts[factor] = values[key]
            eigen[f"{factor}_eigvals"] = tensors[f"{key}.eigvals"]
            eigen[f"{factor}_eigvecs"] = tensors.get(f"{key}.eigvecs")
        layers[name] = LayerFactors(name, parts["A"], parts["G"], meta["layers"][name],
                                    ekfac_eigvals=tensors.get(f"{name}.ekfac"), **eigen)
    return layers


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The checked ``manifest.json`` of a snapshot directory (schema and agreement, see
    `manifest.validate_manifest`) without reading the shards, as its JSON dict; raises
    `SnapshotError` like `Snapshot.load`."""
    path = _path_arg(path, "read_manifest", "path")
    with _SnapshotDir(path) as d:
        return _read_manifest_in(d)[0]


def _path_arg(value: Any, func: str, name: str) -> str:
    """``value`` as a path string; `SnapshotError` naming the argument if it is not one (as
    every error kfac_stream raises on purpose, it derives from `KFACStreamError`)."""
    if isinstance(value, str) or (isinstance(value, os.PathLike)
                                  and isinstance(os.fspath(value), str)):
        return os.fspath(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise SnapshotError(f"{func}: {name}={shown} is not allowed: must be a str or "
                        "os.PathLike naming a snapshot directory")


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


class _SnapshotDir:
    """A snapshot directory opened once; its files are read by plain name relative to it."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise SnapshotError(f"{path}: not a directory") from None
        except OSError as e:
            raise SnapshotError(f"{path}: cannot be opened ({e.strerror})") from None

    def __enter__(self) -> _SnapshotDir:
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


def _read_manifest_in(d: _SnapshotDir) -> tuple[dict[str, Any], Manifest]:
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


def _read_shard(d: _SnapshotDir, fname: str, info: ShardEntry,
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


def _check_values(tensors: dict[str, torch.Tensor], origin: dict[str, str]) -> None:
    """Every tensor finite (`_all_finite`: no float copy); every scale and eigenvalue ≥ 0."""
    for name, t in tensors.items():
        if not _all_finite(t):
            raise SnapshotError(f"{origin[name]}: tensor {name!r} has non-finite values; "
                                "expected finite numbers")
        if name.endswith((".scale", ".eigvals", ".ekfac")) and bool((t < 0).any()):
            raise SnapshotError(f"{origin[name]}: tensor {name!r} has negative values "
                                f"(min {float(t.min()):g}); expected ≥ 0")


def _snapshot_roots_below(root: str, depth: int = 2) -> list[str]:
    """Folders up to ``depth`` levels below ``root`` that hold ``step-*`` entries (a run
    directory's ``kfac/``, a Trainer output's ``<run>/kfac``), in sorted order."""
    found, level = [], [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                subs = sorted(e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
            for sub in subs:
                try:
                    if any(STEP_DIR_RE.match(e) for e in os.listdir(sub)):
                        found.append(sub)
                        continue
                except OSError:
                    continue
                nxt.append(sub)
        level = nxt
    return found[:3]
