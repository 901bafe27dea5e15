"""The MC Fisher's replays run the model as the posterior evaluates it (eval mode: no dropout),
so a model trained with dropout gets the factors of the same model without it.

The reference is independent of the replay code: the same weights with every dropout
probability set to 0 (where the MC gradient of whole micro-batches is taken inside the
training forward, a different code path). Training at learning rate 0 keeps the weights
equal between the two runs (AdamW moves nothing at lr 0), so their Fishers must agree.
"""

import pytest
import torch
from torch import nn

from kfac_stream.capture.posterior_mode import has_active_dropout, posterior_mode

from harness import run
from models import text_examples, tiny_gpt2
from reference import rel_err

#: float64 models; the in-forward gradient and the replay sum the same products in another
#: order (and the replay's rows are one sub-batch's), so only round-off separates them.
SAME_FISHER_TOL = 1e-10
#: With dropout in the replay (what the guard prevents) the factors move by far more.
DROPOUT_MOVES = 1e-3


def _factors(model, tmp_path, mc_sequences):
    cb, _, _ = run(model, text_examples(8, 10), {"fisher": "mc", "mc_sequences": mc_sequences,
                                                 "min_window_sequences": 0},
                   batch=4, steps=4, lr=0.0, tmp_path=tmp_path, record=False)
    return cb.factors()


@pytest.mark.parametrize("mc_sequences", ["all", 2], ids=["all", "sub-batch"])
def test_replay_with_dropout_gives_the_fisher_of_the_model_without(tmp_path, mc_sequences):
    drop = tiny_gpt2(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    plain = tiny_gpt2()  # the same seed: the same weights, every dropout 0
    assert has_active_dropout(drop) and not has_active_dropout(plain)
    got = _factors(drop, tmp_path / "drop", mc_sequences)
    ref = _factors(plain, tmp_path / "plain", mc_sequences)
    assert drop.training  # the training's mode is restored after every replay
    errs = {n: max(rel_err(got[n][0], ref[n][0]), rel_err(got[n][1], ref[n][1]))
            for n in ref}
    print(f"{mc_sequences}: largest factor difference with vs without dropout "
          f"{max(errs.values()):.1e}")
    assert max(errs.values()) < SAME_FISHER_TOL


def test_replay_with_dropout_on_would_differ(tmp_path, monkeypatch):
    """The control: with the replay left in training mode the factors move, so the test
    above can fail."""
    import contextlib

    import kfac_stream.tracking.tracker as tracker

    monkeypatch.setattr(tracker, "posterior_mode", lambda model: contextlib.nullcontext())
    got = _factors(tiny_gpt2(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3),
                   tmp_path / "drop", 2)
    ref = _factors(tiny_gpt2(), tmp_path / "plain", 2)
    assert max(rel_err(got[n][1], ref[n][1]) for n in ref) > DROPOUT_MOVES


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.gradient_checkpointing = True
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(3)


def test_posterior_mode_flags_and_their_restoration():
    model = nn.Sequential(nn.Dropout(0.1), _Checkpointed(), nn.BatchNorm1d(3))
    model[1].drop.eval()  # a flag of the user's own, restored as it was
    before = [m.training for m in model.modules()]
    with posterior_mode(model):
        flags = {type(m).__name__ + str(i): m.training for i, m in enumerate(model.modules())}
        assert flags == {"Sequential0": False, "Dropout1": False, "_Checkpointed2": True,
                         "Dropout3": False, "BatchNorm1d4": False, "BatchNorm1d5": False}
    assert [m.training for m in model.modules()] == before
    with pytest.raises(RuntimeError), posterior_mode(model):
        raise RuntimeError("a failing replay")
    assert [m.training for m in model.modules()] == before
    x = torch.randn(4, 3)
    stats = model[2].running_mean.clone()
    with posterior_mode(model):
        model[2](x)
    assert torch.equal(model[2].running_mean, stats)  # a replay moves no running statistic
