"""The snapshot manifest's schema, and a JSON parser that refuses what a manifest cannot be.

`parse_json` turns the bytes of ``manifest.json`` (or of a shard's safetensors header) into
Python values, refusing non-UTF-8 text, duplicate keys, integer literals over
`layout.MAX_INT_DIGITS` digits and nesting deeper than `layout.MAX_JSON_DEPTH` (NaN and
Infinity literals are read as floats; the schema says where a non-finite number is allowed).
`validate_manifest` then checks the parsed manifest against `SCHEMA` (types, ranges, required
keys per format version) and the agreements between its parts (dims against ``d_in``/``d_out``,
owners against ``world_size``, factor keys, shared-input groups, shard names), before any shard
is opened. `implied_tensors` lists every tensor the manifest implies, with dtype and shape, for
the reader to compare with each shard's header.

Every failure is a `SnapshotError` of the form::

    <file>: <key> is <value>; expected <what>
    <file>: <key> is missing; expected <what>

where ``<key>`` is a path into the document: ``step``, ``counts.tokens_seen``,
``layers['h.0.attn'].A.dim``, ``shards['shard-00000-of-00001.safetensors'].sha256``,
``shared_inputs[0][1]`` (the entries of ``layers`` and ``shards`` are always written
``['name']``, list items ``[i]``, other keys ``.key``).

Keys the schema does not know are kept in ``Snapshot.meta`` but never used: a later writer of
the same format version may add informational fields (counters were added this way).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..config import KFACConfig
from ..enums import FisherType, StorageDtype
from ..exceptions import KFACConfigError, SnapshotError
from ..factor_keys import FACTOR_KINDS, factor_key, split_factor_key
from .layout import (
    FORMAT_NAME,
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    READABLE_VERSIONS,
    SHARD_RE,
    file_name_problem,
)

INT64_MAX = 2**63 - 1
#: Largest world size (ranks) accepted; shard names hold 5 digits or more.
MAX_WORLD_SIZE = 2**20
#: Largest factor side: a tensor dimension that torch and safetensors index with 32 bits.
MAX_FACTOR_DIM = 2**31 - 1
#: Longest string value (layer names, regexes, paths) the schema accepts, in characters.
MAX_STRING = 4096

# ---------------------------------------------------------------- parsing -------------------


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


def _child(path: str, key: str | int, named: bool = False) -> str:
    """Path of ``key`` under ``path`` (see the module docstring for the notation)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if named or not key.isidentifier():
        return f"{path}[{key!r}]"
    return f"{path}.{key}" if path else key


def _named(path: str) -> bool:
    """Whether the keys of the object at ``path`` are names (layers, shards), not fields."""
    return path in ("layers", "shards")


def _where(path: str) -> str:
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
            raise SnapshotError(f"{file}: {_where(path)} is an integer of {v.digits} digits; "
                                f"expected at most {MAX_INT_DIGITS} digits (every integer of "
                                "the format fits in 64 bits)")
        if depth > MAX_JSON_DEPTH:
            raise SnapshotError(f"{file}: {_where(path)} is nested {depth} levels deep; "
                                f"expected at most {MAX_JSON_DEPTH} levels")
        # a scalar document (``null``, ``5``) has no children: validate_manifest refuses it
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        named = isinstance(v, dict) and _named(path)
        for k, x in items:
            if isinstance(x, (dict, list, _HugeInt)):
                stack.append((x, _child(path, k, named), depth + 1))


# ---------------------------------------------------------------- the schema's rules ---------


@dataclass(frozen=True)
class _Ctx:
    file: str
    version: int


