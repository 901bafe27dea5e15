"""File helpers. Durable writes: what survives a crash is either the old file or the whole new
one. `local_path_problem`: a model path that can only be local, checked before any hub request.

Chunked digests: a file's byte stream cut into chunks of `HASH_CHUNK_BYTES` (the last one
shorter), one sha256 per chunk, and a **root**: the sha256 of the chunks' raw 32-byte digests
concatenated in order (a hash list, `chunk_root`). The chunks are hashed in parallel on
`HASH_THREADS` threads (``hashlib`` releases the GIL on large buffers), as a file is written
(`write_chunk_hashed`, `hash_chunked`) and as it is read back (`read_verified`: into a buffer
that is never zero-filled, each chunk's hash running while the next chunk is read).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..exceptions import SnapshotError

#: Bytes per chunk digest: one sha256 per 64 MiB of a file (the last chunk shorter).
HASH_CHUNK_BYTES = 64 << 20
#: Threads that hash chunks (`set_hash_threads`); each call makes its own pool of this many.
HASH_THREADS = min(4, os.cpu_count() or 1)


def fsync_path(path: str) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_hashed(f: BinaryIO, chunks: Iterable[bytes | memoryview],
                 ahead: int = 2) -> tuple[str, int]:
    """Write ``chunks`` to the binary file ``f`` in order and return ``(hex sha256, bytes)``
    of exactly the bytes written: each chunk is fed to the hash as it goes to the file (no
    re-read, no copy). The hash runs on a helper thread while the next chunk is written
    (``hashlib`` and file writes release the GIL on large buffers), at most ``ahead`` chunks
    behind; the chunks must stay unchanged until this returns."""
    h = hashlib.sha256()
    total = 0
    pending: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kfac-sha256") as pool:
        try:
            for chunk in chunks:
                n = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                if not n:
                    continue
                pending.append(pool.submit(h.update, chunk))  # one worker: hashed in order
                f.write(chunk)
                total += n
                while len(pending) > ahead:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
        finally:  # on an error, let the queued updates finish before the chunks go away
            for fut in pending:
                fut.cancel()
    return h.hexdigest(), total


# ---------------------------------------------------------------- chunked digests ------------


def set_hash_threads(n: int) -> None:
    """Hash chunks on ``n`` threads from now on (`HASH_THREADS`; default ``min(4, cores)``)."""
    global HASH_THREADS
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"hash threads: {n!r}; expected an integer ≥ 1")
    HASH_THREADS = n


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many chunk digests a file of ``size`` bytes has: ``ceil(size / chunk_bytes)``."""
    return -(-size // chunk_bytes)


def chunk_root(chunks: Iterable[str]) -> str:
    """The root over the hex chunk digests ``chunks``: the sha256 of their raw 32-byte values
    concatenated in order."""
    h = hashlib.sha256()
    for digest in chunks:
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


@dataclass(frozen=True)
class ChunkDigests:
    """A file's chunked digests: ``chunks[i]`` is the hex sha256 of its bytes
    ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` (the last chunk shorter), ``size`` its bytes,
    ``root`` the sha256 of the raw chunk digests concatenated (`chunk_root`)."""

    chunk_bytes: int
    chunks: tuple[str, ...]
    size: int

    @property
    def root(self) -> str:
        return chunk_root(self.chunks)


def _digest(parts: Sequence[memoryview]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def hash_chunked(pieces: Iterable[bytes | memoryview], *,
                 write: Callable[[memoryview], Any] | None = None,
                 chunk_bytes: int | None = None, threads: int | None = None) -> ChunkDigests:
    """The chunked digests of the byte stream ``pieces`` (buffers of any sizes, in order),
    each piece passed to ``write`` first when given (`write_chunk_hashed`). A chunk is hashed
    on a pool of ``threads`` (default `HASH_THREADS`) as soon as its last byte has arrived,
    from views of the pieces (no copy); at most ``threads + 1`` whole chunks are waiting or
    being hashed at a time (the pieces they span are referenced until then), so memory stays
    bounded by a few chunks. The pieces must stay unchanged until this returns.
    ``chunk_bytes``: default `HASH_CHUNK_BYTES`."""
    chunk_bytes = chunk_bytes or HASH_CHUNK_BYTES
    threads = threads or HASH_THREADS
    digests: list[str] = []
    pending: deque[Future] = deque()
    parts: list[memoryview] = []
    filled = total = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kfac-sha256") as pool:
        try:
            for piece in pieces:
                view = memoryview(piece).cast("B")
                n = view.nbytes
                if not n:
                    continue
                start = 0
                while start < n:
                    take = min(n - start, chunk_bytes - filled)
                    parts.append(view[start:start + take])
                    start += take
                    filled += take
                    if filled == chunk_bytes:
                        pending.append(pool.submit(_digest, parts))
                        parts, filled = [], 0
                if write is not None:
                    write(view)
                total += n
                while len(pending) > threads + 1:
                    digests.append(pending.popleft().result())
            if parts:
                pending.append(pool.submit(_digest, parts))
            while pending:
                digests.append(pending.popleft().result())
        finally:  # on an error, drop the queued chunks; the pool waits for the running ones
            for fut in pending:
                fut.cancel()
    return ChunkDigests(chunk_bytes, tuple(digests), total)


def write_chunk_hashed(f: BinaryIO, pieces: Iterable[bytes | memoryview],
                       chunk_bytes: int | None = None,
                       threads: int | None = None) -> ChunkDigests:
    """Write ``pieces`` to the binary file ``f`` in order and return the chunked digests of
    exactly the bytes written (`hash_chunked`: hashed in parallel as they go to the file, no
    re-read)."""
    return hash_chunked(pieces, write=f.write, chunk_bytes=chunk_bytes, threads=threads)


def file_chunk_digests(path: str, chunk_bytes: int | None = None,
                       threads: int | None = None) -> ChunkDigests:
    """The chunked digests of the file at ``path`` (read once, a chunk at a time)."""
    chunk_bytes = chunk_bytes or HASH_CHUNK_BYTES
    with open(path, "rb") as f:
        return hash_chunked(iter(lambda: f.read(chunk_bytes), b""), chunk_bytes=chunk_bytes,
                            threads=threads)


def read_verified(f: BinaryIO, size: int, chunks: Sequence[str], chunk_bytes: int, *,
                  name: str, key: str = "chunks", root: str | None = None,
                  threads: int | None = None) -> torch.Tensor:
    """The ``size`` bytes of the binary file ``f`` (read from its current position to its
    end) as a uint8 tensor, every chunk checked against its hex digest in ``chunks``.

    The buffer is allocated without zero-filling (``torch.empty``) and read into directly;
    each chunk is hashed on a pool of ``threads`` (default `HASH_THREADS`) while the next one
    is read. ``root``, when given, must be `chunk_root` of ``chunks`` (checked first).

    Raises:
        SnapshotError: naming ``name`` (the file) and ``key`` (where ``chunks`` come from):
            a chunk whose sha256 differs (its index and byte range), a file that ends before
            ``size`` bytes or goes on after them, a root that does not match.
        ValueError: ``len(chunks)`` is not ``chunk_count(size, chunk_bytes)``.
    """
    if len(chunks) != chunk_count(size, chunk_bytes):
        raise ValueError(f"{len(chunks)} chunk digests for {size} bytes in chunks of "
                         f"{chunk_bytes}; expected {chunk_count(size, chunk_bytes)}")
    if root is not None and chunk_root(chunks) != root:
        raise SnapshotError(f"{name}: the root over {key} is {chunk_root(chunks)}; expected "
                            f"{root}")
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    pending: deque[tuple[int, int, Future]] = deque()
    with ThreadPoolExecutor(max_workers=threads or HASH_THREADS,
                            thread_name_prefix="kfac-sha256") as pool:
        try:
            for start in range(0, size, chunk_bytes):
                part = view[start:start + chunk_bytes]
                _read_into(f, part, name)
                pending.append((start, len(part), pool.submit(_digest, (part,))))
                while pending and pending[0][2].done():
                    _check_chunk(pending.popleft(), chunks, chunk_bytes, name, key)
            if f.read(1):
                raise SnapshotError(f"{name}: changed size while being read (more than "
                                    f"{size} bytes); expected a file no one is writing")
            while pending:
                _check_chunk(pending.popleft(), chunks, chunk_bytes, name, key)
        finally:  # on an error, drop the queued chunks; the pool waits for the running ones
            for *_, fut in pending:
                fut.cancel()
    return buf


def _read_into(f: BinaryIO, part: memoryview, name: str) -> None:
    """Fill ``part`` from ``f``; `SnapshotError` if the file ends first."""
    n = 0
    while n < len(part):
        got = f.readinto(part[n:])
        if not got:
            raise SnapshotError(f"{name}: changed size while being read (it ended early); "
                                "expected a file no one is writing")
        n += got


def _check_chunk(item: tuple[int, int, Future], chunks: Sequence[str], chunk_bytes: int,
                 name: str, key: str) -> None:
    """The chunk at ``start`` (``n`` bytes) hashed as ``chunks`` says, else `SnapshotError`."""
    start, n, fut = item
    got, i = fut.result(), start // chunk_bytes
    if got != chunks[i]:
        raise SnapshotError(f"{name}: sha256 mismatch (file altered or truncated): chunk {i} "
                            f"(bytes {start} to {start + n}) hashes to {got}; expected "
                            f"{key}[{i}] = {chunks[i]}")


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a fsynced temporary file and a rename, then
    fsync the directory: a crash leaves the old file or the complete new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def local_path_problem(name: str) -> str | None:
    """Why ``name`` (a ``--model`` or ``--tokenizer``) can only be a local path that does not
    exist, or None (it exists, or it may be a hub name). Decided here, at once, because
    ``from_pretrained`` would ask the hub for it first (49 s of retries without a network):
    a name that starts like a path (``./``, ``../``, ``/``, ``~``), or ``org/name`` whose
    ``org`` is a directory here (``out/nomodel`` beside ``out/``)."""
    if os.path.exists(name):
        return None
    if name.startswith(("./", "../", "/", "~")) or name in (".", ".."):
        return "is a local path that does not exist"
    head = name.split("/", 1)[0]
    if "/" in name and os.path.isdir(head):
        return (f"does not exist ({head}/ is a directory here, so it is a local path, not a hub "
                "name)")
    return None
