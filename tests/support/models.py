"""Tiny, offline model builders and real-text data for the test suite.

Everything here is built from configs (no hub access) and seeded so that tests are
deterministic.  The global torch RNG state is never disturbed: weight initialisation
runs inside ``torch.random.fork_rng``.

Public API
----------
* ``tiny_gpt2(dtype=torch.float64, seed=0, **overrides) -> GPT2LMHeadModel``
* ``tiny_llama(dtype=torch.float64, seed=0, **overrides) -> LlamaForCausalLM``
* ``tiny_opt(dtype=torch.float64, seed=0, **overrides) -> OPTForCausalLM``
* ``tiny_biogpt(dtype=torch.float64, seed=0, **overrides) -> BioGptForCausalLM``
* ``lora_gpt2(dtype=torch.float64, seed=0) -> peft.PeftModelForCausalLM``
* ``real_text() -> bytes``
* ``text_examples(n_seq, seq_len, seed=0, pad_to=None, lengths=None) -> list[dict]``
* ``ListDataset(examples)`` (a ``torch.utils.data.Dataset``)
* ``save_bpe_tokenizer(directory, texts) -> PreTrainedTokenizerFast`` (trained offline)
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

__all__ = [
    "tiny_gpt2",
    "tiny_llama",
    "tiny_opt",
    "tiny_biogpt",
    "lora_gpt2",
    "LORA_TARGETS",
    "real_text",
    "text_examples",
    "ListDataset",
    "save_bpe_tokenizer",
]

#: target modules used by :func:`lora_gpt2`
LORA_TARGETS = ("c_attn", "c_fc")


def _build(model_cls, config, dtype: torch.dtype, seed: int):
    """Instantiate ``model_cls(config)`` under a private RNG seeded with ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype)
    model.train()
    return model


