"""`LaplacePosterior` at scale: the marglik ``τ`` from eigenvalues only (binned
surrogate search + exact Newton polish, `kfac_stream.query.marglik`) equals the exact dense
search; nothing is widened or moved before a query needs it; `Snapshot.load` dequantises
lazily (an A several layers share: once); the benchmark's ``--quick`` smoke run works."""

import math
import sys

import pytest
import torch

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.query import kron_eigen as ke
from kfac_stream.query import marglik
from kfac_stream.query.calibration import minimise_over_log_range as _minimise_over_log_range
from kfac_stream.query.eigen_cache import source_key as _source_key
from kfac_stream.snapshot.snapshot import _Dequantised

from harness import run
from models import text_examples, tiny_llama
from repo_paths import ROOT


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("posterior_scale")
    ex = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    cfg = {"token_fraction": 0.3, "ema_decay": 0.9, "storage_dtype": "float16",
           "snapshot_every": 2}
    cb, _, _ = run(tiny_llama(), ex, cfg, batch=2, tmp_path=tmp, record=False)
    return cb.tracker.capture.model, Snapshot.latest(tmp / "kfac"), ex


def _dense_evidence(post, tau):
    """The objective term by term, as before the binned surrogate: ``Σ_layers marglik_terms``
    with ``log(N γ αᵀ + τ)`` over every eigenvalue pair, float64 on the CPU."""
    total = 0.0
    for name in post.modules:
        lf = post.snapshot[name]
        w = post._weights(name)
        logdet = ke.log_det_precision(lf.G_eigvals, lf.A_eigvals, post.num_data, tau)
        total += float(ke.marglik_terms(w.numel(), float((w * w).sum()), logdet, tau))
    return total


def test_fast_marglik_equals_the_exact_dense_search(trained):
    model, snap, _ = trained
    post = LaplacePosterior(model, snap, prior_precision="marglik")
    exact = _minimise_over_log_range(lambda t: -_dense_evidence(post, math.exp(t)),
                                     1e-6, 1e6, 61, 60)
    tau = post.prior_precision
    assert abs(tau / exact - 1) < 1e-4  # 1% would do; the polish gives ~1e-8
    # the log evidence itself is the dense sum, to float64 rounding
    for t in (1e-3, tau, exact, 10.0):
        dense = _dense_evidence(post, t)
        assert post.log_marginal_likelihood(t) == pytest.approx(dense, rel=1e-12, abs=1e-9)
    # and the two maximisers give the same evidence (the maximum is flat)
    assert _dense_evidence(post, tau) == pytest.approx(_dense_evidence(post, exact), rel=1e-10)
    assert _dense_evidence(post, tau) >= _dense_evidence(post, exact) - 1e-9


def test_binned_surrogate_within_its_stated_bound(trained):
    model, snap, _ = trained
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    norms = post._weight_norms()
    bins = marglik.EvidenceBins([post.eig.eigvals(n)[::-1] for n in post.modules],
                                post.num_data, [norms[n] for n in post.modules])
    params = sum(p for p, _ in norms.values())
    assert bins.bins < sum(snap[n].A_eigvals.numel() * snap[n].G_eigvals.numel()
                           for n in post.modules)
    for log_tau in (-12.0, -3.0, 0.0, 2.5, 9.0):
        exact = _dense_evidence(post, math.exp(log_tau))
        assert abs(bins.surrogate(log_tau) - exact) <= params * marglik.BIN_WIDTH / 2
        # the exact slope is the derivative of the exact evidence in log τ
        first, second = bins.exact_slope(log_tau)
        h = 1e-5
        numeric = (_dense_evidence(post, math.exp(log_tau + h))
                   - _dense_evidence(post, math.exp(log_tau - h))) / (2 * h)
        assert first == pytest.approx(numeric, rel=1e-5, abs=1e-6 * params)
        assert second < 0


def test_range_ends_and_small_grids(trained):
    model, snap, _ = trained
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    best = post.optimize_prior_precision(show_progress=False)
    assert post.optimize_prior_precision(lower=best * 10, upper=best * 1e3) == pytest.approx(
        best * 10, rel=1e-9)  # the maximum lies below the range: its lower end
    assert post.optimize_prior_precision(lower=best / 1e3, upper=best / 10) == pytest.approx(
        best / 10, rel=1e-9)
    assert post.optimize_prior_precision(grid=3, iters=1) == pytest.approx(best, rel=1e-6)


def test_nothing_widened_before_a_query_and_shared_A_once(trained):
    model, snap, ex = trained
    post = LaplacePosterior(model, snap, prior_precision="marglik")
    assert not [k for k in post.eig._cache if k[1] == "eigvecs"]  # marglik: eigenvalues only
    assert not post._qf._cache
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    assert snap.manifest.layers[k].A.key == q + ".A"
    assert post.eigenbases(q)[0] is post.eigenbases(k)[0]  # one conversion for the group
    assert post.eig[q][0] is post.eig[k][0]
    assert post.eig[q][0].dtype == torch.float64
    assert torch.equal(post.eig[q][0], snap[q].A_eigvecs.double())
    batch = {"input_ids": ex[0]["input_ids"][None],
             "attention_mask": ex[0]["attention_mask"][None]}
    mean, cov = post.predictive(batch, positions=-1, token_ids=[1, 2, 3])
    stored = {_source_key(snap, n, f) for n in snap.layer_names for f in "AG"
              if getattr(snap[n], f"{f}_eigvecs") is not None}
    assert set(post._qf._cache) == stored  # each stored eigenbasis converted once
    assert len(stored) < 2 * len(snap.layer_names)
    assert torch.isfinite(cov).all() and (torch.diagonal(cov, dim1=-2, dim2=-1) > 0).all()


def test_snapshot_factors_are_dequantised_lazily_once(trained):
    _, snap, _ = trained
    fresh = Snapshot.load(snap.path)
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    lazy = fresh[q]._A
    assert isinstance(lazy, _Dequantised) and lazy._value is None  # nothing made at load
    assert fresh[k]._A is lazy
    a = fresh[q].A
    assert a.dtype == torch.float32 and fresh[k].A is a  # dequantised once for the group
    assert torch.equal(a, snap[q].A)
    for name in fresh.layer_names:
        for part in ("A", "G"):
            t = getattr(fresh[name], part)
            assert t.dtype == torch.float32 and torch.isfinite(t).all()


def test_benchmark_quick_runs(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import posterior_scale
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "ps.json"
    posterior_scale.main(["--quick", "--no-old", "--reps", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert "LaplacePosterior" in text and "tuned tau" in text
    import json

    res = json.loads(out.read_text())["result"]
    assert res["posterior_s"] > 0 and res["tau"] > 0 and res["layers"] == 14
