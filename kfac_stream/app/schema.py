"""Typed (structured) Hydra configs of the `kfac-stream train` app.

Every group in ``conf/`` merges into these dataclasses, so an unknown key or a value
of the wrong type fails at composition, before anything loads, with the key in Hydra's message
(``Key 'tokn_fraction' not in 'KFACConf'``, ``Value 'x' of type 'str' could not be converted
to Float ... full_key: kfac.token_fraction``). Range checks (``token_fraction=2``) are
`KFACConfig`'s and ``TrainingArguments``' own, run first thing in the app.

=========  ==================================================================================
group      what it holds
=========  ==================================================================================
model      ``tiny`` (GPT-2 built from a config, byte vocabulary) or ``hf`` (from_pretrained)
data       ``pydoc`` (Python's reference docs, on every machine) or ``hf`` (load_dataset)
kfac       `KFACConfig` itself: its fields, types and defaults are the schema (and the
           held-out options' old keys, ``kfac.eval_prior_precision`` and
           ``kfac.answer_tokens``: unset by default, taken with a ``FutureWarning``)
heldout    `HeldoutConfig` itself: ``heldout.prior_precision``, ``heldout.answer_tokens``
trainer    every ``TrainingArguments`` field (``trainer.max_grad_norm=0.5``), app defaults
logging    W&B project/mode, cheap scalars every ``log_every`` steps
report     the end-of-run report: uncertainty contrast sizes
=========  ==================================================================================
"""

from __future__ import annotations

import functools
import operator
import types
import warnings
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from enum import Enum
from typing import Any, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..config import MOVED_OPTIONS, KFACConfig, check_moved_option
from ..exceptions import AppConfigError, did_you_mean
from ..tracking.heldout_config import HeldoutConfig


@dataclass
class ModelConf:
    kind: str = "tiny"  # tiny | hf
    name_or_path: str | None = None  # hf: hub id or local directory
    dtype: str | None = None  # hf: "auto", "float32", "bfloat16", ...
    vocab_size: int = 256  # tiny: byte-level
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    seq_len: int = 128
    seed: int = 0


@dataclass
class DataConf:
    kind: str = "pydoc"  # pydoc | hf
    path: str | None = None  # hf: load_dataset(path, name, data_files=..., split=...)
    name: str | None = None
    data_files: str | None = None
    split: str = "train"
    text_field: str = "text"
    max_documents: int | None = None
    heldout_fraction: float = 0.1  # documents kept out of training for the report
    # out-of-domain text sets for the report: python_source (stdlib), licenses (license texts)
    ood: list[str] = field(default_factory=lambda: ["python_source", "licenses"])


def _mutable_schema(cls: type, extra: tuple[tuple[str, Any, Any], ...] = ()) -> type:
    """A plain (mutable) dataclass with ``cls``'s fields, resolved types and defaults, then
    the ``extra`` ``(name, type, field)`` ones.

    `KFACConfig` is frozen (a tracker's settings never change under it), and Hydra cannot
    apply overrides to a frozen structured config; this copy is generated from it, so the
    dataclass stays the one place where a field, its type and its default are written.
    """
    hints = get_type_hints(cls)
    schema = make_dataclass(f"{cls.__name__.removesuffix('Config')}Conf",
                            [(f.name, _options_as_str(hints[f.name]), field(default=f.default))
                             for f in fields(cls)] + list(extra))
    schema.__module__ = __name__
    return schema


def _options_as_str(hint: Any) -> Any:
    """A `KFACConfig` option's type for the schema: its string enum is a string there
    (``FisherType | str`` is ``str``, ``LayerPreset | str | None`` is ``str | None``: the config
    takes the strings); any other type as it is."""
    if get_origin(hint) not in (Union, types.UnionType):
        return hint
    args = get_args(hint)
    if not any(isinstance(a, type) and issubclass(a, Enum) for a in args):
        return hint
    plain = dict.fromkeys(str if isinstance(a, type) and issubclass(a, Enum) else a
                          for a in args)
    return functools.reduce(operator.or_, plain)


HeldoutConf = _mutable_schema(HeldoutConfig)
#: The held-out options' old keys in the ``kfac`` group (``kfac.eval_prior_precision``,
#: ``kfac.answer_tokens``), typed as their `HeldoutConfig` fields; None: not set there.
_MOVED_KEYS = tuple((old, get_type_hints(HeldoutConfig)[new] | None, field(default=None))
                    for old, new in MOVED_OPTIONS.items())
