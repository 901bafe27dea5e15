"""Memory cost of the layer presets: the CPU bytes of the tracker's stored factors.

Per tracked layer the store keeps A (side ``d_A = d_in + 1`` with a bias, else ``d_in``) and G
(side ``d_out``), each as ``d²`` entries when dense or ``d`` when its side exceeds
``max_dense_dim`` (kept diagonal), at ``storage_bytes`` per entry (2: FP16, the default; the
float32 scale per factor is left out). With ``share_inputs`` the layers that read the same
input (q/k/v, gate/up) keep one A between them (`kfac_stream.capture.sharing`), found by the
tracker's own 2-token probe forward. This is the per-model total: with several ranks each
factor has one owner, so a rank holds about ``1/world_size`` of it. A snapshot on disk adds the
eigenvectors of every dense factor (float32, ``4·d²`` bytes).

``python -m kfac_stream.capture.preset_memory`` prints the table of docs/configuration.md for
GPT-2 small and Llama-2-7B, both built on the ``meta`` device from their configs (nothing is
downloaded or allocated).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..utils.enums import LayerPreset
from .selection import select_layers
from .sharing import plan_factors, probe_shared_inputs


def factor_bytes(dims: Mapping[str, tuple[int, bool]], storage_bytes: int = 2) -> int:
    """Bytes of the factors ``{key: (side d, diagonal)}``: ``d`` or ``d²`` entries each."""
    return storage_bytes * sum(d if diagonal else d * d for d, diagonal in dims.values())


def preset_dims(model: nn.Module, preset: str | None, max_dense_dim: int = 8192,
                share_inputs: bool = False, exclude: list[str] | None = None
                ) -> dict[str, tuple[int, bool]]:
    """``{factor key: (side, diagonal)}`` of the factors ``preset`` tracks in ``model``
    (``preset=None``: the default selection), as the tracker plans them."""
    specs = select_layers(model, None, exclude, preset)
    groups = []
    if share_inputs:
        modules = dict(model.named_modules())
        groups = probe_shared_inputs(model, {n: modules[n] for n in specs})
    return plan_factors(specs, max_dense_dim, groups).dims


def preset_factor_bytes(model: nn.Module, preset: str | None, max_dense_dim: int = 8192,
                        storage_bytes: int = 2, share_inputs: bool = False,
                        exclude: list[str] | None = None) -> int:
    """Stored factor bytes of ``preset`` on ``model``: ``Σ_layers`` A (``d_A²``, or ``d_A`` if
    diagonal) + G (``d_out²``, or ``d_out`` if diagonal), times ``storage_bytes``; with
    ``share_inputs`` a shared A counts once."""
    return factor_bytes(preset_dims(model, preset, max_dense_dim, share_inputs, exclude),
                        storage_bytes)


def meta_models() -> dict[str, nn.Module]:
    """GPT-2 small (``GPT2Config()`` defaults, 124M) and Llama-2-7B, on ``meta``, each also with
    PEFT LoRA adapters (r=16 on GPT-2's ``c_attn``, on Llama's ``q_proj``/``v_proj``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config())
        llama = LlamaForCausalLM(LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, vocab_size=32000))
        gpt2_lora = get_peft_model(GPT2LMHeadModel(GPT2Config()), LoraConfig(
            r=16, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"))
        llama_lora = get_peft_model(LlamaForCausalLM(llama.config), LoraConfig(
            r=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return {"GPT-2 small": gpt2, "Llama-2-7B": llama,
            "GPT-2 small + LoRA": gpt2_lora, "Llama-2-7B + LoRA": llama_lora}


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_table(max_dense_dim: int = 8192, storage_bytes: int = 2) -> str:
    """Markdown table: per preset and model, tracked layers, diagonal factors and the FP16
    factor bytes with one A per layer / with shared inputs (the default ``share_inputs``)."""
    models = meta_models()
    rows = ["| preset | model | layers | diagonal factors | factors, one A per layer "
            "| factors, shared A (default) |", "| --- | --- | --- | --- | --- | --- |"]
    for preset in LayerPreset:
        names = (["GPT-2 small + LoRA", "Llama-2-7B + LoRA"] if preset is LayerPreset.LORA
                 else ["GPT-2 small", "Llama-2-7B"])
        for name in names:
            model = models[name]
            dims = preset_dims(model, preset.value, max_dense_dim)
            shared = preset_dims(model, preset.value, max_dense_dim, share_inputs=True)
            layers = len(select_layers(model, None, None, preset.value))
            diag = sum(d for _, d in dims.values())
            rows.append(f"| `{preset.value}` | {name} | {layers} | {diag} | "
                        f"{_size(factor_bytes(dims, storage_bytes))} | "
                        f"{_size(factor_bytes(shared, storage_bytes))} |")
    return "\n".join(rows)


def main() -> None:  # pragma: no cover - prints the docs' table
    print(memory_table())


if __name__ == "__main__":  # pragma: no cover
    main()
