"""A training job that the distributed tests start through the real launchers.

``accelerate launch --config_file launch/cpu_<engine>.yaml tests/support/dist_job.py --out DIR ...``
(2 processes; ``cpu_fsdp2``: FSDP2, see `fsdp_on_cpu`; two machines: one launch per machine
with ``--num_machines 2 --machine_rank R``, tests/runs/test_multinode.py) or
``python tests/support/dist_job.py --batch 4 ...`` (the 1-process reference over the same global
batches). Each rank writes ``DIR/rank-<r>.safetensors`` (its owned factors,
dequantised) and ``DIR/rank-<r>.json`` (ownership, counters, world size); snapshots go to
``DIR/kfac``.

Data: real text (``pydoc_data``) in fixed-length rows read in order (a sequential sampler), so
that 2 ranks × batch b and 1 process × batch 2b see the same sequences per optimizer step
(accelerate hands rank r the batches r, r+W, ...). ``--pad-rows`` turns chosen rows into pure
padding (attention mask 0, labels -100): with batch 2, rows 2 and 3 are rank 1's whole first
micro-batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepspeed_cpu import skip_deepspeed_op_probe  # noqa: E402

from models import ListDataset, text_examples, tiny_gpt2, tiny_llama  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--n-seq", type=int, default=48)
    p.add_argument("--pad-rows", default="")
    p.add_argument("--fisher", default="empirical")
    p.add_argument("--factor-form", default="expand", help="KFACConfig.factor_form")
    p.add_argument("--mc-sequences", default="all",
                   help="KFACConfig.mc_sequences: 'all', an int, or a fraction like 0.5")
    p.add_argument("--storage-dtype", default="float32")
    p.add_argument("--token-fraction", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=1.0)
    p.add_argument("--snapshot-every", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--async-updates", action="store_true",
                   help="exchange and fold on the tracker's worker thread (the CUDA default)")
    p.add_argument("--strategy", default=None, help="force the exchange: rows or stats")
    p.add_argument("--fail-rank", type=int, default=-1,
                   help="this rank raises while writing its shard of the 2nd snapshot")
    p.add_argument("--fail-fatal", action="store_true",
                   help="fail_on_snapshot_error=True (the injected failure stops training)")
    p.add_argument("--save-steps", type=int, default=0, help="Trainer checkpoints every N steps")
    p.add_argument("--resume", default=None, help="resume_from_checkpoint")
    p.add_argument("--watch", action="store_true",
                   help="record RSS and hook counts per step; then train again with a new "
                   "callback on the same model (long-run test)")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--model", default="gpt2", help="gpt2, or llama (q/k/v, gate/up share A)")
    p.add_argument("--fold-on", default="auto", help="KFACConfig.fold_on")
    p.add_argument("--max-dense-dim", type=int, default=8192, help="KFACConfig.max_dense_dim")
    p.add_argument("--kill-in-snapshot", default="",
                   help="RANK:STEP: that rank SIGKILLs itself right after writing its shard of "
                   "the snapshot of STEP (before rank 0 verifies and renames it)")
    p.add_argument("--gather-shards", action="store_true",
                   help="KFACStreamCallback(gather_shards=True): rank 0 writes every shard")
    p.add_argument("--sync-snapshots", action="store_true",
                   help="snapshots on the training thread (background_snapshots=False)")
    p.add_argument("--query", action="store_true",
                   help="after training: gather_model on every rank, then on the main process a "
                   "predictive query of the last snapshot into DIR/query.safetensors")
    p.add_argument("--checkpointing", action="store_true",
                   help="gradient checkpointing (the MC Fisher pass is then replayed)")
    p.add_argument("--ekfac", action="store_true", help="KFACConfig(ekfac=True)")
    p.add_argument("--final-refresh", default="auto", help="KFACConfig.final_refresh")
    p.add_argument("--lora", action="store_true",
                   help="PEFT LoRA (r=4) on the model's attention and MLP projections, lora_B "
                   "seeded non-zero; only the adapters train and are tracked")
    return p.parse_args()


def _mc_sequences(text: str) -> int | float | str:
    if text == "all":
        return text
    return float(text) if "." in text else int(text)


def main() -> None:
    opts = parse()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
    handler.addFilter(_RankFilter())
    logging.getLogger("kfac_stream").addHandler(handler)
    logging.getLogger("kfac_stream").setLevel(logging.INFO)
    skip_deepspeed_op_probe()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    from transformers import Trainer, TrainingArguments

    from kfac_stream import KFACConfig, KFACStreamCallback

    examples = text_examples(opts.n_seq, opts.seq_len, seed=0)
    for i in (int(x) for x in opts.pad_rows.split(",") if x):
        examples[i]["attention_mask"] = torch.zeros_like(examples[i]["attention_mask"])
        examples[i]["labels"] = torch.full_like(examples[i]["labels"], -100)
    if opts.model == "llama":
        model = tiny_llama(torch.float32, hidden_size=opts.width, intermediate_size=2 * opts.width,
                           attn_implementation="eager")
    else:
        model = tiny_gpt2(torch.float32, n_embd=opts.width, n_layer=2, n_head=2,
                          attn_implementation="eager")
    if opts.lora:
        model = _lora(model, opts.model)
    cfg = KFACConfig(token_fraction=opts.token_fraction, ema_decay=opts.ema_decay,
                     update_every=1, snapshot_every=opts.snapshot_every, fisher=opts.fisher,
                     factor_form=opts.factor_form,
                     mc_sequences=_mc_sequences(opts.mc_sequences),
                     storage_dtype=opts.storage_dtype, seed=0,
                     async_updates=opts.async_updates or None, fold_on=opts.fold_on,
                     exchange=opts.strategy or "auto",
                     max_dense_dim=opts.max_dense_dim,
                     fail_on_snapshot_error=opts.fail_fatal, ekfac=opts.ekfac,
                     final_refresh=opts.final_refresh)
    cb = KFACStreamCallback(cfg, resume_from=opts.resume,
                            spectra_media=os.environ.get("KFAC_TEST_MEDIA", "1") == "1",
                            background_snapshots=not opts.sync_snapshots,
                            gather_shards=opts.gather_shards)
    if opts.fail_rank >= 0:
        _fail_second_shard(opts.fail_rank)
    if opts.kill_in_snapshot:
        _kill_in_snapshot(*(int(x) for x in opts.kill_in_snapshot.split(":")))
    args = TrainingArguments(
        opts.out, per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.accum,
        max_steps=opts.steps, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, report_to=[], use_cpu=True,
        save_strategy="steps" if opts.save_steps else "no", save_steps=opts.save_steps or 500,
        logging_strategy="no", disable_tqdm=True, seed=0,
        bf16=opts.bf16, dataloader_drop_last=True, gradient_checkpointing=opts.checkpointing)

    class SequentialTrainer(Trainer):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    fsdp_on_cpu()
    trainer = SequentialTrainer(model=model, args=args, train_dataset=ListDataset(examples),
                                callbacks=[cb])
    watch = Watch(model) if opts.watch else None
    if watch:
        trainer.add_callback(watch)
    failed = None
    try:
        trainer.train(resume_from_checkpoint=opts.resume)
    except RuntimeError as e:  # the injected shard failure surfaces here
        failed = str(e) + (f" <- {e.__cause__}" if e.__cause__ else "")
    dump(cb, opts.out, failed, watch.summary() if watch else None)
    if opts.query:
        query(trainer, opts.out)
    if watch:  # a second training of the same model with a new callback must not double count
        cb2 = KFACStreamCallback(KFACConfig(**{**cfg.to_dict(), "token_fraction": 1.0,
                                               "output_dir": opts.out + "/kfac2"}))
        args2 = TrainingArguments(**{**args.to_dict(), "max_steps": 20})
        again = SequentialTrainer(model=model, args=args2, train_dataset=ListDataset(examples),
                                  callbacks=[cb2])
        again.train()
        with open(os.path.join(opts.out, f"second-{cb2.tracker.rank}.json"), "w") as f:
            json.dump({"counters": dict(vars(cb2.tracker.counters)),
                       "hooks": Watch.hook_count(model)}, f)


def _lora(model, kind: str):
    """``model`` wrapped by peft LoRA (r=4, alpha=8, no dropout) on Llama's q/v/down or GPT-2's
    c_attn/c_fc; every lora_B weight drawn from N(0, 0.1^2) (seeded) so that the lora_A layers
    get gradients at the first step."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj", "down_proj"] if kind == "llama" else ["c_attn", "c_fc"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                 lora_dropout=0.0, fan_in_fan_out=kind != "llama",
                                                 task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def fsdp_on_cpu() -> None:
    """Under ``accelerate launch`` with an FSDP config on CPU, let accelerate shard the model.

    accelerate (1.15) switches its FSDP plugin on only for GPU-like distributed types: on CPU
    (``use_cpu: true``, ``MULTI_CPU`` over gloo) the launcher exports ``ACCELERATE_USE_FSDP``
    and the FSDP settings, and the state silently drops them, so the Trainer wraps the model in
    DDP. torch's FSDP2 (``fully_shard``) itself runs on CPU over gloo; this sets the two fields
    accelerate would have set (the distributed type and the plugin, read from the launcher's
    environment), so that accelerate's own FSDP2 preparation (``fsdp2_prepare_model``) and the
    Trainer's FSDP paths run. Nothing else is changed; without an FSDP launch it does nothing.
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = Accelerator(cpu=True).state  # the shared state the Trainer's Accelerator reuses
    if state.distributed_type == DistributedType.MULTI_CPU:
        # both singletons: AcceleratorState copies PartialState's fields at every construction
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin()
        print("dist_job: FSDP2 on CPU: accelerate's distributed type set to FSDP", flush=True)


def query(trainer, out: str) -> None:
    """What a user's script does after (FSDP2, ZeRO-3 or plain) training: the partitioned
    model is refused by `LaplacePosterior`, `gather_model` (every rank) gives a whole copy on
    the main process, and that copy answers a predictive query of the newest snapshot and
    influence scores (`influence_scores`, saved as ``influence`` [2, 4])."""
    from safetensors.torch import save_file

    from kfac_stream import LaplacePosterior, Snapshot, gather_model, influence_scores
    from kfac_stream.exceptions import PartitionedModelError

    def stack(examples):
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}

    snap = Snapshot.latest(os.path.join(out, "kfac"))
    refused = ""
    if trainer.is_world_process_zero():
        try:  # local checks only (no collective): safe on one rank
            LaplacePosterior(trainer.model, snap, prior_precision=1.0)
        except PartitionedModelError as e:
            refused = str(e)
    model = gather_model(trainer, os.path.join(out, "model"))
    if model is None:
        return
    batch = {k: torch.stack([e[k] for e in text_examples(3, 16, seed=7)])
             for k in ("input_ids", "attention_mask")}
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    mean, cov = post.predictive(batch, token_ids=[32, 101])
    # influence of 4 training windows on 2 queries (heuristic damping), on the
    # whole copy like every query
    ex = text_examples(6, 16, seed=9)
    scores = influence_scores(post, stack(ex[:2]), [stack(ex[2:])]).scores
    save_file({"mean": mean.contiguous(), "cov": cov.contiguous(),
               "influence": scores.contiguous()},
              os.path.join(out, "query.safetensors"))
    with open(os.path.join(out, "query.json"), "w") as f:
        json.dump({"refused": refused, "model_class": type(model).__name__,
                   "step": snap.step}, f)


class Watch:
    """Per-step RSS (MiB) and number of hooks on the model (a TrainerCallback)."""

    def __init__(self, model) -> None:
        import psutil

        self.model, self.proc = model, psutil.Process()
        self.rss: list[float] = []
        self.hooks: list[int] = []

    @staticmethod
    def hook_count(model) -> int:
        """kfac_stream's forward (pre-)hooks on the model (DeepSpeed adds its own)."""
        def ours(fn) -> bool:
            return getattr(getattr(fn, "__func__", fn), "__module__", "").startswith(
                "kfac_stream")
        return sum(ours(h) for m in model.modules()
                   for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))

    def __getattr__(self, name):  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, **kwargs):
        self.rss.append(self.proc.memory_info().rss / 2**20)
        self.hooks.append(self.hook_count(self.model))

    def summary(self) -> dict:
        return {"rss_mib": self.rss, "hooks": self.hooks}


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.rank = os.environ.get("RANK", "0")
        return True


