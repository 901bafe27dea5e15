r"""The LDS protocol's ground truth: retrained query outputs, computed once, cached, resumable.

Usage: ``python benchmarks/lds_truth.py [--tasks digits text] [--seeds 0 1 2] [--workers 2]
[--budget SECONDS]`` computes what is missing and stops after ``--budget`` seconds (progress is
saved every few retrainings, so a run cut anywhere loses at most those); ``--status`` prints
what is done. `influence_lds.py` reads the files and never retrains.

Per task and seed (`lds_tasks.split`: the seed sets the train / validation / test split, the
scored model's initialisation and its data order):

* ``K`` = 100 random halves of the training set (drawn from the task and seed alone);
* each half retrained ``R`` = 3 times by the task's recipe (`lds_tasks.train_fast`), retrain
  ``r`` of half ``k`` with its own initialisation and data order (`fresh_seed`): the ground
  truth is the mean of the three (the field's protocol: the expected counterfactual over
  training noise, not this one run's);
* and once with the scored model's own initialisation and data order restricted to the half
  (the *fixed-seed* truth: this run's counterfactual with its noise removed, reported beside);
* the outputs recorded: every validation and test query's loss (digits: cross-entropy; text:
  the summed next-byte NLL), float64.

File: ``benchmarks/results/lds_truth/<task>-seed<S>.safetensors`` (committed; ~0.5 MB):
``subsets_packed`` ``[K, ⌈N/8⌉]`` uint8 (the ``[K, N]`` membership bits, 1 = in the half,
``numpy.packbits``), ``fresh`` ``[K, R, Q]`` and ``fixed`` ``[K, Q]`` float32 (read back as
float64; NaN = not yet retrained; a loss to 7 digits is ample for ranks), the queries in the
split's order, validation first; its metadata: the task, seed, sizes, the recipe and the CPU
seconds spent. The sizes and recipe are
part of the file's identity: a file with other sizes is refused, never mixed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing
import random
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tasks import lds_tasks as T

TRUTH_DIR = Path(__file__).resolve().parent / "results" / "lds_truth"
#: (training examples, validation queries, test queries) per task.
SIZES = {"digits": (1000, 100, 200), "text": (600, 100, 200), "mnist": (5000, 500, 500)}
SUBSETS, RETRAINS = 100, 3


def fresh_seed(seed: int, k: int, r: int) -> int:
    """Initialisation and data-order seed of retrain ``r`` of half ``k`` (never a scored
    model's: those are the seeds themselves, < 1e6)."""
    return 1_000_000 * (seed + 1) + 1_000 * k + r


def draw_subsets(task: str, seed: int, n: int, k: int) -> torch.Tensor:
    """``[k, n]`` uint8: ``k`` random halves (``n // 2`` members each), from task and seed."""
    rng = random.Random(f"lds-subsets-{task}-{seed}")
    masks = torch.zeros(k, n, dtype=torch.uint8)
    for i in range(k):
        masks[i, rng.sample(range(n), n // 2)] = 1
    return masks


@dataclass
class Truth:
    """One task and seed's ground truth (module docstring). ``subsets`` ``[K, N]`` uint8,
    ``fresh`` ``[K, R, Q]``, ``fixed`` ``[K, Q]`` float64 (NaN: not done), ``n_val`` the
    validation queries (the first ``n_val`` of ``Q``)."""

    task: str
    seed: int
    sizes: tuple[int, int, int]
    subsets: torch.Tensor
    fresh: torch.Tensor
    fixed: torch.Tensor
    seconds: float = 0.0

    @property
    def n_val(self) -> int:
        return self.sizes[1]

    @property
    def path(self) -> Path:
        return truth_path(self.task, self.seed)

    def missing(self) -> list[tuple[int, int]]:
        """``[(k, r)]`` not yet retrained; ``r = -1``: the fixed-seed retrain."""
        out = []
        for k in range(self.subsets.shape[0]):
            if torch.isnan(self.fixed[k]).any():
                out.append((k, -1))
            out += [(k, r) for r in range(self.fresh.shape[1])
                    if torch.isnan(self.fresh[k, r]).any()]
        return out

    def complete(self) -> bool:
        return not self.missing()

    def members(self) -> list[list[int]]:
        """Each half's members, ``K`` lists of training indices."""
        return [torch.nonzero(m).flatten().tolist() for m in self.subsets]

    def save(self) -> None:
        meta = {"task": self.task, "seed": str(self.seed), "sizes": json.dumps(self.sizes),
                "seconds": f"{self.seconds:.1f}", "recipe": json.dumps(
                    T.RECIPES[self.task].__dict__)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        packed = torch.from_numpy(np.packbits(self.subsets.numpy(), axis=1))
        save_file({"subsets_packed": packed, "fresh": self.fresh.float(),
                   "fixed": self.fixed.float()}, tmp, metadata=meta)
        tmp.chmod(0o644)
        tmp.replace(self.path)


def truth_path(task: str, seed: int) -> Path:
    return TRUTH_DIR / f"{task}-seed{seed}.safetensors"


def load_truth(task: str, seed: int, sizes: tuple[int, int, int] | None = None,
               create: bool = False) -> Truth:
    """The cached truth (``create``: a new empty one when there is none). Refuses a file of
    other sizes or recipe."""
    sizes = tuple(sizes or SIZES[task])
    path = truth_path(task, seed)
    if path.exists():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        t = load_file(str(path))
        if tuple(json.loads(meta["sizes"])) != sizes or json.loads(meta["recipe"]) != \
                T.RECIPES[task].__dict__:
            raise SystemExit(f"{path}: sizes {meta['sizes']} / recipe {meta['recipe']} differ "
                             f"from {sizes} / {T.RECIPES[task].__dict__}: move it away first")
        subsets = (torch.from_numpy(np.unpackbits(t["subsets_packed"].numpy(), axis=1,
                                                  count=sizes[0]))
                   if "subsets_packed" in t else t["subsets"])
        return Truth(task, seed, sizes, subsets, t["fresh"].double(), t["fixed"].double(),
                     float(meta["seconds"]))
    if not create:
        raise FileNotFoundError(f"{path}: no ground truth; run benchmarks/lds_truth.py")
    n, q = sizes[0], sizes[1] + sizes[2]
    nan = float("nan")
    return Truth(task, seed, sizes, draw_subsets(task, seed, n, SUBSETS),
                 torch.full((SUBSETS, RETRAINS, q), nan, dtype=torch.float64),
                 torch.full((SUBSETS, q), nan, dtype=torch.float64))


@cache
def split_of(task: str, seed: int, sizes: tuple[int, int, int]) -> dict:
    return T.split(task, seed, *sizes)


def retrain_job(task: str, seed: int, sizes: tuple[int, int, int], members: list[int],
                k: int, r: int) -> tuple[int, int, torch.Tensor, float]:
    """Worker: half ``k`` (``members``) retrained, ``r`` ≥ 0 from `fresh_seed` (init and
    order), ``r = -1`` from the scored model's ``seed`` → ``(k, r, [Q] float64 outputs on the
    validation then test queries, seconds)``."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    d = split_of(task, seed, sizes)
    s = seed if r < 0 else fresh_seed(seed, k, r)
    model = T.train_fast(task, d["train"], members, s, s)
    out = T.example_losses(model, d["val"] + d["test"])
    return k, r, out, time.perf_counter() - t0


def fill(truth: Truth, workers: int, budget: float, log=print) -> Truth:
    """Retrain what ``truth`` misses, in ``workers`` processes, until done or ``budget``
    seconds have passed (no new job after that); saved every 10 results and at the end."""
    todo = truth.missing()
    if not todo:
        return truth
    members = truth.members()
    t0 = time.perf_counter()
    done = 0
    ctx = multiprocessing.get_context("fork")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        queue = iter(todo)
        running = set()

        def top_up():
            while len(running) < 2 * workers and time.perf_counter() - t0 < budget:
                job = next(queue, None)
                if job is None:
                    return
                k, r = job
                running.add(pool.submit(retrain_job, truth.task, truth.seed, truth.sizes,
                                        members[k], k, r))

        top_up()
        while running:
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for f in finished:
                running.discard(f)
                k, r, out, secs = f.result()
                if r < 0:
                    truth.fixed[k] = out
                else:
                    truth.fresh[k, r] = out
                truth.seconds += secs
                done += 1
                if done % 10 == 0:
                    truth.save()
            top_up()
    truth.save()
    left = len(truth.missing())
    log(f"{truth.task} seed {truth.seed}: {done} retrainings in "
        f"{time.perf_counter() - t0:.0f} s ({truth.seconds / max(len(todo) - left, 1):.2f} "
        f"CPU s each), {left} left")
    return truth


def status(tasks, seeds) -> list[str]:
    lines = []
    for task in tasks:
        for seed in seeds:
            try:
                t = load_truth(task, seed)
            except FileNotFoundError:
                lines.append(f"{task} seed {seed}: none")
                continue
            total = t.fixed.shape[0] * (1 + t.fresh.shape[1])
            lines.append(f"{task} seed {seed}: {total - len(t.missing())}/{total} retrainings, "
                         f"{t.seconds:.0f} CPU s")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--budget", type=float, default=math.inf,
                   help="start no retraining after this many seconds (the rest stays missing)")
    p.add_argument("--status", action="store_true", help="print what is done; compute nothing")
    a = p.parse_args(argv)
    if a.status:
        print("\n".join(status(a.tasks, a.seeds)))
        return
    t0 = time.perf_counter()
    for task in a.tasks:
        for seed in a.seeds:
            left = a.budget - (time.perf_counter() - t0)
            if left <= 0:
                break
            fill(load_truth(task, seed, create=True), a.workers, left)
    print("\n".join(status(a.tasks, a.seeds)), flush=True)


if __name__ == "__main__":
    main()
