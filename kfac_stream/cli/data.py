"""The commands' data pipeline: the inputs read (``--text``, ``--file``, JSON lines), tokenised
and checked against the model, label names, and padding into batches (right-padded ``[B, T]``
ids and masks, written once in `right_pad`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..exceptions import QueryInputError, did_you_mean
from ..query.lengths import input_positions, too_long
from .loading import TOKENIZER_HINT, first_line
from .output import query_status

if TYPE_CHECKING:
    from torch import Tensor


class _RawByte(str):
    """A byte-level token that is no UTF-8 character by itself (``0x80``-``0xff``): its text is
    ``\\xNN`` and its ``repr`` (what the tables print) ``'\\xNN'``, one backslash, as Python
    writes that byte, not the doubled backslash that ``repr`` gives that text."""

    def __repr__(self) -> str:
        return f"'{self}'"


def decode_token(tokenizer, token_id: int) -> str:
    if tokenizer is None:  # byte-level ids
        if token_id >= 256:
            return f"<{token_id}>"
        try:
            return bytes([token_id]).decode("utf-8")
        except UnicodeDecodeError:  # a lead or continuation byte alone
            return _RawByte(f"\\x{token_id:02x}")
    return tokenizer.decode([token_id])


def _shown(where: str, text: str) -> str:
    """An input in a message: ``--text='...'``, or ``--file='f' line 3 ('...')``."""
    return f"--text={text!r}" if where == "--text" else f"{where} ({text!r})"


def token_ids(args, tokenizer, model, text: str, where: str = "--text",
              keep_end: bool = False) -> list[int]:
    """The ids of one input ``text`` (``where``: ``--text`` or ``--file='f' line n``), checked
    against the model's vocabulary and positions. With ``--max-length N`` a longer input is
    cut to ``N`` tokens (said on stderr): ``keep_end`` (a causal LM, read at its last
    positions) keeps its last ``N``, else (a classifier) the first ``N`` are kept, as a
    tokenizer called with ``truncation=True, max_length=N`` does in training; a tokenizer's
    special tokens (``[CLS] ... [SEP]``, a BOS) stay."""
    source = args.tokenizer or args.model
    n = getattr(args, "max_length", None)
    full = None
    if n is None:
        ids = encode_ids(tokenizer, text)
    else:
        ids, whole = truncated_ids(tokenizer, text, n, keep_end)
        full = whole if whole > len(ids) else None
    if tokenizer is not None:
        if not ids:
            arg = "--tokenizer" if args.tokenizer else "--model"
            raise QueryInputError(f"{arg}={source!r}: its tokenizer turns {_shown(where, text)} "
                                  f"into no tokens (it knows {len(tokenizer)} tokens; no "
                                  f"tokenizer files there?): {TOKENIZER_HINT}")
    emb = model.get_input_embeddings()
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and max(ids) >= vocab:
        what = "UTF-8 bytes (--byte-level)" if args.byte_level else f"the tokenizer of {source!r}"
        raise QueryInputError(f"{_shown(where, text)}: {what} give token id {max(ids)}, but the "
                              f"model's vocabulary has {vocab} tokens: pass the model's own "
                              "tokenizer (--tokenizer DIR, or --byte-level for the demo's model)")
    limit = input_positions(model)
    if limit is not None and n is not None and n > limit:
        raise QueryInputError(f"--max-length={n} is more than the model's {limit} positions: "
                              f"must be at most {limit}")
    if limit is not None and len(ids) > limit:
        side = "last" if keep_end else "first"
        raise QueryInputError(too_long(where, len(ids), limit, f"pass --max-length N (at most "
                                       f"{limit}) to keep its {side} N tokens"))
    if full is not None:
        query_status(f"{where}: {full} tokens, truncated to its {'last' if keep_end else 'first'} "
                     f"{len(ids)} (--max-length {n})")
    return ids


def read_texts(args) -> list[tuple[str, str]]:
    """The inputs ``[(text, where)]``: ``--text``, or each non-blank line of ``--file`` (UTF-8;
    ``where`` names the file and line); a ``--file`` named ``*.jsonl``: the ``"text"`` of each
    of its JSON objects (other keys, such as ``"label"``, ignored: the training file of
    ``influence`` reads as is)."""
    if args.file is None:
        return [(args.text, "--text")]
    path = args.file
    if not os.path.exists(path) or os.path.isdir(path):
        problem = "does not exist" if not os.path.exists(path) else "is a directory"
        raise QueryInputError(f"--file={path!r} {problem}: must be a text file with one input "
                              "per line")
    if path.endswith(".jsonl"):
        return _jsonl_texts(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise QueryInputError(f"--file={path!r} could not be read ({first_line(e)}): must be a "
                              "UTF-8 text file with one input per line") from None
    texts = [(line, f"--file={path!r} line {n}") for n, line in enumerate(lines, 1)
             if line.strip()]
    if not texts:
        raise QueryInputError(f"--file={path!r} holds no input: must be a text file with one "
                              "input per (non-blank) line")
    return texts


def _jsonl_texts(path: str) -> list[tuple[str, str]]:
    """``[(text, where)]``: the ``"text"`` of each JSON object of a ``*.jsonl`` ``--file``."""
    texts = []
    for n, rec in json_lines("--file", path):
        where = f"--file={path!r} line {n}"
        if not isinstance(rec, Mapping) or not isinstance(rec.get("text"), str) or \
                not rec["text"].strip():
            raise QueryInputError(f"{where}: must be a JSON object with a non-empty 'text' (a "
                                  "*.jsonl --file holds one {\"text\": ...} per line)")
        texts.append((rec["text"], where))
    if not texts:
        raise QueryInputError(f"--file={path!r} holds no input: must hold one JSON object "
                              "{\"text\": ...} per line")
    return texts


def label_names(id2label: Mapping | None, num_classes: int) -> list[str]:
    """The ``num_classes`` label names: ``config.id2label``'s when any is not transformers'
    default ``LABEL_i``, else the class indices ``"0"``, ``"1"``, ...; keys may be ints or
    strings (a config read back from JSON)."""
    given = {int(k): str(v) for k, v in (id2label or {}).items()}
    if all(given.get(i, f"LABEL_{i}") == f"LABEL_{i}" for i in range(num_classes)):
        return [str(i) for i in range(num_classes)]
    return [given.get(i, str(i)) for i in range(num_classes)]


# -- tokens ------------------------------------------------------------------------------------

def encode_ids(tokenizer, text: str, special: bool = True) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes (``tokenizer`` None: ``--byte-level``), else the
    tokenizer's (with its special tokens when ``special``)."""
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def truncated_ids(tokenizer, text: str, max_length: int, keep_end: bool = False
                  ) -> tuple[list[int], int]:
    """``(ids, whole)``: the ids of ``text`` cut to at most ``max_length`` tokens as a
    tokenizer called with ``truncation=True, max_length=max_length`` cuts them (a Trainer
    user's preprocessing: the special tokens stay, ``[CLS] ... [SEP]``, a BOS), and ``whole``,
    the token count of the uncut text. ``keep_end`` keeps the last tokens (truncation from the
    left), else the first (from the right). Byte-level (``tokenizer`` None): the UTF-8 bytes,
    cut the same way. The commands' one cut of a text (``query --max-length``,
    ``influence --seq-len``)."""
    ids = encode_ids(tokenizer, text)
    if len(ids) <= max_length:
        return ids, len(ids)
    if tokenizer is None:
        return (ids[-max_length:] if keep_end else ids[:max_length]), len(ids)
    side = tokenizer.truncation_side
    tokenizer.truncation_side = "left" if keep_end else "right"
    try:
        cut = tokenizer(text, truncation=True, max_length=max_length, verbose=False)
    finally:
        tokenizer.truncation_side = side
    return list(cut["input_ids"]), len(ids)