def _fail_second_shard(rank: int) -> None:
    import kfac_stream.snapshot.writer as writer

    real = writer.write_shard
    calls = {"n": 0}

    def flaky(tmp_dir, tensors, r, world_size):
        calls["n"] += 1
        if r == rank and calls["n"] == 2:
            raise OSError("injected: disk full while writing the shard")
        return real(tmp_dir, tensors, r, world_size)

    writer.write_shard = flaky


def _kill_in_snapshot(rank: int, step: int) -> None:
    import signal

    import kfac_stream.snapshot.writer as writer

    real = writer.write_shard

    def write_then_die(tmp_dir, tensors, r, world_size):
        out = real(tmp_dir, tensors, r, world_size)
        if r == rank and os.path.basename(tmp_dir).startswith(f".step-{step:08d}.tmp"):
            print(f"KILL rank {r}: SIGKILL after writing its shard into {tmp_dir}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    writer.write_shard = write_then_die


def _weight_shards(layers) -> dict[str, list[int]]:
    """``{layer: [values of its weight held here, whole numel]}``: the first is smaller under
    FSDP2 (a DTensor's local shard) and ZeRO-3."""
    out = {}
    for name, m in layers.items():
        w = m.weight
        local = w.to_local() if hasattr(w, "to_local") else getattr(w, "ds_tensor", w)
        out[name] = [int(local.numel()), int(getattr(w, "ds_numel", w.numel()))]
    return out


def dump(cb, out: str, failed: str | None, watch: dict | None = None) -> None:
    from safetensors.torch import save_file

    tracker = cb.tracker
    r = tracker.rank
    factors = {}
    if failed is None:
        tracker.flush()
        factors = {k: v.contiguous() for k, v in tracker.store.values().items()}
    save_file(factors, os.path.join(out, f"rank-{r}.safetensors"))
    info = {"rank": r, "world_size": tracker.world_size,
            "owner": tracker.ownership.owner,
            "stored_bytes": sum(f.data.numel() * f.data.element_size()
                                for f in tracker.export().factors.values()),
            "counters": dict(vars(tracker.counters)),
            "snapshots": cb.snapshots, "failed": failed, "watch": watch,
            # where this process ran: torchrun's node-local rank and node (GROUP_RANK)
            "local_rank": os.environ.get("LOCAL_RANK"), "node": os.environ.get("GROUP_RANK"),
            "weights": _weight_shards(tracker.layers)}
    with open(os.path.join(out, f"rank-{r}.json"), "w") as f:
        json.dump(info, f, indent=1)


if __name__ == "__main__":
    from kfac_stream.distributed.context import release_process_groups

    try:
        main()
    finally:
        release_process_groups()
