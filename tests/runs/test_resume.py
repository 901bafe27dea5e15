"""Resume: the tracker state rides with Trainer checkpoints, and a run that
is interrupted after a checkpoint and resumed ends with the same factors as an uninterrupted
one — bit-identical with deterministic data order (the sampler's RNG state is restored too),
in float32 and in float16 storage. Multi-process resume and re-sharding: test_distributed.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import TrainerCallback

from kfac_stream.tracking.tracker_state import (
    TrackerStateError,
    check_state_dir,
    load_tracker_state,
)

from harness import run
from models import text_examples, tiny_gpt2

STEPS, SAVE = 8, 4


class Interrupt(TrainerCallback):
    """Raise at the start of ``step`` (0-based), like a killed job, after the checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"interrupted at step {self.step}")


def _run(tmp_path, storage, *, interrupt=None, resume=None, fisher="empirical",
         callback_kwargs=None, window=0.0):
    # "mc": one MC sequence of every micro-batch; "mc-share": the default's kind, a share of
    # 0.1 of the step's 4 sequences (replays on some steps only, at least one at step 0)
    # "empirical-device": the device path (pending statistics on the "device", flushed by the
    # checkpoint's export in both runs), CPU tensors standing in
    mc = {"mc": {"fisher": "mc", "mc_sequences": 1},
          "mc-share": {"fisher": "mc", "mc_sequences": 0.1},
          "empirical-device": {"fisher": "empirical", "fold_on": "device"}}.get(
              fisher, {"fisher": fisher})
    cfg = dict(token_fraction=0.5, ema_decay=0.95, update_every=1, storage_dtype=storage,
               snapshot_every=10_000, final_window=window, min_window_sequences=0, **mc)
    model = tiny_gpt2(torch.float32)
    kwargs = dict(save_strategy="steps", save_steps=SAVE, lr=1e-3)
    if resume:
        kwargs["resume"] = resume
    return run(model, text_examples(40, 16), cfg, batch=2, accum=2, steps=STEPS,
               tmp_path=tmp_path, record=False,
               callbacks=[Interrupt(interrupt)] if interrupt is not None else (),
               callback_kwargs=callback_kwargs, **kwargs)


@pytest.mark.parametrize("storage,fisher,window", [
    ("float32", "empirical", 0.0), ("float16", "empirical", 0.0), ("float32", "mc", 0.0),
    ("float32", "mc-share", 0.0), ("float16", "empirical-device", 0.0),
    # final_window 0.75 of 8 steps: the average restarts at step 2, before the checkpoint at
    # step 4; the resumed run must go on with that window (its start rides with the state)
    ("float32", "empirical", 0.75)])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, storage, fisher, window):
    whole, _, _ = _run(tmp_path / "whole", storage, fisher=fisher, window=window)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", storage, interrupt=6, fisher=fisher, window=window)
    ckpt = tmp_path / "cut" / f"checkpoint-{SAVE}"
    assert (ckpt / "kfac_stream" / "state-rank-00000-of-00001.safetensors").is_file()
    resumed, _, trainer = _run(tmp_path / "cut", storage, resume=str(ckpt), fisher=fisher,
                               window=window)
    assert trainer.state.global_step == STEPS
    a, b = whole.tracker, resumed.tracker
    assert vars(a.counters)["updates"] == vars(b.counters)["updates"]
    assert a.counters.updates == STEPS if fisher != "mc-share" else 1 <= a.counters.updates < STEPS
    for key in ("positions_sampled", "tokens_seen", "skipped_updates", "window_start_step"):
        assert getattr(a.counters, key) == getattr(b.counters, key), key
    assert a.counters.window_start_step == (2 if window else -1)
    fa, fb = a.store.values(), b.store.values()
    assert fa.keys() == fb.keys()
    for key in fa:  # bit for bit
        assert torch.equal(fa[key], fb[key]), (key, float((fa[key] - fb[key]).abs().max()))
        assert a.export().factors[key].weight == b.export().factors[key].weight


