"""The snapshot manifest as dataclasses: the one definition of its keys.

`Manifest` (with `LayerEntry`, `FactorEntry`, `Counts` and the small records below) is what
the writer fills (`kfac_stream.snapshot.contents`) and serialises (`to_json`), and what a
checked ``manifest.json`` reads into (`from_json`). The reader's schema, `SCHEMA`, is
generated from these classes (`record_of`): every field is a key, its metadata (`json_field`)
holds the rule its JSON value must satisfy (`kfac_stream.snapshot.schema`) and whether it may
be absent; a dataclass-valued field is a nested record. `Counts` takes the store's counters
from `kfac_stream.store.traffic.Traffic` by inheritance, and every counter's rule from its
type and default (`counter_rule`).

A key marked ``optional`` (or ``pending``: a factor's statistics in a rank's part for a factor
another rank owns) is left out of the JSON when its value is None; every other key is always
written (None as ``null`` where its rule allows it). Keys the schema does not know are
kept in ``Snapshot.meta`` but never read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar

from ..stats.rows import ROW_SPACES
from ..store.traffic import Traffic
from .layout import FORMAT_NAME, FORMAT_VERSION, READ_VERSIONS
from .schema import (
    CHUNK_BYTES,
    CONFIG,
    COUNT,
    HEX64,
    MAX_FACTOR_DIM,
    MAX_WORLD_SIZE,
    NONNEG,
    SHARD_NAME,
    STORAGE_DTYPES,
    Bool,
    Field,
    Int,
    ListOf,
    MapOf,
    Nullable,
    Num,
    Record,
    Rule,
    ShardName,
    Str,
    layer_name_problem,
    shard_name_problem,
)

_RANK = Int(0, MAX_WORLD_SIZE - 1)
_LAYER_NAME = "a module name (non-empty text)"


def json_field(rule: Rule | None = None, *, optional: bool = False, pending: bool = False,
               name: str | None = None, default: Any = MISSING, factory: Any = MISSING) -> Any:
    """A manifest field: ``rule`` for its JSON value (None: from its type, a nested record or a
    counter); ``optional``: may be absent from the file (None: left out); ``pending``: required
    in the file, but None (left out) in a rank's part until the merge fills it in; ``name``:
    the JSON key when it is not the field's name. Optional and pending fields default to
    None."""
    if (optional or pending) and default is MISSING and factory is MISSING:
        default = None
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"rule": rule, "optional": optional, "pending": pending,
                                       "json": name})


def _omitted(f: dataclasses.Field, value: Any) -> bool:
    """Whether `to_json` leaves field ``f`` out: an optional or pending field that is None."""
    return value is None and (f.metadata.get("optional") or f.metadata.get("pending"))


def json_name(f: dataclasses.Field) -> str:
    """The JSON key of field ``f``."""
    return f.metadata.get("json") or f.name


# ---------------------------------------------------------------- the records ---------------


@dataclass(kw_only=True)
class Density:
    """An estimated spectral density: ``counts[i]`` eigenvalues (estimated, summing to the
    side) with log10 in ``[lo + i·w, lo + (i+1)·w)``, ``w = (hi - lo) / len(counts)``."""

    WHAT: ClassVar[str] = "a spectral density"
    lo: float = json_field(Num(lo=-math.inf))
    hi: float = json_field(Num(lo=-math.inf))
    counts: list[float] = json_field(ListOf(NONNEG, min_len=1))


@dataclass(kw_only=True)
class Spectrum:
    """A factor's spectrum statistics (`kfac_stream.stats.spectrum.spectrum_stats`), exact
    from its eigenvalues, or ``estimated`` (a snapshot whose eigendecomposition is deferred:
    `kfac_stream.stats.lanczos`): then ``max`` within ``max_error`` (the top Ritz pair's
    residual), ``eff_rank`` and ``cond`` estimated (stated relative error of ``eff_rank``:
    ``eff_rank_error``), ``trace`` exact, and ``density`` the estimated density."""

    WHAT: ClassVar[str] = "spectrum statistics"
    max: float = json_field(NONNEG)
    trace: float = json_field(NONNEG)
    cond: float = json_field(Num(lo=1.0, inf=True))  # Infinity: a zero factor
    eff_rank: float = json_field(NONNEG)
    estimated: bool | None = json_field(Bool(), optional=True)
    max_error: float | None = json_field(NONNEG, optional=True)
    eff_rank_error: float | None = json_field(NONNEG, optional=True)
    density: Density | None = json_field(optional=True)


@dataclass(kw_only=True)
class Sampling:
    """A factor's sampling error (`kfac_stream.store.factor_store` ``sampling_error``)."""

    WHAT: ClassVar[str] = "sampling statistics"
    rel_se: float = json_field(Num(lo=0.0, inf=True))  # Infinity: one effective update
    effective_updates: float = json_field(NONNEG)


