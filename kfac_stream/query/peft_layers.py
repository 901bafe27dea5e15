"""Why a snapshot's layer is not a module of the model: the messages of `LaplacePosterior`'s
`SnapshotMismatchError`. First `other_architecture`: a snapshot of another architecture (the
class and ``config.model_type`` its manifest records, `kfac_stream.snapshot.architecture`,
against the model's; a snapshot that records none judged from its layer names), both named.
Then, for a model of the snapshot's architecture, the two ways a LoRA model is commonly loaded
so that its adapter layers are missing or renamed.

- Merged: ``merge_and_unload()`` folds ``B A`` into the base weights and removes the
  ``lora_A`` / ``lora_B`` layers (so does loading the base model alone). The snapshot's
  posterior is over the adapter's weights, which such a model no longer has.
- Loaded by transformers (``AutoModelForCausalLM.from_pretrained(adapter_dir)`` or
  ``model.load_adapter``): the adapter layers are there, but under the base model's names
  (``model.layers.0.mlp.down_proj.lora_A.default``), without the ``base_model.model.`` of the
  ``peft.PeftModel`` that trained (the snapshot's names).

Either way the way out is ``PeftModel.from_pretrained(base, adapter_dir)``, or the directory
``kfac_stream.gather_model`` saved (docs/lora.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from ..snapshot.architecture import describe, model_identity
from ..snapshot.manifest_types import Manifest, to_json

#: Name components of PEFT LoRA adapter layers (as `kfac_stream.capture.presets.LORA_NAMES`).
LORA_PARTS = frozenset({"lora_A", "lora_B"})

#: The module-name prefix of the base model inside a ``peft.PeftModel`` (LoRA and the other
#: tuners that inject layers).
PEFT_PREFIX = "base_model.model."

#: How to load an adapter so that its layers carry the snapshot's names.
RELOAD = ("load the adapter with peft: PeftModel.from_pretrained(base, adapter_dir) (or the "
          "directory kfac_stream.gather_model saved, which holds the base model in base/; "
          "docs/lora.md)")


def base_layer_name(name: str) -> str:
    """The base model's layer that a PEFT adapter layer ``name`` adapts, as a merged model (or
    the base alone) names it: ``base_model.model.h.0.attn.c_attn.lora_A.default`` →
    ``h.0.attn.c_attn``; any other name unchanged."""
    parts = name.removeprefix(PEFT_PREFIX).split(".")
    for i, part in enumerate(parts):
        if part in LORA_PARTS or part == "base_layer":
            return ".".join(parts[:i])
    return ".".join(parts)


def missing_layer_message(where: str, name: str, modules: Mapping[str, nn.Module]) -> str:
    """The one-line message for the snapshot's tracked layer ``name`` that is not in
    ``modules`` (the model's ``dict(named_modules())``); ``where`` opens it (``snapshot
    <path>``). A LoRA layer of a model that has no LoRA layers but the base layer it adapts
    (`base_layer_name`: merged, or the base alone) and one found under transformers' names get
    the way to load the adapter; any other layer the plain mismatch (a snapshot of another
    architecture is said before this, `kfac_stream.snapshot.architecture`)."""
    parts = set(name.split("."))
    plain = f"{where}: tracked layer {name!r} is not a module of the model"
    if not LORA_PARTS & parts:
        return plain
    if not any(LORA_PARTS & set(n.split(".")) for n in modules):
        if base_layer_name(name) not in modules:  # not merged: the layer it adapts is not here
            return (f"{plain}, nor is the layer it adapts, {base_layer_name(name)!r} (the model "
                    "has no LoRA layers)")
        return (f"{plain}, which has no LoRA layers: the snapshot tracked the PEFT LoRA adapter "
                f"layers (lora_A/lora_B), and a model merged with merge_and_unload() (the "
                f"adapters folded into the base weights) or the base model alone has none, so "
                f"its posterior does not apply; {RELOAD}")
    if name.startswith(PEFT_PREFIX) and name[len(PEFT_PREFIX):] in modules:
        return (f"{plain}: the model holds it as {name[len(PEFT_PREFIX):]!r}, without the "
                f"{PEFT_PREFIX!r} of the peft.PeftModel that trained (an adapter loaded by "
                f"transformers, AutoModelFor*.from_pretrained(adapter_dir) or load_adapter); "
                f"{RELOAD}")
    return plain


def other_architecture(where: str, manifest: Manifest, model: nn.Module,
                       modules: Mapping[str, nn.Module], names: Sequence[str], name: str,
                       problem: str) -> str | None:
    """The message for a snapshot (its ``manifest``, tracked layers ``names``) of another
    architecture than ``model`` (``modules``: its ``dict(named_modules())``), or None when it
    is not one (the same recorded class and ``model_type``; for a snapshot that records none,
    any of its layers, or its base layer, is a module of the model). ``where`` opens it;
    ``name`` and ``problem`` are the first layer that does not match and how (``"is not a
    module of the model"``)."""
    have = model_identity(model)
    recorded = manifest.model
    if recorded is not None:
        if (recorded.class_name, recorded.model_type) == (have["class"], have["model_type"]):
            return None
        return (f"{where} is a snapshot of another architecture: it was taken on a "
                f"{describe(to_json(recorded))}, the model is a {describe(have)} (its tracked "
                f"layer {name!r} {problem}); pass the model the snapshot was taken on, or a "
                "snapshot of a run of this model")
    if any(n in modules or base_layer_name(n) in modules for n in names):
        return None
    return (f"{where} is a snapshot of another architecture, it seems: none of its "
            f"{len(names)} tracked layers (e.g. {names[0]!r}), nor their base layers, is a "
            f"module of the model, a {describe(have)} (the snapshot, written by an older "
            "kfac_stream, does not record the model it was taken on); pass the model the "
            "snapshot was taken on, or a snapshot of a run of this model")
