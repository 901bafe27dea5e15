"""The layers a posterior is over (`chosen_layers`), matched to the model's modules
(`match_layers`), and the checks of the model against the snapshot: whole (not sharded)
weights (`check_whole_weights`) and the weights the snapshot was taken at
(`warn_other_weights`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from ..capture.presets import preset_layers
from ..capture.selection import layer_spec
from ..distributed.engines import engine_for
from ..enums import LayerPreset
from ..exceptions import KFACConfigError, PartitionedModelError, SnapshotMismatchError
from ..snapshot.snapshot import Snapshot
from ..snapshot.weights import compare_weights
from . import inputs


def warn_other_weights(where: str, snapshot: Snapshot, modules: dict[str, nn.Module]) -> None:
    """One ``UserWarning`` when the model's tracked weights are not those the snapshot was
    taken at (its ``weights`` fingerprint, `snapshot.weights`; snapshots written before it
    existed are not checked): a model of another run, or of another step of the same run."""
    recorded = snapshot.meta.get("weights")
    if not recorded:
        return
    differ = compare_weights(recorded, modules)
    if differ:
        run = snapshot.meta.get("run_id")
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
        info = snapshot[name].meta
        if name not in modules:  # another architecture; a LoRA layer of a merged model
            raise SnapshotMismatchError(
                other_architecture(where, snapshot.meta, model, modules,
                                   names=snapshot.layer_names, name=name,
                                   problem="is not a module of the model")
                or missing_layer_message(where, name, modules))
        spec = layer_spec(name, modules[name])
        want = (info["d_in"], info["d_out"], bool(info["has_bias"]))
        have = (spec.d_in, spec.d_out, spec.has_bias)
        if want != have:
            shapes = (f"has (d_in, d_out, bias) = {have} in the model but {want} in the "
                      "snapshot")
            raise SnapshotMismatchError(
                other_architecture(where, snapshot.meta, model, modules,
                                   names=snapshot.layer_names, name=name, problem=shapes)
                or f"{where}: layer {name!r} {shapes}")
        out[name] = modules[name]
    return out
