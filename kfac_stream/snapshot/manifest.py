"""Checking a parsed snapshot manifest, and the tensors it implies.

The manifest's keys are the dataclasses of `kfac_stream.snapshot.manifest_types`; their
schema (`manifest_types.SCHEMA`: types, ranges, required keys) is generated from them, and
its rules are `kfac_stream.snapshot.schema`. `parse_json` (`manifest_json`) turns the bytes
of ``manifest.json`` into Python values; `validate_manifest` checks them against `SCHEMA`,
then checks that the manifest's parts agree (dims against ``d_in``/``d_out``, owners against
``world_size``, factor keys, shared-input groups, shard names), before any shard is opened.
`implied_tensors` lists every tensor the manifest implies, with dtype and shape, for the
reader to compare with each shard's header.

Every failure is a `SnapshotError` of the form::

    <file>: <key> is <value>; expected <what>
    <file>: <key> is missing; expected <what>

where ``<key>`` is a path into the document: ``step``, ``counts.tokens_seen``,
``layers['h.0.attn'].A.dim``, ``shards['shard-00000-of-00001.safetensors'].sha256``,
``shared_inputs[0][1]`` (`manifest_json.child_path`).

A shard entry with chunked digests (``chunk_bytes``, ``chunks``: one sha256 per
``chunk_bytes`` of the file, the last chunk shorter) must list exactly ``ceil(bytes /
chunk_bytes)`` of them, and its ``sha256`` is their root: the sha256 of the raw 32-byte chunk
digests concatenated in order (`kfac_stream.utils.files.chunk_root`, recomputed here). Without them,
``sha256`` is the whole file's (snapshots written before chunked digests; both forms load).

Keys the schema does not know are kept in ``Snapshot.meta`` but never used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..exceptions import SnapshotError
from ..utils.enums import StorageDtype
from ..utils.factor_keys import FACTOR_KINDS, factor_key, split_factor_key
from ..utils.files import chunk_count, chunk_root
from .layout import FORMAT_NAME, READ_VERSIONS
from .manifest_json import child_path, parse_json
from .manifest_types import SCHEMA, FactorEntry, Manifest, ShardEntry
from .schema import Ctx, show

__all__ = ["TensorSpec", "checked_manifest", "implied_tensors", "parse_json", "stored_key",
           "validate_manifest"]


def validate_manifest(meta: Any, file: str) -> dict[str, Any]:
    """``meta`` (a parsed manifest) if it satisfies `SCHEMA` and its parts agree; else
    `SnapshotError` naming ``file``, the key and what was expected."""
    checked_manifest(meta, file)
    return meta


def checked_manifest(meta: Any, file: str) -> Manifest:
    """`validate_manifest`, returning the manifest as a `Manifest`."""
    if not isinstance(meta, dict):
        raise SnapshotError(f"{file}: not a kfac_stream snapshot manifest: the document is "
                            f"{show(meta)}; expected an object")
    if meta.get("format") != FORMAT_NAME:
        raise SnapshotError(f"{file}: not a kfac_stream snapshot manifest: format is "
                            f"{show(meta.get('format'))}; expected {json.dumps(FORMAT_NAME)}")
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise SnapshotError(f"{file}: unknown format_version {show(version)} (this "
                            f"kfac_stream reads {' and '.join(map(str, READ_VERSIONS))})")
    ctx = Ctx(file)
    SCHEMA.check(meta, "", ctx)
    manifest = Manifest.from_json(meta)
    _check_agreement(manifest, ctx)
    return manifest


def stored_key(m: Manifest, layer: str, factor: str) -> str:
    """Key of the stored tensor of ``layer``'s ``factor`` in manifest ``m`` (a shared A: its
    group leader's)."""
    return getattr(m.layers[layer], factor).key


