"""Argument checks of the query API (`LaplacePosterior`, `topk_predictive`, the CLI).

Every check raises `QueryInputError` with one line::

    {where}: {argument}={value} {problem}: must be {what is allowed}

naming the call, the argument, its value (shortened to one line) and what is allowed. The checks
look at Python types, tensor shapes and dtypes, and the values of integer tensors that live on
the CPU; they run no model and read nothing back from an accelerator (no host sync), so they cost
microseconds per call.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..exceptions import QueryInputError
from .lengths import check_length, input_positions

#: Longest rendering of a value in a message (longer ones end in "...").
MAX_SHOWN = 80

BATCH_ALLOWED = ("a dict of model inputs with 'input_ids' [B, T] (an integer tensor) or "
                 "'inputs_embeds' [B, T, d], optionally 'attention_mask' [B, T] "
                 "(one sequence ids [T]: {'input_ids': ids[None]})")


def show(value: Any) -> str:
    """``value`` on one line of at most `MAX_SHOWN` characters (a tensor as its shape and
    dtype, a mapping with its values shown so)."""
    if isinstance(value, Tensor):
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"<tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}{where}>"
    if isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k!r}: {show(v)}" for k, v in value.items()) + "}"
    else:
        text = repr(value)
    text = " ".join(text.splitlines())
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def error(where: str, arg: str, value: Any, allowed: str, problem: str = "is not allowed",
          typed: bool = False) -> QueryInputError:
    """The `QueryInputError` ``"{where}: {arg}={value} {problem}: must be {allowed}"``;
    ``typed`` adds the value's type (for a value of the wrong type)."""
    shown = show(value) + (f" (a {type(value).__name__})" if typed else "")
    return QueryInputError(f"{where}: {arg}={shown} {problem}: must be {allowed}")


def check_flag(where: str, arg: str, value: Any) -> None:
    """``value`` is a bool (not merely truthy), else a one-line `QueryInputError`."""
    if not isinstance(value, bool):
        raise error(where, arg, value, "True or False", typed=True)


def forward_inputs(batch: Mapping[str, Any], model: nn.Module | None = None) -> dict[str, Any]:
    """The keyword arguments of a query's forward: ``batch`` without the training-only
    ``labels`` / ``num_items_in_batch`` and, for a ``model`` whose config has ``use_cache``,
    ``use_cache=False`` unless given (a query keeps no key/value cache). An encoder-decoder's
    decoder inputs come from `query_batch`, which every query calls first."""
    out = {k: v for k, v in batch.items() if k not in ("labels", "num_items_in_batch")}
    if model is not None and getattr(getattr(model, "config", None), "use_cache",
                                     None) is not None:
        out.setdefault("use_cache", False)
    return out


def is_int(x: Any) -> bool:
    """An integer, not a bool (Python or NumPy)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A real number, not a bool (Python or NumPy)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int_tensor(x: Any) -> bool:
    """An integer (not bool) tensor."""
    return (isinstance(x, Tensor) and not x.is_floating_point() and not x.is_complex()
            and x.dtype != torch.bool)


def from_numpy(value: Any) -> Any:
    """A NumPy array (anything with ``__array__`` that is no tensor or string) as a tensor;
    anything else unchanged."""
    if hasattr(value, "__array__") and not isinstance(value, (Tensor, str, bytes)):
        return torch.as_tensor(value)
    return value


def check_int(where: str, arg: str, value: Any, lowest: int) -> int:
    """``value`` as an int ``>= lowest``."""
    if not is_int(value):
        raise error(where, arg, value, f"an int >= {lowest}", typed=True)
    if value < lowest:
        raise error(where, arg, value, f"an int >= {lowest}")
    return int(value)


def check_seed(where: str, arg: str, value: Any) -> int:
    """A random seed: any int."""
    if not is_int(value):
        raise error(where, arg, value, "an int (the random seed)", typed=True)
    return int(value)


def check_positive(where: str, arg: str, value: Any, allowed: str = "a positive finite float"
                   ) -> float:
    """``value`` as a float, finite and ``> 0``."""
    if not is_real(value):
        raise error(where, arg, value, allowed, typed=True)
    if not (math.isfinite(value) and value > 0):
        raise error(where, arg, value, allowed)
    return float(value)


def check_finite(where: str, arg: str, value: Any, allowed: str = "a finite float") -> float:
    """``value`` as a finite float."""
    if not is_real(value):
        raise error(where, arg, value, allowed, typed=True)
    if not math.isfinite(value):
        raise error(where, arg, value, allowed)
    return float(value)


def check_choice(where: str, arg: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise error(where, arg, value, f"one of {choices}", typed=not isinstance(value, str))
    return value


def prior_allowed(n_layers: int, marglik: bool) -> str:
    """What a prior precision may be, for a posterior over ``n_layers`` layers."""
    return (f"a positive finite float, a dict {{layer: positive finite float}} with exactly the "
            f"posterior's {n_layers} layers" + (", or one of 'auto', 'heldout', 'marglik'"
                                                 if marglik else ""))


def names_shown(names: Sequence[str], most: int = 3) -> str:
    """The first ``most`` of ``names`` and how many more: ``'a', 'b', 'c' and 5 more``."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(repr(n) for n in names[:most]) + more