def _show(v: Any) -> str:
    """A short, safe rendering of a JSON value for a message."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        text = json.dumps(v)
        return text if len(text) <= 60 else text[:56] + '..."'
    if isinstance(v, list):
        return f"a list of {len(v)} item{'s' * (len(v) != 1)}"
    if isinstance(v, dict):
        return f"an object with {len(v)} key{'s' * (len(v) != 1)}"
    return type(v).__name__


def _fail(ctx: _Ctx, path: str, value: Any, expected: str) -> NoReturn:
    raise SnapshotError(f"{ctx.file}: {_where(path)} is {_show(value)}; expected {expected}")


class Rule:
    """What one JSON value must be; ``check`` raises `SnapshotError` naming the key."""

    expected = "a value"

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Rule):
    """An integer (not a bool, not a float) in ``[lo, hi]``."""

    lo: int = 0
    hi: int = INT64_MAX

    @property
    def expected(self) -> str:
        return (f"an integer ≥ {self.lo}" if self.hi == INT64_MAX
                else f"an integer in [{self.lo}, {self.hi}]")

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not (
                self.lo <= value <= self.hi):
            _fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class Num(Rule):
    """A finite number (an integer is one) in ``[lo, hi]`` (``(lo, hi]`` if ``lo_open``);
    ``inf``: +Infinity is also allowed."""

    lo: float = 0.0
    hi: float = math.inf
    lo_open: bool = False
    inf: bool = False

    @property
    def expected(self) -> str:
        if self.hi == math.inf:
            text = f"a finite number {'>' if self.lo_open else '≥'} {self.lo:g}"
        else:
            text = (f"a finite number in {'(' if self.lo_open else '['}{self.lo:g}, "
                    f"{self.hi:g}]")
        return text + (" or Infinity" if self.inf else "")

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(ctx, path, value, self.expected)
        if self.inf and value == math.inf:
            return
        if not math.isfinite(value) or value > self.hi or value < self.lo or (
                self.lo_open and value == self.lo):
            _fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class Bool(Rule):
    """``true`` or ``false``."""

    expected = "true or false"

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if not isinstance(value, bool):
            _fail(ctx, path, value, self.expected)


def _text_problem(value: str) -> str | None:
    if len(value) > MAX_STRING:
        return f"longer than {MAX_STRING} characters"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "with a control character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid Unicode text"
    return None


@dataclass(frozen=True)
class Str(Rule):
    """A string of printable text: one of ``choices``, or matching ``pattern`` (full match),
    or any (``what`` describes it)."""

    choices: tuple[str, ...] = ()
    pattern: re.Pattern | None = None
    what: str = "a string"

    @property
    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(json.dumps(c) for c in self.choices)
        return self.what

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if not isinstance(value, str) or _text_problem(value) is not None:
            _fail(ctx, path, value, self.expected)
        if self.choices and value not in self.choices:
            _fail(ctx, path, value, self.expected)
        if self.pattern is not None and not self.pattern.fullmatch(value):
            _fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class Nullable(Rule):
    """``null`` or what ``rule`` accepts."""

    rule: Rule

    @property
    def expected(self) -> str:
        return f"null or {self.rule.expected}"

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if value is None:
            return
        if (isinstance(self.rule, ListOf) and isinstance(value, list)) or (
                isinstance(self.rule, Record) and isinstance(value, dict)):
            self.rule.check(value, path, ctx)  # a container: its items name their own keys
            return
        try:
            self.rule.check(value, path, ctx)
        except SnapshotError:
            _fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class ListOf(Rule):
    """A list of at least ``min_len`` items, each accepted by ``item``."""

    item: Rule
    min_len: int = 0

    @property
    def expected(self) -> str:
        least = f" of at least {self.min_len} items" if self.min_len else ""
        return f"a list{least} (each item {self.item.expected})"

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if not isinstance(value, list) or len(value) < self.min_len:
            _fail(ctx, path, value, self.expected)
        for i, x in enumerate(value):
            self.item.check(x, _child(path, i), ctx)


@dataclass(frozen=True)
class Field:
    """A key of a `Record`: its rule, and the first format version that requires it (None:
    optional in every version; an optional key, when present, is still checked)."""

    rule: Rule
    since: int | None = 1


@dataclass(frozen=True)
class Record(Rule):
    """An object with known keys (``fields``); other keys are allowed and not checked."""

    fields: Mapping[str, Field] = field(default_factory=dict)
    what: str = "an object"

    @property
    def expected(self) -> str:
        return self.what

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if not isinstance(value, dict):
            _fail(ctx, path, value, self.expected)
        for name, f in self.fields.items():
            sub = _child(path, name)
            if name not in value:
                if f.since is not None and ctx.version >= f.since:
                    raise SnapshotError(f"{ctx.file}: {sub} is missing; expected "
                                        f"{f.rule.expected}")
                continue
            f.rule.check(value[name], sub, ctx)


@dataclass(frozen=True)
class MapOf(Rule):
    """An object whose keys are names (``name_problem`` says what is wrong with one, or
    None) and whose values are accepted by ``value``."""

    value: Rule
    name_problem: Callable[[str], str | None]
    name_expected: str
    min_len: int = 0
    what: str = "an object"

    @property
    def expected(self) -> str:
        least = f" with at least {self.min_len} entr{'y' if self.min_len == 1 else 'ies'}"
        return self.what + (least if self.min_len else "")

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if not isinstance(value, dict) or len(value) < self.min_len:
            _fail(ctx, path, value, self.expected)
        for name, x in value.items():
            sub = _child(path, name, named=True)
            problem = self.name_problem(name)
            if problem is not None:
                raise SnapshotError(f"{ctx.file}: {sub}: the name is {problem}; expected "
                                    f"{self.name_expected}")
            self.value.check(x, sub, ctx)


def _layer_name_problem(name: str) -> str | None:
    if not name:
        return "empty"
    problem = _text_problem(name)
    return f"a string {problem}" if problem else None


def _shard_name_problem(name: str) -> str | None:
    problem = file_name_problem(name)
    if problem is None and not SHARD_RE.match(name):
        problem = "not a shard file name"
    return problem


# ---------------------------------------------------------------- the schema ----------------

_COUNT = Int()
_NONNEG = Num()
_SHARD_NAME = "a plain shard file name inside the snapshot directory (shard-RRRRR-of-WWWWW" \
    ".safetensors)"
_HEX64 = Str(pattern=re.compile(r"[0-9a-f]{64}"), what="64 lowercase hex digits (a sha256)")
_STORAGE_DTYPES = tuple(d.value for d in StorageDtype)


class _ShardName(Rule):
    """A string naming a shard file (the ``shard`` of a factor entry)."""

    expected = _SHARD_NAME

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if not isinstance(value, str) or _shard_name_problem(value) is not None:
            _fail(ctx, path, value, self.expected)


SPECTRUM = Record({
    "max": Field(_NONNEG),
    "trace": Field(_NONNEG),
    "cond": Field(Num(lo=1.0, inf=True)),  # Infinity: a zero factor (spectrum_stats)
    "eff_rank": Field(_NONNEG),
}, what="spectrum statistics (an object with max, trace, cond, eff_rank)")

SAMPLING = Record({
    "rel_se": Field(Num(lo=0.0, inf=True)),  # Infinity: one effective update
    "effective_updates": Field(_NONNEG),
}, what="sampling statistics (an object with rel_se, effective_updates)")

FACTOR = Record({
    "key": Field(Str(what="a factor key '<layer>.A' or '<layer>.G'"), since=2),
    "dim": Field(Int(1, MAX_FACTOR_DIM)),
    "diagonal": Field(Bool()),
    "dtype": Field(Str(choices=_STORAGE_DTYPES)),
    "owner": Field(Int(0, MAX_WORLD_SIZE - 1), since=None),
    "shard": Field(_ShardName(), since=None),
    "weight": Field(_NONNEG),
    "updates": Field(_COUNT),
    "positions": Field(_COUNT),
    "spectrum": Field(SPECTRUM),
    "sampling": Field(SAMPLING, since=None),
}, what="a factor entry (an object with dim, diagonal, dtype, weight, updates, positions, "
        "spectrum; format 2 also key)")

#: ``KFACConfig(ekfac=True)``: the EK-FAC correction a snapshot stores for a layer
#: (``<layer>.ekfac``, `kfac_stream.ekfac`) and where it comes from.
EKFAC = Record({
    "basis_step": Field(_COUNT),  # the snapshot whose eigenbasis it was accumulated on
    "updates": Field(_COUNT),  # update steps averaged
    "first_step": Field(_COUNT),
    "last_step": Field(_COUNT),
    "weight": Field(_NONNEG),  # N: the positions (or sequences) of those steps, weighted
}, what="an EK-FAC correction entry (an object with basis_step, updates, first_step, "
        "last_step, weight)")

LAYER = Record({
    "kind": Field(Str(choices=("linear", "conv1d"))),
    "d_in": Field(Int(1, MAX_FACTOR_DIM)),
    "d_out": Field(Int(1, MAX_FACTOR_DIM)),
    "has_bias": Field(Bool()),
    # "sequence": one row per sequence (a pooler or head on [B, d]), N counts sequences;
    # absent: one row per token position
    "rows": Field(Str(choices=("position", "sequence")), since=None),
    "A": Field(FACTOR),
    "G": Field(FACTOR),
    "ekfac": Field(EKFAC, since=None),
}, what="a layer entry (an object with kind, d_in, d_out, has_bias, A, G)")

SHARD = Record({
    "sha256": Field(_HEX64),
    "bytes": Field(_COUNT),
    "rank": Field(Int(0, MAX_WORLD_SIZE - 1), since=None),
}, what="a shard entry (an object with sha256 and bytes)")

class _TrackerConfig(Rule):
    """The tracker's configuration as written (``KFACConfig.to_dict()``), informational: each
    key naming a `KFACConfig` field must pass that field's own validation (the dataclass is
    the one source of the fields' types and ranges); keys of other versions are allowed."""

    expected = "the tracker's configuration (an object of KFACConfig fields)"

    def check(self, value: Any, path: str, ctx: _Ctx) -> None:
        if not isinstance(value, dict):
            _fail(ctx, path, value, self.expected)
        names = {f.name for f in dataclasses.fields(KFACConfig)}
        for name, v in value.items():
            if name in names:
                try:
                    KFACConfig(**{name: v})
                except (KFACConfigError, TypeError, ValueError) as e:
                    _fail(ctx, _child(path, name), v, f"a valid value ({e})")


