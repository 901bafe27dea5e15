r"""Influence scores on one GPU at ~1.1B parameters: ours from the streamed factors against
kronfluence's fit-then-score, on the same card in the same call.

What is measured
----------------
The model: TinyLlama-1.1B's layout (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV
heads, vocabulary 32000) built from a config (random init, seeded), bf16 weights, on one CUDA
device. Data: random tokens (seeded): ``--n`` (256) training sequences of ``--seq`` (512)
tokens, labelled everywhere, and ``--queries`` (64) query sequences of the same length, each
labelled on its second half only (a prompt and a completion). Tracked layers: kfac_stream's
default selection (every ``nn.Linear`` inside the decoder blocks: q, k, v, o, gate, up, down; 154
layers, 0.969e9 weights); kronfluence tracks the same modules (Llama's are ``nn.Linear``
already: no `conv1d_to_linear` needed). Each part runs in its own subprocess under its own time
limit (its process group killed past it); what a part finished is kept in the JSON and the
table, so a partial run still reports.

1. **ours** (limit ``--limit-ours``, 180 s): a short real run, ``transformers.Trainer`` with
   `KFACStreamCallback` (``KFACConfig(update_every=1, min_window_sequences=0,
   snapshot_every=10**6)``: every step an update step, the long-run MC share, only the final
   snapshot; no spectra media), ``--steps`` (4) steps of ``--train-batch`` (4) sequences; its
   final snapshot (eigendecomposed in the run) loaded (``Snapshot.load``) into a
   `LaplacePosterior` (``prior_precision="auto"``); one warm-up call (one query, one training
   batch: kernels, and every layer's eigenbases converted and kept on the device); then
   ``Influence(post).scores(queries, train)`` (what ``kfac_stream.influence_scores`` calls),
   heuristic damping, training batches of ``--batch`` (4), query batches of ``--query-batch``
   (2), all on the device. Reported: **training examples scored per second** (``N`` over the
   time spent reading the training set: the calls' time less the queries' preconditioning),
   the **queries' preconditioning time apart** (``Influence._query_rows`` timed,
   CUDA-synchronised, inside the same calls), the **peak device memory** of the scoring
   (``torch.cuda.max_memory_allocated``, reset after the warm-up), and the **training examples
   read** (``InfluenceScores.examples_read`` summed over the calls). Also: the run + final
   snapshot time, the snapshot's size, its load, the posterior, each query group's figures.

   **Passes.** 64 queries go in one pass (each training example read once) when their
   preconditioned rows fit the device; at 1.1B they do not. A bf16 model's influence
   features run in float32 (`LaplacePosterior.feature_dtype`: float64 for a float64 model,
   else float32), so 64 rows of the 0.969e9 tracked weights are ``64 · 0.969e9 · 4`` = 248 GB
   (`kfac_stream.influence_memory`): more than the H200 holds, and more than the lent
   machine's 128 GiB of host memory could hold for ``query_device_bytes`` beside it.
   `Influence.scores` keeps the rows in blocks, one per query batch, never concatenated, so a
   group's rows take their own size once. The script therefore splits the queries into the
   fewest equal groups whose rows fit the device's free memory (after the warm-up, so with the
   eigenbases resident) beside the larger of a training batch's needs and a query batch's
   (`influence_memory`: hooks, per-example gradients; a query batch's gradients and their
   preconditioned copy) and ``--reserve-gb`` (12: the model's forward and backward), one call
   per group (`query_groups`). The training set is then read once per group: the JSON says so
   (``query_groups``, ``examples_read`` = groups × N, ``one_pass`` false). Expected on one
   H200 (~150e9 bytes, ~137e9 free after the bf16 model and 10.6 GB of float32 eigenbases;
   31 GB besides the rows): 27 queries per group, **3 groups**. ``examples_per_s`` counts a
   training example once, scored against all
   64 queries, over all the groups' reads.

2. **kronfluence** 1.0.1 (limit ``--limit-kf``, 150 s): the same model (the same seed: the same
   weights, untrained), ``prepare_model`` + ``Analyzer`` on the device, a task whose loss is the
   summed NLL of the labelled tokens (``sample=True``: labels drawn from the model, its default
   true Fisher), tracking the same modules. EK-FAC factors fitted on the same N training
   sequences in its three stages, timed apart (covariances, eigendecomposition, the EK-FAC
   eigenvalue correction: what ``fit_all_factors`` runs), then ``compute_pairwise_scores`` of
   the same 64 queries. Settings: kronfluence's own bf16 presets,
   ``all_low_precision_factor_arguments(strategy="ekfac", dtype=bfloat16)`` and
   ``all_low_precision_score_arguments(damping_factor=None, dtype=bfloat16)``
   (``kronfluence.utils.common``: autocast, covariances, per-sample gradients, lambda,
   preconditioning and scores in bf16; the eigendecomposition in its default float64;
   ``damping_factor=None``: its heuristic, the rule of our ``"heuristic"``), the rest its
   defaults. Why not its float32 defaults: 64 preconditioned query gradients in float32 are
   248 GB (bf16: 124 GB), and bf16 is what ours is measured in. Batch sizes are given
   (``--batch`` for the training set: no search for an executable batch size); its query batch
   is the largest divisor of 64 whose bf16 preconditioned gradients (``Q_b · W · 2`` bytes) fit
   the free memory less its factors (``Σ d² · 4`` over both sides of every module, plus ``W ·
   4``) and ``--reserve-gb`` (``--kf-query-batch`` overrides): 32 on one H200, so its scoring
   reads the training set twice. Its writes of factors and scores (under ``--tmp``) are part of
   its workflow and of its times. Reported: fit seconds (per stage too), score seconds,
   examples/s (N over the score time, which includes its query preconditioning: it does not
   time it apart; and N over fit + score), peak device memory per stage, training-set reads.

Device figures assumed (one H200: ~150e9 bytes of device memory, ~990 bf16 TFLOP/s dense, ~60
float32 TFLOP/s without TF32 (off: torch's default), 128 GB host memory): ours' final snapshot
~30 s and its load ~20 s (docs/gpu.md, at fp32 weights); the 64 queries' preconditioning
``4 · 64 · Σ d_out·d_A·(d_out + d_A)`` ≈ 1.7e15 float32 flops, ~30 s; a training example per
group ~2.3e12 bf16 flops of forward and backward plus ``2·T·W`` ≈ 1e12 float32 flops of dense
per-example gradients, ~25 ms, so ~32 s for 256 examples in 5 groups: ours ~150 s with start-up.
kronfluence: its float64 eigendecomposition of 308 factors (66 of side 5632) ~60-90 s, the
rest ~50 s. Whole run ≤ 5.5 minutes (the two limits plus start-up); run it alone on the card.

Without CUDA (or with ``--dry-run``) both parts run on a 2-layer Llama (hidden 64) on the CPU
through the same code (``Trainer`` + callback with the device path on the CPU, the snapshot,
the posterior, the scoring; kronfluence's three fit stages and its scores), 64 queries against
``--n`` (24) sequences of 16 tokens, side by side (one torch thread each); the memory figure is
then the process's peak RSS (``ru_maxrss``). The JSON goes to ``--json``/``--out`` (on a GPU by
default ``benchmarks/results/influence_gpu.json``; in a dry run by default a new temporary
directory, printed). ``tests/bench/test_influence_gpu.py`` runs the dry run. If kronfluence cannot
be imported, its part is reported absent with the import error (``make .venv/.bench-peers``
installs it here; on the GPU machine it goes into ``.gpu-site``, below) and ours still runs.

Running it on the lent GPU (docs/gpu.md: no registry there, so kronfluence and its pure-Python
dependencies go into ``.gpu-site`` beside hydra's, once, here)::

    python3 -m pip install -q --no-deps --target .gpu-site kronfluence==1.0.1 einops==0.8.2 \
        einconv==0.1.0 opt_einsum==3.4.0

then one ``run`` call with ``carry: [".gpu-site"]``::

    export PYTHONPATH=$PWD:$PWD/.gpu-site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
    mkdir -p .infl && timeout -k 5 360 python3 benchmarks/influence_gpu.py --tmp $PWD/.infl \
        --json $OUT/influence_gpu.json > $OUT/influence_gpu.log 2>&1
    tail -30 $OUT/influence_gpu.log
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT = HERE / "results" / "influence_gpu.json"

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
#: The sizes of a GPU run and of a dry run (``--n``, ``--seq`` ... override them).
FULL = dict(llama=TINYLLAMA, n=256, seq=512, queries=64, batch=4, query_batch=2, steps=4,
            train_batch=4, limit_ours=180.0, limit_kf=150.0)
DRY = dict(llama=TINY, n=24, seq=16, queries=64, batch=12, query_batch=32, steps=3,
           train_batch=4, limit_ours=120.0, limit_kf=120.0)
#: The tracked run: every step an update step, the long-run MC share, only the final snapshot.
TRACKED = dict(update_every=1, min_window_sequences=0, snapshot_every=10**6)
PARTS = ("ours", "kronfluence")
KF_VERSION = "1.0.1"
GB = 1e9


# -- shared by both parts -------------------------------------------------------------------------

def sizes_of(a) -> dict:
    s = dict(DRY if a.dry else FULL)
    for k in ("n", "seq", "queries", "batch", "query_batch", "steps", "train_batch"):
        if getattr(a, k) is not None:
            s[k] = getattr(a, k)
    return s


def device_of(a) -> torch.device:
    return torch.device("cpu") if a.dry else torch.device("cuda", 0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(s: dict, device: torch.device):
    """The Llama of ``s`` in bf16 on ``device`` (seeded: both parts get the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**s["llama"], max_position_embeddings=s["seq"], use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16)