def decode_ids(tokenizer, ids: Sequence[int]) -> str:
    """The text of ``ids`` (bytes: invalid UTF-8 as U+FFFD)."""
    if tokenizer is None:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")
    return tokenizer.decode(list(ids))


def token_text(tokenizer, token_id: int) -> str:
    return str(decode_token(tokenizer, int(token_id)))


def model_limits(model) -> tuple[int | None, int | None]:
    """``(vocabulary, positions)`` of the model (None where it does not say)."""
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    return vocab, input_positions(model)


def json_lines(flag: str, path: str) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of a JSON-lines file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise QueryInputError(f"{flag}={path!r} could not be read ({first_line(e)}): must be "
                              "a UTF-8 JSON-lines file") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise QueryInputError(f"{flag}={path!r} line {n} is not JSON ({e.msg}): must hold "
                                  "one JSON object per line") from None


def parse_label(value: Any, names: Sequence[str], label2id: Mapping, where: str) -> int:
    """A class index from a label name (``config.id2label``'s, or ``label2id``'s) or an index."""
    n = len(names)
    if isinstance(value, bool) or value is None:
        raise QueryInputError(f"{where}: label {value!r} is not allowed: must be a class name "
                              f"({', '.join(names)}) or an index in [0, {n})")
    if isinstance(value, int):
        if 0 <= value < n:
            return value
        raise QueryInputError(f"{where}: label {value} is out of range: must be a class name "
                              f"({', '.join(names)}) or an index in [0, {n})")
    text = str(value)
    if text in names:
        return names.index(text)
    if text in label2id:
        return int(label2id[text])
    if text.lstrip("-").isdigit():
        return parse_label(int(text), names, label2id, where)
    hint = did_you_mean(text, dict.fromkeys([*names, *label2id]), repr)
    raise QueryInputError(f"{where}: label {text!r} is not one of the model's labels: must be a "
                          f"class name ({', '.join(names)}) or an index in [0, {n})"
                          + (f"; {hint}" if hint else ""))