CONFIG = _TrackerConfig()

# The tracker's counters: the five every writer wrote are required, later ones optional.
COUNTS = Record({
    "tokens_seen": Field(_COUNT),
    "sequences_seen": Field(_COUNT, since=None),
    "positions_sampled": Field(_COUNT),
    "updates": Field(_COUNT),
    "skipped_updates": Field(_COUNT),
    "tracker_seconds": Field(_NONNEG),
    "comm_bytes": Field(ListOf(_COUNT), since=None),
    "exchange_seconds": Field(_NONNEG, since=None),
    "fold_seconds": Field(_NONNEG, since=None),
    "wait_seconds": Field(_NONNEG, since=None),
    "waits": Field(_COUNT, since=None),
    "snapshot_failures": Field(_COUNT, since=None),
    "exchange_bytes_rows": Field(_COUNT, since=None),
    "exchange_bytes_stats": Field(_COUNT, since=None),
    "window_start_step": Field(Int(-1), since=None),
    "sequences_per_update": Field(_COUNT, since=None),
    "window_sequences": Field(_COUNT, since=None),
    # the store's work (`kfac_stream.store.traffic.Traffic`) and the flushes' time
    "flush_seconds": Field(_NONNEG, since=None),
    **{name: Field(_COUNT, since=None) for name in (
        "device_folds", "fold_flops", "fold_device_bytes", "bytes_to_host", "bytes_to_device",
        "host_entries", "flushes", "factor_flushes", "budget_flushes", "flush_chunks",
        "flush_copies", "flush_syncs", "resident_bytes", "peak_resident_bytes")},
    "device_budget": Field(Int(-1), since=None),
}, what="the tracker's counters (an object with tokens_seen, positions_sampled, updates, "
        "skipped_updates, tracker_seconds)")

