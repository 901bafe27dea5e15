"""``HeldoutConfig.answer_tokens``: the answer options of an answer-token fine-tune, resolved at
train begin to token ids (`resolve_answer_tokens`) and recorded in every snapshot's manifest
(``"answer_tokens": {"ids": [...], "texts": [...]}``; `Snapshot.answer_tokens`).

A string is tokenised once with the Trainer's tokenizer (its ``processing_class``, or that
processor's ``tokenizer``), without special tokens, and must be exactly one token; an id must
lie in the model's output vocabulary. The model needs a language-model head (an output
embedding): a classifier's answers are its classes. Every misconfiguration is one
`KFACConfigError` line at train begin, before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..exceptions import KFACConfigError
from .inputs import output_vocab

WHERE = "HeldoutConfig.answer_tokens"


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer of a Trainer's ``processing_class`` (a tokenizer, or a processor holding
    one as ``.tokenizer``), or None."""
    if processing_class is None:
        return None
    tok = getattr(processing_class, "tokenizer", None)
    return tok if tok is not None and callable(tok) else (
        processing_class if callable(processing_class) else None)


def resolve_answer_tokens(spec: Sequence[int | str] | None, model: nn.Module,
                          tokenizer: Any) -> dict[str, list] | None:
    """``{"ids": [K ints], "texts": [K strs] or None}`` of ``HeldoutConfig.answer_tokens`` on
    ``model`` (None when unset); ``texts``: the strings given, or the tokenizer's decoding of
    the ids given (None without a tokenizer, or when one is not printable text).

    Raises:
        KFACConfigError: a model without a language-model head, a string without a tokenizer
            or that is not exactly one token, an id outside the vocabulary, or two options
            that are one token.
    """
    if spec is None:
        return None
    shown = f"{WHERE}={list(spec)!r}"
    vocab = output_vocab(model)
    if vocab is None:
        raise KFACConfigError(
            f"{shown} needs a language-model head (logits over a vocabulary): "
            f"{type(model).__name__} has none (a classifier's answers are its classes: leave "
            "answer_tokens unset)")
    ids, texts = [], []
    for option in spec:
        if isinstance(option, str):
            if tokenizer is None:
                raise KFACConfigError(
                    f"{shown}: the option {option!r} is a string, but the Trainer has no "
                    "tokenizer (processing_class) to encode it: pass Trainer(..., "
                    "processing_class=tokenizer) or the token ids")
            toks = list(tokenizer(option, add_special_tokens=False)["input_ids"])
            if len(toks) != 1:
                raise KFACConfigError(
                    f"{shown}: {option!r} is {len(toks)} tokens {toks} with the Trainer's "
                    "tokenizer: each answer must be exactly one token (a leading space often "
                    "makes it one: ' A' rather than 'A')")
            ids.append(int(toks[0]))
            texts.append(option)
        else:
            ids.append(int(option))
            texts.append(None if tokenizer is None else tokenizer.decode([int(option)]))
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise KFACConfigError(f"{shown}: token id {bad[0]} is outside the model's {vocab} "
                              "vocabulary logits")
    if len(set(ids)) != len(ids):
        first = next(i for i in ids if ids.count(i) > 1)
        same = [repr(o) for o, i in zip(spec, ids) if i == first]
        raise KFACConfigError(f"{shown}: {' and '.join(same)} are the same token ({first}): "
                              "the options must be distinct tokens")
    shown_texts = all(t is not None and t.isprintable() for t in texts)  # a manifest string
    return {"ids": ids, "texts": texts if shown_texts else None}
