"""The query API the benchmarks use instead of private hooks: per-row ``token_ids``
and several prior precisions from one Jacobian pass in `LaplacePosterior`."""

import pytest
import torch

from kfac_stream import Snapshot
from kfac_stream.query.laplace import LaplacePosterior

from harness import run, sum_nll_loss
from models import text_examples, tiny_classifier_run, tiny_gpt2
from reference import rel_err

ROUNDOFF_TOL = 1e-12  # float64 model and features: the same numbers, maybe summed in another order
EXACT_TOL = 1e-12  # the same float64 arithmetic in the same order (bit-identical in practice)
N_DATA, TAU = 50.0, 0.7


@pytest.fixture(scope="module")
def posterior(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("query_api")
    model = tiny_gpt2()  # float64
    run(model, text_examples(8, 12), {"snapshot_every": 10**6}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp, record=False)
    return LaplacePosterior(model, Snapshot.latest(tmp / "kfac"), TAU, N_DATA)


def padded_batch(lengths, seed=4):
    """``{"input_ids", "attention_mask"}``, each ``[B, T]``, right-padded to max(lengths)."""
    ex = text_examples(len(lengths), max(lengths), seed=seed, lengths=lengths)
    return {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}


PER_ROW = [[5, 17, 99], [3, 5, 250], [64, 1, 2]]  # [B=3, K=3]


def row_by_row(post, batch, positions, per_row):
    """The one-list API once per row: row ``b`` of ``predictive(batch, positions, per_row[b])``.

    Returns ``(mean [B, K], cov [B, K, K])``."""
    means, covs = [], []
    for b, ids in enumerate(per_row):
        mean, cov = post.predictive(batch, positions, ids)
        means.append(mean[b])
        covs.append(cov[b])
    return torch.stack(means), torch.stack(covs)


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "lists"])
@pytest.mark.parametrize("positions", [-1, [4, 2, 0]], ids=["last", "per-example"])
def test_per_row_token_ids_equal_the_one_list_api_row_by_row(posterior, as_tensor, positions):
    batch = padded_batch([10, 8, 6])
    ids = torch.tensor(PER_ROW) if as_tensor else PER_ROW
    mean, cov = posterior.predictive(batch, positions, ids)
    ref_mean, ref_cov = row_by_row(posterior, batch, positions, PER_ROW)
    assert mean.shape == (3, 3) and cov.shape == (3, 3, 3)
    print(f"per-row vs row by row: mean {rel_err(mean, ref_mean):.1e}, "
          f"cov {rel_err(cov, ref_cov):.1e}")
    assert rel_err(mean, ref_mean) <= ROUNDOFF_TOL
    assert rel_err(cov, ref_cov) <= ROUNDOFF_TOL
    probs = posterior.predictive_probs(batch, positions, ids, method="probit")
    ref_probs = torch.stack([posterior.predictive_probs(batch, positions, r, method="probit")[b]
                             for b, r in enumerate(PER_ROW)])
    assert rel_err(probs, ref_probs) <= ROUNDOFF_TOL


def test_per_row_features_equal_the_one_list_features_row_by_row(posterior):
    batch = padded_batch([10, 8, 6])
    f, feats = posterior.jacobian_features(batch, -1, torch.tensor(PER_ROW))
    feats = dict(feats)  # {layer: M [B, K, d_out, d_A]}
    for b, ids in enumerate(PER_ROW):
        f_b, feats_b = posterior.jacobian_features(batch, -1, ids)
        assert rel_err(f[b], f_b[b]) <= ROUNDOFF_TOL
        for name, m in feats_b:
            assert rel_err(feats[name][b], m[b]) <= ROUNDOFF_TOL, name


def test_same_ids_in_every_row_equal_the_one_list_api(posterior):
    batch = padded_batch([10, 8, 6])
    tokens = [7, 40, 3, 200]
    _, cov = posterior.predictive(batch, -1, tokens)
    _, cov_rows = posterior.predictive(batch, -1, torch.tensor([tokens] * 3))
    assert rel_err(cov_rows, cov) <= ROUNDOFF_TOL


def test_per_row_token_ids_must_be_one_row_of_k_per_example(posterior):
    batch = padded_batch([10, 8, 6])
    with pytest.raises(ValueError, match="same length K"):
        posterior.predictive(batch, -1, [[1, 2], [3], [4, 5]])
    with pytest.raises(ValueError, match=r"\[B, K\] with B = 3"):
        posterior.predictive(batch, -1, torch.tensor([[1, 2], [3, 4]]))


def test_several_prior_precisions_equal_separate_single_tau_calls(posterior):
    batch = padded_batch([10, 8, 6], seed=5)
    tokens = [5, 17, 99, 3]
    first = posterior.snapshot.layer_names[0]
    priors = [1e-3, TAU, 50.0, {n: (1e4 if n == first else 2.0)
                                for n in posterior.snapshot.layer_names}]
    mean, covs = posterior.predictive_covariances(batch, -1, tokens, prior_precisions=priors)
    assert covs.shape == (len(priors), 3, 4, 4) and covs.dtype == torch.float64
    for p, prior in enumerate(priors):
        single = LaplacePosterior(posterior.model, posterior.snapshot, prior, N_DATA)
        ref_mean, ref_cov = single.predictive(batch, -1, tokens)
        print(f"prior {p}: covariance vs single-tau predictive {rel_err(covs[p], ref_cov):.1e}")
        assert rel_err(covs[p], ref_cov) <= EXACT_TOL
        assert torch.equal(mean, ref_mean)
    # and with per-row ids: one pass for every candidate
    _, covs_rows = posterior.predictive_covariances(batch, -1, PER_ROW, prior_precisions=priors)
    for p, prior in enumerate(priors):
        single = LaplacePosterior(posterior.model, posterior.snapshot, prior, N_DATA)
        assert rel_err(covs_rows[p], single.predictive(batch, -1, PER_ROW)[1]) <= EXACT_TOL


def test_per_row_class_ids_of_a_classification_head(tmp_path):
    model, snap, ex = tiny_classifier_run(tmp_path)
    post = LaplacePosterior(model, snap, TAU, N_DATA)
    batch = {k: torch.stack([e[k] for e in ex[:2]]) for k in ("input_ids", "attention_mask")}
    per_row = [[3, 0], [1, 2]]
    mean, cov = post.predictive(batch, token_ids=per_row)
    ref_mean, ref_cov = row_by_row(post, batch, -1, per_row)
    assert rel_err(mean, ref_mean) <= ROUNDOFF_TOL and rel_err(cov, ref_cov) <= ROUNDOFF_TOL