@dataclass(kw_only=True)
class FactorEntry:
    """One factor (A or G) of a layer: where its tensor is stored and its statistics.

    ``key``: the stored tensor's key (a shared A: the group leader's ``<leader>.A``); ``dim``:
    its side (``[dim, dim]``, ``[dim]`` if ``diagonal``); ``owner``: the rank that stores it, in
    ``shard``. The statistics (``weight``, ``updates``, ``positions``, ``dtype``,
    ``spectrum``) are None only in a rank's part for a factor another rank owns (the merge
    takes them from the owner's part; ``spectrum``: until the eigendecomposition);
    ``sampling``: absent when not recorded (no update).
    """

    WHAT: ClassVar[str] = "a factor entry"
    key: str = json_field(Str(what="a factor key '<layer>.A' or '<layer>.G'"))
    dim: int = json_field(Int(1, MAX_FACTOR_DIM))
    diagonal: bool = json_field(Bool())
    dtype: str | None = json_field(Str(choices=STORAGE_DTYPES), pending=True)
    owner: int = json_field(_RANK)
    shard: str = json_field(ShardName())
    weight: float | None = json_field(NONNEG, pending=True)
    updates: int | None = json_field(COUNT, pending=True)
    positions: int | None = json_field(COUNT, pending=True)
    spectrum: Spectrum | None = json_field(pending=True)  # filled in by the eigendecomposition
    sampling: Sampling | None = json_field(optional=True)


@dataclass(kw_only=True)
class Ekfac:
    """``KFACConfig(ekfac=True)``: where a layer's stored EK-FAC correction
    (``<layer>.ekfac``, `kfac_stream.ekfac`) comes from."""

    WHAT: ClassVar[str] = "an EK-FAC correction entry"
    basis_step: int = json_field(COUNT)  # the snapshot whose eigenbasis it was accumulated on
    updates: int = json_field(COUNT)  # update steps averaged
    first_step: int = json_field(COUNT)
    last_step: int = json_field(COUNT)
    weight: float = json_field(NONNEG)  # N: the positions (or sequences) of those steps, weighted


@dataclass(kw_only=True)
class LayerEntry:
    """One tracked layer: its shape and its two factors. ``rows``: "sequence" for one row per
    sequence (a pooler or head on ``[B, d]``, N counts sequences), "target" for one per
    decoder position of an encoder-decoder (N counts those), absent for one row per token
    position of the input."""

    WHAT: ClassVar[str] = "a layer entry"
    kind: str = json_field(Str(choices=("linear", "conv1d")))
    d_in: int = json_field(Int(1, MAX_FACTOR_DIM))
    d_out: int = json_field(Int(1, MAX_FACTOR_DIM))
    has_bias: bool = json_field(Bool())
    rows: str | None = json_field(Str(choices=ROW_SPACES), optional=True)
    A: FactorEntry = json_field()
    G: FactorEntry = json_field()
    ekfac: Ekfac | None = json_field(optional=True)


