"""What goes into a snapshot: the owned factors as shard tensors and the manifest part, filled
into the manifest's dataclasses (`kfac_stream.snapshot.manifest_types`) and sent on as JSON
(the eigendecomposition adds each factor's ``spectrum``, the ranks exchange their parts)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..utils.factor_keys import FACTOR_KINDS
from .layout import layer_fingerprint, shard_name
from .manifest_types import (
    AnswerTokens,
    Counts,
    FactorEntry,
    LayerEntry,
    Manifest,
    ModelIdentity,
    Ownership,
    RefreshDecision,
    RunPlanEntry,
    Sampling,
    WeightsFingerprint,
    WindowEntry,
    json_name,
)


def snapshot_contents(record, step: int, epoch: float | None = None,
                      extensions: Mapping[str, Any] | None = None,
                      weights: dict[str, dict[str, Any]] | None = None,
                      model: dict[str, Any] | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Shard tensors and manifest part (without ``shards``) for a tracker's owned factors.

    With several ranks each rank makes its part; `merge_manifests` combines them.

    Cheap (copies of the stored factors), so it runs on the training thread; the expensive
    part, the eigendecompositions (`kfac_stream.snapshot.eigen_stream`), works on these
    copies only and can run anywhere.

    Args:
        record: A `kfac_stream.tracking.tracker.TrackerRecord` with factors
            (``Tracker.export()``); its factor tensors become the shard's (not copied again).
        step: Optimizer step.
        epoch: Trainer epoch (fractional), recorded for the data-size estimate.
        extensions: ``{name: ExtensionExport}`` of the tracker's extensions
            (`kfac_stream.tracking.tracker.Tracker.export_extensions`): each layer's tensor
            as ``<layer>.<name>`` in this rank's shard (EK-FAC: ``<layer>.ekfac``, ``λ [d_out,
            d_A]``, in the shard of the layer's G factor) and its entry as
            ``layers[<layer>][<name>]`` in the manifest (EK-FAC: basis step, update steps,
            ``N``); None or empty: neither.
        weights: The tracked weights' fingerprint (`kfac_stream.snapshot.weights`), or None.
        model: The model's architecture (`kfac_stream.snapshot.architecture`), or None.

    Returns:
        ``(tensors, manifest)``: the shard's tensors by name and the manifest part as JSON
        (`manifest_types.Manifest.to_json`).
    """
    tensors: dict[str, torch.Tensor] = {}
    for key, f in record.factors.items():
        tensors[key] = f.data
        tensors[f"{key}.scale"] = torch.tensor([f.scale], dtype=torch.float32)
    layers = {name: _layer_entry(record, name) for name in record.specs}
    exported = extensions or {}
    for ext, export in exported.items():
        for name in record.specs:
            if name in export.entries and name in export.tensors:
                tensors[f"{name}.{ext}"] = export.tensors[name]
    manifest = _manifest(record, step, epoch, layers)
    manifest.weights = None if weights is None else {
        name: WeightsFingerprint(**w) for name, w in weights.items()}
    if model is not None:
        manifest.model = ModelIdentity(class_name=model["class"],
                                       model_type=model["model_type"])
    out = manifest.to_json()
    for ext, export in exported.items():  # each layer's entry, after its own keys
        for name in record.specs:
            if name in export.entries:
                out["layers"][name][ext] = dict(export.entries[name])
    return tensors, out


def _layer_entry(record, name: str) -> LayerEntry:
    """Layer ``name``'s entry: its shape, and its factors (statistics where owned here)."""
    spec = record.specs[name]
    factors = {}
    for factor, key in zip(FACTOR_KINDS, record.plan.keys_of(name)):
        dim, diagonal = record.dims[key]
        owner = record.ownership.owner[key]
        entry = FactorEntry(key=key, dim=dim, diagonal=diagonal, owner=owner,
                            shard=shard_name(owner, record.world_size))
        f = record.factors.get(key)
        if f is not None:  # owned here; other ranks' parts fill in theirs (merge)
            entry.weight, entry.updates, entry.positions = f.weight, f.updates, f.positions
            entry.dtype = str(f.data.dtype).removeprefix("torch.")
            rel_se, k_eff = f.sampling_error()
            if not math.isnan(rel_se):  # not recorded: no update yet
                entry.sampling = Sampling(rel_se=rel_se, effective_updates=k_eff)
        factors[factor] = entry
    # "sequence": a pooler / head, N counts sequences; "target": an encoder-decoder's decoder
    # positions; absent: one row per token position of the input
    rows = record.row_space.get(name) if record.row_space.get(name) != "position" else None
    return LayerEntry(kind=spec.kind, d_in=spec.d_in, d_out=spec.d_out,
                      has_bias=spec.has_bias, rows=rows, **factors)


