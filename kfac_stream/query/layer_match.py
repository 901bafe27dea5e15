"""The layers a posterior is over (`chosen_layers`), matched to the model's modules
(`match_layers`), and the checks of the model against the snapshot: whole (not sharded)
weights (`check_whole_weights`), the weights the snapshot was taken at
(`warn_other_weights`), and layers the run's selection picks in the model that the snapshot
lacks (`check_untracked_layers`)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

from torch import nn

from ..capture.presets import preset_layers
from ..capture.selection import layer_spec, select_layers
from ..distributed.engines import engine_for
from ..exceptions import KFACConfigError, PartitionedModelError, SnapshotMismatchError
from ..snapshot.manifest_types import to_json
from ..snapshot.snapshot import Snapshot
from ..snapshot.weights import compare_weights
from ..utils.enums import LayerPreset
from . import inputs


def warn_other_weights(where: str, snapshot: Snapshot, modules: dict[str, nn.Module]) -> None:
    """One ``UserWarning`` when the model's tracked weights are not those the snapshot was
    taken at (its ``weights`` fingerprint, `snapshot.weights`; snapshots written before it
    existed are not checked): a model of another run, or of another step of the same run."""
    recorded = snapshot.manifest.weights
    if not recorded:
        return
    differ = compare_weights(to_json(recorded), modules)
    if differ:
        run = snapshot.manifest.run_id
        at = f"step {snapshot.step}" if snapshot.weights_step == snapshot.step else (
            f"step {snapshot.weights_step}, the best model the Trainer reloaded at the end of "
            f"training (load_best_model_at_end; its factors run to step {snapshot.step})")
        warnings.warn(
            f"{where}: the model's weights are not those snapshot {snapshot.path} was taken at "
            f"({at}{f', run {run}' if run else ''}): {len(differ)} of "
            f"{len(modules)} layers differ, e.g. {differ[0]}. The posterior pairs this model "
            "with another model's curvature: load the model saved at that step (or the "
            "snapshot of this model's run and step)", UserWarning, stacklevel=3)


def check_whole_weights(where: str, model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """The model holds its whole weights in this process and keeps them: no parameter its
    distributed engine shards (`EngineAdapter.sharded_parameter_problem`: DeepSpeed ZeRO-3
    partitions them again after the next forward even when gathered right after
    ``trainer.train()``; an FSDP2 ``DTensor``'s values are not here), and every tracked weight
    of its full size."""
    engine = engine_for(model)
    for pname, p in model.named_parameters():
        problem = engine.sharded_parameter_problem(where, pname, p)
        if problem is not None:
            raise PartitionedModelError(problem)
    for name, m in modules.items():
        spec = layer_spec(name, m)
        w = m.weight
        full = spec.d_in * spec.d_out
        if w.numel() != full:
            raise PartitionedModelError(
                f"{where}: model has its weights partitioned (layer {name!r} holds "
                f"{w.numel()} of its {full} weights in this process): query a model with whole "
                "weights: save it (trainer.save_model(dir)) and load it again with "
                "from_pretrained(dir) in one process")


def chosen_layers(where: str, model: nn.Module, snapshot: Snapshot,
                   layers: object) -> list[str]:
    """The snapshot's layers the posterior is over, in the snapshot's order."""
    names = snapshot.layer_names
    if layers is None:
        return list(names)
    presets = tuple(p.value for p in LayerPreset)
    allowed = (f"None, a preset ({', '.join(map(repr, presets))}) or a non-empty list of the "
               f"snapshot's layer names (snapshot.layer_names, e.g. {names[0]!r})")
    if isinstance(layers, str):
        if layers not in presets:
            raise inputs.error(where, "layers", layers, allowed)
        try:
            chosen = preset_layers(model, layers)
        except KFACConfigError as e:
            raise inputs.error(where, "layers", layers, allowed,
                               problem=f"selects nothing here ({e})") from None
        missing = [n for n in chosen if n not in names]
        if missing:
            raise inputs.error(where, "layers", layers, allowed,
                               problem=f"selects {len(missing)} layer(s) the snapshot did not "
                                       f"track (e.g. {missing[0]!r})")
    elif isinstance(layers, Sequence) and layers and all(isinstance(n, str) for n in layers):
        chosen = list(layers)
        unknown = [n for n in chosen if n not in names]
        if unknown:
            raise inputs.error(where, "layers", layers, allowed,
                               problem=f"names {unknown[0]!r}, which the snapshot did not track")
    else:
        raise inputs.error(where, "layers", layers, allowed, typed=not isinstance(layers, list))
    keep = set(chosen)
    return [n for n in names if n in keep]


def match_layers(model: nn.Module, snapshot: Snapshot,
                 names: Sequence[str]) -> dict[str, nn.Module]:
    """``{name: module}`` of the model's modules named ``names``, each with the snapshot's
    ``(d_in, d_out, bias)``.

    Raises:
        SnapshotMismatchError: a layer the model lacks or has in another shape (the message
            names another architecture, or a merged or misnamed LoRA adapter: `peft_layers`).
    """
    from .peft_layers import missing_layer_message, other_architecture

    modules = dict(model.named_modules())
    out = {}
    where = f"snapshot {snapshot.path}"
    for name in names:
        entry = snapshot[name].entry
        if name not in modules:  # another architecture; a LoRA layer of a merged model
            missing = [n for n in names if n not in modules]
            count = (f" ({len(missing)} of the {len(names)} layers asked for are not modules "
                     f"of the model: {inputs.names_shown(missing)})" if len(missing) > 1 else "")
            raise SnapshotMismatchError(
                (other_architecture(where, snapshot.manifest, model, modules,
                                    names=snapshot.layer_names, name=name,
                                    problem="is not a module of the model")
                 or missing_layer_message(where, name, modules)) + count)
        spec = layer_spec(name, modules[name])
        want = (entry.d_in, entry.d_out, bool(entry.has_bias))
        have = (spec.d_in, spec.d_out, spec.has_bias)
        if want != have:
            shapes = (f"has (d_in, d_out, bias) = {have} in the model but {want} in the "
                      "snapshot")
            raise SnapshotMismatchError(
                other_architecture(where, snapshot.manifest, model, modules,
                                   names=snapshot.layer_names, name=name, problem=shapes)
                or f"{where}: layer {name!r} {shapes}")
        out[name] = modules[name]
    return out


def untracked_layers(model: nn.Module, snapshot: Snapshot) -> list[str]:
    """The layers of ``model`` that the run's layer selection (its ``KFACConfig`` ``include``,
    ``exclude`` and ``preset``, as the snapshot's manifest records them, applied to ``model``
    as the tracker does: `select_layers`) picks but the snapshot does not hold, in
    ``named_modules`` order; empty when the selection picks nothing in ``model``."""
    cfg = snapshot.manifest.config
    try:
        chosen = select_layers(model, cfg.get("include"), cfg.get("exclude"), cfg.get("preset"))
    except (KFACConfigError, re.error):  # selects nothing here: the layer match says why
        return []
    held = set(snapshot.layer_names)
    return [n for n in chosen if n not in held]


def _selection(cfg: dict) -> str:
    """The run's layer selection in words, from a manifest's ``config``."""
    parts = [f"{k}={cfg[k]!r}" for k in ("include", "preset") if cfg.get(k) is not None]
    parts = parts or ["the default: the trainable Linear/Conv1D layers in the blocks"]
    if cfg.get("exclude"):
        parts.append(f"exclude={cfg['exclude']!r}")
    return ", ".join(parts)


def check_untracked_layers(where: str, model: nn.Module, snapshot: Snapshot,
                           modules: dict[str, nn.Module]) -> None:
    """Layers of ``model`` that the run's selection picks but the snapshot lacks
    (`untracked_layers`), named (the first few and their count).

    The posterior over the snapshot's layers, the others held at their trained values, is a
    valid Laplace posterior over those layers when the curvature was measured on this model
    (the run left these layers out: frozen then, trainable now): a ``UserWarning``. When the
    tracked weights also differ from the snapshot's fingerprint (``modules``, the posterior's
    layers, `compare_weights`), the model is another network (deeper or wider than the one
    the snapshot was taken on): the snapshot's factors, ``G`` above all (the gradients that
    reach each layer pass through every layer above it), describe that network, and every
    query would be wrong: `SnapshotMismatchError`.
    """
    extra = untracked_layers(model, snapshot)
    if not extra:
        return
    recorded = snapshot.manifest.weights
    differ = compare_weights(to_json(recorded), modules) if recorded else []
    names = snapshot.layer_names
    found = (f"the model has {len(extra)} layer(s) that the run's layer selection "
             f"({_selection(snapshot.manifest.config)}) picks but snapshot {snapshot.path} "
             "does not hold "
             f"({len(names)} layers): {inputs.names_shown(extra)}")
    if differ:
        raise SnapshotMismatchError(
            f"{where}: {found}; and its tracked weights are not those the snapshot was taken at "
            f"({len(differ)} of {len(modules)} layers differ, e.g. {differ[0]}). So the model "
            "is not the one the snapshot was taken on (one with more layers, e.g. more "
            "blocks): the snapshot's curvature was measured without those layers (the "
            "gradients reaching each tracked layer pass through every layer above it) and "
            "every query would be wrong. Pass the model the snapshot was taken on (its "
            "step's saved weights), or a snapshot of a run of this model")
    checked = ("the tracked layers' weights are those the snapshot was taken at, so its "
               "curvature is this model's" if recorded else
               "the snapshot records no weight fingerprint to tell whether it was taken on "
               "this model: if it was taken on a model without these layers, its curvature "
               "is another network's and the queries are wrong")
    warnings.warn(
        f"{where}: {found}. The posterior is over the snapshot's layers only, these held at "
        "their trained values: a valid Laplace posterior over those layers when the run left "
        f"these out (e.g. frozen in training); {checked}. To use them too, track them in a "
        "new run (KFACConfig include/preset)", UserWarning, stacklevel=3)