def counter_rule(f: dataclasses.Field, hint: Any) -> Rule:
    """A counter's rule from its type and default: an int is ≥ its default where that is
    negative (-1: not decided yet), else ≥ 0; a float is finite and ≥ 0; a list holds counts
    (one per rank)."""
    if hint is int:
        return Int(min(0, f.default)) if isinstance(f.default, int) else COUNT
    if hint is float:
        return NONNEG
    if typing.get_origin(hint) is list:
        return ListOf(COUNT)
    raise TypeError(f"counter {f.name}: no rule for its type {hint}")  # pragma: no cover


@dataclass(kw_only=True)
class Counts(Traffic):
    """The tracker's counters at the snapshot (`kfac_stream.tracking.factor_updates.Counters`,
    without ``skipped_steps``, which the manifest holds beside them): the store's `Traffic` fields
    (inherited), and the tracker's own below. Made with ``Counts(**counters)``, so a counter
    the tracker adds and this class lacks fails the snapshot instead of going missing.
    ``comm_bytes`` lists each rank's (the merge gathers them); the ``*_seen`` counts are
    summed over the ranks, the durations are the slowest rank's."""

    WHAT: ClassVar[str] = "the tracker's counters"
    tokens_seen: int = 0
    sequences_seen: int = 0
    target_tokens_seen: int = 0
    positions_sampled: int = 0
    updates: int = 0
    skipped_updates: int = 0
    tracker_seconds: float = 0.0
    comm_bytes: list[int] = dataclasses.field(default_factory=list)
    exchange_seconds: float = 0.0
    fold_seconds: float = 0.0
    flush_seconds: float = 0.0
    wait_seconds: float = 0.0
    waits: int = 0
    snapshot_failures: int = 0
    exchange_bytes_rows: int = 0
    exchange_bytes_stats: int = 0
    window_start_step: int = -1
    sequences_per_update: int = 0
    window_sequences: int = 0


@dataclass(kw_only=True)
class Ownership:
    """Each rank's share of the factors: stored bytes and eigendecomposition FLOPs."""

    WHAT: ClassVar[str] = "the factor ownership summary"
    bytes_per_rank: list[int] = json_field(ListOf(COUNT, min_len=1))
    eigh_flops_per_rank: list[float] = json_field(ListOf(NONNEG, min_len=1))


@dataclass(kw_only=True)
class WeightsFingerprint:
    """A tracked layer's weights at the step (`kfac_stream.snapshot.weights`)."""

    WHAT: ClassVar[str] = "a weight fingerprint"
    numel: int = json_field(Int(1))
    sum: float = json_field(Num(lo=-math.inf))
    sumsq: float = json_field(NONNEG)


@dataclass(kw_only=True)
class WeightsFrom:
    """Where a snapshot's weights come from when they are not its own step's: the Trainer
    reloaded a checkpoint before train end (``load_best_model_at_end``,
    `kfac_stream.integrations.best_model`), so the weight fingerprint (``weights``) and the
    held-out fit beside the snapshot describe the weights of ``step`` (None: its step is
    unknown), saved in ``checkpoint``, while the factors run to the snapshot's own step."""

    WHAT: ClassVar[str] = "the reloaded weights' origin"
    step: int | None = json_field(Nullable(COUNT))
    checkpoint: str = json_field(Str(what="a checkpoint directory"))
    reason: str = json_field(Str(choices=("load_best_model_at_end",)))


@dataclass(kw_only=True)
class AnswerTokens:
    """``HeldoutConfig.answer_tokens`` as resolved at train begin (`query.answer_tokens`)."""

    WHAT: ClassVar[str] = "the answer options"
    ids: list[int] = json_field(ListOf(COUNT, min_len=2))
    texts: list[str] | None = json_field(Nullable(ListOf(Str(what="an answer's text"), min_len=2)))


