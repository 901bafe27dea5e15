"""Snapshots tied to their run and model.

* Every snapshot's manifest names its training run (``run_id``) and fingerprints the tracked
  weights at its step (``weights``: per layer the float64 sum and sum of squares of 4 windows
  of 64 entries, `kfac_stream.snapshot.weights`), checked here against the weights read back
  independently.
* A new run into a directory that holds another run's snapshots sets them aside into
  ``earlier-runs/<run id>/`` before it writes: `Snapshot.latest` reads the new run's only.
  A run resumed from a checkpoint keeps its id and its snapshots.
* `LaplacePosterior` warns (once, naming the snapshot) when the model's weights are not the
  snapshot's: a model of another run, or of the same run two steps later.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from transformers import TrainerCallback

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.snapshot.weights import WEIGHTS_RTOL

from harness import run
from models import text_examples, tiny_gpt2

CFG = {"snapshot_every": 2, "token_fraction": 0.5}


class Interrupt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"interrupted at step {self.step}")


def _train(tmp_path, steps: int, seed: int = 0, **kw):
    model = tiny_gpt2(torch.float32, seed=seed, n_embd=32)  # every weight > 256 entries
    cb, _, trainer = run(model, text_examples(16, 12), CFG, steps=steps, lr=1e-2,
                         tmp_path=tmp_path, record=False, **kw)
    return model, cb


def _windows(w: torch.Tensor) -> torch.Tensor:
    """The fingerprint's entries, taken independently: 4 windows of 64 at i·numel/4."""
    flat = w.detach().flatten().double()
    n = flat.numel()
    return torch.cat([flat[i * n // 4:i * n // 4 + 64] for i in range(4)])


def _no_warning(model, snap) -> LaplacePosterior:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return LaplacePosterior(model, snap)


def test_manifest_fingerprints_the_weights_and_names_the_run(tmp_path):
    model, cb = _train(tmp_path, 4)
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.step == 4 and snap.manifest.run_id == cb.tracker.run_id
    assert len(snap.manifest.run_id) == 32
    assert set(snap.manifest.weights) == set(snap.layer_names)
    for name in snap.layer_names:
        w = model.get_submodule(name).weight
        entries = _windows(w)
        rec = snap.manifest.weights[name]
        assert rec.numel == w.numel() and w.numel() > 256
        assert rec.sum == pytest.approx(float(entries.sum()), rel=1e-12, abs=1e-12)
        assert rec.sumsq == pytest.approx(float(entries.square().sum()), rel=1e-12)
    _no_warning(model, snap)  # the model it was taken from: no warning


def test_model_of_another_step_or_run_warns_naming_the_snapshot(tmp_path):
    model, cb = _train(tmp_path / "a", 4)
    early = Snapshot.load(tmp_path / "a" / "kfac" / "step-00000002")
    with pytest.warns(UserWarning, match=r"step-00000002.*step 2.*layers differ") as rec:
        LaplacePosterior(model, early)  # the same run, 2 steps later
    assert len([w for w in rec if "weights are not those" in str(w.message)]) == 1
    other, _ = _train(tmp_path / "b", 4, seed=1)
    with pytest.warns(UserWarning, match="weights are not those snapshot"):
        LaplacePosterior(other, Snapshot.latest(tmp_path / "a" / "kfac"))
    # each layer's recorded sum of squares really moved by more than the tolerance
    late = Snapshot.latest(tmp_path / "a" / "kfac")
    moved = [abs(late.manifest.weights[n].sumsq - early.manifest.weights[n].sumsq)
             / early.manifest.weights[n].sumsq for n in late.layer_names]
    assert min(moved) > 100 * WEIGHTS_RTOL, moved


def test_new_run_sets_the_earlier_run_aside_and_latest_reads_the_new_one(tmp_path, caplog):
    _, first = _train(tmp_path, 6)
    old_id = first.tracker.run_id
    with caplog.at_level("WARNING", logger="kfac_stream"):
        model, second = _train(tmp_path, 2, seed=1)
    root = tmp_path / "kfac"
    steps = ["step-00000002", "step-00000004", "step-00000006"]
    assert sorted(os.listdir(root / "earlier-runs" / old_id)) == sorted(
        steps + [s + ".spectra.png" for s in steps])
    assert sorted(e for e in os.listdir(root) if e.startswith("step-")) == [
        "step-00000002", "step-00000002.spectra.png"]  # the new run's PNG only
    snap = Snapshot.latest(root)
    assert snap.step == 2 and snap.manifest.run_id == second.tracker.run_id != old_id
    assert any("another training run" in r.getMessage() for r in caplog.records)
    _no_warning(model, snap)
    old = Snapshot.load(root / "earlier-runs" / old_id / "step-00000006")  # kept, whole
    with pytest.warns(UserWarning, match="weights are not those"):
        LaplacePosterior(model, old)


def test_snapshots_without_run_id_are_set_aside_too(tmp_path):
    _, first = _train(tmp_path, 2)
    path = tmp_path / "kfac" / "step-00000002"
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["run_id"], manifest["weights"]  # as written before manifests named their run
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert Snapshot.load(path).manifest.run_id is None  # still loads
    _train(tmp_path, 2, seed=1)
    aside = os.listdir(tmp_path / "kfac" / "earlier-runs")
    assert len(aside) == 1 and aside[0].startswith("unknown-")


def test_resumed_run_keeps_its_id_and_its_snapshots(tmp_path):
    kw = dict(save_strategy="steps", save_steps=2)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path, 4, callbacks=[Interrupt(3)], **kw)
    first = Snapshot.load(tmp_path / "kfac" / "step-00000002").manifest.run_id
    _, cb = _train(tmp_path, 4, resume=str(tmp_path / "checkpoint-2"), **kw)
    assert cb.tracker.run_id == first
    assert not (tmp_path / "kfac" / "earlier-runs").exists()
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.step == 4 and snap.manifest.run_id == first


def test_earlier_runs_keep_leaves_them_and_bad_values_are_refused(tmp_path):
    from kfac_stream import KFACConfigError, KFACStreamCallback

    kw = {"callback_kwargs": {"earlier_runs": "keep"}}
    _train(tmp_path, 4, **kw)
    model, _ = _train(tmp_path, 2, seed=1, **kw)
    root = tmp_path / "kfac"
    assert not (root / "earlier-runs").exists()
    assert sorted(e for e in os.listdir(root) if not e.endswith(".png")) == [
        "step-00000002", "step-00000004"]
    with pytest.warns(UserWarning, match="weights are not those"):  # the first run's step 4
        LaplacePosterior(model, Snapshot.latest(root))
    with pytest.raises(KFACConfigError,
                       match=r"earlier_runs='drop'\) is not allowed: must be 'set_aside' or"):
        KFACStreamCallback(earlier_runs="drop")
