"""File helpers. Durable writes: what survives a crash is either the old file or the whole new
one. `local_path_problem`: a model path that can only be local, checked before any hub request."""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO


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
