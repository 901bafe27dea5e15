"""`Snapshot`: load and verify a snapshot directory (JSON + safetensors only: nothing on this
path can execute code from a file; tests/test_snapshot.py checks it).

``Snapshot.load(path)`` checks the manifest (JSON, format name and version), that every shard
listed exists and matches its sha256, and that every tensor has the shape the manifest states;
anything else raises `SnapshotError` naming the path and the reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from ..exceptions import SnapshotError
from ..factor_keys import FACTOR_KINDS, factor_key
from .layout import FORMAT_NAME, MANIFEST, READABLE_VERSIONS, STEP_DIR_RE, sha256_file


@dataclass(frozen=True)
class LayerFactors:
    """Factors of one tracked layer.

    Attributes:
        name: Module name.
        A: ``[d_in(+1), d_in(+1)]`` dense or ``[d_in(+1)]`` diagonal; float32 (float64 if
            stored so). The trailing row/column is the bias when ``has_bias``.
        G: ``[d_out, d_out]`` dense or ``[d_out]`` diagonal.
        meta: The layer's manifest entry.
        A_eigvals: ``[d_A]`` eigenvalues of A (ascending, ≥ 0).
        A_eigvecs: ``[d_A, d_A]`` orthonormal eigenvectors (columns), None if A is diagonal.
        G_eigvals: ``[d_out]``.
        G_eigvecs: ``[d_out, d_out]`` or None.
    """

    name: str
    A: torch.Tensor
    G: torch.Tensor
    meta: dict[str, Any]
    A_eigvals: torch.Tensor | None = None
    A_eigvecs: torch.Tensor | None = None
    G_eigvals: torch.Tensor | None = None
    G_eigvecs: torch.Tensor | None = None

    @property
    def has_bias(self) -> bool:
        """Whether ``A`` includes the bias row/column."""
        return bool(self.meta["has_bias"])


class Snapshot:
    """A verified, immutable snapshot: ``snap.meta``, ``snap.layer_names``, ``snap[name]``."""

    def __init__(self, path: str, meta: dict[str, Any], layers: dict[str, LayerFactors]):
        self.path = path
        self.meta = meta
        self._layers = layers

    @property
    def layer_names(self) -> list[str]:
        """Tracked module names, in model order."""
        return list(self._layers)

    @property
    def step(self) -> int:
        """Optimizer step of the snapshot."""
        return int(self.meta["step"])

    def __getitem__(self, name: str) -> LayerFactors:
        try:
            return self._layers[name]
        except KeyError:
            raise KeyError(f"layer {name!r} is not in snapshot {self.path}") from None

    def __len__(self) -> int:
        return len(self._layers)

    def __repr__(self) -> str:
        return f"Snapshot({self.path!r}, step={self.step}, layers={len(self)})"

    @classmethod
    def load(cls, path: str | os.PathLike) -> Snapshot:
        """Load and verify a snapshot directory.

        Raises:
            SnapshotError: missing/invalid manifest, unknown format version, missing or
                altered shard, or a tensor whose shape differs from the manifest.
        """
        path = os.fspath(path)
        meta = read_manifest(path)
        tensors: dict[str, torch.Tensor] = {}
        for fname, info in meta["shards"].items():
            fpath = os.path.join(path, fname)
            if os.path.basename(fname) != fname or not os.path.isfile(fpath):
                raise SnapshotError(f"{path}: shard {fname!r} listed in the manifest is missing")
            digest = sha256_file(fpath)
            if digest != info.get("sha256"):
                raise SnapshotError(f"{fpath}: sha256 mismatch (file altered or truncated)")
            try:
                with safe_open(fpath, framework="pt") as f:
                    for key in f.keys():
                        tensors[key] = f.get_tensor(key)
            except Exception as e:  # safetensors raises its own error types
                raise SnapshotError(f"{fpath}: not a readable safetensors file ({e})") from None
        layers = {}
        values: dict[str, torch.Tensor] = {}  # dequantised once per stored key (a shared A)
        for name, info in meta["layers"].items():
            parts = {}
            for factor in FACTOR_KINDS:
                finfo = info[factor]
                key = finfo.get("key", factor_key(name, factor))  # format 2: a shared A's key
                if not isinstance(key, str):
                    raise SnapshotError(f"{path}: layer {name!r} factor {factor} has a "
                                        f"non-string key {key!r}")
                if key not in tensors or f"{key}.scale" not in tensors:
                    raise SnapshotError(f"{path}: tensor {key!r} is missing from the shards")
                data = tensors[key]
                d = int(finfo["dim"])
                want = (d,) if finfo["diagonal"] else (d, d)
                if tuple(data.shape) != want:
                    raise SnapshotError(f"{path}: tensor {key!r} has shape {tuple(data.shape)}, "
                                        f"manifest says {want}")
                out = torch.float64 if data.dtype == torch.float64 else torch.float32
                if key not in values:
                    values[key] = data.to(out) * tensors[f"{key}.scale"].to(out)
                parts[factor] = values[key]
                vals, vecs = tensors.get(f"{key}.eigvals"), tensors.get(f"{key}.eigvecs")
                if vals is None or tuple(vals.shape) != (d,) or (
                        not finfo["diagonal"] and (vecs is None or tuple(vecs.shape) != (d, d))):
                    raise SnapshotError(f"{path}: eigendecomposition of {key!r} is missing or "
                                        f"has the wrong shape (manifest says d={d})")
                parts[f"{factor}_eigvals"], parts[f"{factor}_eigvecs"] = vals, vecs
            layers[name] = LayerFactors(name, parts["A"], parts["G"], info,
                                        parts["A_eigvals"], parts["A_eigvecs"],
                                        parts["G_eigvals"], parts["G_eigvecs"])
        return cls(path, meta, layers)

    @classmethod
    def latest(cls, root: str | os.PathLike) -> Snapshot:
        """The newest snapshot under ``root`` that loads and verifies; incomplete or altered
        ones are skipped (with a warning)."""
        root = os.fspath(root)
        steps = sorted((e for e in (os.listdir(root) if os.path.isdir(root) else [])
                        if STEP_DIR_RE.match(e)), reverse=True)
        errors = []
        for entry in steps:
            try:
                return cls.load(os.path.join(root, entry))
            except SnapshotError as e:
                errors.append(str(e))
        detail = f"; skipped: {'; '.join(errors)}" if errors else ""
        raise SnapshotError(f"{root}: no complete snapshot found{detail}")


def read_manifest(path: str) -> dict[str, Any]:
    """The checked ``manifest.json`` of a snapshot directory (format, version, required fields)
    without reading the shards; raises `SnapshotError` like `Snapshot.load`."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise SnapshotError(f"{path}: not a directory")
    if not os.path.isfile(mpath):
        raise SnapshotError(f"{mpath}: missing (snapshot incomplete)")
    try:
        with open(mpath) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SnapshotError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise SnapshotError(f"{mpath}: not a kfac_stream snapshot manifest")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise SnapshotError(f"{mpath}: unknown format_version {meta.get('format_version')!r} "
                            f"(this kfac_stream reads {', '.join(map(str, READABLE_VERSIONS))})")
    for key in ("step", "layers", "shards"):
        if key not in meta:
            raise SnapshotError(f"{mpath}: field {key!r} is missing")
    return meta
