"""`Snapshot`: load and verify a snapshot directory (JSON + safetensors only: nothing on this
path can execute code from a file; tests/unit/snapshot/test_snapshot.py and
tests/unit/snapshot/test_snapshot_fuzz.py check it).

``Snapshot.load(path)``:

1. opens the directory once (a symlink given as ``path`` is resolved there, once); every file
   is then opened relative to that directory by its plain name without following symlinks,
   and must be a regular file: a symlink (to anywhere, also inside), FIFO, device or
   directory in its place is refused before it is opened;
2. reads ``manifest.json`` (at most `layout.MAX_MANIFEST_BYTES`) and checks it against the
   schema, `manifest.validate_manifest`, before any shard is opened (the checked manifest is
   read as a `manifest_types.Manifest`, ``Snapshot.manifest``; ``meta`` keeps the JSON
   dict);
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

import os
import threading
from typing import Any

import torch

from ..exceptions import SnapshotError
from ..utils.factor_keys import FACTOR_KINDS
from ..utils.progress import progress
from .layout import (
    STEP_DIR_RE,
    where_snapshots_are,
)
from .manifest import decomposed, implied_tensors
from .manifest_types import LayerEntry, Manifest, to_json
from .reading import SnapshotDir, check_values, read_manifest_in, read_shard


class LayerFactors:
    """Factors of one tracked layer.

    Attributes:
        name: Module name.
        A: ``[d_in(+1), d_in(+1)]`` dense or ``[d_in(+1)]`` diagonal; float32 (float64 if
            stored so). The trailing row/column is the bias when ``has_bias``. Dequantised
            from the stored tensor at its first access and kept (an A several layers share:
            once for all of them); `Snapshot.load` makes no float copy.
        G: ``[d_out, d_out]`` dense or ``[d_out]`` diagonal (as ``A``).
        entry: The layer's manifest entry (`manifest_types.LayerEntry`: shape, factors'
            keys and statistics, EK-FAC origin).
        meta: The same entry as its JSON dict (what the file holds).
        A_eigvals: ``[d_A]`` eigenvalues of A (ascending, ≥ 0).
        A_eigvecs: ``[d_A, d_A]`` orthonormal eigenvectors (columns), None if A is diagonal.
        G_eigvals: ``[d_out]``.
        G_eigvecs: ``[d_out, d_out]`` or None.
        ekfac_eigvals: ``[d_out, d_A]`` EK-FAC eigenvalues (`kfac_stream.ekfac`): the
            per-sequence gradients' second moment in the previous snapshot's eigenbasis, on
            the scale of ``outer(G_eigvals, A_eigvals)``; None when the snapshot has none
            (``KFACConfig(ekfac=False)``, the first snapshot of a run).

    ``A`` and ``G`` may be given as tensors or as zero-argument callables returning one (called
    once, at the first access). The eigen attributes of a snapshot whose eigendecomposition
    was deferred are computed (or read from its cache) at the first access of any of them
    (`Snapshot.eigen`).
    """

    __slots__ = ("name", "_A", "_G", "entry", "meta", "_eigen", "_deferred", "_keys",
                 "ekfac_eigvals")

    def __init__(self, name: str, A: Any, G: Any, entry: LayerEntry,
                 A_eigvals: torch.Tensor | None = None, A_eigvecs: torch.Tensor | None = None,
                 G_eigvals: torch.Tensor | None = None,
                 G_eigvecs: torch.Tensor | None = None,
                 ekfac_eigvals: torch.Tensor | None = None,
                 deferred: Any = None, keys: dict[str, str] | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        self.name, self._A, self._G, self.entry = name, A, G, entry
        self.meta = to_json(entry) if meta is None else meta
        self._eigen = {"A_eigvals": A_eigvals, "A_eigvecs": A_eigvecs,
                       "G_eigvals": G_eigvals, "G_eigvecs": G_eigvecs}
        # a deferred eigendecomposition: ``deferred()`` gives {"<key>.eigvals": ...} (once
        # computed or read from its cache, `Snapshot.eigen`), ``keys`` the stored keys
        self._deferred, self._keys = deferred, keys or {}
        self.ekfac_eigvals = ekfac_eigvals

    def _eig(self, part: str) -> torch.Tensor | None:
        value = self._eigen[part]
        if value is None and self._deferred is not None:
            factor, what = part.split("_")
            value = self._eigen[part] = self._deferred().get(f"{self._keys[factor]}.{what}")
        return value

    A_eigvals = property(lambda self: self._eig("A_eigvals"), doc="See the class docstring.")
    A_eigvecs = property(lambda self: self._eig("A_eigvecs"), doc="See the class docstring.")
    G_eigvals = property(lambda self: self._eig("G_eigvals"), doc="See the class docstring.")
    G_eigvecs = property(lambda self: self._eig("G_eigvecs"), doc="See the class docstring.")

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
        return bool(self.entry.has_bias)

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
    """A snapshot's layers by name at its ``step``: ``layer_names``, ``step``, ``view[name]``
    (`Snapshot` with the factors and the manifest, `kfac_stream.snapshot.media.Spectra` with
    eigenvalues only)."""

    def __init__(self, path: str, step: int, layers: dict[str, Any]):
        self.path = path
        self._step = int(step)
        self._layers = layers

    @property
    def layer_names(self) -> list[str]:
        """Tracked module names, sorted by name (as the manifest lists them)."""
        return list(self._layers)

    @property
    def step(self) -> int:
        """Optimizer step of the snapshot."""
        return self._step

    def __getitem__(self, name: str):
        try:
            return self._layers[name]
        except KeyError:
            raise KeyError(f"layer {name!r} is not in snapshot {self.path}") from None


class Snapshot(LayerView):
    """A verified, immutable snapshot: ``snap.manifest``, ``snap.layer_names``, ``snap[name]``.

    ``manifest``: the checked ``manifest.json`` as a `manifest_types.Manifest` (what the
    package reads); ``meta``: the same document as its JSON dict, as parsed (keys this version
    does not know included). ``layers``: `LayerFactors` by module name, as the manifest lists
    them. Made by `load` and `latest`; one built by hand holds what it is given (its
    eigendecomposition is never deferred).

    ``eigen_source``: what computes or reads a deferred eigendecomposition (`eigen`), set by
    `kfac_stream.snapshot.eigen_sidecar` (the package imports it; it writes with the writer,
    which reads snapshots: it cannot be imported from here).
    """

    eigen_source: Any = None

    def __init__(self, path: str, manifest: Manifest, layers: dict[str, LayerFactors],
                 meta: dict[str, Any] | None = None):
        super().__init__(path, manifest.step, layers)
        self.manifest = manifest
        self.meta = manifest.to_json() if meta is None else meta
        # the stored tensors of a deferred eigendecomposition (`load`; None: built by hand)
        self._stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._eigen_tensors: dict[str, torch.Tensor] | None = None
        self.eigen_record = None
        self._eigen_lock = threading.Lock()

    @property
    def heldout_prior(self):
        """The prior precision fitted on held-out data and stored beside this snapshot
        (`kfac_stream.snapshot.heldout_prior.HeldoutPrior`: ``.tau``, ``.nll``, ...; written
        with ``HeldoutConfig(prior_precision=True)``), or None."""
        from .heldout_prior import read_heldout_prior

        return read_heldout_prior(self.path)

    @property
    def answer_tokens(self) -> tuple[int, ...] | None:
        """The answer options' token ids (``HeldoutConfig.answer_tokens``, resolved at train
        begin), or None when the run set none: the default ``token_ids`` of a language-model
        head's queries and the CLI's ``--options``."""
        answers = self.manifest.answer_tokens
        return None if answers is None else tuple(int(i) for i in answers.ids)

    @property
    def answer_texts(self) -> tuple[str, ...] | None:
        """The answer options as text (as given, or decoded), or None."""
        answers = self.manifest.answer_tokens
        return None if answers is None or answers.texts is None else tuple(answers.texts)

    @property
    def weights_step(self) -> int | None:
        """The step whose weights this snapshot's fingerprint (``weights``) and held-out fit
        describe: its own ``step``, or, where the Trainer reloaded the best checkpoint before
        the final snapshot (``load_best_model_at_end``; the manifest's ``weights_from``), that
        checkpoint's step (None if unknown). The factors run to ``step`` either way."""
        origin = self.manifest.weights_from
        return self.step if origin is None else origin.step

    def __len__(self) -> int:
        return len(self._layers)

    def __repr__(self) -> str:
        return f"Snapshot({self.path!r}, step={self.step}, layers={len(self)})"

    @property
    def in_run_eigen(self) -> bool:
        """Whether the snapshot was eigendecomposed in the run (its shards hold the
        eigenvalues and eigenvectors; a hand-built one holds what it was given); False:
        deferred to its first use (`eigen`)."""
        return self._stored is None or decomposed(self.manifest)

    def eigen(self, device: torch.device | str | None = "auto",
              threads: int | None = None) -> dict[str, torch.Tensor]:
        """A deferred eigendecomposition, ``{"<key>.eigvals": [d], "<key>.eigvecs": [d, d]}``:
        read from its cache or computed (on ``device``: ``"auto"`` the GPU if there is one,
        else the CPU in float64) and cached (`kfac_stream.snapshot.eigen_sidecar`); once per
        `Snapshot`. The layers' eigen attributes call it at their first access. Empty for a
        snapshot eigendecomposed in the run."""
        if self.in_run_eigen:
            return {}
        with self._eigen_lock:
            if self._eigen_tensors is None:
                if device == "auto":
                    device = "cuda" if torch.cuda.is_available() else None
                self._eigen_tensors, self.eigen_record = Snapshot.eigen_source(
                    self.path, self.manifest, self._stored, device, threads)
        return self._eigen_tensors

    @classmethod
    def load(cls, path: str | os.PathLike, show_progress: bool | None = None,
             eigen: bool = False) -> Snapshot:
        """Load and verify a snapshot directory (the steps in the module docstring).

        A progress bar counts the shard bytes read and verified (``show_progress`` as in
        `kfac_stream.utils.progress`: by default on a terminal only); a 7B model's snapshot is
        several GB. ``eigen``: a snapshot whose eigendecomposition was deferred is
        decomposed now (or its cache read: `eigen`), not at the first access of an
        eigenvalue.

        Raises:
            SnapshotError: missing, invalid or oversized manifest, unknown format version, a
                manifest key of the wrong type or range, a symlink or non-regular file, a
                missing or altered shard, a tensor whose dtype or shape differs from the
                manifest, non-finite values.
        """
        path = _path_arg(path, "Snapshot.load", "path")
        with SnapshotDir(path) as d:
            meta, manifest = read_manifest_in(d)
            implied = implied_tensors(manifest)
            tensors: dict[str, torch.Tensor] = {}
            origin: dict[str, str] = {}  # tensor name -> shard path, for messages
            total = sum(info.bytes for info in manifest.shards.values())
            with progress(total=total, desc=f"loading snapshot {os.path.basename(path)}",
                          unit="B", unit_scale=True, unit_divisor=1024,
                          show=show_progress) as bar:
                for fname, info in manifest.shards.items():
                    found = read_shard(d, fname, info, implied)
                    tensors.update(found)
                    origin.update(dict.fromkeys(found, os.path.join(path, fname)))
                    bar.update(info.bytes)
        for name, spec in implied.items():
            if name not in tensors:
                raise SnapshotError(f"{path}: tensor {name!r} is missing from shard "
                                    f"{spec.shard!r}; expected it, as the manifest says "
                                    f"({spec.source})")
        check_values(tensors, origin)
        snap = cls(path, manifest, {}, meta)
        snap._stored = {spec_key: (tensors[spec_key], tensors[f"{spec_key}.scale"])
                        for spec_key in implied if f"{spec_key}.scale" in implied}
        snap._layers = _layers(manifest, meta, tensors,
                               None if decomposed(manifest) else snap.eigen)
        if eigen:
            snap.eigen()
        return snap

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
        if not steps:  # a run directory, a model folder: where the snapshots are
            detail += where_snapshots_are(root)
        raise SnapshotError(f"{root}: no complete snapshot found{detail}")


def _layers(manifest: Manifest, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
            deferred=None) -> dict[str, LayerFactors]:
    """Every layer's `LayerFactors` from the verified ``tensors`` (``meta``: the manifest's
    JSON dict, whose layer entries the layers keep as theirs; ``deferred``: the eigendecomposition's
    provider when the shards hold none)."""
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
            eigen[f"{factor}_eigvals"] = tensors.get(f"{key}.eigvals")
            eigen[f"{factor}_eigvecs"] = tensors.get(f"{key}.eigvecs")
        keys = {f: getattr(entry, f).key for f in FACTOR_KINDS}
        layers[name] = LayerFactors(name, parts["A"], parts["G"], entry,
                                    ekfac_eigvals=tensors.get(f"{name}.ekfac"),
                                    deferred=deferred, keys=keys, meta=meta["layers"][name],
                                    **eigen)
    return layers


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The checked ``manifest.json`` of a snapshot directory (schema and agreement, see
    `manifest.validate_manifest`) without reading the shards, as a `Manifest`; raises
    `SnapshotError` like `Snapshot.load`."""
    path = _path_arg(path, "read_manifest", "path")
    with SnapshotDir(path) as d:
        return read_manifest_in(d)[1]


def read_manifest_json(path: str | os.PathLike) -> dict[str, Any]:
    """`read_manifest` as the file's JSON dict (keys this version does not know included):
    for rewriting the file."""
    path = _path_arg(path, "read_manifest_json", "path")
    with SnapshotDir(path) as d:
        return read_manifest_in(d)[0]


def _path_arg(value: Any, func: str, name: str) -> str:
    """``value`` as a path string; `SnapshotError` naming the argument if it is not one (as
    every error kfac_stream raises on purpose, it derives from `KFACStreamError`)."""
    if isinstance(value, str) or (isinstance(value, os.PathLike)
                                  and isinstance(os.fspath(value), str)):
        return os.fspath(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise SnapshotError(f"{func}: {name}={shown} is not allowed: must be a str or "
                        "os.PathLike naming a snapshot directory")