def test_state_of_another_model_is_refused(tmp_path):
    cb, _, _ = _run(tmp_path / "a", "float32")
    other, _, _ = run(tiny_gpt2(torch.float32, n_embd=24), text_examples(8, 16),
                      dict(storage_dtype="float32", snapshot_every=10_000), batch=2, steps=1,
                      tmp_path=tmp_path / "b", record=False)
    with pytest.raises(TrackerStateError, match="other layers or shapes"):
        load_tracker_state(other.tracker, os.path.join(tmp_path / "a", f"checkpoint-{SAVE}",
                                                       "kfac_stream"))
    with pytest.raises(TrackerStateError, match="no kfac_stream state files"):
        load_tracker_state(cb.tracker, str(tmp_path))


# -- a checkpoint the Trainer considers complete always carries the tracker state --------------

def _cut_run(tmp_path):
    """An interrupted run (checkpoint at SAVE) and its checkpoint directory."""
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "float32", interrupt=6)
    return tmp_path / f"checkpoint-{SAVE}"


def test_resume_without_tracker_state_is_an_error_naming_the_ways_out(tmp_path):
    ckpt = _cut_run(tmp_path / "cut")
    shutil.rmtree(ckpt / "kfac_stream")
    with pytest.raises(TrackerStateError) as err:
        _run(tmp_path / "cut", "float32", resume=str(ckpt))
    msg = str(err.value)
    print(msg)
    assert f"from {ckpt}, which holds no complete tracker state" in msg
    assert f"{ckpt / 'kfac_stream' / 'index.json'} is missing" in msg
    assert "resume_from_checkpoint=<path>" in msg and "missing_state='fresh'" in msg


def test_missing_state_fresh_is_an_explicit_opt_in(tmp_path, caplog):
    ckpt = _cut_run(tmp_path / "cut")
    shutil.rmtree(ckpt / "kfac_stream")
    with caplog.at_level("WARNING", logger="kfac_stream"):
        cb, _, trainer = _run(tmp_path / "cut", "float32", resume=str(ckpt),
                              callback_kwargs={"missing_state": "fresh"})
    assert trainer.state.global_step == STEPS
    assert cb.tracker.counters.updates == STEPS - SAVE  # from zero at the checkpoint
    assert "the factors start from zero (missing_state='fresh')" in caplog.text


def test_missing_state_option_is_validated():
    from kfac_stream import KFACConfigError, KFACStreamCallback

    with pytest.raises(KFACConfigError, match=r"missing_state='warn'\) is not allowed: must be "
                                              r"'error' or 'fresh'"):
        KFACStreamCallback(missing_state="warn")


def test_state_left_beside_the_checkpoint_by_a_crash_is_restored_and_moved_in(tmp_path):
    """A kill after the Trainer's ``trainer_state.json`` but before ``on_save`` leaves the
    state in ``kfac_stream-pending/checkpoint-N``: resuming restores it bit for bit (against an
    uninterrupted run) and moves it into the checkpoint."""
    whole, _, _ = _run(tmp_path / "whole", "float32")
    ckpt = _cut_run(tmp_path / "cut")
    pending = tmp_path / "cut" / "kfac_stream-pending" / f"checkpoint-{SAVE}"
    pending.parent.mkdir()
    os.replace(ckpt / "kfac_stream", pending)  # exactly what such a kill leaves on disk
    resumed, _, _ = _run(tmp_path / "cut", "float32", resume=str(ckpt))
    fa, fb = whole.tracker.store.values(), resumed.tracker.store.values()
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    assert (ckpt / "kfac_stream" / "index.json").is_file() and not pending.exists()


def test_corrupted_state_file_is_refused_by_its_checksum(tmp_path):
    ckpt = _cut_run(tmp_path / "cut")
    path = ckpt / "kfac_stream" / "state-rank-00000-of-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(TrackerStateError, match="does not match its size and sha256"):
        _run(tmp_path / "cut", "float32", resume=str(ckpt))


def test_every_saved_checkpoint_has_a_verified_state_and_nothing_is_left_pending(tmp_path):
    _run(tmp_path, "float32")
    ckpts = sorted(p for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert [p.name for p in ckpts] == [f"checkpoint-{SAVE}", f"checkpoint-{STEPS}"]
    for ckpt in ckpts:
        index = json.loads((ckpt / "kfac_stream" / "index.json").read_text())
        assert index["step"] == int(ckpt.name.split("-")[1])
        assert [e["file"] for e in index["files"]] == ["state-rank-00000-of-00001.safetensors"]
        assert check_state_dir(str(ckpt / "kfac_stream")) is None
    assert not (tmp_path / "kfac_stream-pending").exists()
