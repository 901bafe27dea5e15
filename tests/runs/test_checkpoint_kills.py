"""SIGKILL a training job at checkpoint writes, resume, and never lose the tracker.

The Trainer treats a checkpoint as complete once its ``trainer_state.json`` is written, and it
calls ``on_save`` only after that (and after rotating old checkpoints away). Each chain below
trains `tests/support/checkpoint_job.py` (12 steps, a checkpoint every 2, ``save_total_limit=2``)
and SIGKILLs it, then resumes from the newest checkpoint whose ``trainer_state.json`` parses (with
``resume_from_checkpoint=True``, the Trainer's own choice, when that is the newest
``checkpoint-*`` directory; by its path when the kill left a newer half-written one), kills the
resumed run again, and so on until a run finishes. Kills are of two kinds:

* **targeted**: the job kills itself right after writing a ``trainer_state.json`` (the moment
  that used to leave a complete checkpoint without tracker state);
* **random**: the test kills the job from outside at a seeded random moment while it trains
  and saves.

Every resume must restore the tracker state (its log line says ``restored``; none starts the
factors from zero), and every chain must end with factors equal, bit for bit, to an
uninterrupted run's (CPU, float32 storage, sequential data: deterministic).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

import repo_paths

ROOT = str(repo_paths.ROOT)
JOB = str(repo_paths.SUPPORT / "checkpoint_job.py")
STEPS, SAVE_STEPS = 12, 2
MAX_CHAINS = 16
MIN_KILLS = 20  # kills each followed by a resume
RUN_TIMEOUT = 240  # s per launch; a launch takes ~10 s on 2 cores (imports dominate)

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _launch(out: str, tag: str, resume: str | None, kill_after_state: int = 0):
    args = [sys.executable, JOB, "--out", out, "--tag", tag, "--steps", str(STEPS),
            "--save-steps", str(SAVE_STEPS), "--kill-after-state", str(kill_after_state)]
    if resume:
        # when the newest checkpoint-* is complete, let the Trainer pick it itself
        # (resume_from_checkpoint=True), else name the newest complete one
        newest = max((n for n in os.listdir(out) if n.startswith("checkpoint-")),
                     key=lambda n: int(n.split("-")[1]))
        args += ["--resume", "latest" if os.path.basename(resume) == newest else resume]
    log = open(os.path.join(out, f"{tag}.log"), "wb")
    proc = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    return proc, log


def _marks(out: str, tag: str, event: str) -> list[str]:
    with open(os.path.join(out, f"{tag}.log"), errors="replace") as f:
        return [line for line in f if line.startswith(f"CKPT-JOB {event}")]


def _newest_complete_checkpoint(out: str) -> str | None:
    best = None
    for name in os.listdir(out):
        if not name.startswith("checkpoint-"):
            continue
        try:
            with open(os.path.join(out, name, "trainer_state.json")) as f:
                json.load(f)
        except (OSError, ValueError):
            continue  # not complete for the Trainer (no or half-written trainer_state.json)
        step = int(name.split("-")[1])
        if best is None or step > best[0]:
            best = (step, os.path.join(out, name))
    return best[1] if best else None


def _field(line: str, name: str) -> str:
    return next(kv.split("=", 1)[1] for kv in line.split() if kv.startswith(f"{name}="))


def _state_factors(checkpoint: str) -> dict[str, torch.Tensor]:
    """The factors in a checkpoint's (single-rank) tracker state, found where a resume would
    find it (inside the checkpoint, or beside it if the kill came before ``on_save``)."""
    from safetensors import safe_open

    from kfac_stream.tracking.tracker_state import find_tracker_state

    directory, reasons = find_tracker_state(checkpoint)
    assert directory is not None, (checkpoint, reasons)
    path = os.path.join(directory, "state-rank-00000-of-00001.safetensors")
    with safe_open(path, framework="pt") as f:
        return {k.removeprefix("factor."): f.get_tensor(k) for k in f.keys()
                if k.startswith("factor.")}


def _chain(base: str, index: int, rng: random.Random, window: float) -> dict:
    """Kill, resume, kill ... until a run finishes; returns what happened. ``window``: how long
    an uninterrupted run takes from ready to its last checkpoint (s); random kills land
    uniformly in that time after the job is ready."""
    out = os.path.join(base, f"chain-{index}")
    os.makedirs(out)
    kills, resumes, log = 0, 0, []
    resume = None
    for link in range(12):
        tag = f"link-{link}"
        targeted = rng.random() < 0.6
        proc, fh = _launch(out, tag, resume, kill_after_state=1 if targeted else 0)
        if not targeted:  # a random moment after the job is up and training
            deadline = time.monotonic() + RUN_TIMEOUT
            while not _marks(out, tag, "ready") and proc.poll() is None:
                assert time.monotonic() < deadline, f"{out}/{tag}.log: never ready"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, window))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        rc = proc.wait(RUN_TIMEOUT)
        fh.close()
        if resume is not None:
            resumes += 1
            restored = _marks(out, tag, "restored")
            assert restored and not _marks(out, tag, "fresh"), \
                f"{out}/{tag}.log: the resume from {resume} did not restore the tracker state"
        if rc == 0:
            assert _marks(out, tag, "finished"), f"{out}/{tag}.log"
            log.append(f"{tag}: finished")
            return {"out": out, "final": os.path.join(out, f"final-{tag}.safetensors"),
                    "kills": kills, "resumes": resumes, "log": log}
        assert rc == -signal.SIGKILL, f"{out}/{tag}.log: rc={rc}"
        resume = _newest_complete_checkpoint(out)
        if resume is not None and resume.endswith(f"checkpoint-{STEPS}"):
            # killed after the last checkpoint: training is complete, its state is final (not
            # counted: no resume follows)
            log.append(f"{tag}: kill after the last checkpoint")
            return {"out": out, "final": resume, "kills": kills, "resumes": resumes,
                    "log": log}
        kills += resume is not None  # a kill before the first checkpoint restarts, not resumes
        log.append(f"{tag}: {'targeted' if targeted else 'random'} kill -> resume from "
                   f"{os.path.basename(resume) if resume else 'scratch'}")
    pytest.fail(f"{out}: no run finished in 12 links")


def test_kills_at_checkpoint_writes_never_lose_the_tracker_state(tmp_path):
    t0 = time.monotonic()
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    proc, fh = _launch(str(ref_dir), "ref", None)
    assert proc.wait(RUN_TIMEOUT) == 0, (ref_dir / "ref.log").read_text()[-3000:]
    fh.close()
    reference = load_file(str(ref_dir / "final-ref.safetensors"))
    ready = _marks(str(ref_dir), "ref", "ready")[0]
    last_save = _marks(str(ref_dir), "ref", "saved")[-1]
    window = float(_field(last_save, "t")) - float(_field(ready, "t"))
    rng = random.Random(14)
    seeds = [rng.randrange(2**31) for _ in range(MAX_CHAINS)]
    chains: list[dict] = []
    with ThreadPoolExecutor(max_workers=2) as pool:  # two chains at a time, until enough kills
        while sum(c["kills"] for c in chains) < MIN_KILLS and len(chains) < MAX_CHAINS:
            batch = range(len(chains), min(len(chains) + 2, MAX_CHAINS))
            chains += pool.map(
                lambda i: _chain(str(tmp_path), i, random.Random(seeds[i]), window), batch)
    kills = sum(c["kills"] for c in chains)
    resumes = sum(c["resumes"] for c in chains)
    for c in chains:
        print(f"{os.path.basename(c['out'])}: " + "; ".join(c["log"]))
    print(f"{kills} kills, {resumes} resumes, all restored (training window {window:.2f} s); "
          f"{time.monotonic() - t0:.0f} s")
    assert kills >= MIN_KILLS, f"only {kills} kills followed by a resume in {MAX_CHAINS} chains"
    for c in chains:
        got = load_file(c["final"]) if c["final"].endswith(".safetensors") else \
            _state_factors(c["final"])
        assert got.keys() == reference.keys()
        for key in reference:  # bit for bit
            assert torch.equal(got[key], reference[key]), (c["out"], key)