def check_prior(where: str, arg: str, value: Any, layers: Sequence[str], marglik: bool
                ) -> float | dict[str, float] | str:
    """A prior precision ``τ``: a float, ``{layer: float}`` over exactly ``layers`` (returned in
    their order, as floats) or, where ``marglik``, the string ``"marglik"``."""
    allowed = prior_allowed(len(layers), marglik)
    if isinstance(value, str):
        if marglik and value == "marglik":
            return value
        raise error(where, arg, value, allowed)
    if isinstance(value, Mapping):
        missing = [n for n in layers if n not in value]
        if missing:
            raise error(where, arg, value, allowed,
                        problem=f"lacks {len(missing)} of the posterior's layers "
                                f"({names_shown(missing)})")
        known = set(layers)
        extra = [k for k in value if k not in known]
        if extra:
            raise error(where, arg, value, allowed,
                        problem=f"has {len(extra)} key(s) that are no layer of the snapshot "
                                f"({names_shown(extra)})")
        return {n: check_positive(where, f"{arg}[{n!r}]", value[n]) for n in layers}
    if not is_real(value):
        raise error(where, arg, value, allowed, typed=True)
    if not (math.isfinite(value) and value > 0):
        raise error(where, arg, value, allowed)
    return float(value)


def input_vocab(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (the ids ``input_ids`` may hold), or None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    return int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else None


def output_vocab(model: nn.Module) -> int | None:
    """Logits of the model's language-model head, or None (a classifier): its output layer's
    ``out_features`` / ``num_embeddings`` (not its ZeRO-3-partitioned weight), or the config's."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    size = None if head is None else (getattr(head, "out_features", None) or getattr(
        head, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size",
                                                 None))
    return int(size) if size else None


def check_id_range(where: str, arg: str, value: Any, ids: Tensor, size: int, what: str) -> None:
    """Every entry of the integer tensor ``ids`` in ``[0, size)``; ``value`` is what the caller
    passed (for the message). Tensors on an accelerator are not read (no host sync)."""
    if ids.device.type != "cpu" or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        raise error(where, arg, value, f"ids in [0, {size})",
                    problem=f"holds {bad}, outside {what}")


def check_batch(where: str, arg: str, batch: Any, vocab: int | None = None,
                positions: int | None = None) -> tuple[int, int]:
    """A batch of model inputs; returns ``(B, T)``.

    ``input_ids`` must be a ``[B, T]`` integer tensor (on the CPU, ids in ``[0, vocab)``) or
    ``inputs_embeds`` a ``[B, T, d]`` floating tensor, with ``T`` at most ``positions`` (the
    model's, `input_positions`; None: not checked); ``attention_mask``, if given, ``[B, T]``.
    """
    if not isinstance(batch, Mapping):
        raise error(where, arg, batch, BATCH_ALLOWED, typed=True)
    ids, emb = batch.get("input_ids"), batch.get("inputs_embeds")
    if ids is None and emb is None:
        raise error(where, arg, batch, BATCH_ALLOWED,
                    problem="has neither 'input_ids' nor 'inputs_embeds'")
    if ids is not None:
        allowed = "a [B, T] integer tensor of token ids with B, T >= 1"
        if not is_int_tensor(ids) or ids.dim() != 2 or ids.numel() == 0:
            raise error(where, f"{arg}['input_ids']", ids, allowed,
                        typed=not isinstance(ids, Tensor))
        if vocab is not None:
            check_id_range(where, f"{arg}['input_ids']", ids, ids, vocab,
                           f"the model's {vocab} input embeddings")
        shape = tuple(ids.shape)
    else:
        if not isinstance(emb, Tensor) or not emb.is_floating_point() or emb.dim() != 3 or (
                emb.shape[0] == 0 or emb.shape[1] == 0):
            raise error(where, f"{arg}['inputs_embeds']", emb,
                        "a [B, T, d] floating tensor with B, T >= 1",
                        typed=not isinstance(emb, Tensor))
        shape = tuple(emb.shape[:2])
    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, Tensor) or tuple(mask.shape) != shape[:2]):
        raise error(where, f"{arg}['attention_mask']", mask,
                    f"a [B, T] = {list(shape[:2])} tensor (1: token, 0: padding)",
                    typed=not isinstance(mask, Tensor))
    key = "input_ids" if ids is not None else "inputs_embeds"
    check_length(where, f"{arg}[{key!r}]", int(shape[1]), positions)
    return int(shape[0]), int(shape[1])


def check_model_batch(where: str, arg: str, batch: Any, model: nn.Module) -> tuple[int, int]:
    """`check_batch` against ``model``'s input embeddings (`input_vocab`) and positions
    (`input_positions`); returns ``(B, T)``."""
    return check_batch(where, arg, batch, input_vocab(model), input_positions(model))


#: Label value of a position without a label (as in Hugging Face's losses).
IGNORE_INDEX = -100

DECODER_ALLOWED = ("'labels' [B, T'] (the target token ids, -100 where there is no label: the "
                   "decoder inputs are made from them as in training) or 'decoder_input_ids' "
                   "[B, T']")


def seq2seq_lm(model: nn.Module) -> bool:
    """An encoder-decoder language model (T5, BART, Marian, Pegasus, ...): its config's
    ``is_encoder_decoder`` and a ``prepare_decoder_input_ids_from_labels`` (the shift that
    makes the decoder's inputs from the labels in training). Its decoder needs
    ``decoder_input_ids``; an encoder-decoder classifier (``BartForSequenceClassification``)
    makes its own from ``input_ids`` and is not one."""
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "is_encoder_decoder", False)) and callable(
        getattr(model, "prepare_decoder_input_ids_from_labels", None))


def make_decoder_input_ids(where: str, arg: str, labels: Tensor, model: nn.Module) -> Tensor:
    """``model.prepare_decoder_input_ids_from_labels(labels=labels)``: what training feeds the
    decoder (the labels shifted right behind the decoder start token, ``-100`` as padding).

    Raises:
        QueryInputError: the model cannot make them (e.g. no ``decoder_start_token_id`` or
            ``pad_token_id`` in its config).
    """
    try:
        return model.prepare_decoder_input_ids_from_labels(labels=labels)
    except (ValueError, TypeError, AttributeError) as e:
        raise error(where, f"{arg}['labels']", labels, "labels the model can make its "
                    "decoder_input_ids from (or pass 'decoder_input_ids' yourself)",
                    problem=f"gives no decoder inputs ({type(e).__name__}: "
                            f"{' '.join(str(e).split())})") from None


def query_batch(where: str, arg: str, batch: Mapping[str, Any], model: nn.Module
                ) -> Mapping[str, Any]:
    """The batch a query runs ``model`` on (``batch`` already passed `check_batch`).

    ``batch`` itself, except for an encoder-decoder language model (`seq2seq_lm`: T5, BART,
    ...) given ``labels`` ``[B, T']`` but no ``decoder_input_ids`` / ``decoder_inputs_embeds``:
    then a new dict (the caller's is not changed) with ``decoder_input_ids`` made from the
    labels as in training (`make_decoder_input_ids`). The labels stay in the batch: they say
    which decoder positions carry a label (`output_positions`), and no forward sees them
    (`forward_inputs`). Decoder inputs given are checked (``[B, T']``, with the labels' ``T'``
    when both are given) and used as they are.

    Raises:
        QueryInputError: an encoder-decoder's batch with neither labels nor decoder inputs
            (one line, instead of the model's own error deep in its forward), or one whose
            labels / decoder inputs have the wrong type or shape.
    """
    if not seq2seq_lm(model):
        return batch
    first = batch.get("input_ids")
    size = int((first if first is not None else batch["inputs_embeds"]).shape[0])
    labels, dec = batch.get("labels"), batch.get("decoder_input_ids")
    dec_emb, dec_mask = batch.get("decoder_inputs_embeds"), batch.get("decoder_attention_mask")
    if labels is not None and (not is_int_tensor(labels) or labels.dim() != 2
                               or labels.shape[0] != size or labels.shape[1] == 0):
        raise error(where, f"{arg}['labels']", labels,
                    f"a [B, T'] integer tensor of target ids with B = {size} (the batch's) and "
                    f"T' >= 1, -100 where there is no label", typed=not isinstance(labels, Tensor))
    if dec is not None:
        if not is_int_tensor(dec) or dec.dim() != 2 or dec.shape[0] != size or dec.shape[1] == 0:
            raise error(where, f"{arg}['decoder_input_ids']", dec,
                        f"a [B, T'] integer tensor of token ids with B = {size} (the batch's) "
                        "and T' >= 1", typed=not isinstance(dec, Tensor))
        shape = tuple(dec.shape)
    elif dec_emb is not None:
        if not isinstance(dec_emb, Tensor) or not dec_emb.is_floating_point() or \
                dec_emb.dim() != 3 or dec_emb.shape[0] != size or dec_emb.shape[1] == 0:
            raise error(where, f"{arg}['decoder_inputs_embeds']", dec_emb,
                        f"a [B, T', d] floating tensor with B = {size} (the batch's) and "
                        "T' >= 1", typed=not isinstance(dec_emb, Tensor))
        shape = tuple(dec_emb.shape[:2])
    elif labels is None:
        raise error(where, arg, batch, DECODER_ALLOWED,
                    problem="has neither 'labels' nor 'decoder_input_ids' (an encoder-decoder "
                            "model's decoder needs one)")
    else:
        shape = tuple(labels.shape)
    if labels is not None and tuple(labels.shape) != shape:
        raise error(where, f"{arg}['labels']", labels,
                    f"a [B, T'] = {list(shape)} integer tensor (the decoder inputs' shape)",
                    problem="does not fit the decoder inputs")
    if dec_mask is not None and (not isinstance(dec_mask, Tensor)
                                 or tuple(dec_mask.shape) != shape):
        raise error(where, f"{arg}['decoder_attention_mask']", dec_mask,
                    f"a [B, T'] = {list(shape)} tensor (1: token, 0: padding)",
                    typed=not isinstance(dec_mask, Tensor))
    if dec is not None or dec_emb is not None:
        return batch
    return {**batch, "decoder_input_ids": make_decoder_input_ids(where, arg, labels, model)}


def output_positions(batch: Mapping[str, Any], length: int) -> tuple[int, Mapping[str, Any]]:
    """What a query's ``positions`` index: ``(T, the batch whose attention_mask says which of
    them are tokens)``. A causal LM or encoder: the input's ``T`` and ``batch`` itself. An
    encoder-decoder (the batch holds ``decoder_input_ids [B, T']``, given or made from the
    labels by `query_batch`): the decoder's ``T'``; position ``t`` is the decoder's logit row
    ``t``, the one that predicts ``labels[:, t]`` (no shift, unlike a causal LM's). Its mask is
    ``decoder_attention_mask`` if given, else ``labels != -100`` when the batch has labels
    ``[B, T']`` (so ``-1`` is each example's last labelled position), else none."""
    dec = batch.get("decoder_input_ids")
    if not (isinstance(dec, Tensor) and dec.dim() == 2):
        dec = batch.get("decoder_inputs_embeds")
    if isinstance(dec, Tensor) and dec.dim() in (2, 3) and dec.shape[1] > 0:
        mask = batch.get("decoder_attention_mask")
        labels = batch.get("labels")
        if mask is None and isinstance(labels, Tensor) and labels.shape == dec.shape[:2]:
            mask = labels != IGNORE_INDEX
        return int(dec.shape[1]), ({} if mask is None else {"attention_mask": mask})
    return length, batch


def check_positions(where: str, arg: str, positions: Any, batch_size: int, length: int
                    ) -> int | list[int]:
    """One position for every example or one per example, each in ``[-T, T)``; returns an int
    or a list of ``B`` ints."""
    allowed = (f"an int in [-{length}, {length}) for every example, or {batch_size} such ints "
               f"(one per example); negative counts back from the last non-padding token")
    if is_int(positions):
        out: int | list[int] = int(positions)
        values = [out]
    else:
        positions = from_numpy(positions)
        if isinstance(positions, Tensor):
            if not is_int_tensor(positions) or positions.dim() != 1:
                raise error(where, arg, positions, allowed)
            values = positions.tolist()
        elif isinstance(positions, Sequence) and not isinstance(positions, (str, bytes)):
            values = list(positions)
            if not all(is_int(p) for p in values):
                raise error(where, arg, positions, allowed)
            values = [int(p) for p in values]
        else:
            raise error(where, arg, positions, allowed, typed=True)
        if len(values) != batch_size:
            raise error(where, arg, positions, allowed,
                        problem=f"gives {len(values)} positions for {batch_size} examples")
        out = values
    for p in values:
        if not -length <= p < length:
            raise error(where, arg, positions, allowed,
                        problem=f"{'is' if is_int(positions) else f'holds {p},'} outside the "
                                f"{length} positions")
    return out


def position_index(where: str, arg: str, positions_given: Any, batch: Mapping[str, Tensor],
                   size: int, length: int, positions: int | list[int]) -> list[int]:
    """The checked ``positions`` (one int or ``B`` ints, each in ``[-T, T)``) as ``B`` indices
    into the sequence axis. A negative position ``p`` counts back from the example's last
    non-padding token (``last + 1 + p``; right padding: ``n + p``, left padding: ``T + p``,
    ``n`` the example's tokens) and must stay within its tokens (``n + p ≥ 0``).

    Raises:
        QueryInputError: a negative position that counts back past an example's start.
    """
    mask = batch.get("attention_mask")
    if mask is None:
        lengths, last = [length] * size, [length - 1] * size
    else:
        m = mask.detach().cpu().bool()
        lengths = m.sum(1).tolist()
        last = (length - 1 - m.flip(1).int().argmax(1)).tolist()  # the last 1 of each row
    pos = [positions] * size if isinstance(positions, int) else list(positions)
    for b, (n, p) in enumerate(zip(lengths, pos)):
        if p < 0 and n + p < 0:
            raise error(where, arg, positions_given,
                        "in [-n, T) for an example of n non-padding tokens",
                        problem=f"counts back past the start of example {b}, which has "
                                f"{int(n)} non-padding tokens")
    return [p if p >= 0 else t + 1 + p for p, t in zip(pos, last)]


def _one_per_example(where: str, arg: str, token_ids: Any, flat: list[int], size: int,
                     options: bool) -> QueryInputError:
    """The error for ids of shape ``[B, 1]`` that may be meant as ``B`` options for every
    example (a tokenizer's ``input_ids`` of ``B`` one-token answers)."""
    readings = (f"it reads as K = 1 id per example, or as K = {len(flat)} options for every "
                f"example (a tokenizer's input_ids of {len(flat)} one-token answers)")
    if options:
        return error(where, arg, token_ids, f"K >= 2 options: for the {len(flat)} options of "
                     f"every example pass them flat ({flat[:4]}{'...' if len(flat) > 4 else ''}"
                     "), or per example a [B, K] row of K >= 2",
                     problem=f"gives one option per example (its probability is 1): {readings}")
    return error(where, arg, token_ids, f"explicit: K options for every example flat "
                 f"({flat[:4]}{'...' if len(flat) > 4 else ''}), or one id per example as a "
                 f"[B, 1] integer tensor", problem=f"is ambiguous for a batch of {size}: "
                                                   f"{readings}")


def answer_positions(where: str, arg: str, positions: Any, batch: Mapping[str, Any],
                     size: int, length: int, shift: bool) -> int | list[int]:
    """Where a query reads each example's answer: from the batch's ``labels [B, T]`` when it
    holds them, else from ``positions``.

    One convention, the training loss's: a batch with labels (an integer ``[B, T]`` tensor,
    ``-100`` where there is no label) is answered at each row's FIRST labelled position, the
    first one the loss scores. A causal LM's logit at ``t`` predicts the label at ``t + 1``
    (``shift``): the answer position is the first label's minus one; an encoder-decoder's
    decoder position ``t`` predicts ``labels[:, t]`` (no shift). ``positions`` must then be
    None: a batch with labels and positions would have two answers. Without labels (or with a
    classifier's ``labels [B]``) ``positions`` is checked as `check_positions` (None: ``-1``,
    each example's last token).

    Returns:
        One int or ``B`` ints as `check_positions` (label-read positions are non-negative).

    Raises:
        QueryInputError: positions given with labels; labels of the wrong shape, a row without
            a label, or a causal LM's row labelled at position 0 (no logit predicts it).
    """
    labels = batch.get("labels")
    if not (is_int_tensor(labels) and labels.dim() == 2):
        return check_positions(where, arg, -1 if positions is None else positions, size, length)
    if positions is not None:
        how = ("leave labels out of the batch" if shift else
               "pass decoder_input_ids (and decoder_attention_mask) instead of labels")
        raise error(where, arg, positions, f"None when the batch holds labels [B, T] (the answer "
                    "is read from them: each row's first labelled position, where training "
                    f"scores it); to choose positions, {how}",
                    problem="is given with the batch's labels")
    if tuple(labels.shape) != (size, length):
        raise error(where, "batch['labels']", labels, f"a [B, T] = {[size, length]} integer "
                    "tensor (-100 where there is no label)", problem="does not fit the batch")
    marked = labels.detach().cpu() != IGNORE_INDEX  # [B, T]
    empty = ~marked.any(1)
    if bool(empty.any()):
        b = int(empty.int().argmax())
        raise error(where, "batch['labels']", labels, "a label (!= -100) in every row: the "
                    "answer is read at each row's first labelled position",
                    problem=f"has none in row {b}")
    first = marked.int().argmax(1)  # [B]: the first labelled position of each row
    if shift and bool((first == 0).any()):
        b = int((first == 0).int().argmax())
        raise error(where, "batch['labels']", labels, "labels after position 0 (a causal LM's "
                    "logit at t - 1 predicts the label at t)",
                    problem=f"labels position 0 first in row {b}, which no logit predicts")
    return (first - 1 if shift else first).tolist()


def check_token_ids(where: str, arg: str, token_ids: Any, batch_size: int,
                    options: bool = False) -> Tensor | None:
    """The chosen logits' ids: None, ``K`` ints for every example (returned as a CPU ``[K]``
    int64 tensor) or a row of ``K`` per example (a ``[B, K]`` int64 tensor, on the device it
    came on). Ranges are checked against the logits later (`check_id_range`).

    ``B ≥ 2`` nested sequences of one int each (``[[383], [657], …]``, a tokenizer's
    ``input_ids`` of one-token answers) are refused as ambiguous: ``K = 1`` per example, or
    ``B`` options for every example; one id per example is taken as a ``[B, 1]`` tensor.
    ``options`` (a probability over the ids: `predictive_probs`, `answer_distribution`,
    held-out fits): ``K ≥ 2``, and a ``[B, 1]`` tensor is refused too, naming both readings.
    """
    if token_ids is None:
        return None
    least = 2 if options else 1
    allowed = (f"K >= {least} ids: one sequence of K ints for every example, or per example a "
               f"row of K ints ([B, K] with B = {batch_size}, the batch; every row the same "
               "length K)")
    token_ids = from_numpy(token_ids)
    if isinstance(token_ids, Tensor):
        if not is_int_tensor(token_ids) or token_ids.dim() not in (1, 2) or token_ids.numel() == 0:
            raise error(where, arg, token_ids, allowed)
        if token_ids.dim() == 1:
            ids = torch.tensor(token_ids.tolist(), dtype=torch.long)
            if options and len(ids) < 2:
                raise error(where, arg, token_ids, allowed, problem="has 1 option")
            return ids
        if token_ids.shape[0] != batch_size:
            raise error(where, arg, token_ids, allowed,
                        problem=f"has {token_ids.shape[0]} rows for {batch_size} examples")
        if options and token_ids.shape[1] < 2:
            if batch_size >= 2 and token_ids.device.type == "cpu":
                raise _one_per_example(where, arg, token_ids, token_ids[:, 0].tolist(),
                                       batch_size, options)
            raise error(where, arg, token_ids, allowed, problem="has 1 option per example")
        return token_ids.long()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
        raise error(where, arg, token_ids, allowed, typed=True)
    if len(token_ids) == 0:
        raise error(where, arg, token_ids, allowed, problem="is empty")
    rows = [r.tolist() if isinstance(r, Tensor) and r.dim() == 1 else r for r in token_ids]
    if all(is_int(i) for i in rows):
        if options and len(rows) < 2:
            raise error(where, arg, token_ids, allowed, problem="has 1 option")
        return torch.tensor([int(i) for i in rows], dtype=torch.long)
    if not all(isinstance(r, Sequence) and not isinstance(r, (str, bytes)) for r in rows) or not (
            all(is_int(i) for r in rows for i in r)):
        raise error(where, arg, token_ids, allowed)
    lengths = sorted({len(r) for r in rows})
    if len(lengths) != 1 or lengths[0] == 0:
        raise error(where, arg, token_ids, allowed, problem=f"has rows of lengths {lengths}")
    if lengths == [1] and len(rows) >= 2:  # [[383], [657], ...]: K = 1 each, or K = len(rows)?
        raise _one_per_example(where, arg, token_ids, [int(r[0]) for r in rows], batch_size,
                               options)
    if len(rows) != batch_size:
        raise error(where, arg, token_ids, allowed,
                    problem=f"has {len(rows)} rows for {batch_size} examples")
    if options and lengths[0] < 2:
        raise error(where, arg, token_ids, allowed, problem="has 1 option")
    return torch.tensor([[int(i) for i in r] for r in rows], dtype=torch.long)


def check_priors(where: str, arg: str, value: Any, layers: Sequence[str]
                 ) -> list[float | dict[str, float]]:
    """A non-empty sequence of prior precisions (each as `check_prior`, no ``"marglik"``)."""
    allowed = (f"a non-empty list of prior precisions, each {prior_allowed(len(layers), False)}"
               f" (one: [tau])")
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise error(where, arg, value, allowed, typed=True)
    if len(value) == 0:
        raise error(where, arg, value, allowed, problem="is empty")
    return [check_prior(where, f"{arg}[{p}]", v, layers, marglik=False)  # type: ignore[misc]
            for p, v in enumerate(value)]


def check_labels(where: str, arg: str, value: Any, batch_size: int) -> Tensor:
    """``B`` class indices (an integer tensor or a sequence of ints) as a CPU int64 tensor."""
    allowed = f"{batch_size} ints (per example, the index into its token_ids of the right answer)"
    value = from_numpy(value)
    if isinstance(value, Tensor):
        if not is_int_tensor(value) or value.dim() != 1:
            raise error(where, arg, value, allowed)
        labels = value.cpu().long()
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and all(
            is_int(i) for i in value):
        labels = torch.tensor([int(i) for i in value], dtype=torch.long)
    else:
        raise error(where, arg, value, allowed, typed=True)
    if labels.shape[0] != batch_size:
        raise error(where, arg, value, allowed,
                    problem=f"has {labels.shape[0]} labels for {batch_size} examples")
    return labels
