"""Models for the training app: a tiny GPT-2 built from a config, or a pretrained causal LM.

``tiny_gpt2`` needs no download (its byte-level vocabulary matches ``data.ByteTokenizer``);
``load_hf_model`` is the Hugging Face path (a hub name such as ``"gpt2"`` or a local directory
written by ``save_pretrained``).
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


def tiny_gpt2(vocab_size: int = 256, n_layer: int = 2, n_embd: int = 128, n_head: int = 4,
              seq_len: int = 128, seed: int = 0) -> GPT2LMHeadModel:
    """A freshly initialised GPT-2 in float32 and train mode, the same for the same ``seed``.

    No dropout; ``seq_len`` positions; token 0 is both BOS and EOS. The initialisation draws
    from a forked RNG, so the global torch RNG is left as it was. The model maps
    ``input_ids`` [batch, seq] (seq <= seq_len) to ``logits`` [batch, seq, vocab_size].
    """
    config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd,
                        n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    return model.float().train()


def load_hf_model(name_or_path: str, dtype: str | None = None,
                  trust_remote_code: bool = False
                  ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A pretrained causal LM and its tokenizer, from the hub or a local directory.

    ``dtype``: ``"auto"`` (the checkpoint's dtype), a torch dtype name (``"float32"``,
    ``"bfloat16"``, ...) or None (the transformers default: ``"auto"`` in 5.x, float32 in 4.x).
    A tokenizer without a pad token gets its EOS token as the pad token. The model comes back
    as ``from_pretrained`` leaves it (eval mode; the Trainer switches it to train mode).
    """
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype if dtype == "auto" else _torch_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                 **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``, ``"bfloat16"``, ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use 'auto', a torch dtype name or None")
    return dtype
