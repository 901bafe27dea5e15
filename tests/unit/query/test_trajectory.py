"""Influence along the run (`trajectory_influence`, `checkpoint_snapshots`): a real Trainer run
saving a checkpoint at every snapshot, scored against the dense float64 Kronecker solve of
tests/unit/query/test_influence.py at each step's weights and factors, averaged."""

import os

import pytest
import torch
from test_influence import _dense_scores, _lm_loss, _stack
from transformers import AutoModelForCausalLM

from kfac_stream import (
    LaplacePosterior,
    QueryInputError,
    Snapshot,
    checkpoint_snapshots,
    trajectory_influence,
    trajectory_posteriors,
)

from harness import run, sum_nll_loss
from models import text_examples, tiny_gpt2

# as tests/unit/query/test_influence.py: float64 end to end, eigh roundoff relative to λ
EXACT_TOL = 1e-6
DAMPING = 0.5  # a fixed damping, so the reference needs no rule of ours


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps; a snapshot and a Trainer checkpoint every 2 steps (steps 2, 4, 6)."""
    tmp = tmp_path_factory.mktemp("traj")
    run(tiny_gpt2(), text_examples(12, 12), {"snapshot_every": 2}, batch=2, steps=6,
        loss=sum_nll_loss, tmp_path=tmp, record=False, save_strategy="steps", save_steps=2)
    return tmp


def test_pairs_are_the_steps_with_a_checkpoint_and_a_snapshot(trained, tmp_path):
    pairs = checkpoint_snapshots(trained)
    assert [s for s, _, _ in pairs] == [2, 4, 6]
    for step, ckpt, snap in pairs:
        assert os.path.basename(ckpt) == f"checkpoint-{step}"
        assert Snapshot.load(snap).step == step
    with pytest.raises(QueryInputError, match=r"no step has both.*steps \[2, 4, 6\]"):
        checkpoint_snapshots(tmp_path, kfac_dir=trained / "kfac")


def test_trajectory_scores_are_the_mean_of_each_steps_dense_solve(trained):
    queries = text_examples(2, 10, seed=5, lengths=[10, 7])
    train = text_examples(5, 12, seed=7, lengths=[12, 8, 11, 12, 5])
    batches = [_stack(train[:3]), _stack(train[3:])]
    posts = list(trajectory_posteriors(checkpoint_snapshots(trained), _load,
                                       prior_precision=1.0))
    got = trajectory_influence(posts, _stack(queries), batches, damping=DAMPING)
    per_step = [_dense_scores(p, dict.fromkeys(p.layer_names, DAMPING), queries, train, _lm_loss)
                for p in posts]
    want = torch.stack(per_step).mean(0)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"trajectory over steps {[p.snapshot.step for p in posts]}: rel err {err:.2e}")
    assert got.shape == (2, 5) and got.dtype == torch.float64
    assert err <= EXACT_TOL
    # the steps differ: the mean is not any one step's scores
    spread = min(float((s - want).abs().max() / want.abs().max()) for s in per_step)
    assert spread > 1e-3, spread


def test_wrong_inputs_are_refused_in_one_line(trained):
    pairs = checkpoint_snapshots(trained)
    post = next(iter(trajectory_posteriors(pairs[:1], _load, prior_precision=1.0)))
    batch = _stack(text_examples(2, 10, seed=5))
    with pytest.raises(QueryInputError, match="is an iterator"):
        trajectory_influence([post], batch, iter([batch]))
    with pytest.raises(QueryInputError, match="step 2 is given twice"):
        trajectory_influence([post, post], batch, [batch])
    with pytest.raises(QueryInputError, match="no posterior given"):
        trajectory_influence([], batch, [batch])
    other = LaplacePosterior(_load(pairs[1][1]).eval(), Snapshot.load(pairs[1][2]),
                             prior_precision=1.0)
    other.snapshot.manifest.run_id = "0" * 32
    with pytest.raises(QueryInputError, match="one run's snapshots only"):
        trajectory_influence([post, other], batch, [batch])
