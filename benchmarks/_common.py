"""What the benchmark scripts share.

Every script in ``benchmarks/`` answers one question; besides the library it imports this
module, the helper modules beside it (`multiple_choice`, `kron_laplace`,
`classification_figures`, `exact_curvature`, and a large script's own parts: ``gpu_check_*``,
``influence_peers_report``, ``scale_inputs``) and the task definitions of ``tasks/``; only
``suite_default.py`` imports another script (``suite.py``). tests/bench/test_benchmark_layout.py
holds them to 800 lines a module, 120 a function and no import circle. Contents, by the
scripts that use them:

* results: `write_section` (one script's section of ``benchmarks/RESULTS.md``), `machine`
  (CPU, cores, threads, versions), `dist_version`, `log`, `free_port`;
* a snapshot's unavoidable work, eigh + one write (snapshot_scale, snapshot_gpu):
  `snapshot_reference`; the mid-size Llama's run arguments (snapshot_scale, posterior_scale):
  `mid_llama_run_args`; random-token data for the GPU scripts: `RandomTokens`;
* the GPT-2 of the cost benchmarks (overhead, snapshot_query, distributed, peers): `MODEL`,
  `BATCH`, `SEQ`, `make_data`;
* plain and tracked blocks interleaved in one training run (overhead, distributed):
  `BlockClock`, `StartClock`, `StopClock`, `GatedKFAC`;
* the peers' view of GPT-2 (peers, uncertainty): `conv1d_to_linear`;
* the small LM of the uncertainty benchmarks (uncertainty, uncertainty_classification):
  `SEQ_LEN`, `pick`, `lm_datasets`, `train_lm`, `train_and_collect`, `save_base_lm`;
* row slices of a batch dict (the classification scripts and tasks): `batches`;
* metrics: `nll_ece`, `auroc`;
* over seeds (uncertainty, uncertainty_classification): `mean_std`.
"""

from __future__ import annotations

import atexit
import copy
import datetime
import json
import math
import os
import platform
import shutil
import socket
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.app import data as app_data
from kfac_stream.app.data import ExampleDataset
from kfac_stream.app.models import tiny_gpt2
from kfac_stream.query import metrics

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
#: The mid-size Llama of the CPU scale benchmarks (4 layers of hidden 1024, intermediate 2816:
#: 44 factors, 1.29e8 entries) and the tiny stand-in of the scripts' --quick runs; each script
#: sets the vocabulary of its data (snapshot_scale.py, posterior_scale.py).
MID_LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)
QUICK_LLAMA = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
TITLE = "# Benchmarks\n"


# -- results -------------------------------------------------------------------------------------

def write_json(name: str, payload: dict) -> Path:
    """``benchmarks/results/<name>.json`` (indented; values JSON cannot hold as ``str``)."""
    path = HERE / "results" / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def run_uncertainty_benchmark(name: str, a, run, report, begin: str, end: str) -> None:
    """The uncertainty scripts' main body: ``run(a)`` timed, ``report(r, a, info)`` printed,
    then (unless ``a.quick``) ``results/<name>.json`` and the RESULTS.md section written.
    ``--quick`` trains its base LM into a temporary directory that is removed at exit."""
    if a.quick:
        a.base_model = tempfile.mkdtemp(prefix="kfac-bench-lm-")
        atexit.register(shutil.rmtree, a.base_model, ignore_errors=True)
    t0 = time.perf_counter()
    info = dict(machine({"laplace_torch": "laplace-torch", "peft": "peft"}),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    r = run(a)
    r["total_seconds"] = time.perf_counter() - t0
    section = report(r, a, info)
    print(section, flush=True)
    if a.quick:
        return
    write_json(name, {"machine": info, "command": a.command, "args": vars(a), **r})
    write_section(begin, end, section)


def write_section(begin: str, end: str, section: str, path: Path = RESULTS,
                  top: bool = False) -> None:
    """Replace the text from ``begin`` to ``end`` (markers included in ``section``), or, when the
    markers are not there yet, append ``section`` (``top``: put it right under the title)."""
    old = path.read_text() if path.exists() else TITLE
    if begin in old and end in old:
        new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
    elif top and old.startswith(TITLE):
        new = TITLE + "\n" + section + "\n\n" + old[len(TITLE):].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new)


