"""`whole_model`: the trained model with whole weights in one process, for queries after
DeepSpeed ZeRO-3 training in the same script.

Under ZeRO-3 each rank holds 1/world of every parameter; the engine gathers them only inside its
own forward and partitions them again after it. `LaplacePosterior` therefore refuses such a
model (`PartitionedModelError`). The way out, in the training script itself::

    trainer.train()
    model = kfac_stream.whole_model(trainer, f"{out}/model")   # on EVERY rank (collective)
    if model is not None:                                       # the main process
        post = LaplacePosterior(model, Snapshot.latest(f"{out}/kfac"), prior_precision="marglik")

It saves the model with ``trainer.save_model`` (which gathers the weights when the DeepSpeed
config has ``stage3_gather_16bit_weights_on_model_save``; `launch/`'s ZeRO-3 configs set it)
and loads the saved copy on the main process outside DeepSpeed. Without ZeRO-3 it saves the
model the same way and returns the trained model itself on every rank.

`check_deepspeed_device`: DeepSpeed on CPU (``DS_ACCELERATOR=cpu``, `launch/cpu_zero*.yaml`)
needs ``TrainingArguments(use_cpu=True)``; the callback checks it when the Trainer is built.
"""

from __future__ import annotations

import glob
import os

from torch import nn

from ..exceptions import KFACConfigError, PartitionedModelError

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


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


def is_zero3_partitioned(model: nn.Module) -> bool:
    """True if DeepSpeed ZeRO-3 manages any parameter of ``model`` (it sets ``ds_numel``)."""
    return any(hasattr(p, "ds_numel") for p in model.parameters())


def whole_model(trainer, save_dir: str, device=None) -> nn.Module | None:
    """The trained model of ``trainer`` with whole weights, for `LaplacePosterior`.

    Call it on every rank after ``trainer.train()``. Under DeepSpeed ZeRO-3 it is collective:
    every rank takes part in ``trainer.save_model(save_dir)``; then the main process loads the
    saved model with ``from_pretrained`` outside DeepSpeed (transformers' global ZeRO-3 flag is
    cleared first, or the load would partition the copy again, a collective call on one rank)
    and returns it in eval mode; the other ranks return None. The copy needs the whole model's
    memory on ``device`` of the main process (default: the Trainer's device; pass ``"cpu"``
    when one accelerator cannot hold it).

    Without ZeRO-3 the model is saved the same way (``trainer.save_model(save_dir)``: the main
    process writes it, for ``kfac-stream query --model save_dir``) and the unwrapped trained
    model itself is returned on every rank (``device`` is ignored).

    Raises:
        PartitionedModelError: the model is not a transformers ``PreTrainedModel`` (ZeRO-3
            only), or ``save_model`` wrote no whole weights (the DeepSpeed config lacks
            ``stage3_gather_16bit_weights_on_model_save: true``).
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not is_zero3_partitioned(model):
        trainer.save_model(save_dir)  # the main process writes; DDP ranks return at once
        return model
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise PartitionedModelError(
            f"whole_model: the ZeRO-3 model is a {type(model).__name__}, not a transformers "
            "PreTrainedModel; save it with trainer.save_model(dir) and load it in a process "
            "without DeepSpeed with its own loader")
    trainer.save_model(save_dir)  # collective under ZeRO-3: gathers the 16-bit weights
    trainer.accelerator.wait_for_everyone()
    # A second barrier before the other ranks return (and usually exit at once). gloo's worker
    # thread destroys a finished barrier's work after waking the caller; that work released
    # tensors with Python objects (core dump of the abort: ProcessGroupGloo::runLoop →
    # ~AsyncBarrierWork → ~AsyncWork → decref_pyobject → take_gil → pthread_exit →
    # std::terminate), so a rank that had begun interpreter shutdown by then aborted
    # ("terminate called without an active exception", SIGABRT): the ZeRO-3 quickstart test
    # in 3 of 7 runs on a loaded 2-core machine. The worker destroys the first barrier's work
    # before it runs the second, while this thread waits without the GIL: 0 aborts in 16 runs
    # under the same load.
    trainer.accelerator.wait_for_everyone()
    if not trainer.is_world_process_zero():
        return None
    found = [f for f in _WEIGHT_FILES if os.path.exists(os.path.join(save_dir, f))]
    if not found or _only_empty_weights(save_dir):
        raise PartitionedModelError(
            f"whole_model: trainer.save_model({save_dir!r}) wrote no whole weights: set "
            "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config (accelerate "
            "yaml: zero3_save_16bit_model: true, as launch/'s ZeRO-3 configs do)")
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    copy = type(model).from_pretrained(save_dir)
    return copy.to(trainer.args.device if device is None else device).eval()


def _only_empty_weights(save_dir: str) -> bool:
    """True if the saved weight files hold no values (what ``save_model`` writes under ZeRO-3
    without the 16-bit gather)."""
    files = glob.glob(os.path.join(save_dir, "*.safetensors"))
    if not files:
        return False
    from safetensors import safe_open

    for path in files:
        with safe_open(path, "pt") as f:
            if any(f.get_slice(k).get_shape() not in ([], [0]) for k in f.keys()):
                return False
    return True