OWNERSHIP = Record({
    "bytes_per_rank": Field(ListOf(_COUNT, min_len=1)),
    "eigh_flops_per_rank": Field(ListOf(_NONNEG, min_len=1)),
}, what="the factor ownership summary (an object with bytes_per_rank, eigh_flops_per_rank)")

WEIGHTS = Record({
    "numel": Field(Int(1)),
    "sum": Field(Num(lo=-math.inf)),
    "sumsq": Field(_NONNEG),
}, what="a weight fingerprint (an object with numel, sum, sumsq)")

#: ``KFACConfig.answer_tokens`` as resolved at train begin (`integrations.answer_tokens`).
ANSWER_TOKENS = Record({
    "ids": Field(ListOf(_COUNT, min_len=2)),
    "texts": Field(Nullable(ListOf(Str(what="an answer's text"), min_len=2))),
}, what="the answer options (an object with ids and texts)")

#: The model's architecture (`kfac_stream.snapshot.architecture.model_identity`): its class
#: name and ``config.model_type`` (null where the model has none).
MODEL = Record({
    "class": Field(Str(what="a model class name")),
    "model_type": Field(Nullable(Str(what="a config.model_type"))),
}, what="the model's architecture (an object with class, model_type)")

#: The whole manifest, formats 1 and 2 (``since=2``: required from format 2 on).
SCHEMA = Record({
    "format": Field(Str(choices=(FORMAT_NAME,))),
    "format_version": Field(Int(min(READABLE_VERSIONS), max(READABLE_VERSIONS))),
    "step": Field(_COUNT),
    "epoch": Field(Nullable(_NONNEG)),
    "created_unix": Field(_NONNEG),
    "world_size": Field(Int(1, MAX_WORLD_SIZE)),
    "rank": Field(Int(0, MAX_WORLD_SIZE - 1), since=None),
    "ownership": Field(OWNERSHIP, since=None),
    "fisher": Field(Str(choices=tuple(f.value for f in FisherType))),
    "ema_decay": Field(Num(0.0, 1.0)),
    "token_fraction": Field(Num(0.0, 1.0, lo_open=True)),
    "update_every": Field(Int(1)),
    "storage_dtype": Field(Str(choices=_STORAGE_DTYPES)),
    "config": Field(CONFIG),
    "counts": Field(COUNTS),
    "skipped_steps": Field(ListOf(_COUNT)),
    "shared_inputs": Field(ListOf(ListOf(Str(what="a layer name"), min_len=2)), since=2),
    "fingerprint": Field(_HEX64),
    # the training run and its weights at the step: optional, older snapshots lack
    # them (`kfac_stream.snapshot.weights`)
    "run_id": Field(Str(pattern=re.compile(r"[0-9a-f]{32}"), what="32 lowercase hex digits"),
                    since=None),
    "weights": Field(MapOf(WEIGHTS, _layer_name_problem, "a module name (non-empty text)",
                           what="an object of weight fingerprints"), since=None),
    "answer_tokens": Field(ANSWER_TOKENS, since=None),
    "model": Field(MODEL, since=None),  # optional: older snapshots lack it
    "layers": Field(MapOf(LAYER, _layer_name_problem, "a module name (non-empty text)",
                          min_len=1, what="an object of layer entries")),
    "shards": Field(MapOf(SHARD, _shard_name_problem, _SHARD_NAME, min_len=1,
                          what="an object of shard entries")),
}, what="an object (a kfac_stream snapshot manifest)")


