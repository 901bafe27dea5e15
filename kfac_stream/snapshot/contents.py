"""What goes into a snapshot: the owned factors as shard tensors and the manifest fields."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ..stats.spectrum import safe_psd_eigh, spectrum_stats
from .layout import FORMAT_NAME, FORMAT_VERSION, layer_fingerprint


def snapshot_contents(tracker, step: int, epoch: float | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Shard tensors and manifest (without ``shards``) for ``tracker``'s owned factors.

    Cheap (copies of the stored factors), so it runs on the training thread; the expensive
    part, `add_eigendecompositions`, works on these copies only and can run anywhere.

    Args:
        tracker: A `kfac_stream.tracker.Tracker` (flushed here).
        step: Optimizer step.
        epoch: Trainer epoch (fractional), recorded for the data-size estimate.
    """
    tracker.flush()
    cfg = tracker.config
    tensors: dict[str, torch.Tensor] = {}
    for key, f in tracker.store.factors.items():
        tensors[key] = f.data.clone()
        tensors[f"{key}.scale"] = torch.tensor([f.scale], dtype=torch.float32)
    layers: dict[str, Any] = {}
    for name, spec in tracker.specs.items():
        entry: dict[str, Any] = {"kind": spec.kind, "d_in": spec.d_in, "d_out": spec.d_out,
                                 "has_bias": spec.has_bias}
        for factor in ("A", "G"):
            key = f"{name}.{factor}"
            f = tracker.store.factors[key]
            entry[factor] = {"dim": int(f.data.shape[0]), "diagonal": f.diagonal,
                             "owner": tracker.ownership.owner[key], "weight": f.weight,
                             "updates": f.updates, "positions": f.positions,
                             "dtype": str(f.data.dtype).removeprefix("torch.")}
        layers[name] = entry
    counters = dataclasses.asdict(tracker.counters)
    counters.pop("skipped_steps", None)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "epoch": epoch,
        "created_unix": time.time(),
        "world_size": tracker.world_size,
        "fisher": cfg.fisher,
        "ema_decay": cfg.ema_decay,
        "token_fraction": cfg.token_fraction,
        "update_every": cfg.update_every,
        "storage_dtype": cfg.storage_dtype,
        "config": cfg.to_dict(),
        "counts": counters,
        "skipped_steps": list(tracker.counters.skipped_steps),
        "fingerprint": layer_fingerprint(
            {n: (s.d_in, s.d_out, s.has_bias) for n, s in tracker.specs.items()}),
        "layers": layers,
    }
    return tensors, manifest


def add_eigendecompositions(tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
    """Add ``<key>.eigvals`` / ``<key>.eigvecs`` and per-factor spectrum statistics, in place.

    Each factor is decomposed as stored (dequantised, so the eigenbasis is that of exactly the
    matrix in the shard) with `safe_psd_eigh` in float64, and kept in float32 (float64 for
    float64 storage); diagonal factors get eigenvalues only.
    """
    eig_dtype = torch.float64 if manifest["storage_dtype"] == "float64" else torch.float32
    for name, entry in manifest["layers"].items():
        for factor in ("A", "G"):
            key = f"{name}.{factor}"
            if key not in tensors:  # owned by another rank
                continue
            data = tensors[key]
            value = data.double() * float(tensors[f"{key}.scale"])
            eigvals, eigvecs = safe_psd_eigh(value)
            tensors[f"{key}.eigvals"] = eigvals.to(eig_dtype)
            if eigvecs is not None:
                tensors[f"{key}.eigvecs"] = eigvecs.to(eig_dtype)
            entry[factor]["spectrum"] = spectrum_stats(eigvals)
