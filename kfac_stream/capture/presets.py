"""Layer presets: named choices of the tracked layers (``KFACConfig.preset``).

Which modules can be tracked at all is also defined here (`SUPPORTED_TYPES`, `is_trainable`,
`block_prefix`), so that `kfac_stream.capture.selection` builds on this module and not the
other way round.

Every preset starts from the *candidates*: the modules of ``model.named_modules()`` that are a
supported type (``nn.Linear`` or transformers' ``Conv1D``) with a trainable weight
(``weight.requires_grad``; a frozen base is left out, as without a preset). The *blocks* are the
longest outermost ``nn.ModuleList`` of the model (``transformer.h``, ``model.layers``, ...; an
encoder-decoder's decoder stack, ``decoder.block``, ``model.decoder.layers``: `block_stack`); a
candidate's *parents* are the name components between the block index and its own name
(``transformer.h.3.attn.c_attn`` → ``attn``; a LoRA adapter
``...h.3.attn.c_attn.lora_A.default`` → ``attn``, ``c_attn``, ``lora_A``).

=============  =================================================================================
preset         tracked layers
=============  =================================================================================
all_linear     every candidate inside the blocks (the default selection, ``include=None``)
attention      candidates inside the blocks with a parent in `ATTENTION_PARENTS` (GPT-2
               ``attn.c_attn``, ``attn.c_proj``; Llama ``self_attn.{q,k,v,o}_proj``; BERT
               ``attention.*``)
mlp            candidates inside the blocks with a parent in `MLP_PARENTS` (GPT-2 ``mlp.c_fc``,
               ``mlp.c_proj``; Llama ``mlp.{gate,up,down}_proj``), or directly in a block and
               named in `MLP_NAMES` (OPT, BioGPT, BART, Whisper ``fc1``, ``fc2``)
last_layer     the output head: ``model.get_output_embeddings()`` when it is a supported module
               (``lm_head`` of GPT-2 / Llama LMs; GPT-2's is tied to ``wte``, which the tracker
               supports); else, outside the blocks, the last candidate named or under a module
               named in `HEAD_NAMES` (``score`` of GPT2/LlamaForSequenceClassification,
               ``classifier``, ...; a PEFT ``modules_to_save`` copy of it)
lora           the PEFT LoRA adapters: candidates with a name component ``lora_A`` or ``lora_B``
               (their ``nn.Linear`` children ``lora_A.default``, ...); a model without any such
               layer is an error
=============  =================================================================================

With a frozen base and LoRA adapters, ``attention`` / ``mlp`` / ``all_linear`` give the
adapters under those parents, and ``last_layer`` is an error unless the head is trainable
(e.g. listed in PEFT's ``modules_to_save``). An empty result is a `KFACConfigError` naming the
preset and the model class; ``exclude`` (in `kfac_stream.capture.selection.select_layers`)
applies on top.

Memory. The LM head's G factor has side = vocabulary (50257 for GPT-2, 32000 for Llama-2), over
the default ``max_dense_dim`` (8192): it is kept diagonal (``d`` entries, `plan_factors`) while
its A (``d_model`` or ``d_model + 1``) stays dense. FP16 factor bytes per preset on real configs:
`kfac_stream.capture.preset_memory` and docs/configuration.md ("Layer presets").
"""

from __future__ import annotations

import torch
from torch import nn

from ..exceptions import KFACConfigError
from ..utils.enums import LayerPreset

try:  # transformers is a dependency, but keep the math importable without it
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = ()  # type: ignore[assignment]

SUPPORTED_TYPES: tuple[type, ...] = (nn.Linear,) + ((Conv1D,) if Conv1D else ())

#: parent name components (lower case) that mark an attention block
ATTENTION_PARENTS = frozenset({
    "attn", "self_attn", "attention", "self_attention", "selfattention", "cross_attn",
    "cross_attention", "crossattention", "encdecattention", "encoder_attn",
})
#: parent name components (lower case) that mark a feed-forward block
MLP_PARENTS = frozenset({"mlp", "feed_forward", "feedforward", "ffn", "ff"})
#: names (the last component) of feed-forward layers that sit directly in a block (OPT, BioGPT,
#: BART, mBART, Marian, Pegasus, M2M100, Whisper: ``layers.3.fc1``)
MLP_NAMES = frozenset({"fc1", "fc2"})
#: names of a classification head (the last name component), for models without an LM head
HEAD_NAMES = ("score", "classifier", "qa_outputs")
#: name components of PEFT LoRA adapter containers
LORA_NAMES = frozenset({"lora_A", "lora_B"})


def is_trainable(module: nn.Module) -> bool:
    """The module has a ``weight`` tensor that requires grad."""
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.requires_grad


