"""Reading the bytes of a manifest (or of a shard's safetensors header) into JSON values, and
the key paths every manifest message names.

`parse_json` refuses non-UTF-8 text, duplicate keys, integer literals over
`layout.MAX_INT_DIGITS` digits and nesting deeper than `layout.MAX_JSON_DEPTH` (NaN and
Infinity literals are read as floats; the schema, `kfac_stream.snapshot.schema`, says where a
non-finite number is allowed).

A key path (`child_path`) is ``step``, ``counts.tokens_seen``, ``layers['h.0.attn'].A.dim``,
``shards['shard-00000-of-00001.safetensors'].sha256``, ``shared_inputs[0][1]``: the entries
of ``layers`` and ``shards`` are always written ``['name']``, list items ``[i]``, other keys
``.key``.
"""

from __future__ import annotations

import json
from typing import Any

from ..exceptions import SnapshotError
from .layout import MAX_INT_DIGITS, MAX_JSON_DEPTH


class _HugeInt:
    """Placeholder for an integer literal over `MAX_INT_DIGITS` digits (never converted: Python
    refuses over 4300 digits with a bare ValueError and is quadratic below); `parse_json`
    reports it with its key."""

    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int | _HugeInt:
    digits = len(text) - text.startswith("-")
    return _HugeInt(digits) if digits > MAX_INT_DIGITS else int(text)


def child_path(path: str, key: str | int, named: bool = False) -> str:
    """Path of ``key`` under ``path`` (see the module docstring for the notation)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if named or not key.isidentifier():
        return f"{path}[{key!r}]"
    return f"{path}.{key}" if path else key


def is_named_map(path: str) -> bool:
    """Whether the keys of the object at ``path`` are names (layers, shards), not fields."""
    return path in ("layers", "shards")


def where(path: str) -> str:
    """``path`` as a message names it (the top: "the document")."""
    return path or "the document"


def parse_json(data: bytes | bytearray | memoryview, file: str) -> Any:
    """The JSON value of ``data``, read with the limits of `layout`; `SnapshotError` naming
    ``file`` (and the key, where there is one) for anything else."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise SnapshotError(f"{file}: not valid JSON (not UTF-8 text: {e})") from None

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise SnapshotError(f"{file}: not valid for a snapshot: key {dup!r} appears twice "
                                "in one object; expected unique keys")
        return out

    try:
        value = json.loads(text, parse_int=_parse_int, parse_constant=float,
                           object_pairs_hook=unique)
    except RecursionError:
        raise SnapshotError(f"{file}: not valid for a snapshot: containers nested deeper than "
                            f"the parser allows; expected at most {MAX_JSON_DEPTH} levels"
                            ) from None
    except json.JSONDecodeError as e:
        raise SnapshotError(f"{file}: not valid JSON ({e})") from None
    _check_tree(value, file)
    return value


def _check_tree(value: Any, file: str) -> None:
    """Refuse integer literals over `MAX_INT_DIGITS` digits and nesting over `MAX_JSON_DEPTH`
    anywhere in ``value`` (iteratively: no recursion however deep)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, _HugeInt):
            raise SnapshotError(f"{file}: {where(path)} is an integer of {v.digits} digits; "
                                f"expected at most {MAX_INT_DIGITS} digits (every integer of "
                                "the format fits in 64 bits)")
        if depth > MAX_JSON_DEPTH:
            raise SnapshotError(f"{file}: {where(path)} is nested {depth} levels deep; "
                                f"expected at most {MAX_JSON_DEPTH} levels")
        # a scalar document (``null``, ``5``) has no children: validate_manifest refuses it
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        named = isinstance(v, dict) and is_named_map(path)
        for k, x in items:
            if isinstance(x, (dict, list, _HugeInt)):
                stack.append((x, child_path(path, k, named), depth + 1))
