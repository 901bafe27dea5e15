"""Choose the tracked layers of a model.

Supported layer types: ``torch.nn.Linear`` (``z = a Wᵀ + b``, weight ``[d_out, d_in]``) and
transformers' ``Conv1D`` (GPT-2; ``z = a W + b``, weight ``[d_in, d_out]``): the same math, the
A factor is over the ``d_in`` inputs and the G factor over the ``d_out`` outputs in both cases.
PEFT LoRA layers are containers; their ``lora_A``/``lora_B`` children are plain ``nn.Linear``
and are tracked as such, while the frozen ``base_layer`` is left out by the trainable filter.

Default selection (``include=None``): every supported layer with a trainable weight inside the
transformer blocks, i.e. under the longest outermost ``nn.ModuleList`` of the model
(``transformer.h``, ``model.layers``, ...; a list nested in a block, such as T5's
``block.0.layer``, is never the stack), and for an encoder-decoder (``config.is_encoder_decoder``:
T5, BART, ...) under its decoder's stack (``decoder.block``, ``model.decoder.layers``) whatever
the two stacks' depths (`kfac_stream.capture.presets.block_stack`). The LM head and the
embeddings are outside the blocks. A ``preset``
(``last_layer``, ``lora``, ``attention``, ``mlp``, ``all_linear``) names another choice; its
rules are in `kfac_stream.capture.presets`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..distributed.engines import engine_for
from ..exceptions import KFACConfigError, UnsupportedModuleError
from .presets import SUPPORTED_TYPES, Conv1D, block_prefix, is_trainable, preset_layers


@dataclass(frozen=True)
class LayerSpec:
    """One tracked layer.

    Attributes:
        name: Module name as in ``model.named_modules()``.
        d_in: Input features (without the bias column).
        d_out: Output features.
        has_bias: Whether ``ā = [a; 1]`` (the A factor then has side ``d_in + 1``).
        kind: ``"linear"`` or ``"conv1d"``.
    """

    name: str
    d_in: int
    d_out: int
    has_bias: bool
    kind: str

    @property
    def a_dim(self) -> int:
        """Side of the A factor: ``d_in + 1`` with a bias, else ``d_in``."""
        return self.d_in + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Side of the G factor: ``d_out``."""
        return self.d_out


def layer_spec(name: str, module: nn.Module) -> LayerSpec:
    """Describe a supported module. Never reads the weight's data (ZeRO-3 may have freed it)."""
    if isinstance(module, nn.Linear):
        return LayerSpec(name, module.in_features, module.out_features,
                         module.bias is not None, "linear")
    if Conv1D and isinstance(module, Conv1D):
        d_in, d_out = _conv1d_dims(module)
        return LayerSpec(name, d_in, d_out, getattr(module, "bias", None) is not None, "conv1d")
    raise UnsupportedModuleError(
        f"module {name!r} is a {type(module).__name__}, which kfac_stream cannot track: "
        f"supported types are {tuple(t.__name__ for t in SUPPORTED_TYPES)}"
    )


def _conv1d_dims(module: nn.Module) -> tuple[int, int]:
    d_out = int(module.nf)
    w = module.weight
    # The whole shape from the engine (ZeRO-3's local weight is a placeholder of numel 0).
    shape = engine_for(module).full_shape(w)
    return int(shape[0]), d_out


def select_layers(
    model: nn.Module, include: list[str] | None = None, exclude: list[str] | None = None,
    preset: str | None = None,
) -> dict[str, LayerSpec]:
    """Return ``{name: LayerSpec}`` of the layers to track, in ``named_modules`` order.

    A layer is tracked if it is supported, has a trainable weight, matches no ``exclude``
    regex, and matches an ``include`` regex (``re.search``), or is among the ``preset``'s
    layers (`kfac_stream.capture.presets.preset_layers`), or, with neither, lies inside the
    transformer blocks.

    Raises:
        UnsupportedModuleError: an ``include`` regex selects no supported layer but matches a
            module of another type that holds parameters (e.g. an embedding).
        KFACConfigError: an ``include`` regex, a preset, or the whole selection, selects
            nothing; ``preset`` and ``include`` are both given; an unknown preset.
    """
    if preset is not None:
        return _select_preset(model, preset, include, exclude)
    inc = [re.compile(p) for p in include] if include is not None else None
    exc = [re.compile(p) for p in exclude or []]
    prefix = block_prefix(model) if inc is None else None
    kinds = "/".join(t.__name__ for t in SUPPORTED_TYPES)
    candidates = {
        name: m for name, m in model.named_modules()
        if not any(p.search(name) for p in exc)
    }
    chosen: dict[str, LayerSpec] = {}
    for name, module in candidates.items():
        if not isinstance(module, SUPPORTED_TYPES) or not is_trainable(module):
            continue
        if inc is not None:
            if not any(p.search(name) for p in inc):
                continue
        elif prefix is None or not name.startswith(prefix + "."):
            continue
        chosen[name] = layer_spec(name, module)
    for pattern in inc or []:
        if any(pattern.search(name) for name in chosen):
            continue
        unsupported = [
            (name, m) for name, m in candidates.items()
            if pattern.search(name) and not isinstance(m, SUPPORTED_TYPES)
            and any(True for _ in m.parameters(recurse=False))
        ]
        if unsupported:
            name, m = unsupported[0]
            raise UnsupportedModuleError(
                f"KFACConfig.include regex {pattern.pattern!r} matches module {name!r} of type "
                f"{type(m).__name__}, which kfac_stream cannot track: supported types are "
                f"{tuple(t.__name__ for t in SUPPORTED_TYPES)}"
            )
        raise KFACConfigError(
            f"KFACConfig.include regex {pattern.pattern!r} matches no trainable {kinds} module "
            f"(exclude={exclude!r})"
        )
    if not chosen:
        raise KFACConfigError(
            f"KFACConfig.include/exclude select no layer: the default selection (trainable "
            f"{kinds} modules under {prefix!r}) with exclude={exclude!r} is empty"
        )
    return chosen


def _select_preset(model: nn.Module, preset: str, include: list[str] | None,
                   exclude: list[str] | None) -> dict[str, LayerSpec]:
    if include is not None:
        raise KFACConfigError(
            f"KFACConfig.preset={preset!r} and include={include!r} are both set: a preset "
            "chooses the layers itself; set one of them (exclude still applies on top of a "
            "preset)")
    names = preset_layers(model, preset)
    exc = [re.compile(p) for p in exclude or []]
    modules = dict(model.named_modules())
    chosen = {n: layer_spec(n, modules[n]) for n in names
              if not any(p.search(n) for p in exc)}
    if not chosen:
        raise KFACConfigError(
            f"KFACConfig.preset={preset!r} with exclude={exclude!r} selects no layer: "
            f"exclude removes all {len(names)} of the preset's layers of "
            f"{type(model).__name__} ({names[0]!r}, ...)")
    return chosen
