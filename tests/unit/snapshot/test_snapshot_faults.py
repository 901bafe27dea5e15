"""Storage faults are logged, counted and non-fatal by default: a full disk
while writing a shard, an unwritable snapshot directory, a failed eigendecomposition. The
previous snapshot stays valid; ``fail_on_snapshot_error=True`` makes the failure stop training.
"""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

import kfac_stream.snapshot.writer as writer
from kfac_stream import Snapshot

from harness import run
from models import text_examples, tiny_gpt2

# every snapshot decomposed in the run: the failures below are of eigendecompositions and writes
CFG = dict(storage_dtype="float32", snapshot_every=2, eigendecompose="always")


def snapshot_dirs(root) -> list[str]:
    """Entries of a snapshot root other than the spectra PNGs beside the snapshots."""
    return sorted(e for e in os.listdir(root) if not e.endswith(".spectra.png"))


def _train(tmp_path, **cfg):
    model = tiny_gpt2(torch.float32)
    return run(model, text_examples(8, 16), {**CFG, **cfg}, batch=2, steps=4,
               tmp_path=tmp_path, record=False)


def _full_disk_on_call(monkeypatch, n: int) -> None:
    real, calls = writer.write_shard, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_shard", flaky)


def test_full_disk_is_logged_counted_and_not_fatal(tmp_path, monkeypatch, caplog):
    _full_disk_on_call(monkeypatch, 2)  # snapshots at steps 2 and 4: the second one fails
    with caplog.at_level(logging.ERROR, logger="kfac_stream"):
        cb, _, trainer = _train(tmp_path)
    assert trainer.state.global_step == 4  # training went on to the end
    root = os.path.join(tmp_path, "kfac")
    assert snapshot_dirs(root) == ["step-00000002"]  # nothing partial, no temporaries
    assert Snapshot.latest(root).step == 2
    assert cb.tracker.counters.snapshot_failures == 1
    assert any("snapshot of step 4 failed" in r.message and "No space left" in r.message
               for r in caplog.records)


def test_fail_on_snapshot_error_makes_it_fatal(tmp_path, monkeypatch):
    _full_disk_on_call(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="writing a snapshot failed") as info:
        _train(tmp_path, fail_on_snapshot_error=True)
    assert "No space left" in str(info.value.__cause__)


def test_unwritable_snapshot_directory_is_not_fatal(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the snapshot directory should be")
    with caplog.at_level(logging.ERROR, logger="kfac_stream"):
        cb, _, trainer = _train(tmp_path, output_dir=str(blocker / "kfac"))
    assert trainer.state.global_step == 4
    assert cb.tracker.counters.snapshot_failures == 2 and cb.snapshots == []
    assert sum("snapshot of step" in r.message for r in caplog.records) == 2


def test_failed_eigendecomposition_is_not_fatal(tmp_path, monkeypatch, caplog):
    from kfac_stream.stats import spectrum

    real, calls = spectrum.safe_psd_eigh, {"n": 0}

    def broken(value):
        calls["n"] += 1
        if calls["n"] > 16:  # the first snapshot's 16 factors succeed, then eigh fails
            raise torch.linalg.LinAlgError("simulated: eigh failed even with a shift")
        return real(value)

    monkeypatch.setattr(spectrum, "safe_psd_eigh", broken)  # what eigh_factors calls
    with caplog.at_level(logging.ERROR, logger="kfac_stream"):
        cb, _, _ = _train(tmp_path)
    assert cb.tracker.counters.snapshot_failures == 1
    assert snapshot_dirs(os.path.join(tmp_path, "kfac")) == ["step-00000002"]
    assert any("eigendecomposition failed" in r.message for r in caplog.records)