# ---------------------------------------------------------------- validation ----------------


def validate_manifest(meta: Any, file: str) -> dict[str, Any]:
    """``meta`` (a parsed manifest) if it satisfies `SCHEMA` and its parts agree; else
    `SnapshotError` naming ``file``, the key and what was expected."""
    if not isinstance(meta, dict):
        raise SnapshotError(f"{file}: not a kfac_stream snapshot manifest: the document is "
                            f"{_show(meta)}; expected an object")
    if meta.get("format") != FORMAT_NAME:
        raise SnapshotError(f"{file}: not a kfac_stream snapshot manifest: format is "
                            f"{_show(meta.get('format'))}; expected {json.dumps(FORMAT_NAME)}")
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise SnapshotError(f"{file}: unknown format_version {_show(version)} (this "
                            f"kfac_stream reads {', '.join(map(str, READABLE_VERSIONS))})")
    ctx = _Ctx(file, version)
    SCHEMA.check(meta, "", ctx)
    _check_agreement(meta, ctx)
    return meta


def stored_key(meta: dict[str, Any], layer: str, factor: str) -> str:
    """Key of the stored tensor of ``layer``'s ``factor`` (format 1: always its own)."""
    return meta["layers"][layer][factor].get("key", factor_key(layer, factor))  # type: ignore


