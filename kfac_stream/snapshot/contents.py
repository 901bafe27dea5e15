"""What goes into a snapshot: the owned factors as shard tensors and the manifest fields."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

import torch

from ..factor_keys import FACTOR_KINDS
from .layout import FORMAT_NAME, FORMAT_VERSION, layer_fingerprint, shard_name


def snapshot_contents(record, step: int, epoch: float | None = None, ekfac=None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Shard tensors and manifest part (without ``shards``) for a tracker's owned factors.

    With several ranks each rank makes its part; `merge_manifests` combines them.

    Cheap (copies of the stored factors), so it runs on the training thread; the expensive
    part, the eigendecompositions (`kfac_stream.snapshot.eigen_stream`), works on these
    copies only and can run anywhere.

    Args:
        record: A `kfac_stream.tracker.TrackerRecord` with factors (``Tracker.export()``); its
            factor tensors become the shard's (not copied again).
        step: Optimizer step.
        epoch: Trainer epoch (fractional), recorded for the data-size estimate.
        ekfac: ``({layer: λ [d_out, d_A]}, {layer: entry})``, the EK-FAC correction
            (`kfac_stream.tracker.Tracker.take_ekfac`): tensor ``<layer>.ekfac`` in the shard
            of the layer's G factor and ``layers[<layer>]["ekfac"]`` in the manifest (basis
            step, update steps, ``N``); None or empty: neither (the snapshot is as without
            EK-FAC).
    """
    cfg = record.config
    tensors: dict[str, torch.Tensor] = {}
    for key, f in record.factors.items():
        tensors[key] = f.data
        tensors[f"{key}.scale"] = torch.tensor([f.scale], dtype=torch.float32)
    layers: dict[str, Any] = {}
    world = record.world_size
    for name, spec in record.specs.items():
        entry: dict[str, Any] = {"kind": spec.kind, "d_in": spec.d_in, "d_out": spec.d_out,
                                 "has_bias": spec.has_bias}
        if record.row_space.get(name) == "sequence":  # a pooler / head: N counts sequences
            entry["rows"] = "sequence"
        for factor, key in zip(FACTOR_KINDS, record.plan.keys_of(name)):
            dim, diagonal = record.dims[key]
            owner = record.ownership.owner[key]
            entry[factor] = {"key": key, "dim": dim, "diagonal": diagonal, "owner": owner,
                             "shard": shard_name(owner, world)}
            f = record.factors.get(key)
            if f is not None:  # owned here; other ranks' parts fill in theirs (merge)
                entry[factor].update({"weight": f.weight, "updates": f.updates,
                                      "positions": f.positions,
                                      "dtype": str(f.data.dtype).removeprefix("torch.")})
                rel_se, k_eff = f.sampling_error()
                if not math.isnan(rel_se):  # not recorded (a state from an older version)
                    entry[factor]["sampling"] = {"rel_se": rel_se, "effective_updates": k_eff}
        if ekfac is not None and name in ekfac[1]:
            tensors[f"{name}.ekfac"] = ekfac[0][name]
            entry["ekfac"] = dict(ekfac[1][name])
        layers[name] = entry
    counters = dataclasses.asdict(record.counters)
    counters.pop("skipped_steps", None)
    counters["comm_bytes"] = [counters["comm_bytes"]]  # per rank, filled in by the merge
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "epoch": epoch,
        "created_unix": time.time(),
        "world_size": world,
        "rank": record.rank,
        "ownership": {"bytes_per_rank": list(record.ownership.bytes_per_rank),
                      "eigh_flops_per_rank": list(record.ownership.eigh_flops_per_rank)},
        "fisher": cfg.fisher,
        "ema_decay": cfg.ema_decay,
        "token_fraction": cfg.token_fraction,
        "update_every": cfg.update_every,
        "storage_dtype": cfg.storage_dtype,
        "config": cfg.to_dict(),
        "counts": counters,
        "skipped_steps": list(record.counters.skipped_steps),
        "shared_inputs": record.plan.describe(),
        **({"run_id": record.run_id} if record.run_id else {}),
        **({"answer_tokens": dict(record.answer_tokens)} if record.answer_tokens else {}),
        "fingerprint": layer_fingerprint(
            {n: (s.d_in, s.d_out, s.has_bias) for n, s in record.specs.items()}),
        "layers": layers,
    }
    return tensors, manifest


def merge_manifests(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One manifest from every rank's part (rank order), as rank 0 writes it.

    Each factor's statistics (weight, updates, positions, dtype, spectrum) come from its
    owner's part; ``tokens_seen`` and ``sequences_seen`` (counted per rank) are summed;
    ``tracker_seconds``, ``exchange_seconds`` and ``fold_seconds`` are the slowest rank's;
    ``comm_bytes`` lists every rank's. Everything else is the same on all ranks and is taken
    from rank 0.
    """
    out = json.loads(json.dumps(parts[0]))  # deep copy
    for part in parts[1:]:
        for name, entry in part["layers"].items():
            for factor in FACTOR_KINDS:
                if entry[factor]["owner"] == part["rank"]:
                    out["layers"][name][factor] = entry[factor]
    counts = out["counts"]
    counts["tokens_seen"] = sum(p["counts"]["tokens_seen"] for p in parts)
    if all("sequences_seen" in p["counts"] for p in parts):
        counts["sequences_seen"] = sum(p["counts"]["sequences_seen"] for p in parts)
    for part in parts[1:]:  # a layer's row space, as the first rank that captured it saw it
        for name, entry in part["layers"].items():
            if "rows" in entry:
                out["layers"][name]["rows"] = entry["rows"]
    for key in ("tracker_seconds", "exchange_seconds", "fold_seconds", "wait_seconds"):
        counts[key] = max(p["counts"][key] for p in parts)
    counts["comm_bytes"] = [b for p in parts for b in p["counts"]["comm_bytes"]]
    out.pop("rank", None)
    return out