def _check_agreement(m: Manifest, ctx: Ctx) -> None:
    """The parts of a schema-valid manifest agree with each other."""
    file, world = ctx.file, m.world_size
    for name in ("bytes_per_rank", "eigh_flops_per_rank"):
        values = getattr(m.ownership, name)
        if len(values) != world:
            raise SnapshotError(f"{file}: ownership.{name} has {len(values)} items; expected "
                                f"world_size={world}")
    for sname, info in m.shards.items():
        if info.rank >= world:
            raise SnapshotError(f"{file}: shards[{sname!r}].rank is {info.rank}; expected "
                                f"a rank below world_size={world}")
        check_chunks(child_path("shards", sname, named=True), info, ctx)
    for name in m.weights or {}:
        if name not in m.layers:
            raise SnapshotError(f"{file}: weights[{name!r}] names no tracked layer; expected "
                                "a key of layers")
    by_key: dict[str, tuple[str, FactorEntry]] = {}
    for name, entry in m.layers.items():
        lpath = child_path("layers", name, named=True)
        want = {"A": (entry.d_in + entry.has_bias,
                      f"d_in={entry.d_in} and has_bias={show(entry.has_bias)}"),
                "G": (entry.d_out, f"d_out={entry.d_out}")}
        for factor in FACTOR_KINDS:
            f, fpath = getattr(entry, factor), f"{lpath}.{factor}"
            _check_factor(m, f, fpath, want[factor], ctx)
            _check_key(m, name, factor, fpath, ctx)
            if f.key in by_key:  # a shared A: every entry must describe the same tensor
                other, first = by_key[f.key]
                for attr in ("dim", "diagonal", "dtype", "owner", "shard"):
                    if getattr(f, attr) != getattr(first, attr):
                        raise SnapshotError(
                            f"{file}: {fpath}.{attr} is {show(getattr(f, attr))}; expected "
                            f"{show(getattr(first, attr))}, as {other}.{attr} (the same "
                            f"stored tensor {f.key!r})")
            else:
                by_key[f.key] = (fpath, f)
    _check_groups(m, ctx)


def check_chunks(spath: str, info: ShardEntry, ctx: Ctx) -> None:
    """A shard entry's chunked digests, if any, agree with its size and its sha256 (the root
    over them); ``spath``: the entry's key."""
    if (info.chunks is None) != (info.chunk_bytes is None):
        have, lack = ("chunks", "chunk_bytes") if info.chunk_bytes is None else (
            "chunk_bytes", "chunks")
        raise SnapshotError(f"{ctx.file}: {spath}.{lack} is missing; expected it with "
                            f"{spath}.{have} (chunked digests give both)")
    if info.chunks is None or info.chunk_bytes is None:
        return
    n, c = len(info.chunks), info.chunk_bytes
    if chunk_count(info.bytes, c) != n:
        raise SnapshotError(f"{ctx.file}: {spath}.bytes is {info.bytes}; expected "
                            f"{(n - 1) * c + 1} to {n * c}, as {spath}.chunks lists {n} "
                            f"chunk digest{'s' * (n != 1)} of {spath}.chunk_bytes={c} bytes "
                            "(the last chunk shorter)")
    root = chunk_root(info.chunks)
    if info.sha256 != root:
        raise SnapshotError(f"{ctx.file}: {spath}.sha256 is {show(info.sha256)}; expected "
                            f"{root}, the root over {spath}.chunks (the sha256 of the chunk "
                            "digests concatenated)")


def _check_factor(m: Manifest, f: FactorEntry, fpath: str, want: tuple[int, str],
                  ctx: Ctx) -> None:
    """A factor entry agrees with its layer's shape (``want``: its side and what says so),
    the storage dtype, the world size and the shards listed."""
    dim, says = want
    if f.dim != dim:
        raise SnapshotError(f"{ctx.file}: {fpath}.dim is {f.dim}; expected {dim}, as the "
                            f"manifest says {says}")
    if f.dtype != m.storage_dtype:
        raise SnapshotError(f"{ctx.file}: {fpath}.dtype is {show(f.dtype)}; expected "
                            f"{show(m.storage_dtype)}, the manifest's storage_dtype")
    if f.owner >= m.world_size:
        raise SnapshotError(f"{ctx.file}: {fpath}.owner is {f.owner}; expected a rank "
                            f"below world_size={m.world_size}")
    if f.shard not in m.shards:
        raise SnapshotError(f"{ctx.file}: {fpath}.shard is {show(f.shard)}; expected one of "
                            f"the files listed in shards ({', '.join(map(repr, m.shards))})")


def _check_key(m: Manifest, name: str, factor: str, fpath: str, ctx: Ctx) -> None:
    """G is stored under the layer's own key, A under its own or under the A key of the
    leader of its shared-input group (which stores it under its own)."""
    key = getattr(m.layers[name], factor).key
    own = factor_key(name, factor)  # type: ignore[arg-type]
    try:
        layer, kind = split_factor_key(key)
    except ValueError:
        layer, kind = "", ""
    if kind != factor or layer not in m.layers or (factor == "G" and key != own):
        allowed = (f"{own!r}" if factor == "G" else
                   f"{own!r} or the A key of another tracked layer (a shared input)")
        raise SnapshotError(f"{ctx.file}: {fpath}.key is {show(key)}; expected {allowed}")
    if key != own:
        leader_key = m.layers[layer].A.key
        if leader_key != key:
            raise SnapshotError(f"{ctx.file}: {fpath}.key is {show(key)}, but "
                                f"layers[{layer!r}].A.key is {show(leader_key)}; expected the "
                                "key the group leader stores its own A under")
        if not any(g[0] == layer and name in g for g in m.shared_inputs):
            raise SnapshotError(f"{ctx.file}: {fpath}.key is {show(key)}; expected {own!r}, "
                                f"as shared_inputs has no group led by {layer!r} with "
                                f"{name!r}")