def _check_agreement(meta: dict[str, Any], ctx: _Ctx) -> None:
    """The parts of a schema-valid manifest agree with each other."""
    file, world, layers = ctx.file, meta["world_size"], meta["layers"]
    storage = meta["storage_dtype"]
    for name in ("bytes_per_rank", "eigh_flops_per_rank"):
        values = meta.get("ownership", {}).get(name, [])
        if "ownership" in meta and len(values) != world:
            raise SnapshotError(f"{file}: ownership.{name} has {len(values)} items; expected "
                                f"world_size={world}")
    for sname, info in meta["shards"].items():
        if info.get("rank", 0) >= world:
            raise SnapshotError(f"{file}: shards[{sname!r}].rank is {info['rank']}; expected "
                                f"a rank below world_size={world}")
    for name in meta.get("weights", {}):
        if name not in layers:
            raise SnapshotError(f"{file}: weights[{name!r}] names no tracked layer; expected "
                                "a key of layers")
    by_key: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, entry in layers.items():
        lpath = _child("layers", name, named=True)
        want = {"A": (entry["d_in"] + entry["has_bias"],
                      f"d_in={entry['d_in']} and has_bias={_show(entry['has_bias'])}"),
                "G": (entry["d_out"], f"d_out={entry['d_out']}")}
        for factor in FACTOR_KINDS:
            f, fpath = entry[factor], f"{lpath}.{factor}"
            dim, says = want[factor]
            if f["dim"] != dim:
                raise SnapshotError(f"{file}: {fpath}.dim is {f['dim']}; expected {dim}, as the "
                                    f"manifest says {says}")
            if f["dtype"] != storage:
                raise SnapshotError(f"{file}: {fpath}.dtype is {_show(f['dtype'])}; expected "
                                    f"{_show(storage)}, the manifest's storage_dtype")
            if f.get("owner", 0) >= world:
                raise SnapshotError(f"{file}: {fpath}.owner is {f['owner']}; expected a rank "
                                    f"below world_size={world}")
            if "shard" in f and f["shard"] not in meta["shards"]:
                raise SnapshotError(f"{file}: {fpath}.shard is {_show(f['shard'])}; expected "
                                    f"one of the files listed in shards "
                                    f"({', '.join(map(repr, meta['shards']))})")
            key = stored_key(meta, name, factor)
            if ctx.version >= 2:
                _check_key(meta, name, factor, key, fpath, ctx)
            if key in by_key:  # a shared A: every entry must describe the same tensor
                other, first = by_key[key]
                for attr in ("dim", "diagonal", "dtype", "owner", "shard"):
                    if f.get(attr) != first.get(attr):
                        raise SnapshotError(
                            f"{file}: {fpath}.{attr} is {_show(f.get(attr))}; expected "
                            f"{_show(first.get(attr))}, as {other}.{attr} (the same stored "
                            f"tensor {key!r})")
            else:
                by_key[key] = (fpath, f)
    if ctx.version >= 2:
        _check_groups(meta, ctx)


