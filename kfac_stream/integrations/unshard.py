"""`gather_model`: the trained model with whole weights in one process, for queries after
DeepSpeed ZeRO-3 or FSDP2 training in the same script.

Under ZeRO-3 each rank holds 1/world of every parameter; the engine gathers them only inside its
own forward and partitions them again after it. `LaplacePosterior` therefore refuses such a
model (`PartitionedModelError`). The way out, in the training script itself::

    trainer.train()
    model = kfac_stream.gather_model(trainer, f"{out}/model")   # on EVERY rank (collective)
    if model is not None:                                       # the main process
        post = LaplacePosterior(model, Snapshot.latest(f"{out}/kfac"), prior_precision="marglik")

It saves the model with ``trainer.save_model`` (which gathers the weights when the DeepSpeed
config has ``stage3_gather_16bit_weights_on_model_save``; `launch/`'s ZeRO-3 configs set it)
and loads the saved copy on the main process outside DeepSpeed. Under FSDP2 (``fully_shard``:
parameters are ``DTensor`` shards) it gathers the whole state dict to the main process
(``torch.distributed.checkpoint``'s ``get_model_state_dict``, whatever the accelerate
``fsdp_state_dict_type``), loads it into a fresh model of the unsharded class and saves that
with ``save_pretrained``. Otherwise it saves the model with ``trainer.save_model`` too and
returns the trained model itself on every rank.

A PEFT model (``peft.PeftModel``, e.g. LoRA) is saved self-contained, under ZeRO-3 or not: the
adapter where ``trainer.save_model`` puts it and the base model in ``save_dir/base``, with
``kfac_stream_peft.json`` saying where (`kfac_stream.integrations.peft_adapter`), so that
``kfac-stream query --model save_dir`` and ``PeftModel.from_pretrained(base, save_dir)`` load
it with the snapshot's layer names (docs/lora.md).

`check_deepspeed_device`: DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, `launch/cpu_zero*.yaml`)
needs ``TrainingArguments(use_cpu=True)``; the callback checks it when the Trainer is built.
"""

from __future__ import annotations

import logging
import os

from torch import nn

from ..distributed.engines import EngineAdapter, engine_for
from ..exceptions import KFACConfigError, PartitionedModelError
from .peft_adapter import adapter_location, is_peft_model, load_adapter, save_base

logger = logging.getLogger("kfac_stream")


def deepspeed_requested(args) -> bool:
    """True if the Trainer will start a DeepSpeed engine: ``args.deepspeed`` (a JSON, the
    ``deepspeed`` launcher) or ``accelerate launch`` with a DeepSpeed config (it sets
    ``ACCELERATE_USE_DEEPSPEED``)."""
    env = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes")
    return bool(getattr(args, "deepspeed", None)) or env


def check_deepspeed_device(args) -> None:
    """Refuse DeepSpeed on CPU without ``use_cpu=True`` in one line (`KFACConfigError`).

    With ``DS_ACCELERATOR=cpu`` (or no CUDA device) and ``use_cpu`` unset, the Trainer counts
    one process where DeepSpeed counts all of them, and every rank fails in DeepSpeed's own
    batch-size assertion (``train_batch_size is not equal to micro_batch_per_gpu *
    gradient_acc_step * world_size``) after the engine starts."""
    if not deepspeed_requested(args) or getattr(args, "use_cpu", False):
        return
    import torch

    accel = os.environ.get("DS_ACCELERATOR", "")
    if accel == "cpu" or (not accel and not torch.cuda.is_available()):
        why = "DS_ACCELERATOR=cpu" if accel == "cpu" else "no CUDA device"
        raise KFACConfigError(
            f"kfac_stream: DeepSpeed on CPU ({why}) needs TrainingArguments(use_cpu=True) "
            "(the app: trainer.use_cpu=true); without it DeepSpeed's batch-size assertion "
            "fails on every rank")