def block_stack(model: nn.Module) -> tuple[str, int] | None:
    """``(name, length)`` of the transformer blocks' ``nn.ModuleList``, or None (no list).

    The blocks are the longest *outermost* ``nn.ModuleList`` (first on a tie): one nested in
    another list's element is a part of a block (T5's ``block.3.layer``, an MoE's experts),
    never the stack, however long. An encoder-decoder (``config.is_encoder_decoder``: T5,
    BART, Marian, Whisper, ...) takes its decoder's stack, the lists with a ``decoder`` name
    component (``decoder.block``, ``model.decoder.layers``), whatever the two stacks' depths;
    only one without any (T5's encoder-only model) falls back to the longest outermost list.
    """
    lists = [(n, len(m)) for n, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0]
    outer = [(n, k) for n, k in lists
             if not any(n.startswith(o + ".") for o, _ in lists if o != n)]
    if bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)):
        outer = [(n, k) for n, k in outer if any(
            c == "decoder" or c.endswith("_decoder") for c in n.split("."))] or outer
    return max(outer, key=lambda t: t[1], default=None)  # max keeps the first on a tie


def block_prefix(model: nn.Module) -> str | None:
    """Name of the transformer blocks' ``nn.ModuleList`` (`block_stack`), or None."""
    stack = block_stack(model)
    return stack[0] if stack is not None else None


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, SUPPORTED_TYPES) and is_trainable(m)]


def _parents(name: str, prefix: str | None) -> list[str] | None:
    """Name components between the block index and the module's own name, lower case; None
    outside the blocks."""
    if prefix is None or not name.startswith(prefix + "."):
        return None
    return [c.lower() for c in name[len(prefix) + 1:].split(".")[1:-1]]


def _output_head(model: nn.Module) -> tuple[str | None, nn.Module | None]:
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        head = None
    if not isinstance(head, SUPPORTED_TYPES):
        return None, None
    name = next((n for n, m in model.named_modules() if m is head), None)
    return name, head


def _last_layer(model: nn.Module, prefix: str | None) -> tuple[list[str], str]:
    name, head = _output_head(model)
    if head is not None:
        if is_trainable(head):
            return [name], ""
        return [], f"its output head {name!r} is frozen (weight.requires_grad is False)"
    heads = [n for n, _ in model.named_modules()
             if n and n.rsplit(".", 1)[-1] in HEAD_NAMES and _parents(n, prefix) is None]
    for head_name in reversed(heads):
        inside = [n for n, _ in _candidates(model)
                  if n == head_name or n.startswith(head_name + ".")]
        if inside:
            return [inside[-1]], ""
    if heads:
        return [], f"its head {heads[-1]!r} has no trainable Linear/Conv1D layer"
    return [], (f"it has no output head: get_output_embeddings() gives no Linear/Conv1D and "
                f"no module is named one of {HEAD_NAMES}")


def preset_layers(model: nn.Module, preset: str) -> list[str]:
    """Module names (``named_modules`` order) that ``preset`` selects in ``model``; rules in the
    module docstring. ``exclude`` is not applied here (`select_layers` does it).

    Raises:
        KFACConfigError: an unknown preset; ``"lora"`` on a model without LoRA layers; a
            preset that selects nothing in ``model`` (the message names both).
    """
    if preset not in LayerPreset:
        from ..config import unknown_preset_error  # KFACConfig's message, with "did you mean"

        raise unknown_preset_error(preset)
    preset = LayerPreset(preset)
    cls = type(model).__name__
    prefix = block_prefix(model)
    candidates = _candidates(model)
    reason = ""
    if preset is LayerPreset.LAST_LAYER:
        names, reason = _last_layer(model, prefix)
    elif preset is LayerPreset.LORA:
        is_lora = [isinstance(m, SUPPORTED_TYPES) and LORA_NAMES.intersection(n.split("."))
                   for n, m in model.named_modules()]
        if not any(is_lora):
            raise KFACConfigError(
                f"KFACConfig.preset='lora' needs a PEFT LoRA model: {cls} has no lora_A/lora_B "
                "Linear layers (wrap it with peft.get_peft_model, or pick another preset)")
        names = [n for n, _ in candidates if LORA_NAMES.intersection(n.split("."))]
        reason = "its lora_A/lora_B layers are all frozen"
    else:
        inside = [(n, _parents(n, prefix)) for n, _ in candidates]
        inside = [(n, parents) for n, parents in inside if parents is not None]
        if preset is LayerPreset.ATTENTION:
            names = [n for n, parents in inside if ATTENTION_PARENTS.intersection(parents)]
            what = f"under a parent named one of {sorted(ATTENTION_PARENTS)}"
        elif preset is LayerPreset.MLP:
            names = [n for n, parents in inside if MLP_PARENTS.intersection(parents) or (
                not parents and n.rsplit(".", 1)[-1] in MLP_NAMES)]
            what = (f"under a parent named one of {sorted(MLP_PARENTS)} or named one of "
                    f"{sorted(MLP_NAMES)}")
        else:
            names = [n for n, _ in inside]
            what = ""
        reason = (f"no trainable Linear/Conv1D inside the transformer blocks ({prefix!r}) {what}"
                  if prefix is not None else "it has no transformer blocks (no nn.ModuleList)")
    if not names:
        raise KFACConfigError(f"KFACConfig.preset={preset.value!r} selects no layer of {cls}: "
                              f"{reason.strip()}")
    return names