def dist_version(dist: str) -> str:
    """Installed version of the distribution ``dist``, or ``"not installed"``."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def machine(versions: dict[str, str] | None = None) -> dict:
    """``{"cpu", "cores", "torch_threads", "torch", "transformers", <versions>, "python"}``;
    ``versions`` maps a result key to a distribution name, e.g. ``{"peft": "peft"}``."""
    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            **{key: dist_version(dist) for key, dist in (versions or {}).items()},
            "python": platform.python_version()}


class RandomTokens(torch.utils.data.Dataset):
    """``n`` causal-LM examples cycling over ``pool`` random sequences of ``seq`` tokens below
    ``vocab`` (seeded; the GPU scripts, where the data does not matter)."""

    def __init__(self, n: int, seq: int, vocab: int, pool: int = 64):
        self.n = n
        self.pool = torch.randint(0, vocab, (pool, seq),
                                  generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        ids = self.pool[i % len(self.pool)]
        return {"input_ids": ids, "labels": ids.clone()}


def mid_llama_run_args(p) -> None:
    """``--reps/--steps/--batch/--seq`` of the mid-size Llama's training run (snapshot_scale,
    posterior_scale): 3 repetitions of 12 steps of 4 x 128 tokens."""
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)


def snapshot_reference(path: str, device: str | torch.device, tmp: str) -> dict:
    """The unavoidable work of the snapshot at ``path`` (snapshot_scale, snapshot_gpu): an eigh
    of each dense stored factor (float32 on a GPU, as snapshots decompose there; float64 on
    the CPU) plus one safetensors write and fsync of the same bytes (factors, scales,
    eigenvalues, eigenvectors). Returns ``{"eigh_s", "write_s", "unavoidable_s", "factors",
    "dense_factors", "entries"}``."""
    from safetensors.torch import load_file, save_file

    stored = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        stored.update({k: v for k, v in load_file(str(shard)).items()
                       if not k.endswith((".eigvals", ".eigvecs"))})
    keys = [k for k in stored if f"{k}.scale" in stored]  # the stored factors
    cuda = torch.device(device).type == "cuda"
    out = dict(stored)
    t0 = time.perf_counter()
    for k in keys:
        f = stored[k].to(device, torch.float32 if cuda else torch.float64)
        f = f * float(stored[f"{k}.scale"])
        if f.dim() == 2:
            w, q = torch.linalg.eigh(f)
            out[f"{k}.eigvals"] = w.float().cpu()
            out[f"{k}.eigvecs"] = q.float().contiguous().cpu()
        else:
            out[f"{k}.eigvals"] = f.float().cpu()
        del f
    t1 = time.perf_counter()
    target = os.path.join(tmp, "reference.safetensors")
    save_file(out, target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    t2 = time.perf_counter()
    os.remove(target)
    return {"eigh_s": t1 - t0, "write_s": t2 - t1, "unavoidable_s": t2 - t0,
            "factors": len(keys), "dense_factors": sum(stored[k].dim() == 2 for k in keys),
            "entries": sum(stored[k].numel() for k in keys)}


def log(msg: str) -> None:
    print(msg, flush=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the GPT-2 of the cost benchmarks ------------------------------------------------------------

BATCH, SEQ = 8, 256
MODEL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=SEQ, resid_pdrop=0.0,
             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def make_data(n: int) -> ExampleDataset:
    """``n`` windows of ``SEQ`` byte tokens of ``pydoc_data.topics`` (ships with CPython), each
    ``{"input_ids", "attention_mask", "labels"}`` of shape ``[SEQ]``; token id = byte (0..255).
    ~1800 windows; longer runs cycle through the text again."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    windows = len(ids) // SEQ
    return ExampleDataset([{"input_ids": x, "attention_mask": torch.ones_like(x),
                            "labels": x.clone()}
                           for x in (ids[(i % windows) * SEQ:(i % windows + 1) * SEQ]
                                     for i in range(n))])


# -- plain and tracked blocks in one training run ------------------------------------------------