# -- batches -----------------------------------------------------------------------------------

def right_pad(rows: Sequence[Sequence[int]], fill: int, width: int | None = None
              ) -> tuple[Tensor, Tensor]:
    """``(ids [B, T], mask [B, T])``: the ``B`` rows of ids right-padded with ``fill`` to
    ``T = width`` (default: the longest row's length); ``mask`` is 1 on a row's own ids, 0 on
    its padding. The one padding of the commands' batches."""
    import torch

    T = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), T), fill, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
    return ids, mask


#: Inputs per forward (and per batched backward) of a classifier's query: memory grows with
#: it as ``B · C · d_out · d_A`` per layer.
CLASSIFY_BATCH = 16


def class_batches(ids: list[list[int]], pad_id: int | None) -> list[dict]:
    """The inputs' batches: ``{"input_ids", "attention_mask"}``, each ``[B, T]``, up to
    `CLASSIFY_BATCH` inputs right-padded with the model's ``pad_token_id`` (mask 0); one
    input per batch when the model has none (GPT-2's classifier finds each input's last token
    by it and refuses a batch of several without it)."""
    size = 1 if pad_id is None else CLASSIFY_BATCH
    batches = []
    for start in range(0, len(ids), size):
        chunk = ids[start:start + size]
        input_ids, mask = right_pad(chunk, 0 if pad_id is None else pad_id)
        batches.append({"input_ids": input_ids, "attention_mask": mask})
    return batches


def collate(examples: Sequence, pad_id: int, device=None) -> dict:
    """``{"input_ids", "attention_mask", "labels"}`` of examples with ``ids`` and ``labels``
    (per token, or class indices), right-padded with ``pad_id`` (mask 0, label -100)."""
    import torch

    ids, mask = right_pad([e.ids for e in examples], pad_id)
    per_token = not isinstance(examples[0].labels, int)
    labels = (right_pad([e.labels for e in examples], -100, ids.shape[1])[0] if per_token
              else torch.tensor([e.labels for e in examples], dtype=torch.long))
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return out if device is None else {k: v.to(device) for k, v in out.items()}