@dataclass(kw_only=True)
class ModelIdentity:
    """The model's architecture (`kfac_stream.snapshot.architecture.model_identity`): its
    class name and ``config.model_type`` (None where the model has none)."""

    WHAT: ClassVar[str] = "the model's architecture"
    class_name: str = json_field(Str(what="a model class name"), name="class")
    model_type: str | None = json_field(Nullable(Str(what="a config.model_type")))


#: A Fisher estimator's name: any one, so that a snapshot made with an estimator registered by
#: its writer (`kfac_stream.fisher.register_fisher`) reads where that estimator is not
#: registered; the run plan checks the name against the registry when a run starts.
FISHER_NAME = Str(pattern=re.compile(r".+"), what="a Fisher estimator's name")


@dataclass(kw_only=True)
class WindowEntry:
    """The final window the run planned (`kfac_stream.tracking.plan.WindowPlan`)."""

    WHAT: ClassVar[str] = "the planned final window"
    restart_step: int = json_field(COUNT)
    updates: int = json_field(COUNT)
    sequences: int = json_field(COUNT)
    sequences_per_update: int = json_field(COUNT)


@dataclass(kw_only=True)
class RefreshDecision:
    """Whether the run planned to refresh its factors at the final weights at train end
    (`kfac_stream.tracking.plan.plan_refresh`), and why."""

    WHAT: ClassVar[str] = "the planned final-weight refresh"
    on: bool = json_field(Bool())
    reason: str = json_field(Str(what="a reason"))


@dataclass(kw_only=True)
class FinalRefresh:
    """The final snapshot's factors are a refresh at the final weights
    (`kfac_stream.tracking.refresh`): their plain mean over ``sequences`` training sequences
    (all ranks), which took ``seconds`` of wall time (the slowest rank's)."""

    WHAT: ClassVar[str] = "the final-weight refresh"
    sequences: int = json_field(COUNT)
    seconds: float = json_field(NONNEG)


@dataclass(kw_only=True)
class RunPlanEntry:
    """The run's plan as resolved at train begin (`kfac_stream.tracking.plan.RunPlan.to_dict`):
    the curvature, the run's shape, where the fold and the eigendecompositions run, the device
    budget (None: decided at the first update), the updates per deferred fold, the MC share a
    short run raised (None: kept), the sequences per update and the final window (absent: the
    EMA throughout)."""

    WHAT: ClassVar[str] = "the run plan"
    fisher: str = json_field(FISHER_NAME)
    form: str = json_field(Str(choices=("expand", "reduce")))
    batch: int = json_field(COUNT)
    accumulation: int = json_field(COUNT)
    world: int = json_field(Int(1, MAX_WORLD_SIZE))
    max_steps: int = json_field(COUNT)
    fold_on: str = json_field(Str(choices=("device", "host")))
    eigh_device: str | None = json_field(Nullable(Str(what="a device")))
    device_budget: int | None = json_field(Nullable(COUNT))
    fold_defer: int = json_field(Int(1, 1 << 20))
    async_updates: bool = json_field(Bool())
    mc_share_raised: float | None = json_field(Nullable(Num(0.0, 1.0, lo_open=True)))
    sequences_per_update: int = json_field(COUNT)
    window: WindowEntry | None = json_field(optional=True)
    final_refresh: RefreshDecision | None = json_field(optional=True)


