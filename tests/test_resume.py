"""Resume (issue 6, item 2): the tracker state rides with Trainer checkpoints, and a run that
is interrupted after a checkpoint and resumed ends with the same factors as an uninterrupted
one — bit-identical with deterministic data order (the sampler's RNG state is restored too),
in float32 and in float16 storage. Multi-process resume and re-sharding: test_distributed.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import TrainerCallback

from kfac_stream.tracker_state import TrackerStateError, load_tracker_state

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


def _run(tmp_path, storage, *, interrupt=None, resume=None, fisher="empirical"):
    cfg = dict(token_fraction=0.5, ema_decay=0.95, update_every=1, storage_dtype=storage,
               fisher=fisher, snapshot_every=10_000)
    model = tiny_gpt2(torch.float32)
    kwargs = dict(save_strategy="steps", save_steps=SAVE, lr=1e-3)
    if resume:
        kwargs["resume"] = resume
    return run(model, text_examples(40, 16), cfg, batch=2, accum=2, steps=STEPS,
               tmp_path=tmp_path, record=False,
               callbacks=[Interrupt(interrupt)] if interrupt is not None else (), **kwargs)


@pytest.mark.parametrize("storage,fisher", [("float32", "empirical"), ("float16", "empirical"),
                                            ("float32", "mc")])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, storage, fisher):
    whole, _, _ = _run(tmp_path / "whole", storage, fisher=fisher)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", storage, interrupt=6, fisher=fisher)
    ckpt = tmp_path / "cut" / f"checkpoint-{SAVE}"
    assert (ckpt / "kfac_stream" / "state-rank-00000-of-00001.safetensors").is_file()
    resumed, _, trainer = _run(tmp_path / "cut", storage, resume=str(ckpt), fisher=fisher)
    assert trainer.state.global_step == STEPS
    a, b = whole.tracker, resumed.tracker
    assert vars(a.counters)["updates"] == vars(b.counters)["updates"] == STEPS
    for key in ("positions_sampled", "tokens_seen", "skipped_updates"):
        assert getattr(a.counters, key) == getattr(b.counters, key), key
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