def token_rows(count: int, s: dict, seed: int) -> torch.Tensor:
    return torch.randint(0, s["llama"]["vocab_size"], (count, s["seq"]),
                         generator=torch.Generator().manual_seed(seed))


def train_examples(s: dict) -> list[dict[str, torch.Tensor]]:
    """``N`` training sequences, every position after the first a target."""
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}
            for x in token_rows(s["n"], s, seed=1)]


def query_examples(s: dict) -> list[dict[str, torch.Tensor]]:
    """``Q`` queries, each labelled on its second half only (a prompt and its completion)."""
    out = []
    for x in token_rows(s["queries"], s, seed=2):
        labels = torch.where(torch.arange(len(x)) >= len(x) // 2, x, torch.full_like(x, -100))
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": labels})
    return out


def batches(exs: list[dict], size: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.stack([e[k] for e in exs[i:i + size]]).to(device) for k in exs[0]}
            for i in range(0, len(exs), size)]


def default_layers(model) -> list[str]:
    """kfac_stream's default layer selection (what the callback tracks)."""
    from kfac_stream.capture.selection import select_layers

    return list(select_layers(model))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    """``torch.cuda.max_memory_allocated`` on CUDA; the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"


def free_device_bytes(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


class Partial:
    """The part's figures, written to its JSON after each phase (a killed part keeps them)."""

    def __init__(self, path: str):
        self.path, self.data = Path(path), {}

    def put(self, **kw) -> None:
        self.data.update(kw)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def sum_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[B]``: each example's summed NLL over its labelled tokens (HF shift), in float32."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:].to(logits.device)
    nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (nll * (labels != -100)).sum(1)