KFACConf = _mutable_schema(KFACConfig, _MOVED_KEYS)


@dataclass
class AppTrainerDefaults:
    """The ``TrainingArguments`` fields whose app default differs from transformers' (or whose
    type the app narrows); `TrainerConf` adds every other field with transformers' default."""

    max_steps: int = 1000
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    lr_scheduler_type: str = "cosine"
    warmup_steps: int = 10
    weight_decay: float = 0.0
    logging_steps: int = 25
    save_strategy: str = "no"
    save_steps: int = 500
    bf16: bool = False
    fp16: bool = False
    gradient_checkpointing: bool = False
    use_cpu: bool = False
    seed: int = 0
    report_to: list[str] = field(default_factory=lambda: ["wandb", "tensorboard"])
    run_name: str | None = None
    disable_tqdm: bool = False
    dataloader_num_workers: int = 0
    deepspeed: str | None = None  # path to a DeepSpeed JSON (the `deepspeed` launcher)


#: Types the schema keeps from ``TrainingArguments``' annotations; a field of any other type
#: (an enum or a dict beside a string, a list) is ``Any``: ``TrainingArguments`` checks it.
_PLAIN = (bool, int, float, str)


def _schema_type(hint: Any) -> Any:
    """``hint`` if it is a plain type or an Optional/Union of plain types, else ``Any``."""
    if get_origin(hint) not in (Union, types.UnionType):
        return hint if hint in _PLAIN else Any
    args = [a for a in get_args(hint) if a is not type(None)]
    if not all(a in _PLAIN for a in args):
        return Any
    if len(args) < len(get_args(hint)):  # Optional
        args.append(type(None))
    return functools.reduce(operator.or_, args)


def _trainer_schema() -> type:
    """`TrainerConf`: every ``TrainingArguments`` field (but ``output_dir``, the run
    directory), so ``trainer.max_grad_norm=0.5`` works like ``trainer.max_steps=200`` and a
    typo fails at composition; the app's own defaults first (`AppTrainerDefaults`), then
    transformers' in its order; ``extra`` (``+trainer.extra.<field>=value``, from before every
    field was declared) still passes a field through, and names the declared key instead."""
    from transformers import TrainingArguments

    app = {f.name: f for f in fields(AppTrainerDefaults)}
    hints = get_type_hints(TrainingArguments)
    spec: list[tuple[str, Any, Any]] = [(f.name, f.type, f) for f in app.values()]
    for f in fields(TrainingArguments):
        if not f.init or f.name in app or f.name == "output_dir" or f.name.startswith("_"):
            continue
        if f.default_factory is not MISSING:  # a list or dict default
            default = field(default_factory=f.default_factory)
        else:
            default = field(default=f.default.value if isinstance(f.default, Enum)
                            else f.default)
        spec.append((f.name, _schema_type(hints[f.name]), default))
    spec.append(("extra", dict[str, Any], field(default_factory=dict)))
    schema = make_dataclass("TrainerConf", spec)
    schema.__module__ = __name__
    schema.__doc__ = ("Every ``TrainingArguments`` field (``trainer.<field>=value``); ``extra``, "
                      "kept for older configs, passes a field that is not declared.")
    return schema


TrainerConf = _trainer_schema()


@dataclass
class LoggingConf:
    wandb_project: str = "kfac_stream"
    wandb_mode: str | None = None  # None: "online" with an API key, else "offline"
    log_every: int = 25  # cheap tracker scalars every N steps (0: off)
    media: bool = True  # W&B histograms of log10 eigenvalues and the spectra PNG
    level: str = "INFO"


@dataclass
class ReportConf:
    enabled: bool = True
    windows: int = 16  # held-out and out-of-domain windows each
    positions: int = 4  # positions per window
    top_k: int = 4  # next-token logits per position
    prior_precision: float = 1.0


