"""A shard's chunked digests as the snapshot format defines them, computed here with hashlib
only (not with kfac_stream's own helpers), for the snapshot tests: one sha256 per
``chunk_bytes`` of the file (the last chunk shorter) and the root, the sha256 of the raw
32-byte chunk digests concatenated in order."""

import hashlib


def root_of(chunks: list[str]) -> str:
    return hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()


def chunked(data: bytes, chunk_bytes: int) -> dict:
    """The shard entry's digest keys of ``data``: ``sha256`` (the root), ``bytes``,
    ``chunk_bytes``, ``chunks``."""
    chunks = [hashlib.sha256(data[i:i + chunk_bytes]).hexdigest()
              for i in range(0, len(data), chunk_bytes)]
    return {"sha256": root_of(chunks), "bytes": len(data), "chunk_bytes": chunk_bytes,
            "chunks": chunks}
