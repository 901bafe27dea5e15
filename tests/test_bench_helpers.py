"""The helpers the uncertainty benchmarks rely on (issue 7): the docstring multiple-choice data,
the per-tau covariance reuse (`LaplacePosterior.predictive_covariances` since issue 13), and the
answer-position indexing under right padding."""

import sys
from pathlib import Path

import pytest
import torch

from kfac_stream import Snapshot
from kfac_stream.app.models import tiny_gpt2 as app_gpt2
from kfac_stream.query.laplace import LaplacePosterior

from harness import run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import uncertainty_classification as uc  # noqa: E402

EXACT_TOL = 1e-12  # the same float64 arithmetic in a different order
PAD_TOL = 1e-5  # float32 model: padded vs unpadded batches take different kernels


def test_choice_splits_balanced_disjoint_and_labelled_by_their_package():
    splits = uc.choice_splits(6, 3, 5, seed=1)
    per = {p: set(uc.docstring_snippets(p)) for p in uc.PACKAGES}
    seen = set()
    for name, n in (("train", 6), ("val", 3), ("test", 5)):
        items = splits[name]
        assert sorted(c for _, c in items) == sorted(list(range(4)) * n)
        for s, c in items:
            assert s in per[uc.PACKAGES[c]]
            assert all(s not in per[p] for p in uc.PACKAGES if p != uc.PACKAGES[c])
            assert 40 <= len(s.encode()) <= uc.SNIPPET_BYTES
            assert s not in seen
            seen.add(s)
    assert uc.choice_splits(6, 3, 5, seed=1) == splits  # deterministic


def test_train_example_loss_only_at_the_answer_and_collate_pads():
    a = uc.train_example("short docstring of something useful here, long enough", 2)
    b = uc.train_example("x" * 60, 0)
    assert a["input_ids"][-1] == ord("C") and b["input_ids"][-1] == ord("A")
    assert (a["labels"][:-1] == -100).all() and a["labels"][-1] == ord("C")
    batch = uc.collate([a, b])
    T = max(len(a["input_ids"]), len(b["input_ids"]))
    assert batch["input_ids"].shape == (2, T)
    n = len(b["input_ids"])
    assert batch["attention_mask"][1].tolist() == [1] * n + [0] * (T - n)
    assert (batch["labels"][1, n:] == -100).all() and (batch["input_ids"][1, n:] == 0).all()
    assert len(uc.prompt_ids("y" * uc.SNIPPET_BYTES)) + 1 <= 128  # fits the base LM


def test_answer_logits_under_right_padding_equal_unpadded_ones():
    model = app_gpt2(seed=3).eval()
    items = [("a fairly long docstring about event loops, futures and their tasks", 0),
             ("short one, yet forty characters long....", 1)]
    batch, y = uc.prompt_batch(items)
    assert y.tolist() == [0, 1]
    got = uc.map_answer_logits(model, batch)
    head = uc.AnswerHead(model)
    head.answers_only = True
    with torch.no_grad():
        via_head = head(batch["input_ids"]).double()
    for i, (s, _) in enumerate(items):
        ids = torch.tensor([uc.prompt_ids(s)])
        with torch.no_grad():
            ref = model(input_ids=ids).logits[0, -1, uc.ANSWER_IDS].double()
        assert (got[i] - ref).abs().max() < PAD_TOL
        assert (via_head[i] - ref).abs().max() < PAD_TOL


@pytest.fixture(scope="module")
def posterior(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    model = tiny_gpt2()
    run(model, text_examples(8, 12), {"snapshot_every": 10**6}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp, record=False)
    return LaplacePosterior(model, Snapshot.latest(tmp / "kfac"), num_data=40.0)


def test_covs_for_many_tau_equal_the_librarys_predictive(posterior):
    ex = text_examples(3, 10, seed=4, lengths=[10, 8, 6])
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    tokens = uc.ANSWER_IDS
    taus = [1e-3, 0.7, 50.0]
    covs = uc.stream_covs(posterior, batch, taus)  # one predictive_covariances pass
    for t in taus:
        posterior.prior_precision = t
        _, ref = posterior.predictive(batch, -1, tokens)
        err = rel_err(covs[t], ref)
        print(f"tau {t}: covariance vs predictive {err:.1e}")
        assert err < EXACT_TOL
