"""What ``N`` counts (docs/queries.md, "What N counts") on an answer-token fine-tune:
labels -100 on the prompt, one labelled token per example, right padding. Under the expand
form ``N`` is every position that can carry the loss's gradient per epoch (the non-padding ones
up to the last scored logit row: the prompt's, not only the labelled ones); the output
gradient at an unlabelled position is zero only in the layers whose output there reaches no
scored logit (the last block after its attention), for the observed labels and for the MC
Fisher's sampled ones alike; ``factor_form="reduce"`` makes ``N`` the sequences (the
questions)."""

import warnings

import pytest
import torch

from kfac_stream import LaplacePosterior, Snapshot

from harness import run, sum_nll_loss
from models import text_examples, tiny_gpt2

LENGTHS = [12, 9, 12, 7, 12, 12, 10, 12]  # 86 non-padding positions, 8 labelled
#: the positions up to each sequence's scored logit row (the one before its answer, its last
#: real token): 86 − 8, whether the forward sees the labels or (a compute_loss_func) not
SCORED = 78
EXACT = {"token_fraction": 1.0, "ema_decay": 1.0, "final_window": 0.0, "update_every": 1,
         "storage_dtype": "float64", "snapshot_every": 10**6}


def _answer_token_examples():
    ex = text_examples(8, 12, lengths=LENGTHS)
    for e, n in zip(ex, LENGTHS):
        labels = torch.full_like(e["input_ids"], -100)
        labels[n - 1] = e["input_ids"][n - 1]  # the answer: the last real token
        e["labels"] = labels
    return ex


def _rank(F: torch.Tensor) -> int:
    ev = torch.linalg.eigvalsh(F.double())
    return int((ev > 1e-9 * ev.max()).sum())


@pytest.mark.parametrize("fisher", [{"fisher": "empirical"},
                                    {"fisher": "mc", "mc_sequences": "all"}])
def test_expand_form_counts_every_non_padding_position(tmp_path, fisher):
    model = tiny_gpt2()
    cb, _, _ = run(model, _answer_token_examples(), {**EXACT, **fisher}, batch=2, epochs=2,
                   loss=sum_nll_loss, tmp_path=tmp_path, record=False)
    snap = Snapshot.load(cb.snapshots[-1])
    assert snap.manifest.counts.tokens_seen == 2 * (sum(LENGTHS) - len(LENGTHS)) == 2 * SCORED
    post = LaplacePosterior(model.eval(), snap)
    assert post.num_data_unit == "position"
    assert post.num_data == SCORED  # per epoch: the prompts' positions too, not 8


MC = {"fisher": "mc", "mc_sequences": "all"}


@pytest.mark.parametrize("fisher,loss,masked", [
    ({"fisher": "empirical"}, sum_nll_loss, True),
    (MC, None, True),  # the model's own loss: the forward gets the labels
    (MC, sum_nll_loss, False),  # a compute_loss_func: the Trainer pops the labels first
])
def test_unlabelled_positions_have_no_gradient_after_the_last_attention(tmp_path, fisher,
                                                                        loss, masked):
    """One epoch, 8 labelled positions: the last block's attention output and MLP layers
    (16 wide) get G of rank ≤ 8 (rows only where the logit predicts an answer; the MC labels
    drawn at prompt positions weigh 0), while their A spans all 78 positions (full rank, 17
    and 65 with the bias); an earlier layer, and the last block's q/k/v (which feed the answer
    position through attention), get G rows at the prompt positions too (rank > 8). With a
    ``compute_loss_func`` the model's forward never sees the labels, and the MC loss is taken
    at every non-padding position (documented in "What N counts"): rank > 8 there too."""
    model = tiny_gpt2()
    cb, _, _ = run(model, _answer_token_examples(), {**EXACT, **fisher}, batch=2,
                   loss=loss, tmp_path=tmp_path, record=False)
    factors = cb.factors()
    for name in ("transformer.h.1.attn.c_proj", "transformer.h.1.mlp.c_proj"):
        A, G = factors[name]
        assert (_rank(G) <= 8) == masked, name
        assert _rank(A) == A.shape[0] > 8, name  # full: 17 or 65 dims, 78 positions
    for name in ("transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_attn"):
        assert _rank(factors[name][1]) > 8, name


def test_num_data_questions_and_the_reduce_form(tmp_path):
    """``num_data=8`` (the questions) rescales every layer's ``N`` alike, 78 → 8, and warns
    (over 4x from the snapshot's count); ``factor_form="reduce"`` counts the 8 questions by
    default (``sequences_seen`` per epoch)."""
    model = tiny_gpt2()
    cb, _, _ = run(model, _answer_token_examples(), EXACT, batch=2, loss=sum_nll_loss,
                   tmp_path=tmp_path / "expand", record=False)
    snap = Snapshot.load(cb.snapshots[-1])
    model.eval()
    base = LaplacePosterior(model, snap, prior_precision=1.0)
    with pytest.warns(UserWarning, match="num_data"):
        questions = LaplacePosterior(model, snap, prior_precision=1.0, num_data=8)
    assert set(questions.layer_num_data.values()) == {8.0}
    assert set(base.layer_num_data.values()) == {float(SCORED)}
    batch = {"input_ids": torch.stack([e["input_ids"][:6] for e in _answer_token_examples()])}
    _, cov_base = base.predictive(batch, positions=-1, token_ids=[65, 66])
    _, cov_q = questions.predictive(batch, positions=-1, token_ids=[65, 66])
    # a smaller N: a wider posterior (the data term 78/8 times smaller, τ the same)
    assert bool((cov_q.diagonal(dim1=-2, dim2=-1) > cov_base.diagonal(dim1=-2, dim2=-1)).all())

    reduce_model = tiny_gpt2()
    cb, _, _ = run(reduce_model, _answer_token_examples(), {**EXACT, "factor_form": "reduce"},
                   batch=2, loss=sum_nll_loss, tmp_path=tmp_path / "reduce", record=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        post = LaplacePosterior(reduce_model.eval(), Snapshot.load(cb.snapshots[-1]))
    assert post.num_data_unit == "sequence" and post.num_data == 8
