"""Text sources, a byte-level tokenizer and causal-LM examples for the training app.

Offline sources ship with CPython: Python's reference documentation (``pydoc_data.topics``)
for training and held-out evaluation, and standard-library source code as out-of-domain text.
``load_hf_documents`` is the Hugging Face ``datasets`` path (hub datasets, or local text/json
files). ``encode_documents`` turns documents into one id stream and ``lm_examples`` cuts it into
fixed-length windows, the examples the Trainer consumes.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import torch
from tqdm.auto import tqdm

# Well-known standard-library modules, present in every CPython 3.10+ (``ood_documents`` skips
# any that a given version lays out differently: ``pathlib`` is a package from 3.13 on).
_OOD_MODULES = (
    "argparse.py",
    "ast.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "pprint.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "typing.py",
)


class ByteTokenizer:
    """Byte-level tokenizer: ids are the UTF-8 bytes of the text (no vocabulary file).

    Id 0 (the NUL byte, absent from real text) doubles as the padding id.
    """

    vocab_size = 256
    pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``, each an id in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of byte ids (a list or a 1-D tensor); invalid UTF-8 becomes U+FFFD."""
        return bytes(torch.as_tensor(ids).tolist()).decode("utf-8", errors="replace")


def pydoc_documents() -> list[str]:
    """Python's reference documentation topics, one string per topic, sorted by topic key."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def split_documents(docs: list[str], heldout_fraction: float,
                    seed: int = 0) -> tuple[list[str], list[str]]:
    """Split documents into ``(train, heldout)``, deterministically for a ``seed``.

    The split is by distinct text: a seeded shuffle of the distinct documents holds out
    ``round(heldout_fraction * n_distinct)`` of them (at least one when the fraction is positive,
    and never all), so no held-out text appears in train even when ``docs`` has duplicates.
    Both lists keep the input order; together they are ``docs``.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    distinct = list(dict.fromkeys(docs))
    n_held = 0
    if heldout_fraction > 0:
        if len(distinct) < 2:
            raise ValueError(f"cannot hold out documents from {len(distinct)} distinct one(s)")
        n_held = min(len(distinct) - 1, max(1, round(heldout_fraction * len(distinct))))
    random.Random(seed).shuffle(distinct)
    held = set(distinct[:n_held])
    return [d for d in docs if d not in held], [d for d in docs if d in held]


def ood_documents(max_chars: int = 200_000) -> list[str]:
    """Out-of-domain text: source code of well-known standard-library modules.

    One document per module file of ``_OOD_MODULES`` that exists, in sorted order. Every module
    gets an equal share of the ``max_chars`` budget (the leading part of its file; what a short
    file leaves over goes to the next ones), so the total is at most ``max_chars`` characters.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / rel for rel in sorted(_OOD_MODULES) if (stdlib / rel).is_file()]
    docs, budget = [], max_chars
    for i, path in enumerate(files):
        docs.append(path.read_text(encoding="utf-8")[:budget // (len(files) - i)])
        budget -= len(docs[-1])
    return docs


def license_documents(root: str = "/usr/share/common-licenses",
                      max_chars: int = 200_000) -> list[str]:
    """Out-of-domain prose: the license texts Debian-family systems ship (empty list if the
    directory is absent), one document per file in sorted order, at most ``max_chars`` in
    total with every file given an equal share of the budget."""
    base = Path(root)
    files = sorted(p for p in base.iterdir() if p.is_file()) if base.is_dir() else []
    docs, budget = [], max_chars
    for i, path in enumerate(files):
        docs.append(path.read_text(encoding="utf-8", errors="replace")[:budget // (len(files) - i)])
        budget -= len(docs[-1])
    return docs


class ExampleDataset(torch.utils.data.Dataset):
    """A map-style dataset over a list of example dicts (what `lm_examples` returns)."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def lm_examples(ids: list[int] | torch.Tensor, seq_len: int,
                max_examples: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Consecutive non-overlapping windows of ``seq_len`` ids as causal-LM examples.

    ``ids``: [n_ids] token ids. Example ``i`` covers ``ids[i * seq_len:(i + 1) * seq_len]``;
    the incomplete tail is dropped, and at most ``max_examples`` examples are returned.
    Each example holds ``input_ids`` [seq_len] long, ``attention_mask`` [seq_len] long (ones)
    and ``labels`` [seq_len] long (a copy of ``input_ids``; the model shifts them).
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = len(ids) // seq_len
    if max_examples is not None:
        n = min(n, max_examples)
    out = []
    for i in range(n):
        x = ids[i * seq_len:(i + 1) * seq_len].clone()
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def encode_documents(docs: list[str], tokenizer, separator: str = "\n\n") -> list[int]:
    """Token ids of the documents joined by ``separator``, as one flat list [n_ids].

    ``tokenizer`` is a ``ByteTokenizer`` or a Hugging Face tokenizer (no special tokens added).
    Each document is encoded on its own, with the separator's ids between documents (for
    ``ByteTokenizer`` this equals encoding the joined text); a progress bar shows on a terminal.
    Documents longer than an HF tokenizer's ``model_max_length`` are encoded whole without its
    warning: ``lm_examples`` cuts the stream into windows afterwards.
    """
    if isinstance(tokenizer, ByteTokenizer):
        encode = tokenizer.encode
    else:
        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    sep = encode(separator) if separator else []
    ids: list[int] = []
    for i, doc in enumerate(tqdm(docs, desc="tokenize", unit="doc", disable=None, leave=False)):
        if i:
            ids.extend(sep)
        ids.extend(encode(doc))
    return ids


def load_hf_documents(path: str, name: str | None = None, data_files=None, split: str = "train",
                      text_field: str = "text",
                      max_documents: int | None = None) -> list[str]:
    """The non-blank ``text_field`` values of a ``datasets`` split, in dataset order.

    ``path``/``name`` name a hub dataset (``"wikitext", "wikitext-2-raw-v1"``) or a packaged
    builder for local files (``"text"`` or ``"json"`` with ``data_files``). Empty and
    whitespace-only texts are skipped; at most ``max_documents`` texts are returned.
    """
    import datasets

    ds = datasets.load_dataset(path, name, data_files=data_files, split=split)
    docs = []
    for text in ds[text_field]:
        if max_documents is not None and len(docs) >= max_documents:
            break
        if text and text.strip():
            docs.append(text)
    return docs