def query_groups(queries: int, row_bytes: int, free: int | None, need: int) -> int:
    """The fewest groups of (nearly) equal size the ``queries`` fall into so that a group's
    preconditioned rows fit the ``free`` device bytes beside ``need`` (None: no limit, the
    CPU): ``row_bytes`` per query (`Influence.scores` keeps the rows in blocks, never
    concatenated). At least one query per group."""
    if free is None:
        return 1
    per = max(1, int((free - need) // row_bytes))  # queries a group may hold
    return min(queries, math.ceil(queries / per))


# -- part 1: ours ---------------------------------------------------------------------------------

def train_with_callback(a, s: dict, model, train_ex: list[dict], tmp: str, out: Partial) -> str:
    """The factors of part 1: a short real run of ``model`` with the callback (under ``tmp``);
    returns its final snapshot's path. The optimizer and the tracker are freed after."""
    from transformers import Trainer, TrainingArguments

    from kfac_stream import KFACConfig, KFACStreamCallback
    from kfac_stream.app.data import ExampleDataset

    device = device_of(a)
    cuda = device.type == "cuda"
    kfac = KFACStreamCallback(KFACConfig(
        **TRACKED, output_dir=os.path.join(tmp, "kfac"),
        **({} if cuda else {"async_updates": True, "fold_on": "device"})),
        report_spectra=False, report_media=False, spectra_media=False)
    args = TrainingArguments(
        os.path.join(tmp, "trainer"), per_device_train_batch_size=s["train_batch"],
        max_steps=s["steps"], learning_rate=1e-5, lr_scheduler_type="constant",
        report_to=[], use_cpu=not cuda, bf16=True, logging_strategy="no",
        save_strategy="no", disable_tqdm=True, seed=0, dataloader_pin_memory=False,
        max_grad_norm=0.0)
    fit = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in train_ex]
    trainer = Trainer(model=model, args=args, train_dataset=ExampleDataset(fit),
                      callbacks=[kfac])
    t = time.perf_counter()
    trainer.train()
    sync(device)
    path = kfac.snapshots[-1]
    out.put(train_and_snapshot_s=time.perf_counter() - t, steps=s["steps"],
            updates=kfac.tracker.counters.updates,
            snapshot_bytes=sum(p.stat().st_size for p in Path(path).rglob("*")
                               if p.is_file()))
    del trainer, kfac  # the optimizer's state, the tracker's device statistics
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return path


def plan_query_groups(a, post, query_ex: list[dict], device, out: Partial) -> list[list[dict]]:
    """Part 1's plan: the fewest query groups whose preconditioned rows fit the device."""
    from kfac_stream import influence_memory

    s = sizes_of(a)
    mem = influence_memory(post, s["queries"], s["batch"], s["seq"])
    item = mem["query_rows"] // (s["queries"] * mem["tracked_weights"])
    qmem = influence_memory(post, s["query_batch"], s["query_batch"], s["seq"])
    need = max(mem["batch_hooks"] + 2 * mem["batch_gradients"],
               qmem["batch_hooks"] + 2 * qmem["query_rows"]) + int(a.reserve_gb * GB)
    free = free_device_bytes(device)
    if a.query_budget_gb is not None:
        free, need = int(a.query_budget_gb * GB), 0
    groups = query_groups(s["queries"], mem["tracked_weights"] * item, free, need)
    per = math.ceil(s["queries"] / groups)
    qgroups = [query_ex[i:i + per] for i in range(0, s["queries"], per)]
    out.put(memory_plan={**mem, "itemsize": item, "device_free_bytes": free,
                         "need_besides_rows_bytes": need},
            query_groups=len(qgroups), queries_per_group=[len(g) for g in qgroups])
    print(f"ours: {len(post.layer_names)} layers, {mem['tracked_weights'] / 1e9:.3f}e9 "
          f"tracked weights, {s['queries']} query rows "
          f"{mem['query_rows'] / GB:.1f} GB ({post.feature_dtype}); device free "
          f"{'-' if free is None else f'{free / GB:.1f} GB'}, besides the rows "
          f"{need / GB:.1f} GB: {len(qgroups)} query group(s)", flush=True)
    return qgroups


def ours_part(a, out: Partial) -> None:
    from kfac_stream import Influence, LaplacePosterior, Snapshot

    class TimedInfluence(Influence):
        """`Influence` with the queries' preconditioning timed (synchronised) in the call."""

        precondition_s = 0.0

        def _query_rows(self, *args):
            sync(self.post.device)
            t = time.perf_counter()
            rows = super()._query_rows(*args)
            sync(self.post.device)
            self.precondition_s += time.perf_counter() - t
            return rows

    s, device = sizes_of(a), device_of(a)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    model = build_model(s, device)
    sync(device)
    out.put(build_s=time.perf_counter() - t0, device=device_name(device),
            params=sum(p.numel() for p in model.parameters()))
    train_ex, query_ex = train_examples(s), query_examples(s)

    # the factors: a short real run with the callback, its final snapshot
    tmp = tempfile.mkdtemp(prefix="kfac-infl-gpu-", dir=a.tmp)
    try:
        path = train_with_callback(a, s, model, train_ex, tmp, out)
        model.eval()
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        snap = Snapshot.load(path, show_progress=False)
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        post = LaplacePosterior(model, snap)
        sync(device)
        out.put(load_s=load_s, posterior_s=time.perf_counter() - t,
                layers=list(post.layer_names), feature_dtype=str(post.feature_dtype))

        train = batches(train_ex, s["batch"], device)
        # warm-up: one query against one training batch (kernels; every layer's eigenbases
        # converted and kept on the device, so the plan below sees them resident)
        warm = TimedInfluence(post)
        warm.scores(batches(query_ex[:1], 1, device), train[:1], show_progress=False)
        del warm
        sync(device)

        qgroups = plan_query_groups(a, post, query_ex, device, out)
        reset_peak(device)
        inf = TimedInfluence(post)
        read, parts, q_bytes, per_group = 0, [], 0, []
        t = time.perf_counter()
        for g in qgroups:
            t_g, pre = time.perf_counter(), inf.precondition_s
            r = inf.scores(batches(g, s["query_batch"], device), train, show_progress=False)
            sync(device)
            secs = time.perf_counter() - t_g
            read += r.examples_read
            q_bytes = max(q_bytes, r.query_bytes)
            parts.append(r.scores)
            per_group.append({"queries": len(g), "seconds": secs,
                              "precondition_s": inf.precondition_s - pre,
                              "read_s": secs - (inf.precondition_s - pre),
                              "examples_read": r.examples_read, "query_bytes": r.query_bytes,
                              "peak_memory_bytes": peak_bytes(device)})
            out.put(groups_done=per_group)  # a run cut short keeps each group's figures
            del r
        sync(device)
        total = time.perf_counter() - t
        scores = torch.cat(parts)
        score_s = total - inf.precondition_s
        out.put(scores_s=total, precondition_s=inf.precondition_s, read_s=score_s,
                examples_per_s=s["n"] / score_s,
                query_examples_per_s=s["queries"] / inf.precondition_s,
                peak_memory_bytes=peak_bytes(device),
                peak_memory_source="torch.cuda.max_memory_allocated" if cuda else
                "ru_maxrss (CPU dry run)",
                examples_read=read, n_train=s["n"], one_pass=read == s["n"],
                query_bytes_per_group=q_bytes,
                scores_shape=list(scores.shape),
                scores_finite=bool(torch.isfinite(scores).all()),
                scores_abs_mean=float(scores.abs().mean()))
        print(f"ours: {s['n']} training examples x {s['queries']} queries in {total:.2f} s "
              f"(preconditioning {inf.precondition_s:.2f} s, reading {score_s:.2f} s: "
              f"{s['n'] / score_s:.1f} examples/s), read {read}, peak "
              f"{peak_bytes(device) / GB:.2f} GB", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- part 2: kronfluence -------------------------------------------------------------------------

def kf_task(layers: list[str]):
    from kronfluence.task import Task

    class LMTask(Task):
        """The summed NLL of the labelled tokens (``sample``: labels drawn from the model at
        the labelled positions, its true Fisher)."""

        def compute_train_loss(self, batch, model, sample=False):
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"]
            if sample:
                with torch.no_grad():
                    probs = torch.softmax(logits[:, :-1].detach().float(), -1)
                    draw = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
                    labels = labels.clone()
                    labels[:, 1:] = torch.where(labels[:, 1:] == -100, labels[:, 1:], draw)
            return sum_nll(logits, labels).sum()

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return list(layers)

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    return LMTask()


def kf_part(a, out: Partial) -> None:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.utils.common.factor_arguments import all_low_precision_factor_arguments
    from kronfluence.utils.common.score_arguments import all_low_precision_score_arguments

    from kfac_stream.app.data import ExampleDataset

    s, device = sizes_of(a), device_of(a)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    model = build_model(s, device)
    layers = default_layers(model)
    weights = sum(model.get_submodule(n).weight.numel() + (
        model.get_submodule(n).bias.numel() if model.get_submodule(n).bias is not None else 0)
        for n in layers)
    task = kf_task(layers)
    model = prepare_model(model, task)
    tmp = tempfile.mkdtemp(prefix="kf-infl-gpu-", dir=a.tmp)
    try:
        analyzer = Analyzer("influence_gpu", model, task, cpu=not cuda,
                            log_level=logging.WARNING, disable_tqdm=True, output_dir=tmp)
        sync(device)
        fa = all_low_precision_factor_arguments(strategy="ekfac", dtype=torch.bfloat16)
        sa = all_low_precision_score_arguments(damping_factor=None, dtype=torch.bfloat16)
        out.put(build_s=time.perf_counter() - t0, device=device_name(device), layers=layers,
                tracked_weights=weights,
                factor_args=fa.to_str_dict(), score_args=sa.to_str_dict())
        train_ds, query_ds = ExampleDataset(train_examples(s)), ExampleDataset(query_examples(s))

        # its query batch: the largest whose preconditioned gradients (bf16) fit
        free = free_device_bytes(device)
        factors = sum(d * d for n in layers for d in kf_sides(model, n)) * 4 + weights * 4
        qb = a.kf_query_batch or kf_query_batch(s["queries"], weights, factors, free,
                                                int(a.reserve_gb * GB))
        out.put(query_batch=qb, score_reads=math.ceil(s["queries"] / qb),
                device_free_bytes=free)

        stages = {}

        def stage(name, fn):
            sync(device)
            reset_peak(device)
            t = time.perf_counter()
            fn()
            sync(device)
            stages[name] = {"s": time.perf_counter() - t, "peak_memory_bytes": peak_bytes(device)}
            out.put(stages=stages)
            print(f"kronfluence {name}: {stages[name]['s']:.2f} s, peak "
                  f"{stages[name]['peak_memory_bytes'] / GB:.2f} GB", flush=True)

        b = s["batch"]
        stage("covariance", lambda: analyzer.fit_covariance_matrices(
            "ekfac", train_ds, per_device_batch_size=b, factor_args=fa,
            overwrite_output_dir=True))
        stage("eigendecomposition", lambda: analyzer.perform_eigendecomposition(
            "ekfac", factor_args=fa, overwrite_output_dir=True))
        stage("lambda", lambda: analyzer.fit_lambda_matrices(
            "ekfac", train_ds, per_device_batch_size=b, factor_args=fa,
            overwrite_output_dir=True))
        fit_s = sum(stages[k]["s"] for k in ("covariance", "eigendecomposition", "lambda"))
        out.put(fit_s=fit_s)
        stage("score", lambda: analyzer.compute_pairwise_scores(
            "scores", "ekfac", query_ds, train_ds, per_device_query_batch_size=qb,
            per_device_train_batch_size=b, score_args=sa, overwrite_output_dir=True))
        scores = analyzer.load_pairwise_scores("scores")["all_modules"].float()
        score_s = stages["score"]["s"]
        reads = 2 + math.ceil(s["queries"] / qb)  # covariances, lambda, one per query batch
        out.put(score_s=score_s, total_s=fit_s + score_s, examples_per_s=s["n"] / score_s,
                fit_and_score_examples_per_s=s["n"] / (fit_s + score_s),
                peak_memory_bytes=max(v["peak_memory_bytes"] for v in stages.values()),
                peak_memory_source="torch.cuda.max_memory_allocated" if cuda else
                "ru_maxrss (CPU dry run)",
                n_train=s["n"], examples_read=reads * s["n"], training_set_reads=reads,
                scores_shape=list(scores.shape),
                scores_finite=bool(torch.isfinite(scores).all()),
                scores_abs_mean=float(scores.abs().mean()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def kf_query_batch(queries: int, weights: int, factor_bytes: int, free: int | None,
                   reserve: int) -> int:
    """kronfluence's query batch: the largest divisor of ``queries`` whose preconditioned
    query gradients in bf16 (``2 · weights`` bytes each) fit the ``free`` device bytes beside
    its factors and ``reserve`` (None: no limit, the CPU: all at once)."""
    if free is None:
        return queries
    fit = max(1, int((free - factor_bytes - reserve) // (2 * weights)))
    return max(b for b in range(1, queries + 1) if queries % b == 0 and b <= fit)


def kf_sides(model, name: str) -> tuple[int, int]:
    """A tracked ``nn.Linear``'s covariance sides (input + bias column, output): kronfluence
    holds an eigenbasis of each (float32) during scoring."""
    m = model.get_submodule(name)
    m = getattr(m, "original_module", m)
    w = m.weight
    return w.shape[1] + (m.bias is not None), w.shape[0]


def kronfluence_absent() -> str | None:
    """Why kronfluence cannot be used here (None: it can)."""
    try:
        importlib.import_module("kronfluence.analyzer")
    except Exception as e:  # noqa: BLE001 - any import failure is the reason reported
        return (f"kronfluence is not importable ({type(e).__name__}: {e}); install it with "
                f"`make .venv/.bench-peers` (pip install --no-deps kronfluence=={KF_VERSION}; "
                "on the GPU machine into .gpu-site with einops, einconv, opt_einsum: see this "
                "script's docstring)")
    return None


# -- the parent: parts under time limits, the table ---------------------------------------------

class Limited:
    """A command in its own process group, its output relayed (prefixed) and its last lines
    kept; `wait` kills the group once ``limit`` seconds have passed since the start."""

    def __init__(self, cmd: list[str], limit: float, env: dict, prefix: str):
        self.t, self.limit = time.perf_counter(), limit
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     bufsize=1, start_new_session=True)
        self.tail: deque[str] = deque(maxlen=40)
        self.thread = threading.Thread(target=self._relay, args=(prefix,), daemon=True)
        self.thread.start()

    def _relay(self, prefix: str) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            print(prefix + line, end="", flush=True)

    def wait(self) -> tuple[int | None, list[str], float]:
        """(exit status or None when killed at the limit, last lines, seconds)."""
        left = self.limit - (time.perf_counter() - self.t)
        try:
            rc = self.proc.wait(timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            rc = None
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this call started
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.thread.join(timeout=5)
        return rc, list(self.tail), time.perf_counter() - self.t


def child_cmd(a, part: str, partial: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--partial", partial,
           "--reserve-gb", str(a.reserve_gb)]
    if a.dry:
        cmd.append("--dry-run")
    for k in ("n", "seq", "queries", "batch", "query_batch", "steps", "train_batch",
              "kf_query_batch", "query_budget_gb", "tmp"):
        v = getattr(a, k)
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def fmt(v, spec: str, scale: float = 1.0) -> str:
    return "—" if v is None else format(v / scale, spec)


def table(report: dict) -> list[list[str]]:
    o, k = report["parts"].get("ours", {}), report["parts"].get("kronfluence", {})
    kst = k.get("stages", {})
    return [
        ["status", o.get("status", "—"), k.get("status", "—")],
        ["part seconds (limit)", f"{fmt(o.get('seconds'), '.0f')} ({fmt(o.get('limit_s'), '.0f')})",
         f"{fmt(k.get('seconds'), '.0f')} ({fmt(k.get('limit_s'), '.0f')})"],
        ["factors", f"train + final snapshot {fmt(o.get('train_and_snapshot_s'), '.1f')} s, "
         f"load {fmt(o.get('load_s'), '.1f')} s",
         f"fit {fmt(k.get('fit_s'), '.1f')} s (cov "
         f"{fmt(kst.get('covariance', {}).get('s'), '.1f')} + eigh "
         f"{fmt(kst.get('eigendecomposition', {}).get('s'), '.1f')} + lambda "
         f"{fmt(kst.get('lambda', {}).get('s'), '.1f')})"],
        ["queries preconditioned", f"{fmt(o.get('precondition_s'), '.2f')} s",
         "(inside score)"],
        ["score (training reads)", f"{fmt(o.get('read_s'), '.2f')} s",
         f"{fmt(k.get('score_s'), '.2f')} s"],
        ["training examples / s", fmt(o.get("examples_per_s"), ".2f"),
         f"{fmt(k.get('examples_per_s'), '.2f')} (fit + score: "
         f"{fmt(k.get('fit_and_score_examples_per_s'), '.2f')})"],
        ["peak memory (GB)", fmt(o.get("peak_memory_bytes"), ".2f", GB),
         fmt(k.get("peak_memory_bytes"), ".2f", GB)],
        ["training examples read", f"{o.get('examples_read', '—')} of N = "
         f"{report['sizes']['n']} ({o.get('query_groups', '—')} query group(s))",
         f"{k.get('examples_read', '—')} ({k.get('training_set_reads', '—')} reads)"],
    ]


def print_table(rows: list[list[str]]) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [["", "ours"]])
    print(f"\n{'':<{w0}} | {'ours':<{w1}} | kronfluence {KF_VERSION}")
    print(f"{'-' * w0}-+-{'-' * w1}-+-{'-' * 20}")
    for r in rows:
        print(f"{r[0]:<{w0}} | {r[1]:<{w1}} | {r[2]}")


def finish(report: dict, part: str, partial: str, job: Limited, out: Path,
           t_start: float) -> None:
    """Wait for a part, merge what it wrote, write the JSON so far."""
    rc, tail, secs = job.wait()
    res = report["parts"][part]
    if os.path.exists(partial):
        res.update(json.loads(Path(partial).read_text()))
    res.update(seconds=secs, rc=rc,
               status="ok" if rc == 0 else "timeout" if rc is None else "failed")
    if rc != 0:
        res["tail"] = tail[-25:]
        print(f"{part}: {res['status']} after {secs:.0f} s", flush=True)
    report["seconds"] = time.perf_counter() - t_start
    out.write_text(json.dumps(report, indent=1, default=str))


def parent(a) -> int:
    t_start = time.perf_counter()
    s = sizes_of(a)
    cuda = not a.dry
    if a.dry:
        print("influence_gpu: no CUDA (or --dry-run): both parts on a tiny Llama on the CPU",
              flush=True)
    out = Path(a.json) if a.json else RESULT if cuda else \
        Path(tempfile.mkdtemp(prefix="influence-gpu-")) / "influence_gpu.json"
    import transformers

    report: dict = {
        # the parts name the card: a CUDA context here would take memory from them
        "device": None if cuda else "cpu (dry run)",
        "dry_run": a.dry, "torch": torch.__version__, "transformers": transformers.__version__,
        "sizes": s, "tracked": TRACKED, "parts": {}}
    try:
        from importlib.metadata import version
        report["kronfluence"] = version("kronfluence")
    except Exception:  # noqa: BLE001
        report["kronfluence"] = None
    want = [p for p in PARTS if p in a.only.split(",")]
    limits = {"ours": a.limit_ours or s["limit_ours"], "kronfluence": a.limit_kf or s["limit_kf"]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if a.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="influence-gpu-parts-", dir=a.tmp) as tmp:
        running = {}
        for part in want:
            res: dict = {"limit_s": limits[part]}
            report["parts"][part] = res
            if part == "kronfluence":
                why = kronfluence_absent()
                if why is not None:
                    res.update(status="absent", reason=why)
                    print(f"\nkronfluence: absent: {why}", flush=True)
                    continue
            partial = os.path.join(tmp, f"{part}.json")
            print(f"\n{part} (limit {limits[part]:.0f} s)", flush=True)
            running[part] = (partial, Limited(child_cmd(a, part, partial), limits[part], env,
                                              f"  {part} | "))
            if not a.dry:  # one part at a time on the card; the dry run's run side by side
                finish(report, part, *running.pop(part), out, t_start)
        for part, (partial, job) in running.items():
            finish(report, part, partial, job, out, t_start)
    report["device"] = report["device"] or next(
        (r["device"] for r in report["parts"].values() if r.get("device")), None)
    report["seconds"] = time.perf_counter() - t_start
    rows = table(report)
    report["table"] = rows
    out.write_text(json.dumps(report, indent=1, default=str))
    print_table(rows)
    print(f"({report['seconds']:.0f} s in all; JSON: {out})", flush=True)
    bad = [p for p, r in report["parts"].items() if r["status"] not in ("ok", "absent")]
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--json", "--out", dest="json", default=None,
                   help=f"where the JSON goes (GPU default {RESULT}; dry run: a temp dir)")
    p.add_argument("--tmp", default=None, help="where snapshots and kronfluence's factors go")
    p.add_argument("--only", default=",".join(PARTS), help="parts to run: ours,kronfluence")
    for k in ("n", "seq", "queries", "batch", "query-batch", "steps", "train-batch",
              "kf-query-batch"):
        p.add_argument(f"--{k}", type=int, default=None)
    p.add_argument("--limit-ours", type=float, default=None)
    p.add_argument("--limit-kf", type=float, default=None)
    p.add_argument("--reserve-gb", type=float, default=12.0,
                   help="device memory kept for the model's forward and backward beside the "
                        "query rows (ours) / query gradients and factors (kronfluence)")
    p.add_argument("--query-budget-gb", type=float, default=None,
                   help="device bytes our query groups are planned in (default: the free "
                        "memory, less the batches' needs and --reserve-gb)")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--partial", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.dry = a.dry_run or not torch.cuda.is_available()
    if a.part:
        if a.dry:  # tiny ops: one thread each (two would only contend on a small machine)
            torch.set_num_threads(1)
        logging.getLogger("kfac_stream").setLevel(logging.ERROR)
        import warnings
        warnings.filterwarnings("ignore")
        (ours_part if a.part == "ours" else kf_part)(a, Partial(a.partial))
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