def tiny_classifier_run(tmp_path, n_classes: int = 4):
    """A 1-layer float64 ``GPT2ForSequenceClassification`` (16 wide, ``n_classes`` labels)
    trained by `harness.run` on 4 sequences of 12 byte tokens labelled ``i % n_classes``, its
    snapshot under ``tmp_path/kfac``. Returns ``(model, snapshot, examples)``."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from kfac_stream import Snapshot

    from harness import run

    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=n_classes,
        pad_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).double()
    ex = text_examples(4, 12)
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % n_classes)
    run(model, ex, batch=2, tmp_path=tmp_path, record=False)
    return model, Snapshot.latest(tmp_path / "kfac"), ex


def tiny_gpt2(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A 2-layer byte-level GPT-2 (``transformers.pytorch_utils.Conv1D`` layers).

    Defaults: n_layer=2, n_embd=16, n_head=2, vocab_size=256, n_positions=64, all dropout
    probabilities 0.0, tied input/output embeddings (``lm_head`` is an ``nn.Linear`` without
    bias sharing its weight with ``transformer.wte``).  ``overrides`` are passed to
    ``GPT2Config`` (e.g. ``vocab_size=32``, ``tie_word_embeddings=False``,
    ``attn_implementation="eager"``).

    Tracked-layer names (``model.named_modules()``): ``transformer.h.{i}.attn.c_attn``
    (16->48), ``transformer.h.{i}.attn.c_proj`` (16->16), ``transformer.h.{i}.mlp.c_fc``
    (16->64), ``transformer.h.{i}.mlp.c_proj`` (64->16), all Conv1D with bias, and
    ``lm_head`` (Linear 16->256, no bias).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    kw = dict(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=256,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    kw.update(overrides)
    return _build(GPT2LMHeadModel, GPT2Config(**kw), dtype, seed)


def tiny_llama(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A 2-layer byte-level Llama with grouped-query attention (all ``nn.Linear``, no bias).

    Defaults: hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
    max_position_embeddings=64, attention_bias=False, mlp_bias=False,
    tie_word_embeddings=False.  ``overrides`` go to ``LlamaConfig``.

    Tracked-layer names: ``model.layers.{i}.self_attn.{q,k,v,o}_proj``
    (q: 16->16, k/v: 16->8, o: 16->16), ``model.layers.{i}.mlp.{gate,up}_proj`` (16->32),
    ``model.layers.{i}.mlp.down_proj`` (32->16), ``lm_head`` (16->256).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    kw.update(overrides)
    return _build(LlamaForCausalLM, LlamaConfig(**kw), dtype, seed)


def tiny_seq2seq(family: str, vocab_size: int, d_model: int = 32):
    """A one-layer-each-side encoder-decoder from a config, seeded, dropout 0: ``"t5"``
    (``T5ForConditionalGeneration``; pad 0, eos 1, decoder start 0) or ``"bart"``
    (``BartForConditionalGeneration``; bos 0, pad 1, eos 2, decoder start 2), 4 heads,
    feed-forward width ``2·d_model``."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    if family == "t5":
        return T5ForConditionalGeneration(T5Config(
            vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model,
            num_layers=1, num_decoder_layers=1, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    return BartForConditionalGeneration(BartConfig(
        vocab_size=vocab_size, d_model=d_model, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))


def tiny_albert(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A byte-level ALBERT LM head model whose ONE shared layer group runs at every depth: its
    Linear layers are called ``num_hidden_layers`` times per forward (ALBERT's sharing).

    Defaults: embedding_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=24, vocab_size=256, max_position_embeddings=64, dropout 0.
    Shared-layer names: ``albert.encoder.albert_layer_groups.0.albert_layers.0.`` +
    ``attention.{query,key,value,dense}`` (16->16), ``ffn`` (16->24), ``ffn_output``
    (24->16), all with bias; called once: ``albert.encoder.embedding_hidden_mapping_in``
    (8->16).
    """
    from transformers import AlbertConfig, AlbertForMaskedLM

    kw = dict(vocab_size=256, embedding_size=8, hidden_size=16, num_hidden_layers=2,
              num_attention_heads=2, intermediate_size=24, max_position_embeddings=64,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              classifier_dropout_prob=0.0)
    kw.update(overrides)
    return _build(AlbertForMaskedLM, AlbertConfig(**kw), dtype, seed)


def tiny_opt(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A 2-layer byte-level OPT (all ``nn.Linear`` with bias, dropout 0).

    Defaults: hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
    vocab_size=256, max_position_embeddings=64. Its attention registers ``k_proj, v_proj,
    q_proj`` but calls ``q_proj`` first (the shared-input group's call order differs from its
    registration order), and ``fc1``/``fc2`` receive ``[B*T, d]`` rows, not ``[B, T, d]``.

    Tracked-layer names: ``model.decoder.layers.{i}.self_attn.{k,v,q,out}_proj`` (32->32),
    ``model.decoder.layers.{i}.fc1`` (32->64), ``model.decoder.layers.{i}.fc2`` (64->32).
    """
    from transformers import OPTConfig, OPTForCausalLM

    kw = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
              num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
              dropout=0.0, attention_dropout=0.0, layerdrop=0.0, pad_token_id=1,
              bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    return _build(OPTForCausalLM, OPTConfig(**kw), dtype, seed)


def tiny_biogpt(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A 2-layer byte-level BioGPT (``k_proj, v_proj, q_proj`` registered, ``q_proj`` called
    first, as in OPT). Defaults: hidden_size=32, intermediate_size=64, num_attention_heads=4,
    vocab_size=256, max_position_embeddings=64, dropout 0."""
    from transformers import BioGptConfig, BioGptForCausalLM

    kw = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
              num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, activation_dropout=0.0, layerdrop=0.0,
              pad_token_id=1, bos_token_id=0, eos_token_id=2)
    kw.update(overrides)
    return _build(BioGptForCausalLM, BioGptConfig(**kw), dtype, seed)


def lora_gpt2(dtype: torch.dtype = torch.float64, seed: int = 0, lora_b_std: float = 0.1):
    """``tiny_gpt2`` wrapped by peft LoRA (r=4, alpha=8, targets c_attn and c_fc).

    peft zero-initialises ``lora_B``, which would make every gradient w.r.t. the ``lora_A``
    outputs exactly zero; here every ``lora_B`` weight is re-initialised with
    N(0, lora_b_std^2) from a generator seeded with ``seed + 1``, so tests are non-trivial.

    Module names (``model.named_modules()``) of the LoRA ``nn.Linear`` layers:
    ``base_model.model.transformer.h.{i}.attn.c_attn.lora_A.default`` (16->4),
    ``...attn.c_attn.lora_B.default`` (4->48), ``...mlp.c_fc.lora_A.default`` (16->4),
    ``...mlp.c_fc.lora_B.default`` (4->64); none has a bias.  They receive [B, T, d]
    inputs.  Only LoRA weights require grad; the base layers (``...c_attn.base_layer``,
    Conv1D) are frozen.
    """
    from peft import LoraConfig, get_peft_model

    base = tiny_gpt2(dtype=dtype, seed=seed)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        fan_in_fan_out=True,
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                # keep adapters in the requested dtype whatever peft's autocast policy is
                if p.dtype != dtype:
                    p.data = p.data.to(dtype)
            if ".lora_B." in name and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * lora_b_std)
    model.train()
    return model


@functools.lru_cache(maxsize=1)
def real_text() -> bytes:
    """Real English text shipped with CPython: the values of ``pydoc_data.topics.topics``
    (Python's language-reference topics), joined by blank lines, UTF-8 encoded (~470 kB)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def _pad(ids: torch.Tensor, total: int) -> dict[str, torch.Tensor]:
    n = ids.numel()
    if total < n:
        raise ValueError(f"pad length {total} is shorter than the example ({n})")
    input_ids = torch.zeros(total, dtype=torch.long)
    attention_mask = torch.zeros(total, dtype=torch.long)
    labels = torch.full((total,), -100, dtype=torch.long)
    input_ids[:n] = ids
    attention_mask[:n] = 1
    labels[:n] = ids
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def text_examples(
    n_seq: int,
    seq_len: int,
    seed: int = 0,
    pad_to: int | None = None,
    lengths: Sequence[int] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Byte-level windows of :func:`real_text` as causal-LM examples.

    Each example is a dict of 1-D ``torch.long`` tensors of length ``L``:
    ``input_ids`` [L] (byte ids 0..255), ``attention_mask`` [L] and ``labels`` [L]
    (``labels == input_ids`` on real tokens).  Window offsets are drawn from
    ``random.Random(seed)``.

    * ``lengths=None``: every example has true length ``seq_len``; ``L = pad_to`` if given
      (must be >= seq_len) else ``seq_len``.
    * ``lengths=[...]`` (``len(lengths) == n_seq``): example i has true length
      ``lengths[i]``; all are padded to ``L = pad_to`` if given else ``max(lengths)``.

    Padding is on the right: ``input_ids`` 0, ``attention_mask`` 0, ``labels`` -100.
    """
    text = real_text()
    if lengths is None:
        lengths = [seq_len] * n_seq
    else:
        lengths = [int(x) for x in lengths]
        if len(lengths) != n_seq:
            raise ValueError(f"len(lengths)={len(lengths)} != n_seq={n_seq}")
    if any(x < 1 for x in lengths):
        raise ValueError("every example needs at least one token")
    total = max(lengths) if pad_to is None else int(pad_to)
    rng = random.Random(seed)
    out = []
    for n in lengths:
        off = rng.randrange(0, len(text) - n)
        ids = torch.tensor(list(text[off : off + n]), dtype=torch.long)
        out.append(_pad(ids, total))
    return out


class ListDataset(Dataset):
    """A map-style dataset over a list of example dicts (usable by HF ``Trainer`` with its
    default collator; examples batched together must have equal length)."""

    def __init__(self, examples: Sequence[dict[str, torch.Tensor]]):
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return dict(self.examples[i])


def save_bpe_tokenizer(directory, texts: list[str]):
    """Train a small byte-level BPE on ``texts`` offline and save it as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    hf.save_pretrained(directory)
    return hf


def padded_batch(lengths: Sequence[int], seed: int = 4) -> dict[str, torch.Tensor]:
    """``{"input_ids", "attention_mask"}``, each ``[B, T]``, right-padded to max(lengths)."""
    ex = text_examples(len(lengths), max(lengths), seed=seed, lengths=list(lengths))
    return {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}


def labelled_examples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` 12-token `text_examples` (windows from ``seed``) as a 3-class classifier's:
    ``labels`` a 0-d tensor, the first byte mod 3."""
    ex = text_examples(n, 12, seed=seed)
    for e in ex:
        e["labels"] = torch.tensor(int(e["input_ids"][0]) % 3)
    return ex