class BlockClock:
    """Alternates plain and tracked blocks of steps inside ONE training run and times them.

    Driven by a `StartClock` placed before the kfac callback (the clock starts before its
    ``on_step_begin``) and a `StopClock` after it (stops after its ``on_step_end``); the kfac
    callback itself sits behind a `GatedKFAC`. Before a plain block the kfac hooks are removed
    from the model (a true plain step); before a tracked block they are put back. The last step
    of a tracked block also pays, timed, for folding its pending rows into the store, so every
    block pays exactly for its own updates.

    Per step (lists indexed by step): ``times`` wall seconds, ``cpu`` process CPU seconds,
    ``tracker_s`` the tracker's training-thread seconds (+ the block's final fold).
    """

    def __init__(self, schedule: list[str], kfac: KFACStreamCallback):
        self.schedule, self.kfac = schedule, kfac  # schedule[step]: "plain" | "tracked"
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.tracker_s: list[float] = []

    def _set_mode(self, step: int) -> None:
        mode = self.schedule[step]
        prev = self.schedule[step - 1] if step > 0 else None
        if mode == prev:
            return
        if mode == "plain":
            self.kfac.tracker.detach()  # every hook off the model: a true plain step
        elif prev == "plain":
            self.kfac.tracker.attach()  # the same hooks back, sampler state carried over

    def start(self, step: int) -> None:
        self._set_mode(step)
        self._c0 = self.kfac.tracker.counters.tracker_seconds
        self._p0, self._t0 = time.process_time(), time.perf_counter()

    def stop(self, step: int) -> None:
        tr = self.kfac.tracker
        flush_s = 0.0
        if self.schedule[step] == "tracked" and (
                step + 1 == len(self.schedule) or self.schedule[step + 1] != "tracked"):
            t = time.perf_counter()
            tr.flush()  # timed: the block pays for folding its own updates
            flush_s = time.perf_counter() - t
        self.times.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._p0)
        self.tracker_s.append(tr.counters.tracker_seconds - self._c0 + flush_s)


class StartClock(TrainerCallback):
    """First in the callback list: starts the `BlockClock` at ``on_step_begin``."""

    def __init__(self, clock: BlockClock):
        self.clock = clock

    def on_step_begin(self, args, state, control, **kw):
        self.clock.start(state.global_step)


class StopClock(TrainerCallback):
    """Last in the callback list: stops the `BlockClock` at ``on_step_end``."""

    def __init__(self, clock: BlockClock):
        self.clock = clock

    def on_step_end(self, args, state, control, **kw):
        self.clock.stop(state.global_step - 1)


class GatedKFAC(TrainerCallback):
    """Forwards step events to the kfac callback only in tracked blocks."""

    def __init__(self, kfac: KFACStreamCallback, schedule: list[str]):
        self.kfac, self.schedule = kfac, schedule

    def on_train_begin(self, *a, **kw):
        return self.kfac.on_train_begin(*a, **kw)

    def on_train_end(self, *a, **kw):
        return self.kfac.on_train_end(*a, **kw)

    def on_step_begin(self, args, state, control, **kw):
        if self.schedule[state.global_step] == "tracked":
            return self.kfac.on_step_begin(args, state, control, **kw)

    def on_step_end(self, args, state, control, **kw):
        if self.schedule[state.global_step - 1] == "tracked":
            return self.kfac.on_step_end(args, state, control, **kw)


# -- the peers' view of GPT-2 --------------------------------------------------------------------

