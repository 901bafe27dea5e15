"""What the callback checks and measures around the Trainer's events: the launch (DeepSpeed on
CPU, an engine asked for but not in use), the run's inputs at train begin (CUDA graphs,
answer tokens), the wall time of its event handlers, and the training batches the
final-weight refresh reads at train end."""

from __future__ import annotations

import functools
import logging
import time

from ..capture.graphs import compile_mode_error
from ..config import KFACConfig
from ..distributed.engines import engines_not_applied
from ..query.answer_tokens import resolve_answer_tokens, text_tokenizer
from ..utils.log_setup import show_info_by_default
from ..utils.own_rng import kept_generators
from .unshard import check_deepspeed_device, deepspeed_requested

logger = logging.getLogger("kfac_stream")


def timed(part: str):
    """Add a handler's wall time to ``callback_seconds`` and its ``callback_parts[part]``;
    the training's global generators are as the handler found them when it returns
    (`kept_generators`: whatever the handler draws, the training draws what it would have)."""

    def wrap(handler):
        @functools.wraps(handler)
        def timed(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                with kept_generators(run_devices(args[0] if args else None)):
                    return handler(self, *args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                self.callback_seconds += spent
                self.callback_parts[part] += spent
        return timed
    return wrap


def run_devices(args) -> list:
    """The training device of TrainingArguments ``args`` as a list (empty: no arguments)."""
    device = getattr(args, "device", None) if args is not None else None
    return [device] if device is not None else []


def check_engine_start(args) -> None:
    """At the end of ``Trainer.__init__``: refuse DeepSpeed on CPU without ``use_cpu``
    (`unshard.check_deepspeed_device`) before its engine fails on every rank, and say that its
    start inside ``trainer.train()`` takes a while."""
    check_deepspeed_device(args)
    if deepspeed_requested(args) and getattr(args, "process_index", 0) == 0:
        show_info_by_default()
        logger.info("kfac_stream: DeepSpeed starts its engine inside trainer.train() before "
                    "the first step (ZeRO-3: partitioning the model over the processes), "
                    "often tens of seconds without output; tracking begins after it")


def check_train_begin(config: KFACConfig, args, model, processing_class=None,
                      answer_tokens: list[int | str] | None = None) -> dict | None:
    """Train begin, before any collective: the config re-validated (it may be a copy), CUDA
    graphs refused (they would replay stale hooks), the answer tokens
    (``HeldoutConfig.answer_tokens``) resolved with the Trainer's tokenizer and checked
    against the eval set's needs; returns them."""
    KFACConfig(**config.to_dict())
    error = compile_mode_error(args)
    if error is not None:
        raise error
    return resolve_answer_tokens(answer_tokens, model, text_tokenizer(processing_class))


def warn_engines_not_applied(model) -> None:
    """Warn once per engine the launch asked for that does not manage ``model``
    (`kfac_stream.distributed.engines.engines_not_applied`)."""
    for warning in engines_not_applied(model):
        logger.warning("%s", warning)


def training_batches(loader):
    """This rank's training batches for the final-weight refresh, from the dataloader the
    Trainer hands its callbacks (``train_dataloader``; None: none). Accelerate's prepared
    loader (``DataLoaderShard``: this rank's shard, batches moved to the device) is read
    through the plain loader it wraps (``base_dataloader``: the same shard and collator), so
    its own state (the epoch it sets on the sampler, the accelerator's gradient state, the
    generators it synchronises) is untouched; other loaders are iterated as they are."""
    if loader is None:
        return None
    base = getattr(loader, "base_dataloader", None)
    if type(loader).__name__ == "DataLoaderShard" and base is not None:
        return base
    return loader