@dataclass(kw_only=True)
class EigenEntry:
    """Whether and where a snapshot's eigendecomposition ran (`kfac_stream.snapshot.eigen_rule`).

    ``in_run``: its shards hold every factor's eigenvalues and eigenvectors (else they are
    computed at its first use and cached beside it, `kfac_stream.snapshot.eigen_sidecar`);
    ``policy``: ``KFACConfig.eigendecompose``; ``final``: the run's last snapshot; ``share``:
    the predicted share of the snapshot interval (None when not predicted); ``reason``: the
    rule's verdict in words; ``device``, ``finished_unix``, ``seconds``: where, when and how
    long (this rank's, rank 0's in the merged manifest; None when deferred)."""

    WHAT: ClassVar[str] = "an eigendecomposition entry"
    in_run: bool = json_field(Bool())
    policy: str = json_field(Str(choices=("auto", "always", "final")))
    final: bool = json_field(Bool())
    share: float | None = json_field(Nullable(NONNEG))
    reason: str = json_field(Str(what="text"))
    device: str | None = json_field(Nullable(Str(what="a device name")))
    finished_unix: float | None = json_field(Nullable(NONNEG))
    seconds: float | None = json_field(Nullable(NONNEG))


@dataclass(kw_only=True)
class ShardEntry:
    """A shard file: its sha256 and size as written, and the rank whose factors it holds.

    Chunked digests (``chunk_bytes`` and ``chunks``, both or neither): ``chunks[i]`` is the
    sha256 of the file's bytes ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` (the last chunk
    shorter; ``ceil(bytes / chunk_bytes)`` digests), and ``sha256`` is then the **root** over
    them: the sha256 of the 32-byte digests concatenated in order (`kfac_stream.utils.files.
    chunk_root`), not the sha256 of the file. The writer writes them (the chunks are hashed in
    parallel, as written and as read); without them (snapshots written before), ``sha256`` is
    the sha256 of the whole file, read and checked as one stream.
    """

    WHAT: ClassVar[str] = "a shard entry"
    sha256: str = json_field(HEX64)
    bytes: int = json_field(COUNT)
    rank: int = json_field(_RANK)
    chunk_bytes: int | None = json_field(CHUNK_BYTES, optional=True)
    chunks: list[str] | None = json_field(ListOf(HEX64, min_len=1), optional=True)


# ---------------------------------------------------------------- the schema ----------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _inner(hint: Any) -> Any:
    """``X`` of ``X | None`` (other hints unchanged)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


@functools.cache
def record_of(cls: type) -> Record:
    """The schema rule of dataclass ``cls``: a `Record` of its fields' keys (see the module
    docstring), described by its ``WHAT`` and its required keys."""
    fields: dict[str, Field] = {}
    for f in dataclasses.fields(cls):
        hint = _inner(_hints(cls)[f.name])
        rule = f.metadata.get("rule")
        if rule is None:
            rule = record_of(hint) if dataclasses.is_dataclass(hint) else counter_rule(f, hint)
        fields[json_name(f)] = Field(rule, required=not f.metadata.get("optional", False))
    required = [k for k, f in fields.items() if f.required]
    shown = ", ".join(required[:6]) + (f" and {len(required) - 6} more" if len(required) > 6
                                       else "")
    return Record(fields, what=f"{cls.WHAT} (an object with {shown})")


def to_json(obj: Any) -> Any:
    """The JSON value of ``obj`` (a manifest dataclass, or a dict or list of them; new
    containers, shared leaves): an optional or pending field that is None is left out."""
    if dataclasses.is_dataclass(obj):
        return {json_name(f): to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not _omitted(f, getattr(obj, f.name))}
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def from_json(cls: type, value: dict[str, Any]) -> Any:
    """The ``cls`` dataclass of ``value`` (a JSON object the schema accepted, or a rank's part
    as `to_json` made it): absent keys take the field's default, unknown keys are ignored;
    values are shared with ``value`` where they are not records."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if json_name(f) in value:
            kwargs[f.name] = _decode(_hints(cls)[f.name], value[json_name(f)])
    return cls(**kwargs)