def conv1d_to_linear(model: nn.Module, names: list[str] | None = None) -> nn.Module:
    """A copy of ``model`` with transformers' ``Conv1D`` s (the named ones; ``None``: all) as
    equal ``nn.Linear`` s (weight transposed: Conv1D holds ``[d_in, d_out]``); named modules
    that are not ``Conv1D`` (a BERT's ``nn.Linear`` s) are copied as they are."""
    from transformers.pytorch_utils import Conv1D

    model = copy.deepcopy(model)
    if names is None:
        names = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    for name in names:
        old = model.get_submodule(name)
        if not isinstance(old, Conv1D):
            continue
        lin = nn.Linear(old.weight.shape[0], old.weight.shape[1], bias=old.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(old.weight.T)
            if old.bias is not None:
                lin.bias.copy_(old.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, lin)
    return model


# -- the small LM of the uncertainty benchmarks --------------------------------------------------

SEQ_LEN = 128


def pick(windows: list[torch.Tensor], n: int, seed: int | None = None) -> torch.Tensor:
    """``n`` windows (each ``[T]``) evenly spaced over the list, ``[n, T]``.

    ``seed`` ``None``: indices ``round(linspace(0, L-1, n))``; an int: ``floor((i + u) L / n)``
    for i < n with one phase ``u`` ~ U[0, 1) drawn from a generator seeded with ``seed`` (still
    one window per stretch of L/n, distinct; another sample for another seed)."""
    if len(windows) < n:
        raise SystemExit(f"only {len(windows)} windows available, {n} requested")
    if seed is None:
        idx = torch.linspace(0, len(windows) - 1, n).round().long().tolist()
    else:
        u = torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        idx = [min(int((i + float(u)) * len(windows) / n), len(windows) - 1) for i in range(n)]
    return torch.stack([windows[i] for i in idx])


def lm_datasets(n_seqs: int, seed: int | None = None
                ) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """``(training examples, evaluation sets)`` of the LM task, byte tokens, ``SEQ_LEN`` windows.

    Training: the pydoc topics left after ``split_documents(0.1, seed=seed)`` (``None``: seed
    0). Evaluation sets, each ``[n_seqs, SEQ_LEN]`` (`pick` with ``seed``; ``None``: no random
    phase, the split of seed 0): ``val`` = the even half of the held-out topics, ``id`` = the odd
    half, ``python_source`` = ``ood_documents()``, ``licenses`` = ``license_documents()`` (when
    the machine has them). Each set's windows get their own phase (``seed`` + 1000 × set)."""
    tok = app_data.ByteTokenizer()
    train_docs, held = app_data.split_documents(app_data.pydoc_documents(), 0.1,
                                                seed=0 if seed is None else seed)
    set_index = iter(range(4))

    def picked(docs):
        i = next(set_index)
        return pick(windows(docs), n_seqs, seed=None if seed is None else seed + 1000 * i)

    def windows(docs):
        return [e["input_ids"]
                for e in app_data.lm_examples(app_data.encode_documents(docs, tok), SEQ_LEN)]

    sets = {"val": picked(held[0::2]), "id": picked(held[1::2]),
            "python_source": picked(app_data.ood_documents())}
    lic = app_data.license_documents()
    if lic:
        sets["licenses"] = picked(lic)
    train = app_data.lm_examples(app_data.encode_documents(train_docs, tok), SEQ_LEN)
    return train, sets


def train_lm(train_examples: list[dict], steps: int, out: str, fisher: str | None,
             seed: int = 0):
    """The app's default tiny GPT-2 trained by one Trainer run with one `KFACStreamCallback`
    (``fisher``; ``None``: the same recipe without a tracker, snapshot ``None``); ``seed`` sets
    the initialisation, the Trainer's seed (data order) and the tracker's ``KFACConfig.seed``.

    Two callbacks on one Trainer do not work (only the last one records, the other ends with
    tokens_seen 0), so each Fisher gets its own run from the same seed. Returns what
    `train_and_collect` returns."""
    model = tiny_gpt2(seed=seed)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=10,
                             weight_decay=0.0, logging_steps=max(steps // 4, 1),
                             save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, seed=seed)
    cb = None if fisher is None else KFACStreamCallback(KFACConfig(
        fisher=fisher, output_dir=os.path.join(out, "kfac"), snapshot_every=10 * steps,
        seed=seed))
    trainer = Trainer(model=model, args=args, train_dataset=ExampleDataset(train_examples),
                      callbacks=None if cb is None else [cb])
    return train_and_collect(trainer, model, cb)


def train_and_collect(trainer, model: nn.Module, cb: KFACStreamCallback | None):
    """Run ``trainer``; returns ``(model in eval mode, the callback's last snapshot directory
    or None without a callback, training seconds, the logged losses)``."""
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model.eval()
    return model, None if cb is None else cb.snapshots[-1], wall, losses


def save_base_lm(model: nn.Module, path: str, steps: int) -> None:
    """Cache the LM task's trained model as the classification task's base (``lm_steps.txt``
    records its training steps)."""
    model.save_pretrained(path)
    (Path(path) / "lm_steps.txt").write_text(f"{steps}\n")


# -- metrics -------------------------------------------------------------------------------------

def batches(batch: dict[str, torch.Tensor], size: int):
    """Consecutive row slices of ``size`` of ``batch`` (a dict of ``[n, ...]`` tensors)."""
    n = batch["input_ids"].shape[0]
    for i in range(0, n, size):
        yield {k: v[i:i + size] for k, v in batch.items()}


def nll_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> tuple[float, float]:
    """Mean NLL (nats) of the labels ``y [n]`` under ``probs [n, C]``, and the ECE over
    ``bins`` equal-width bins of the top-1 confidence (right-closed, the first bin includes 0):
    `kfac_stream.query.metrics.nll` and `kfac_stream.query.metrics.ece`."""
    return metrics.nll(probs, y), metrics.ece(probs, y, bins)


def auroc(score_in: torch.Tensor, score_out: torch.Tensor) -> float:
    """P(score of a random OOD item > that of a random ID item), ties 1/2; ``[n_in]``,
    ``[n_out]``: `kfac_stream.query.metrics.auroc`."""
    return metrics.auroc(score_in, score_out)


# -- over seeds ----------------------------------------------------------------------------------

def mean_std(xs: list[float]) -> tuple[float, float]:
    """``(mean, sample standard deviation)`` (0 for one value)."""
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1
               else 0.0)
