"""The rules a manifest's JSON values must satisfy, and the messages that name what is wrong.

A `Rule` checks one JSON value (``check(value, path, ctx)``) and raises `SnapshotError` of the
form::

    <file>: <key> is <value>; expected <what>
    <file>: <key> is missing; expected <what>

``<key>`` is the value's path (`manifest_json.child_path`). The leaves (`Int`, `Num`, `Bool`,
`Str`, `Nullable`, `ListOf`) are given by hand; the objects (`Record`, `MapOf`) are generated
from the manifest's dataclasses (`kfac_stream.snapshot.manifest_types`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..config import MOVED_OPTIONS, KFACConfig, check_moved_option
from ..exceptions import KFACConfigError, SnapshotError
from ..utils.enums import StorageDtype
from .layout import SHARD_RE, file_name_problem
from .manifest_json import child_path, where

INT64_MAX = 2**63 - 1
#: Largest world size (ranks) accepted; shard names hold 5 digits or more.
MAX_WORLD_SIZE = 2**20
#: Largest factor side: a tensor dimension that torch and safetensors index with 32 bits.
MAX_FACTOR_DIM = 2**31 - 1
#: Longest string value (layer names, regexes, paths) the schema accepts, in characters.
MAX_STRING = 4096


@dataclass(frozen=True)
class Ctx:
    """What every message names: the file checked."""

    file: str


def show(v: Any) -> str:
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


def fail(ctx: Ctx, path: str, value: Any, expected: str) -> NoReturn:
    """Raise the message that ``value`` at ``path`` is not what was ``expected``."""
    raise SnapshotError(f"{ctx.file}: {where(path)} is {show(value)}; expected {expected}")


class Rule:
    """What one JSON value must be; ``check`` raises `SnapshotError` naming the key."""

    expected = "a value"

    def check(self, value: Any, path: str, ctx: Ctx) -> None:  # pragma: no cover
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

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not (
                self.lo <= value <= self.hi):
            fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class PowerOfTwo(Int):
    """An integer in ``[lo, hi]`` that is a power of two."""

    @property
    def expected(self) -> str:
        return f"a power of two in [{self.lo}, {self.hi}]"

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        super().check(value, path, ctx)
        if value & (value - 1):
            fail(ctx, path, value, self.expected)


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

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(ctx, path, value, self.expected)
        if self.inf and value == math.inf:
            return
        if not math.isfinite(value) or value > self.hi or value < self.lo or (
                self.lo_open and value == self.lo):
            fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class Bool(Rule):
    """``true`` or ``false``."""

    expected = "true or false"

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if not isinstance(value, bool):
            fail(ctx, path, value, self.expected)


def text_problem(value: str) -> str | None:
    """Why ``value`` is not printable text of at most `MAX_STRING` characters, or None."""
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

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if not isinstance(value, str) or text_problem(value) is not None:
            fail(ctx, path, value, self.expected)
        if self.choices and value not in self.choices:
            fail(ctx, path, value, self.expected)
        if self.pattern is not None and not self.pattern.fullmatch(value):
            fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class Nullable(Rule):
    """``null`` or what ``rule`` accepts."""

    rule: Rule

    @property
    def expected(self) -> str:
        return f"null or {self.rule.expected}"

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if value is None:
            return
        if (isinstance(self.rule, ListOf) and isinstance(value, list)) or (
                isinstance(self.rule, Record) and isinstance(value, dict)):
            self.rule.check(value, path, ctx)  # a container: its items name their own keys
            return
        try:
            self.rule.check(value, path, ctx)
        except SnapshotError:
            fail(ctx, path, value, self.expected)


@dataclass(frozen=True)
class ListOf(Rule):
    """A list of at least ``min_len`` items, each accepted by ``item``."""

    item: Rule
    min_len: int = 0

    @property
    def expected(self) -> str:
        least = f" of at least {self.min_len} items" if self.min_len else ""
        return f"a list{least} (each item {self.item.expected})"

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if not isinstance(value, list) or len(value) < self.min_len:
            fail(ctx, path, value, self.expected)
        for i, x in enumerate(value):
            self.item.check(x, child_path(path, i), ctx)


@dataclass(frozen=True)
class Field:
    """A key of a `Record`: its rule, and whether it must be there (an optional key, when
    present, is still checked)."""

    rule: Rule
    required: bool = True


@dataclass(frozen=True)
class Record(Rule):
    """An object with known keys (``fields``); other keys are allowed and not checked."""

    fields: Mapping[str, Field] = field(default_factory=dict)
    what: str = "an object"

    @property
    def expected(self) -> str:
        return self.what

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if not isinstance(value, dict):
            fail(ctx, path, value, self.expected)
        for name, f in self.fields.items():
            sub = child_path(path, name)
            if name not in value:
                if f.required:
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

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if not isinstance(value, dict) or len(value) < self.min_len:
            fail(ctx, path, value, self.expected)
        for name, x in value.items():
            sub = child_path(path, name, named=True)
            problem = self.name_problem(name)
            if problem is not None:
                raise SnapshotError(f"{ctx.file}: {sub}: the name is {problem}; expected "
                                    f"{self.name_expected}")
            self.value.check(x, sub, ctx)


def layer_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a layer (a key of ``layers``, ``weights``), or None."""
    if not name:
        return "empty"
    problem = text_problem(name)
    return f"a string {problem}" if problem else None


def shard_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a shard file, or None."""
    problem = file_name_problem(name)
    if problem is None and not SHARD_RE.match(name):
        problem = "not a shard file name"
    return problem


# ---------------------------------------------------------------- leaves used often ---------

#: The leaves used most: a count (an integer ≥ 0), a finite number ≥ 0.
COUNT = Int()
NONNEG = Num()
SHARD_NAME = "a plain shard file name inside the snapshot directory (shard-RRRRR-of-WWWWW" \
    ".safetensors)"
HEX64 = Str(pattern=re.compile(r"[0-9a-f]{64}"), what="64 lowercase hex digits (a sha256)")
STORAGE_DTYPES = tuple(d.value for d in StorageDtype)
#: A shard's ``chunk_bytes``: 1 MiB to 1 GiB, a power of two (written: `files.HASH_CHUNK_BYTES`).
CHUNK_BYTES = PowerOfTwo(1 << 20, 1 << 30)


class ShardName(Rule):
    """A string naming a shard file (the ``shard`` of a factor entry)."""

    expected = SHARD_NAME

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if not isinstance(value, str) or shard_name_problem(value) is not None:
            fail(ctx, path, value, self.expected)


class TrackerConfig(Rule):
    """The tracker's configuration as written (``KFACConfig.to_dict()``, with the held-out
    options under their old names), informational: each key naming a `KFACConfig` field must
    pass that field's own validation (the dataclass is the one source of the fields' types and
    ranges), a held-out option its own (`check_moved_option`); keys naming neither are not
    checked, like every key the schema does not know."""

    expected = "the tracker's configuration (an object of KFACConfig fields)"

    def check(self, value: Any, path: str, ctx: Ctx) -> None:
        if not isinstance(value, dict):
            fail(ctx, path, value, self.expected)
        names = {f.name for f in dataclasses.fields(KFACConfig)}
        for name, v in value.items():
            if name in names or name in MOVED_OPTIONS:
                try:
                    if name in MOVED_OPTIONS:  # the held-out options, under their old names
                        check_moved_option(name, v)
                    else:
                        KFACConfig(**{name: v})
                except (KFACConfigError, TypeError, ValueError) as e:
                    fail(ctx, child_path(path, name), v, f"a valid value ({e})")


CONFIG = TrackerConfig()