def _check_groups(m: Manifest, ctx: Ctx) -> None:
    """Each shared-input group names tracked layers, each in one group only, all storing A
    under the first member's key."""
    seen: set[str] = set()
    for i, group in enumerate(m.shared_inputs):
        lead = factor_key(group[0], "A")
        for j, name in enumerate(group):
            path = f"shared_inputs[{i}][{j}]"
            if name not in m.layers:
                raise SnapshotError(f"{ctx.file}: {path} is {show(name)}; expected the name "
                                    "of a tracked layer (a key of layers)")
            if name in seen:
                raise SnapshotError(f"{ctx.file}: {path} is {show(name)}, already in another "
                                    "group; expected each layer in one group at most")
            seen.add(name)
            key = m.layers[name].A.key
            if key != lead:
                raise SnapshotError(f"{ctx.file}: layers[{name!r}].A.key is {show(key)}; "
                                    f"expected {lead!r}, as {path} puts it in the group led "
                                    f"by {group[0]!r}")


# ---------------------------------------------------------------- implied tensors -----------


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a valid manifest implies: dtype (torch name, ``"float16"``), shape, the shard
    file it must be in and the manifest key that implies it (for messages)."""

    dtype: str
    shape: tuple[int, ...]
    shard: str
    source: str

    @property
    def nbytes(self) -> int:
        """Size of its data in bytes."""
        return math.prod(self.shape) * {"float16": 2, "float32": 4, "float64": 8}[self.dtype]


def decomposed(m: Manifest) -> bool:
    """Whether the snapshot's shards hold its eigendecomposition (format 2: always; format 3:
    as its ``eigen`` entry says)."""
    return m.eigen is None or m.eigen.in_run


def eigen_tensors(key: str, d: int, diagonal: bool, wide: str, shard: str, src: str
                  ) -> dict[str, TensorSpec]:
    """``K.eigvals`` ``[d]`` and, dense, ``K.eigvecs`` ``[d, d]`` of stored factor ``key``."""
    out = {f"{key}.eigvals": TensorSpec(wide, (d,), shard, f"{src}.dim")}
    if not diagonal:
        out[f"{key}.eigvecs"] = TensorSpec(wide, (d, d), shard, f"{src}.dim")
    return out


def wide_dtype_name(m: Manifest) -> str:
    """The eigen tensors' dtype name: float32 (float64 for float64 storage)."""
    return str(StorageDtype(m.storage_dtype).wide_dtype).removeprefix("torch.")


def implied_tensors(m: Manifest) -> dict[str, TensorSpec]:
    """Every tensor the (checked) manifest implies, by name: per stored factor key ``K``,
    ``K`` (``[d, d]`` or ``[d]`` diagonal, in the factor's dtype), ``K.scale`` (float32
    ``[1]``), ``K.eigvals`` (``[d]``) and, for a dense factor, ``K.eigvecs`` (``[d, d]``), the
    eigen tensors in float32 (float64 for float64 storage); per layer with an ``ekfac`` entry,
    ``<layer>.ekfac`` (``[d_out, d_A]``, in that dtype, in its G factor's shard)."""
    wide = wide_dtype_name(m)
    out: dict[str, TensorSpec] = {}
    for name, entry in m.layers.items():
        for factor in FACTOR_KINDS:
            f = getattr(entry, factor)
            if f.key in out:
                continue
            src = f"{child_path('layers', name, named=True)}.{factor}"
            d, key = f.dim, f.key
            out[key] = TensorSpec(f.dtype, (d,) if f.diagonal else (d, d), f.shard,
                                  f"{src}.dim/.diagonal/.dtype")
            out[f"{key}.scale"] = TensorSpec("float32", (1,), f.shard, src)
            if decomposed(m):
                out.update(eigen_tensors(key, d, f.diagonal, wide, f.shard, src))
        if entry.ekfac is not None:
            src = f"{child_path('layers', name, named=True)}.ekfac"
            out[f"{name}.ekfac"] = TensorSpec(wide, (entry.G.dim, entry.A.dim), entry.G.shard,
                                              src)
    return out
