"""The main job: ``kfac-stream train`` / ``python -m kfac_stream.app`` (Hydra).

Trains a causal LM with ``transformers.Trainer`` and `KFACStreamCallback`, logs the factors'
spectra (W&B, offline unless an API key is set; TensorBoard; the Trainer's own log), and prints
the end-of-run report: where the snapshot is, the per-layer spectrum table, what the tracker
cost, and an uncertainty contrast on held-out vs out-of-domain text.

Runs the same in one process, under ``accelerate launch`` (DDP, DeepSpeed ZeRO-1/2/3) and
under the ``deepspeed`` launcher (``trainer.deepspeed=launch/deepspeed/zero3.json``). With
several processes the run directory is rank 0's (all ranks write their snapshot shards there).

Defaults need no network and finish in a few minutes on 2 CPU cores: a 2 x 128 GPT-2 built
from a config, byte-level tokens, Python's reference documentation.

Configs: ``conf/`` (``config.yaml`` and the groups ``model``, ``data``, ``kfac``, ``trainer``,
``logging``, ``report``; the wheel ships them as ``kfac_stream/conf/``), found from any working
directory.
Override any key on the command line (``kfac-stream train trainer.max_steps=200
model.n_layer=4``), or add configs of your own with Hydra's flags (before the overrides):
``--config-dir DIR`` (``-cd``) adds ``DIR`` to the search path, after the shipped directory
(new group options such as ``DIR/model/mine.yaml``, chosen by ``model=mine``; a shipped file
of the same name wins), and ``--config-name NAME`` (``-cn``) picks the primary config
``NAME.yaml`` (default ``config``; ``demo`` is ``config`` into ``out/demo``, what
``kfac-stream demo`` runs). A primary config of your own should list ``- config`` first in its
defaults (then ``override model: mine``, ... and ``_self_``) to keep the typed schema, e.g.
``kfac-stream train -cd my_conf -cn my_run trainer.max_steps=200``.
``kfac-stream train --help`` prints these flags and the composed config; ``--hydra-help``
all of Hydra's.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import fields
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ..distributed.context import agree_with_rank0, release_process_groups
from ..exceptions import AppConfigError, KFACConfigError
from ..integrations.unshard import check_deepspeed_device
from .schema import (
    AppTrainerDefaults,
    check_keys,
    check_override_keys,
    heldout_config,
    kfac_config,
    register,
)

logger = logging.getLogger("kfac_stream")
register()


def conf_dir() -> str:
    """The app's configs: ``conf/`` at the top of a checkout (beside the package, also for an
    editable install), which the wheel ships as ``kfac_stream/conf/`` (package data). An
    absolute path, so Hydra reads them as files from any working directory
    (``--config-dir``/``-cd`` adds a directory searched after this one)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # above app/
    installed = os.path.join(package, "conf")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(package),
                                                                   "conf")