def _manifest(record, step: int, epoch: float | None,
              layers: dict[str, LayerEntry]) -> Manifest:
    """The manifest part of ``record`` at ``step`` around ``layers`` (no shards yet)."""
    cfg = record.config
    counters = dataclasses.asdict(record.counters)
    counters.pop("skipped_steps")  # beside the counts, as a list of steps
    counters["comm_bytes"] = [counters["comm_bytes"]]  # per rank, filled in by the merge
    answers = record.answer_tokens
    return Manifest(
        step=int(step), epoch=epoch, created_unix=time.time(), world_size=record.world_size,
        rank=record.rank,
        ownership=Ownership(bytes_per_rank=list(record.ownership.bytes_per_rank),
                            eigh_flops_per_rank=list(record.ownership.eigh_flops_per_rank)),
        fisher=cfg.fisher, ema_decay=cfg.ema_decay, token_fraction=cfg.token_fraction,
        update_every=cfg.update_every, storage_dtype=cfg.storage_dtype, config=_config_json(record),
        counts=Counts(**counters), skipped_steps=list(record.counters.skipped_steps),
        shared_inputs=record.plan.describe(), run_id=record.run_id or None,
        answer_tokens=AnswerTokens(**answers) if answers else None,
        run_plan=_run_plan(getattr(record, "run_plan", None)),
        fingerprint=layer_fingerprint(
            {n: (s.d_in, s.d_out, s.has_bias) for n, s in record.specs.items()}),
        layers=layers)


def _config_json(record) -> dict[str, Any]:
    """The manifest's ``config``: the record's (the held-out options included), else its
    config's own."""
    config_json = getattr(record, "config_json", None)
    return dict(config_json) if config_json is not None else record.config.to_dict()


def _run_plan(plan: dict[str, Any] | None) -> RunPlanEntry | None:
    if not plan:
        return None
    window, refresh = plan.get("window"), plan.get("final_refresh")
    return RunPlanEntry(**{**plan, "window": WindowEntry(**window) if window else None,
                           "final_refresh": RefreshDecision(**refresh) if refresh else None})


def merge_manifests(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One manifest from every rank's part (rank order), as rank 0 writes it.

    Each factor's statistics (weight, updates, positions, dtype, spectrum) come from its
    owner's part, a layer's tracker-extension entries (EK-FAC's, and any key the layer entry
    does not define) from its G factor's owner's; ``tokens_seen`` and
    the other ``*_seen`` (counted per rank) are summed; ``tracker_seconds``,
    ``exchange_seconds``, ``fold_seconds`` and ``wait_seconds`` are the slowest rank's;
    ``comm_bytes`` lists every rank's. Everything else is the same on all ranks and is
    taken from rank 0.
    """
    ranks = [Manifest.from_json(p) for p in parts]
    out = Manifest.from_json(parts[0])  # its own objects: the parts are left as they are
    for part in ranks[1:]:
        for name, entry in part.layers.items():
            for factor in FACTOR_KINDS:
                if getattr(entry, factor).owner == part.rank:
                    setattr(out.layers[name], factor, getattr(entry, factor))
            if entry.rows is not None:  # a layer's row space, as a rank that captured it saw it
                out.layers[name].rows = entry.rows
            if entry.G.owner == part.rank:  # the EK-FAC correction: stored by G's owner
                out.layers[name].ekfac = entry.ekfac
    counts = out.counts
    counts.tokens_seen = sum(p.counts.tokens_seen for p in ranks)
    counts.sequences_seen = sum(p.counts.sequences_seen for p in ranks)
    counts.target_tokens_seen = sum(p.counts.target_tokens_seen for p in ranks)
    for key in ("tracker_seconds", "exchange_seconds", "fold_seconds", "wait_seconds"):
        setattr(counts, key, max(getattr(p.counts, key) for p in ranks))
    counts.comm_bytes = [b for p in ranks for b in p.counts.comm_bytes]
    out.rank = None
    merged = out.to_json()
    known = {json_name(f) for f in dataclasses.fields(LayerEntry)}
    for part, raw in zip(ranks, parts):  # other extensions' entries: the schema knows none
        for name, entry in raw["layers"].items():
            if part.layers[name].G.owner == part.rank:
                merged["layers"][name].update(
                    {k: v for k, v in entry.items() if k not in known})
    return merged
