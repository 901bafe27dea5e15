"""Typed (structured) Hydra configs of the `kfac-stream train` app.

Every group in ``kfac_stream/conf/`` merges into these dataclasses, so an unknown key or a value
of the wrong type fails at composition, before anything loads, with the key in Hydra's message
(``Key 'tokn_fraction' not in 'KFACConf'``, ``Value 'x' of type 'str' could not be converted
to Float ... full_key: kfac.token_fraction``). Range checks (``token_fraction=2``) are
`KFACConfig`'s and ``TrainingArguments``' own, run first thing in the app.

=========  ==================================================================================
group      what it holds
=========  ==================================================================================
model      ``tiny`` (GPT-2 built from a config, byte vocabulary) or ``hf`` (from_pretrained)
data       ``pydoc`` (Python's reference docs, on every machine) or ``hf`` (load_dataset)
kfac       `KFACConfig` itself: its fields, types and defaults are the schema
trainer    ``TrainingArguments`` fields; ``extra`` passes any other field through
logging    W&B project/mode, cheap scalars every ``log_every`` steps
report     the end-of-run report: uncertainty contrast sizes
=========  ==================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..config import KFACConfig


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


def _mutable_schema(cls: type) -> type:
    """A plain (mutable) dataclass with ``cls``'s fields, resolved types and defaults.

    `KFACConfig` is frozen (a tracker's settings never change under it), and Hydra cannot
    apply overrides to a frozen structured config; this copy is generated from it, so the
    dataclass stays the one place where a field, its type and its default are written.
    """
    hints = get_type_hints(cls)
    schema = make_dataclass(f"{cls.__name__.removesuffix('Config')}Conf",
                            [(f.name, hints[f.name], field(default=f.default))
                             for f in fields(cls)])
    schema.__module__ = __name__
    return schema


KFACConf = _mutable_schema(KFACConfig)


@dataclass
class TrainerConf:
    """``TrainingArguments`` fields the app sets; ``extra`` holds any other field."""

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
    extra: dict[str, Any] = field(default_factory=dict)


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
    trainer: TrainerConf = field(default_factory=TrainerConf)
    logging: LoggingConf = field(default_factory=LoggingConf)
    report: ReportConf = field(default_factory=ReportConf)
    output_dir: str | None = None  # default: Hydra's run directory


def register() -> None:
    """Store the schema as ``app_schema`` (kfac_stream/conf/config.yaml lists it first in its
    defaults)."""
    ConfigStore.instance().store(name="app_schema", node=AppConf)


def kfac_config(conf) -> KFACConfig:
    """The validated `KFACConfig` of a composed ``kfac`` node (raises `KFACConfigError`)."""
    values = OmegaConf.to_container(OmegaConf.create(conf), resolve=True)
    return KFACConfig(**values)