def _check_key(meta: dict[str, Any], name: str, factor: str, key: str, fpath: str,
               ctx: _Ctx) -> None:
    """Format 2: G is stored under the layer's own key, A under its own or under the A key of
    the leader of its shared-input group (which stores it under its own)."""
    own = factor_key(name, factor)  # type: ignore[arg-type]
    try:
        layer, kind = split_factor_key(key)
    except ValueError:
        layer, kind = "", ""
    if kind != factor or layer not in meta["layers"] or (factor == "G" and key != own):
        allowed = (f"{own!r}" if factor == "G" else
                   f"{own!r} or the A key of another tracked layer (a shared input)")
        raise SnapshotError(f"{ctx.file}: {fpath}.key is {_show(key)}; expected {allowed}")
    if key != own:
        leader_key = stored_key(meta, layer, "A")
        if leader_key != key:
            raise SnapshotError(f"{ctx.file}: {fpath}.key is {_show(key)}, but "
                                f"layers[{layer!r}].A.key is {_show(leader_key)}; expected the "
                                "key the group leader stores its own A under")
        if not any(g[0] == layer and name in g for g in meta["shared_inputs"]):
            raise SnapshotError(f"{ctx.file}: {fpath}.key is {_show(key)}; expected {own!r}, "
                                f"as shared_inputs has no group led by {layer!r} with "
                                f"{name!r}")


def _check_groups(meta: dict[str, Any], ctx: _Ctx) -> None:
    """Format 2: each shared-input group names tracked layers, each in one group only, all
    storing A under the first member's key."""
    seen: set[str] = set()
    for i, group in enumerate(meta["shared_inputs"]):
        lead = factor_key(group[0], "A")
        for j, name in enumerate(group):
            path = f"shared_inputs[{i}][{j}]"
            if name not in meta["layers"]:
                raise SnapshotError(f"{ctx.file}: {path} is {_show(name)}; expected the name "
                                    "of a tracked layer (a key of layers)")
            if name in seen:
                raise SnapshotError(f"{ctx.file}: {path} is {_show(name)}, already in another "
                                    "group; expected each layer in one group at most")
            seen.add(name)
            key = stored_key(meta, name, "A")
            if key != lead:
                raise SnapshotError(f"{ctx.file}: layers[{name!r}].A.key is {_show(key)}; "
                                    f"expected {lead!r}, as {path} puts it in the group led "
                                    f"by {group[0]!r}")


# ---------------------------------------------------------------- implied tensors -----------


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a valid manifest implies: dtype (torch name, ``"float16"``), shape, the shard
    file it must be in (None: format-1 entries without ``shard``: any) and the manifest key
    that implies it (for messages)."""

    dtype: str
    shape: tuple[int, ...]
    shard: str | None
    source: str

    @property
    def nbytes(self) -> int:
        """Size of its data in bytes."""
        return math.prod(self.shape) * {"float16": 2, "float32": 4, "float64": 8}[self.dtype]


def implied_tensors(meta: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor the (validated) manifest implies, by name: per stored factor key ``K``,
    ``K`` (``[d, d]`` or ``[d]`` diagonal, in the factor's dtype), ``K.scale`` (float32
    ``[1]``), ``K.eigvals`` (``[d]``) and, for a dense factor, ``K.eigvecs`` (``[d, d]``), the
    eigen tensors in float32 (float64 for float64 storage); per layer with an ``ekfac`` entry,
    ``<layer>.ekfac`` (``[d_out, d_A]``, in that dtype, in its G factor's shard)."""
    wide = str(StorageDtype(meta["storage_dtype"]).wide_dtype).removeprefix("torch.")
    out: dict[str, TensorSpec] = {}
    for name, entry in meta["layers"].items():
        for factor in FACTOR_KINDS:
            key = stored_key(meta, name, factor)
            if key in out:
                continue
            f = entry[factor]
            src = f"{_child('layers', name, named=True)}.{factor}"
            d, shard = f["dim"], f.get("shard")
            out[key] = TensorSpec(f["dtype"], (d,) if f["diagonal"] else (d, d), shard,
                                  f"{src}.dim/.diagonal/.dtype")
            out[f"{key}.scale"] = TensorSpec("float32", (1,), shard, src)
            out[f"{key}.eigvals"] = TensorSpec(wide, (d,), shard, f"{src}.dim")
            if not f["diagonal"]:
                out[f"{key}.eigvecs"] = TensorSpec(wide, (d, d), shard, f"{src}.dim")
        if "ekfac" in entry:
            src = f"{_child('layers', name, named=True)}.ekfac"
            out[f"{name}.ekfac"] = TensorSpec(wide, (entry["G"]["dim"], entry["A"]["dim"]),
                                              entry["G"].get("shard"), src)
    return out