CONF_DIR = conf_dir()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (AppConfigError, KFACConfigError) as e:  # a bad override: say which, no traceback
        if os.environ.get("RANK", "0") == "0":  # the same line on every rank: print it once
            print(f"kfac-stream train: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        release_process_groups()  # before interpreter shutdown: no gloo worker outlives it


def run(cfg: DictConfig, output_dir: str | None = None) -> dict[str, Any]:
    """Validate everything, then train; returns paths and figures of the run (rank 0 fills
    the report entries)."""
    logging.basicConfig(level=getattr(logging, cfg.logging.level), format="%(message)s")
    kcfg = kfac_config(cfg.kfac)  # range checks first: nothing has loaded yet
    heldout = heldout_config(cfg)
    _check_choices(cfg)
    out = output_dir or cfg.output_dir or HydraConfig.get().runtime.output_dir
    args = training_arguments(cfg, out)
    check_deepspeed_device(args)  # before the model loads, not in DeepSpeed's engine
    out = agree_with_rank0(os.path.abspath(out))  # ranks may have started a second apart
    if out != args.output_dir:
        args = training_arguments(cfg, out)
    _setup_reporting(cfg, args, out)
    torch.set_flush_denormal(True)  # x86 CPUs run ~10x slower on denormals (small models)

    from transformers import Trainer

    from ..integrations.hf_callback import KFACStreamCallback
    from . import data as appdata

    if args.process_index == 0:
        logger.info("kfac_stream: run directory %s; building the model and the data (%d "
                    "process%s)", out, args.world_size, "es" * (args.world_size != 1))
    model, tokenizer, seq_len = _model(cfg)
    train_docs, heldout_docs, ood_docs = _documents(cfg)
    train = training_windows(train_docs, tokenizer, seq_len)
    if not train:
        raise AppConfigError(f"data: the training text yields no window of seq_len={seq_len}")
    # the callback reports its spectra and scalars to the Trainer's reporters itself
    kfac = KFACStreamCallback(kcfg, log_every=cfg.logging.log_every,
                              report_media=cfg.logging.media, heldout=heldout)
    trainer = Trainer(model=model, args=args, train_dataset=appdata.ExampleDataset(train),
                      callbacks=[kfac])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(os.path.join(out, "model"))  # every rank (ZeRO-3 gathers the weights)
    if trainer.is_world_process_zero() and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(os.path.join(out, "model"))
    result: dict[str, Any] = {"output_dir": out, "snapshots": list(kfac.snapshots),
                              "train_seconds": wall}
    if trainer.is_world_process_zero() and kfac.snapshots:
        from .report import end_of_run_report

        result.update(end_of_run_report(
            cfg, model, tokenizer, seq_len=seq_len, kfac=kfac, wall=wall,
            heldout_docs=heldout_docs, ood_docs=ood_docs, world_size=args.world_size,
            model_dir=os.path.join(out, "model")))
    return result


# -- building blocks ------------------------------------------------------------------------------

def _check_choices(cfg: DictConfig) -> None:
    choices = {"model.kind": (cfg.model.kind, ("tiny", "hf")),
               "data.kind": (cfg.data.kind, ("pydoc", "hf")),
               **{f"data.ood[{i}]": (v, tuple(OOD_SETS)) for i, v in enumerate(cfg.data.ood)}}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise AppConfigError(f"{key}={value!r}: must be one of {allowed}")
    if cfg.model.kind == "hf" and not cfg.model.name_or_path:
        raise AppConfigError("model.name_or_path is required with model=hf")
    if cfg.model.kind == "hf":
        from ..utils.files import local_path_problem

        problem = local_path_problem(cfg.model.name_or_path)
        if problem is not None:  # at once: from_pretrained would retry the hub first
            raise AppConfigError(f"model.name_or_path={cfg.model.name_or_path!r} {problem}")
    if cfg.data.kind == "hf" and not cfg.data.path:
        raise AppConfigError("data.path is required with data=hf")
    if not 0.0 <= cfg.data.heldout_fraction < 1.0:
        raise AppConfigError(f"data.heldout_fraction={cfg.data.heldout_fraction}: must be in "
                             "[0, 1)")
    for key in ("windows", "positions", "top_k"):
        value = cfg.report[key]
        if value < 1:
            raise AppConfigError(f"report.{key}={value}: must be a positive integer")
    tau = cfg.report.prior_precision
    if not (math.isfinite(tau) and tau > 0):
        raise AppConfigError(f"report.prior_precision={tau}: must be a positive finite float")


def training_arguments(cfg: DictConfig, out: str):
    """``TrainingArguments`` from the ``trainer`` group: the app's defaults
    (`schema.AppTrainerDefaults`), every field set away from transformers' default, and
    ``extra`` passed through."""
    from transformers import TrainingArguments

    tc = OmegaConf.to_container(cfg.trainer, resolve=True)
    check_keys("trainer", tc)  # `+trainer.<typo>=...` adds a key Hydra does not check
    ta_defaults = {f.name: f.default for f in fields(TrainingArguments) if f.init}
    app = {f.name for f in fields(AppTrainerDefaults)}
    kwargs = {k: v for k, v in tc.items()
              if k != "extra" and (k in app or v != _default_value(ta_defaults[k]))}
    kwargs["report_to"] = list(kwargs["report_to"]) or "none"
    extra = tc["extra"]
    clash = set(extra) & (set(tc) - {"extra"})
    if clash:
        raise AppConfigError(f"trainer.extra.{sorted(clash)[0]}: set trainer."
                             f"{sorted(clash)[0]} instead")
    known = {f.name for f in fields(TrainingArguments)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise AppConfigError(f"trainer.extra.{unknown[0]} is not a TrainingArguments field")
    try:
        return TrainingArguments(output_dir=out, **kwargs, **extra)
    except (ValueError, TypeError) as e:
        raise AppConfigError(f"trainer: {e}") from e


def _default_value(default: Any) -> Any:
    """A ``TrainingArguments`` field default as the schema holds it (an enum by its value; a
    list or dict factory's field compares unequal, so it is passed)."""
    from enum import Enum

    return default.value if isinstance(default, Enum) else default


def _setup_reporting(cfg: DictConfig, args, out: str) -> None:
    import importlib.util

    report_to = list(args.report_to)
    for name, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if name in report_to and importlib.util.find_spec(module) is None:
            logger.warning("kfac_stream: report_to has %s but it is not installed "
                           "(pip install 'kfac_stream[app]'); skipping it", name)
            report_to.remove(name)
    args.report_to = report_to
    if "wandb" not in report_to:
        return
    os.environ.setdefault("WANDB_PROJECT", cfg.logging.wandb_project)
    os.environ.setdefault("WANDB_DIR", out)
    mode = cfg.logging.wandb_mode or os.environ.get("WANDB_MODE") or (
        "online" if os.environ.get("WANDB_API_KEY") else "offline")
    os.environ["WANDB_MODE"] = mode
    if mode == "offline" and args.process_index == 0:
        logger.info("kfac_stream: W&B runs offline (no WANDB_API_KEY); to upload later: "
                    "wandb sync %s/wandb/offline-run-*", os.environ["WANDB_DIR"])


def _model(cfg: DictConfig):
    from . import data as appdata
    from . import models

    m = cfg.model
    if m.kind == "tiny":
        model = models.tiny_gpt2(vocab_size=m.vocab_size, n_layer=m.n_layer, n_embd=m.n_embd,
                                 n_head=m.n_head, seq_len=m.seq_len, seed=m.seed)
        return model, appdata.ByteTokenizer(), m.seq_len
    model, tokenizer = models.load_hf_model(m.name_or_path, dtype=m.dtype)
    return model, tokenizer, m.seq_len


OOD_SETS = {"python_source": "ood_documents", "licenses": "license_documents"}


def training_documents(cfg: DictConfig) -> tuple[list[str], list[str]]:
    """``(train, heldout)`` documents of the ``data`` and ``model`` groups of a composed
    config (the split is seeded by ``model.seed``): what `run` trains on, and what
    ``kfac-stream influence --train app`` scores."""
    from . import data as appdata

    d = cfg.data
    if d.kind == "pydoc":
        docs = appdata.pydoc_documents()[: d.max_documents]
    else:
        docs = appdata.load_hf_documents(d.path, d.name, d.data_files, d.split, d.text_field,
                                         d.max_documents)
    return appdata.split_documents(docs, d.heldout_fraction, seed=cfg.model.seed)


def training_windows(docs: list[str], tokenizer, seq_len: int,
                     max_examples: int | None = None) -> list[dict[str, torch.Tensor]]:
    """The training examples of ``docs``: one token stream (`encode_documents`: joined by a
    blank line, no special tokens) cut into consecutive windows of ``seq_len`` tokens, the
    incomplete tail dropped (`lm_examples`), at most ``max_examples``."""
    from . import data as appdata

    return appdata.lm_examples(appdata.encode_documents(docs, tokenizer), seq_len,
                               max_examples)


def _documents(cfg: DictConfig) -> tuple[list[str], list[str], dict[str, list[str]]]:
    from . import data as appdata

    train, heldout = training_documents(cfg)
    ood = {name: getattr(appdata, OOD_SETS[name])() for name in cfg.data.ood}
    return train, heldout, {name: docs for name, docs in ood.items() if docs}


def _strip_local_rank_arg() -> None:
    """The ``deepspeed`` launcher appends ``--local_rank=N``, which Hydra would reject as an
    override: move it to ``LOCAL_RANK`` (where accelerate and the Trainer read it)."""
    for i, arg in enumerate(sys.argv[1:], 1):
        if arg.startswith("--local_rank"):
            value = arg.split("=", 1)[1] if "=" in arg else sys.argv[i + 1]
            os.environ.setdefault("LOCAL_RANK", value)
            del sys.argv[i:i + (1 if "=" in arg else 2)]
            return


def cli_main() -> None:
    """Entry point of ``python -m kfac_stream.app`` and ``kfac-stream train``."""
    _strip_local_rank_arg()
    try:
        check_override_keys(sys.argv[1:])  # "did you mean", before Hydra composes
    except AppConfigError as e:
        print(f"kfac-stream train: error: {e}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli_main()
