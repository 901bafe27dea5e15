"""PEFT (LoRA) models saved so that they load back: `gather_model`'s layout and the CLI's loader.

``trainer.save_model(dir)`` of a ``peft.PeftModel`` writes only the adapter
(``adapter_config.json``, ``adapter_model.safetensors``), and for a base model built from a
config the adapter's ``base_model_name_or_path`` is empty: nothing can load it back. For a
PEFT model `kfac_stream.gather_model(trainer, dir)` therefore writes a self-contained
directory::

    dir/                          what trainer.save_model writes for a PeftModel:
      adapter_config.json         the adapter's config; base_model_name_or_path is set to
                                  dir/base (absolute) when the model had none
      adapter_model.safetensors   the adapter (lora_A / lora_B, modules_to_save) weights
      tokenizer files, training_args.bin
      kfac_stream_peft.json       {"format": 1, "base": "base", "adapter": ".",
                                   "adapter_name": "default", "base_class": "LlamaForCausalLM"}
      base/                       the base model alone (save_pretrained): config.json, its
        config.json               weights under the base model's own names (no lora_A / lora_B,
        model.safetensors         no ``base_layer.``, a modules_to_save head's original
        tokenizer files           weights), and the tokenizer files when the Trainer has one

``kfac_stream_peft.json`` (`SIDECAR`) holds paths relative to ``dir``, so the directory may
be moved; the absolute path in ``adapter_config.json`` lets peft's own
``AutoPeftModelForCausalLM.from_pretrained(dir)`` find the base where it was written. To load
it in Python::

    base = AutoModelForCausalLM.from_pretrained(f"{dir}/base")
    model = PeftModel.from_pretrained(base, dir)   # names: base_model.model.model.layers.0...

Its module names are the training PeftModel's (``base_model.model.…lora_A.default``), which
are the snapshot's layer names. `adapter_location` is what ``kfac-stream query --model dir``
reads: the sidecar's base, else ``adapter_config.json``'s ``base_model_name_or_path``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor, nn

from ..exceptions import QueryInputError
from ..utils.files import local_path_problem

#: The file `gather_model` writes next to a PEFT adapter: where its base model is.
SIDECAR = "kfac_stream_peft.json"

#: The sidecar's format version.
SIDECAR_FORMAT = 1

#: The base model's directory inside `gather_model`'s save directory.
BASE_DIR = "base"

#: peft's adapter config file: a directory holding it is a PEFT adapter.
ADAPTER_CONFIG = "adapter_config.json"

#: peft's default adapter name (the last component of a LoRA layer's module name).
DEFAULT_ADAPTER = "default"


def is_peft_model(model: nn.Module) -> bool:
    """True if ``model`` is a ``peft.PeftModel`` (without importing peft when it is not
    installed: then nothing is one)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _base_prefix(model: nn.Module) -> str:
    """The module-name prefix of the transformers model inside a PeftModel (``base_model.model.``
    for LoRA and the other tuners that inject layers)."""
    base = model.get_base_model()
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    raise ValueError("the PeftModel's base model is not one of its modules")