def gather_model(trainer, save_dir: str, device=None) -> nn.Module | None:
    """The trained model of ``trainer`` with whole weights, for `LaplacePosterior`.

    Call it on every rank after ``trainer.train()``. Under DeepSpeed ZeRO-3 it is collective:
    every rank takes part in ``trainer.save_model(save_dir)``; then the main process loads the
    saved model with ``from_pretrained`` outside DeepSpeed (transformers' global ZeRO-3 flag is
    cleared first, or the load would partition the copy again, a collective call on one rank)
    and returns it in eval mode; the other ranks return None. The copy needs the whole model's
    memory on ``device`` of the main process (default: the Trainer's device; pass ``"cpu"``
    when one accelerator cannot hold it).

    Under FSDP2 it is collective too: every rank takes part in gathering the whole state dict
    (to the main process's CPU memory); the main process loads it into a fresh model of the
    class ``fully_shard`` replaced, saves it to ``save_dir`` (``save_pretrained``) and returns
    it in eval mode; the other ranks return None.

    Which of the two a model takes is its engine adapter's ``whole_copy``
    (`kfac_stream.distributed.engines`: ``"save"`` for ZeRO-3, ``"state_dict"`` for FSDP2).
    Without a sharding engine the model is saved the same way as under ZeRO-3
    (``trainer.save_model(save_dir)``: the main process writes it, for ``kfac-stream query
    --model save_dir``) and the unwrapped trained model itself is returned on every rank
    (``device`` is ignored).

    A PEFT model (``peft.PeftModel``): ``trainer.save_model`` writes only the adapter
    (``adapter_config.json``, ``adapter_model.safetensors``), so the main process also writes
    the base model (the transformers model inside, under its own parameter names: no
    ``lora_A`` / ``lora_B``, ``base_layer.`` stripped, a ``modules_to_save`` head's original
    weights) with its config and the tokenizer to ``save_dir/base``, records it in
    ``save_dir/kfac_stream_peft.json`` and, when the adapter names no base model, sets
    ``adapter_config.json``'s ``base_model_name_or_path`` to it
    (`kfac_stream.integrations.peft_adapter`). Under ZeRO-3 the base's weights are gathered
    for it (one more collective gather of the whole model, after ``save_model``'s of the
    adapter) and the main process returns ``PeftModel.from_pretrained(BaseClass.from_pretrained(
    save_dir/base), save_dir)``, whose module names (``base_model.model.…lora_A.default``)
    are the snapshot's. FSDP2 with a PEFT model is not supported (`PartitionedModelError`).

    Raises:
        PartitionedModelError: the model is not a transformers ``PreTrainedModel`` or a
            ``peft.PeftModel`` around one (ZeRO-3), not a ``PreTrainedModel`` (FSDP2), or
            ``save_model`` wrote no whole weights (the DeepSpeed config lacks
            ``stage3_gather_16bit_weights_on_model_save: true``).
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    engine = engine_for(model)
    if not engine.is_sharded(model):
        return _whole_unsharded(trainer, model, save_dir)
    if engine.whole_copy == "state_dict":
        return _whole_gathered(trainer, model, engine, save_dir, device)
    if is_peft_model(model):
        return _whole_peft_saved(trainer, model, engine, save_dir, device)
    return _whole_saved(trainer, model, engine, save_dir, device)


def _whole_unsharded(trainer, model: nn.Module, save_dir: str) -> nn.Module:
    """`gather_model` of a model no engine shards: saved (with a PEFT model's base), returned."""
    trainer.save_model(save_dir)  # the main process writes; DDP ranks return at once
    if is_peft_model(model) and trainer.args.should_save:
        problem = _peft_base_problem(model)
        if problem is None:
            save_base(model, model.state_dict(), save_dir, _tokenizer_of(trainer))
        else:
            logger.warning("kfac_stream: gather_model saved only the PEFT adapter in %s: %s",
                           save_dir, problem)
    return model


def _require_pretrained(engine: EngineAdapter, cls: type) -> None:
    """Refuse a sharded model of class ``cls`` that is no transformers ``PreTrainedModel``."""
    from transformers import PreTrainedModel

    if not issubclass(cls, PreTrainedModel):
        raise PartitionedModelError(
            f"gather_model: the {engine.name} model is a {cls.__name__}, not a transformers "
            f"PreTrainedModel; {engine.manual_copy_hint}")


def _settle(trainer) -> None:
    """Two barriers before the other ranks return (and usually exit at once).

    gloo's worker thread destroys a finished barrier's work after waking the caller; that work
    released tensors with Python objects (core dump of the abort: ProcessGroupGloo::runLoop →
    ~AsyncBarrierWork → ~AsyncWork → decref_pyobject → take_gil → pthread_exit →
    std::terminate), so a rank that had begun interpreter shutdown by then aborted
    ("terminate called without an active exception", SIGABRT): the ZeRO-3 quickstart test in
    3 of 7 runs on a loaded 2-core machine. The worker destroys the first barrier's work before
    it runs the second, while this thread waits without the GIL: 0 aborts in 16 runs under the
    same load."""
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.wait_for_everyone()


def _whole_saved(trainer, model: nn.Module, engine: EngineAdapter, save_dir: str,
                 device) -> nn.Module | None:
    """`gather_model` through the engine's own save (ZeRO-3): ``save_model`` gathers the
    weights into files, the main process loads them outside the engine."""
    _require_pretrained(engine, type(model))
    trainer.save_model(save_dir)  # collective under ZeRO-3: gathers the 16-bit weights
    _settle(trainer)
    if not trainer.is_world_process_zero():
        return None
    problem = engine.saved_weights_problem(save_dir)
    if problem is not None:
        raise PartitionedModelError(f"gather_model: trainer.save_model({save_dir!r}) {problem}")
    engine.before_local_load()
    copy = type(model).from_pretrained(save_dir)
    return copy.to(trainer.args.device if device is None else device).eval()


def _whole_peft_saved(trainer, model: nn.Module, engine: EngineAdapter, save_dir: str,
                      device) -> nn.Module | None:
    """`gather_model` of a PeftModel under ZeRO-3: the adapter (``save_model``, which gathers the
    trainable parameters alone), then the whole state dict gathered once more for the base
    model's copy in ``save_dir/base``; the main process loads both outside DeepSpeed."""
    problem = _peft_base_problem(model)
    if problem is not None:  # the same on every rank, before any collective
        raise PartitionedModelError(f"gather_model: {problem}")
    trainer.save_model(save_dir)  # collective: gathers the adapter's parameters
    try:  # collective: every parameter, whole, on the main process
        state = trainer.accelerator.get_state_dict(getattr(trainer, "deepspeed", None)
                                                   or trainer.model_wrapped)
    except ValueError:  # the same on every rank: the DeepSpeed config gathers no weights
        raise PartitionedModelError(
            f"gather_model: the base model of the PEFT model in {save_dir!r} cannot be saved "
            f"whole: {engine.save_gather_hint}") from None
    if trainer.is_world_process_zero():
        save_base(model, state, save_dir, _tokenizer_of(trainer))
    del state
    _settle(trainer)
    if not trainer.is_world_process_zero():
        return None
    engine.before_local_load()
    location = adapter_location(save_dir)
    base = type(model.get_base_model()).from_pretrained(location.base)
    copy = load_adapter(location, base)
    return copy.to(trainer.args.device if device is None else device).eval()


def _peft_base_problem(model: nn.Module) -> str | None:
    """Why the base model of the PeftModel ``model`` cannot be saved beside its adapter (it is
    no transformers ``PreTrainedModel``), or None."""
    from transformers import PreTrainedModel

    base = model.get_base_model()
    if isinstance(base, PreTrainedModel):
        return None
    return (f"the PEFT model's base model is a {type(base).__name__}, not a transformers "
            "PreTrainedModel, so it is not saved beside the adapter; save it with its own saver "
            "and load it in a process without DeepSpeed")


def _tokenizer_of(trainer):
    """What ``trainer.save_model`` saves beside the model: the processing class, else the data
    collator's tokenizer, or None."""
    if trainer.processing_class is not None:
        return trainer.processing_class
    return getattr(getattr(trainer, "data_collator", None), "tokenizer", None)


def _whole_gathered(trainer, model: nn.Module, engine: EngineAdapter, save_dir: str,
                    device) -> nn.Module | None:
    """`gather_model` by the engine's state-dict gather (FSDP2): the main process loads it into
    an unsharded copy, saves that and returns it."""
    cls = engine.unsharded_class(model)
    _require_pretrained(engine, cls)
    state = engine.gather_full_state_dict(model)  # collective: every rank, the main one receives
    _settle(trainer)
    if not trainer.is_world_process_zero():
        return None
    engine.before_local_load()
    copy = cls(model.config)
    copy.load_state_dict(state)
    copy.save_pretrained(save_dir)
    return copy.to(trainer.args.device if device is None else device).eval()
