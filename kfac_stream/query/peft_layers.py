"""Why a snapshot's PEFT (LoRA) layer is not a module of the model: the message of
`LaplacePosterior`'s `SnapshotMismatchError` for the two ways a LoRA model is commonly loaded
so that its adapter layers are missing or renamed.

- Merged: ``merge_and_unload()`` folds ``B A`` into the base weights and removes the
  ``lora_A`` / ``lora_B`` layers (so does loading the base model alone). The snapshot's
  posterior is over the adapter's weights, which such a model no longer has.
- Loaded by transformers (``AutoModelForCausalLM.from_pretrained(adapter_dir)`` or
  ``model.load_adapter``): the adapter layers are there, but under the base model's names
  (``model.layers.0.mlp.down_proj.lora_A.default``), without the ``base_model.model.`` of the
  ``peft.PeftModel`` that trained (the snapshot's names).

Either way the way out is ``PeftModel.from_pretrained(base, adapter_dir)``, or the directory
``kfac_stream.whole_model`` saved (docs/lora.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

#: Name components of PEFT LoRA adapter layers (as `kfac_stream.capture.presets.LORA_NAMES`).
LORA_PARTS = frozenset({"lora_A", "lora_B"})

#: The module-name prefix of the base model inside a ``peft.PeftModel`` (LoRA and the other
#: tuners that inject layers).
PEFT_PREFIX = "base_model.model."

#: How to load an adapter so that its layers carry the snapshot's names.
RELOAD = ("load the adapter with peft: PeftModel.from_pretrained(base, adapter_dir) (or the "
          "directory kfac_stream.whole_model saved, which holds the base model in base/; "
          "docs/lora.md)")


def missing_layer_message(where: str, name: str, modules: Mapping[str, nn.Module]) -> str:
    """The one-line message for the snapshot's tracked layer ``name`` that is not in
    ``modules`` (the model's ``dict(named_modules())``); ``where`` opens it (``snapshot
    <path>``). A LoRA layer of a model that has no LoRA layers (merged, or the base alone) and
    one found under transformers' names get the way to load the adapter; any other layer the
    plain mismatch."""
    parts = set(name.split("."))
    plain = f"{where}: tracked layer {name!r} is not a module of the model"
    if not LORA_PARTS & parts:
        return plain
    if not any(LORA_PARTS & set(n.split(".")) for n in modules):
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