def base_state_dict(model: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The base model's own state dict from a PeftModel's (full) state dict ``state``.

    Keys under the base model (``base_model.model.``) keep their name less that prefix; every
    PEFT layer (a module with ``adapter_layer_names``: LoRA layers, ``modules_to_save`` and
    trainable-token wrappers) loses its adapter entries (``lora_A.*``, ``lora_B.*``,
    ``modules_to_save.*``, ...) and gives back the wrapped module's under the plain name
    (``q_proj.base_layer.weight`` → ``q_proj.weight``, ``score.original_module.weight`` →
    ``score.weight``). Keys outside the base model (tuner-level buffers) are dropped. Tensors
    are not copied.

    Args:
        model: The PeftModel (its module structure; under ZeRO-3 its parameters may be
            partitioned, they are not read).
        state: Its state dict (e.g. gathered by DeepSpeed), keys as ``model.state_dict()``'s.
    """
    prefix = _base_prefix(model)
    drop, rename = [], []
    for name, module in model.named_modules():
        layers = getattr(module, "adapter_layer_names", None)
        if not name.startswith(prefix) or layers is None:
            continue
        drop += [f"{name}.{attr}." for attr in (*layers, *getattr(module, "other_param_names",
                                                                   ()))]
        for inner in ("base_layer", "original_module"):
            if isinstance(getattr(module, inner, None), nn.Module):
                rename.append((f"{name}.{inner}.", f"{name}."))
    # longest first: a PEFT layer inside another's base layer is renamed before the outer one
    rename.sort(key=lambda r: -len(r[0]))
    drop_t = tuple(drop)
    out = {}
    for key, value in state.items():
        if not key.startswith(prefix) or (drop_t and key.startswith(drop_t)):
            continue
        for old, new in rename:
            if key.startswith(old):
                key = new + key[len(old):]
        out[key[len(prefix):]] = value
    return out


def save_base(model: nn.Module, state: Mapping[str, Tensor], save_dir: str,
              processing_class=None) -> str:
    """Write the base model of the PeftModel ``model`` (weights from its full state dict
    ``state``, `base_state_dict`) to ``save_dir/base`` with the base model's
    ``save_pretrained``, the tokenizer there too; then the sidecar, and ``adapter_config.json``'s
    empty ``base_model_name_or_path`` set to that directory. Main process only. Returns the
    base directory."""
    base_dir = os.path.join(save_dir, BASE_DIR)
    base = model.get_base_model()
    base.save_pretrained(base_dir, state_dict=base_state_dict(model, state))
    if processing_class is not None:
        processing_class.save_pretrained(base_dir)
    name = getattr(model, "active_adapter", DEFAULT_ADAPTER)
    # peft saves an adapter not named "default" in a subdirectory of that name
    adapter = "." if name == DEFAULT_ADAPTER else name
    sidecar = {"format": SIDECAR_FORMAT, "base": BASE_DIR, "adapter": adapter,
               "adapter_name": name, "base_class": type(base).__name__}
    with open(os.path.join(save_dir, SIDECAR), "w") as f:
        json.dump(sidecar, f, indent=1)
    config_path = os.path.join(save_dir, adapter, ADAPTER_CONFIG)
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
        if not config.get("base_model_name_or_path"):
            config["base_model_name_or_path"] = os.path.abspath(base_dir)
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
    return base_dir


@dataclass(frozen=True)
class AdapterLocation:
    """Where a saved PEFT adapter and its base model are.

    Attributes:
        adapter_dir: The directory holding ``adapter_config.json`` and the adapter weights.
        adapter_name: The adapter's name (the last component of its layers' module names).
        base: The base model: a directory, or a hub name from ``base_model_name_or_path``.
        base_from: Where ``base`` was read: ``"kfac_stream_peft.json"`` or
            ``"adapter_config.json's base_model_name_or_path"`` or ``"--base"``.
        modules_to_save: ``adapter_config.json``'s ``modules_to_save`` (modules whose trained
            copy the adapter holds, e.g. a classifier's head): the base may lack them.
    """

    adapter_dir: str
    adapter_name: str
    base: str
    base_from: str
    modules_to_save: tuple[str, ...]


def adapter_location(path: str, base: str | None = None) -> AdapterLocation | None:
    """The adapter and base of a model directory ``path``, or None when it is no PEFT adapter
    directory (neither ``kfac_stream_peft.json`` nor ``adapter_config.json`` in it).

    The base is ``base`` when given (``kfac-stream query --base``), else the sidecar's
    (`gather_model`'s copy, relative to ``path``), else ``adapter_config.json``'s
    ``base_model_name_or_path`` (a directory, relative to the working directory as peft reads
    it, or a hub name).

    Raises:
        QueryInputError: an adapter directory whose base is not recorded, or whose recorded
            base does not exist (one line naming ``--model``, saying to pass ``--base``).
    """
    if not os.path.isdir(path):
        return None
    fix = ("pass --base with the base model's directory or hub name (kfac_stream.gather_model "
           "saves the base next to the adapter, in base/)")
    model = f"--model={path!r}"
    sidecar = os.path.join(path, SIDECAR)
    info, base_from = {}, "--base"
    if os.path.isfile(sidecar):
        with open(sidecar) as f:
            info = json.load(f)
        adapter_dir = os.path.normpath(os.path.join(path, info.get("adapter", ".")))
        if base is None:
            base = os.path.normpath(os.path.join(path, info.get("base", BASE_DIR)))
            base_from = SIDECAR
            if not os.path.isdir(base):
                raise QueryInputError(
                    f"{model} is a PEFT adapter saved by kfac_stream.gather_model whose base "
                    f"model directory {base!r} ({SIDECAR}) is missing: copy the whole "
                    f"directory, base/ included, or {fix}")
    elif os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        adapter_dir = path
    else:
        return None
    config_path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise QueryInputError(f"{model} is a PEFT adapter saved by kfac_stream.gather_model "
                              f"without its {config_path!r}: copy the whole directory")
    with open(config_path) as f:
        config = json.load(f)
    if base is None:
        base = config.get("base_model_name_or_path")
        base_from = f"{ADAPTER_CONFIG}'s base_model_name_or_path"
        if not base:
            raise QueryInputError(f"{model} is a PEFT adapter directory ({ADAPTER_CONFIG}) that "
                                  f"names no base model (base_model_name_or_path is {base!r}): "
                                  f"{fix}")
    problem = local_path_problem(base)
    if problem is not None:
        raise QueryInputError(f"{model} is a PEFT adapter directory whose base model {base!r} "
                              f"({base_from}) {problem}: {fix}")
    return AdapterLocation(adapter_dir, info.get("adapter_name", DEFAULT_ADAPTER), base,
                           base_from, tuple(config.get("modules_to_save") or ()))


def load_adapter(location: AdapterLocation, base_model: nn.Module) -> nn.Module:
    """``PeftModel.from_pretrained(base_model, adapter_dir, adapter_name=...)``: the adapter on
    the loaded base, its module names those of the PeftModel that trained
    (``base_model.model.…lora_A.<adapter_name>``)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, location.adapter_dir,
                                     adapter_name=location.adapter_name)