def _decode(hint: Any, value: Any) -> Any:
    hint = _inner(hint)
    if value is None:
        return None
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value)
    if typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
        return {k: from_json(typing.get_args(hint)[1], v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- the manifest --------------


@dataclass(kw_only=True)
class Manifest:
    """A snapshot's ``manifest.json``.

    The run: ``step``, ``epoch`` (the Trainer's, fractional, or None), ``created_unix``,
    ``world_size``, ``rank`` (a rank's part only: the merge drops it), ``run_id`` (absent
    without one), ``model`` and ``weights`` (absent without a model), ``weights_from``
    (absent when the weights are the step's own: `WeightsFrom`), ``answer_tokens``
    (absent when the run set none). The tracker: five settings readers use (``fisher``,
    ``ema_decay``, ``token_fraction``, ``update_every``, ``storage_dtype``; the whole
    configuration, ``KFACConfig.to_dict()``, is ``config``), ``counts``, ``skipped_steps``,
    ``final_refresh`` (the final snapshot's factors refreshed at the final weights; absent
    otherwise).
    The factors: ``fingerprint`` (of the tracked layers' shapes, `layout.layer_fingerprint`),
    ``shared_inputs`` (groups of layers storing one A under the first one's key),
    ``ownership``, ``eigen`` (whether the shards hold the eigendecomposition; absent in
    format 2, where they always do), ``layers`` (by module name, sorted) and ``shards``
    (by file name; filled in by the writer).
    """

    WHAT: ClassVar[str] = "a kfac_stream snapshot manifest"
    format: str = json_field(Str(choices=(FORMAT_NAME,)), default=FORMAT_NAME)
    format_version: int = json_field(Int(min(READ_VERSIONS), FORMAT_VERSION),
                                     default=FORMAT_VERSION)
    step: int = json_field(COUNT)
    epoch: float | None = json_field(Nullable(NONNEG))
    created_unix: float = json_field(NONNEG)
    world_size: int = json_field(Int(1, MAX_WORLD_SIZE))
    rank: int | None = json_field(_RANK, optional=True)
    ownership: Ownership = json_field()
    fisher: str = json_field(FISHER_NAME)
    ema_decay: float = json_field(Num(0.0, 1.0))
    token_fraction: float = json_field(Num(0.0, 1.0, lo_open=True))
    update_every: int = json_field(Int(1))
    storage_dtype: str = json_field(Str(choices=STORAGE_DTYPES))
    config: dict[str, Any] = json_field(CONFIG)
    counts: Counts = json_field()
    skipped_steps: list[int] = json_field(ListOf(COUNT))
    shared_inputs: list[list[str]] = json_field(ListOf(ListOf(Str(what="a layer name"), min_len=2)))
    fingerprint: str = json_field(HEX64)
    run_id: str | None = json_field(Str(pattern=re.compile(r"[0-9a-f]{32}"),
                                 what="32 lowercase hex digits"), optional=True)
    weights: dict[str, WeightsFingerprint] | None = json_field(
        MapOf(record_of(WeightsFingerprint), layer_name_problem, _LAYER_NAME,
              what="an object of weight fingerprints"), optional=True)
    weights_from: WeightsFrom | None = json_field(optional=True)
    answer_tokens: AnswerTokens | None = json_field(optional=True)
    model: ModelIdentity | None = json_field(optional=True)
    run_plan: RunPlanEntry | None = json_field(optional=True)
    final_refresh: FinalRefresh | None = json_field(optional=True)
    eigen: EigenEntry | None = json_field(optional=True)
    layers: dict[str, LayerEntry] = json_field(
        MapOf(record_of(LayerEntry), layer_name_problem, _LAYER_NAME, min_len=1,
              what="an object of layer entries"))
    shards: dict[str, ShardEntry] = json_field(
        MapOf(record_of(ShardEntry), shard_name_problem, SHARD_NAME, min_len=1,
              what="an object of shard entries"), factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest as written (`to_json`)."""
        return to_json(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Manifest:
        """The manifest of a parsed, schema-checked ``manifest.json`` (`from_json`)."""
        return from_json(cls, value)


#: The whole manifest's schema, generated from `Manifest`.
SCHEMA = record_of(Manifest)