@dataclass
class AppConf:
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    kfac: KFACConf = field(default_factory=KFACConf)
    heldout: HeldoutConf = field(default_factory=HeldoutConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    logging: LoggingConf = field(default_factory=LoggingConf)
    report: ReportConf = field(default_factory=ReportConf)
    output_dir: str | None = None  # default: Hydra's run directory


def register() -> None:
    """Store the schema as ``app_schema`` (conf/config.yaml lists it first in its
    defaults)."""
    ConfigStore.instance().store(name="app_schema", node=AppConf)


def kfac_config(conf) -> KFACConfig:
    """The validated `KFACConfig` of a composed ``kfac`` node (raises `KFACConfigError`; an
    unknown key, which only ``+kfac.<key>`` can add, is an `AppConfigError` naming it). The
    held-out options' old keys are left to `heldout_config`."""
    values = OmegaConf.to_container(OmegaConf.create(conf), resolve=True)
    check_keys("kfac", values)
    return KFACConfig(**{k: v for k, v in values.items() if k not in MOVED_OPTIONS})


def heldout_config(conf) -> HeldoutConfig:
    """The validated `HeldoutConfig` of a composed app config: its ``heldout`` node, or the
    old keys set in its ``kfac`` node (``kfac.answer_tokens=...``: one ``FutureWarning``
    naming ``heldout.answer_tokens``). Raises `KFACConfigError` for a bad value,
    `AppConfigError` for an unknown ``heldout`` key or an option set both ways."""
    values = OmegaConf.to_container(OmegaConf.create(conf.heldout), resolve=True)
    check_keys("heldout", values)
    kfac = OmegaConf.to_container(OmegaConf.create(conf.kfac), resolve=True)
    moved = {old: kfac[old] for old in MOVED_OPTIONS if kfac.get(old) is not None}
    for old, value in moved.items():
        check_moved_option(old, value)  # a bad value named as before
    if moved:
        default = HeldoutConfig()
        both = [new for new in (MOVED_OPTIONS[old] for old in moved)
                if values[new] != getattr(default, new)]
        if both:
            raise AppConfigError(
                f"heldout.{both[0]} and kfac.{_old_key(both[0])} are both set: set only "
                f"heldout.{both[0]} (kfac.{_old_key(both[0])} is its old place)")
        warnings.warn(", ".join(f"kfac.{old}" for old in moved) + " moved to the heldout "
                      "group: set " + ", ".join(f"heldout.{MOVED_OPTIONS[old]}" for old in moved)
                      + " (the old keys still work for now)", FutureWarning, stacklevel=2)
        values.update({MOVED_OPTIONS[old]: value for old, value in moved.items()})
    return HeldoutConfig(**values)


def _old_key(new: str) -> str:
    return next(old for old, name in MOVED_OPTIONS.items() if name == new)


#: The app's config groups and their schema.
GROUPS: dict[str, type] = {"model": ModelConf, "data": DataConf, "kfac": KFACConf,
                           "heldout": HeldoutConf, "trainer": TrainerConf,
                           "logging": LoggingConf, "report": ReportConf}


def unknown_key_error(group: str, key: str) -> AppConfigError:
    """``group.key`` is no field of the group's schema: the error, with the closest names."""
    known = [f.name for f in fields(GROUPS[group])]
    hint = (did_you_mean(key, known, lambda c: f"{group}.{c}")
            or f"the {group} keys are listed by `kfac-stream train --cfg job`")
    return AppConfigError(f"{group}.{key} is not a key of the {group} config: {hint}")


def check_keys(group: str, values) -> None:
    """Every key of a composed group node is a schema field (Hydra's ``+group.key=value`` adds
    keys even to a typed node); else `unknown_key_error` for the first unknown one."""
    known = {f.name for f in fields(GROUPS[group])}
    for key in values:
        if key not in known:
            raise unknown_key_error(group, str(key))


def check_override_keys(argv: list[str]) -> None:
    """The command line's ``group.key=value`` overrides (with or without ``+``/``++``/``~``)
    name fields of the group's schema; raises `AppConfigError` with "did you mean" before
    Hydra composes (whose own message for a typo suggests ``+group.key``, which for the ``kfac``
    group ended in a ``TypeError``). Hydra's flags, group choices (``model=hf``), Hydra's own
    keys and ``trainer.extra.*`` are left to Hydra."""
    for arg in argv:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        parts = key.split(".")
        if len(parts) < 2 or parts[0] not in GROUPS or "@" in key:
            continue
        if parts[1] not in {f.name for f in fields(GROUPS[parts[0]])}:
            raise unknown_key_error(parts[0], parts[1])
