"""`kfac_stream.query.metrics`: hand computations on tiny inputs, independent brute-force
implementations, invariances, and the one-line input errors."""

import itertools
import math
import sys

import pytest
import torch

from kfac_stream.exceptions import QueryInputError
from kfac_stream.query import metrics as M

from repo_paths import BENCHMARKS

EXACT = 1e-12  # float64, a different order of the same arithmetic


def close(a: float, b: float, tol: float = EXACT) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


# -- independent references (written differently from the module) ---------------------------------

def auroc_pairs(s_in, s_out) -> float:
    """O(n·m) pair count with Python floats."""
    total = 0.0
    for o in s_out.tolist():
        for a in s_in.tolist():
            total += 1.0 if o > a else 0.5 if o == a else 0.0
    return total / (len(s_in) * len(s_out))


def risk_curve_stable(correct, uncertainty) -> list[float]:
    """Risk at k = 1..n with ties broken by input order (Python sort is stable)."""
    order = sorted(range(len(correct)), key=lambda i: float(uncertainty[i]))
    errs, out = 0.0, []
    for k, i in enumerate(order, 1):
        errs += 0.0 if bool(correct[i]) else 1.0
        out.append(errs / k)
    return out


def risk_curve_all_tie_orders(correct, uncertainty) -> list[float]:
    """Mean over every permutation of the inputs of the stable-sort curve: averages every way
    of breaking the ties (each tie order equally often)."""
    n = len(correct)
    curves = [risk_curve_stable([correct[i] for i in p], [uncertainty[i] for i in p])
              for p in itertools.permutations(range(n))]
    return [sum(c[k] for c in curves) / len(curves) for k in range(n)]


def sparsification_loop(error, uncertainty, fractions) -> float:
    """AUSE by removing examples one fraction at a time (no ties in uncertainty or error)."""
    e = error.tolist()
    by_u = sorted(range(len(e)), key=lambda i: -float(uncertainty[i]))  # most uncertain first
    by_e = sorted(range(len(e)), key=lambda i: -e[i])  # largest error first
    gaps = []
    for f in fractions:
        r = math.floor(f * len(e) + 1e-9)
        kept_u = [e[i] for i in by_u[r:]]
        kept_o = [e[i] for i in by_e[r:]]
        gaps.append(sum(kept_u) / len(kept_u) - sum(kept_o) / len(kept_o))
    return sum(gaps) / len(gaps)


def random_probs(n: int, C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(n, C, generator=g, dtype=torch.float64), -1)
    y = torch.randint(0, C, (n,), generator=g)
    return p, y


# -- NLL ------------------------------------------------------------------------------------------

def test_nll_by_hand_and_the_floor():
    p = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    y = torch.tensor([0, 1])
    # −(ln 0.5 + ln 0.75)/2 = (ln 2 + ln 4/3)/2
    assert close(M.nll(p, y), (math.log(2) + math.log(4 / 3)) / 2, 1e-7)  # float32 input
    assert torch.allclose(M.nll_per_example(p, y),
                          torch.tensor([math.log(2), math.log(4 / 3)], dtype=torch.float64))
    # a zero probability of the true class costs −ln(1e-300) = 300 ln 10 ≈ 690.78 nats
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert close(M.nll(z, torch.tensor([1])), 300 * math.log(10))


# -- ECE ------------------------------------------------------------------------------------------

ECE_P = torch.tensor([[0.9, 0.05, 0.05],   # conf 0.9, predicts 0, y 0: right
                      [0.8, 0.1, 0.1],     # conf 0.8, predicts 0, y 1: wrong
                      [0.4, 0.3, 0.3],     # conf 0.4, predicts 0, y 0: right
                      [0.5, 0.25, 0.25]],  # conf 0.5, predicts 0, y 2: wrong
                     dtype=torch.float64)
ECE_Y = torch.tensor([0, 1, 0, 2])


def test_ece_by_hand_with_right_closed_bins():
    # bins=2: [0, 0.5] and (0.5, 1]; conf 0.5 falls in the FIRST bin (right-closed)
    # bin 1 {0.4 right, 0.5 wrong}: acc 0.5, conf 0.45 -> 2/4 · 0.05 = 0.025
    # bin 2 {0.9 right, 0.8 wrong}: acc 0.5, conf 0.85 -> 2/4 · 0.35 = 0.175
    assert close(M.ece(ECE_P, ECE_Y, bins=2), 0.2)
    # (were the bins left-closed, 0.5 would join bin 2: 1/4·0.6 + 3/4·|1/3 − 2.2/3| = 0.45)
    # bins=1: acc 0.5, mean conf 2.6/4 = 0.65 -> 0.15
    assert close(M.ece(ECE_P, ECE_Y, bins=1), 0.15)
    # bins=10: (0.3,0.4] {0.4 right} 1/4·0.6; (0.4,0.5] {0.5 wrong} 1/4·0.5;
    # (0.7,0.8] {0.8 wrong} 1/4·0.8; (0.8,0.9] {0.9 right} 1/4·0.1 -> (0.6+0.5+0.8+0.1)/4 = 0.5
    assert close(M.ece(ECE_P, ECE_Y, bins=10), 0.5)


def test_ece_zero_when_calibrated_by_construction():
    # 10 examples at confidence 0.7 of which 7 right, 10 at 0.9 of which 9 right, 4 at 0.25
    # (4 classes) of which 1 right: every bin's accuracy equals its confidence
    rows, ys = [], []
    for conf, n, right in ((0.7, 10, 7), (0.9, 10, 9)):
        for i in range(n):
            rows.append([conf, 1 - conf])
            ys.append(0 if i < right else 1)
    p2 = torch.tensor(rows, dtype=torch.float64)
    assert M.ece(p2, torch.tensor(ys)) < 1e-12
    p4 = torch.full((4, 4), 0.25, dtype=torch.float64)  # argmax = class 0 (first maximum)
    assert M.ece(p4, torch.tensor([0, 1, 2, 3])) < 1e-12


def old_nll_ece(probs, y, bins=15):
    """The benchmarks' implementation before this module (a loop over bins)."""
    nll = float(-probs.gather(1, y[:, None]).clamp(min=1e-300).log().mean())
    conf, pred = probs.max(-1)
    acc = (pred == y).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=conf.dtype)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf > lo) & (conf <= hi) if lo > 0 else (conf >= lo) & (conf <= hi)
        if m.any():
            ece += float(m.double().mean() * (conf[m].mean() - acc[m].mean()).abs())
    return nll, ece


@pytest.mark.parametrize("bins", [1, 3, 15, 100])
def test_ece_and_nll_match_a_loop_over_bins(bins):
    p, y = random_probs(500, 5, seed=bins)
    nll, ece = old_nll_ece(p, y, bins)
    assert close(M.nll(p, y), nll)
    assert close(M.ece(p, y, bins), ece)


def test_ece_nll_brier_are_permutation_invariant():
    p, y = random_probs(200, 4, seed=1)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(0))
    for f in (M.nll, M.ece, M.brier):
        assert close(f(p[perm], y[perm]), f(p, y))


# -- Brier ----------------------------------------------------------------------------------------

def test_brier_by_hand_multiclass_form():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 2])
    # (0.3² + 0.2² + 0.1²) = 0.14 ; (0.5² + 0.5² + 1²) = 1.5 ; mean 0.82
    assert close(M.brier(p, y), 0.82)
    # extremes: a confident right answer 0, a confident wrong one 2
    assert M.brier(torch.eye(3, dtype=torch.float64), torch.tensor([0, 1, 2])) == 0
    assert close(M.brier(torch.eye(2, dtype=torch.float64), torch.tensor([1, 0])), 2.0)


def test_brier_two_classes_is_twice_the_binary_score():
    p, y = random_probs(300, 2, seed=3)
    binary = float(((p[:, 1] - (y == 1).double()) ** 2).mean())
    assert close(M.brier(p, y), 2 * binary)


def test_against_sklearn_where_installed():
    skm = pytest.importorskip(
        "sklearn.metrics", reason="scikit-learn is not installed in this venv (not a dependency)")
    p, y = random_probs(300, 2, seed=4)
    assert close(M.brier(p, y), 2 * skm.brier_score_loss(y.numpy(), p[:, 1].numpy()), 1e-10)
    g = torch.Generator().manual_seed(5)
    s_in = torch.randint(0, 20, (200,), generator=g).double()
    s_out = torch.randint(5, 25, (150,), generator=g).double()
    labels = torch.cat([torch.zeros(200), torch.ones(150)]).numpy()
    ref = skm.roc_auc_score(labels, torch.cat([s_in, s_out]).numpy())
    assert close(M.auroc(s_in, s_out), ref, 1e-10)


# -- AUROC ----------------------------------------------------------------------------------------

def test_auroc_by_hand_with_ties():
    s_in = torch.tensor([0.1, 0.4, 0.4])
    s_out = torch.tensor([0.4, 0.9])
    # out 0.4: > 0.1 (1), = 0.4 (½), = 0.4 (½) -> 2 ; out 0.9: above all three -> 3 ; 5/6
    assert close(M.auroc(s_in, s_out), 5 / 6)
    assert close(M.auroc(s_out, s_in), 1 / 6)
    assert M.auroc(torch.ones(3), torch.ones(4)) == 0.5  # all tied
    assert M.auroc(torch.zeros(2), torch.ones(1)) == 1.0
    assert M.auroc(torch.tensor([-math.inf, 0.0]), torch.tensor([math.inf])) == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_auroc_equals_the_pair_count_and_is_symmetric(seed):
    g = torch.Generator().manual_seed(seed)
    n, m = 37 + seed, 23 + 2 * seed
    s_in = torch.randint(0, 8, (n,), generator=g).double()  # many ties
    s_out = torch.randint(2, 10, (m,), generator=g).double()
    a = M.auroc(s_in, s_out)
    assert close(a, auroc_pairs(s_in, s_out))
    assert close(a + M.auroc(s_out, s_in), 1.0)
    # permutations and a strictly increasing transform of the scores change nothing
    assert close(M.auroc(s_in.flip(0), s_out[torch.randperm(m, generator=g)]), a)
    assert close(M.auroc(torch.exp(s_in / 3) - 7, torch.exp(s_out / 3) - 7), a)


# -- selective prediction -------------------------------------------------------------------------

def test_risk_coverage_aurc_and_accuracy_at_coverage_by_hand():
    correct = torch.tensor([True, False, True, True])
    u = torch.tensor([0.1, 0.4, 0.2, 0.3])
    # most certain first: 0.1 right, 0.2 right, 0.3 right, 0.4 wrong
    cov, risk = M.risk_coverage(correct, u)
    assert cov.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert risk.tolist() == [0.0, 0.0, 0.0, 0.25]
    assert close(M.aurc(correct, u), 0.25 / 4)  # (0 + 0 + 0 + 1/4) / 4
    assert M.accuracy_at_coverage(correct, u, 0.75) == 1.0  # k = 3
    assert M.accuracy_at_coverage(correct, u, 0.7) == 1.0  # k = ⌈2.8⌉ = 3
    assert M.accuracy_at_coverage(correct, u, 0.76) == 0.75  # k = ⌈3.04⌉ = 4
    assert M.accuracy_at_coverage(correct, u, 1.0) == 0.75
    assert M.accuracy_at_coverage(correct, u, 0.01) == 1.0  # k = 1


def test_accuracy_at_coverage_rounding_of_the_count():
    # 0.07 · 100 = 7.000000000000001 in floating point; k must be 7, not 8
    correct = torch.tensor([True] * 7 + [False] * 93)
    u = torch.arange(100.0)
    assert 0.07 * 100 > 7
    assert M.accuracy_at_coverage(correct, u, 0.07) == 1.0
    assert close(M.accuracy_at_coverage(correct, u, 0.08), 7 / 8)


def test_ties_in_uncertainty_are_averaged_by_hand():
    correct = torch.tensor([True, False, True])
    u = torch.tensor([0.5, 0.5, 0.1])
    # 0.1 right first; then the tie group {right, wrong}, error rate 1/2:
    # risk_1 = 0, risk_2 = (0 + 1·½)/2 = ¼, risk_3 = 1/3 ; AURC = (0 + ¼ + ⅓)/3 = 7/36
    _, risk = M.risk_coverage(correct, u)
    assert torch.allclose(risk, torch.tensor([0, 0.25, 1 / 3], dtype=torch.float64))
    assert close(M.aurc(correct, u), 7 / 36)
    assert close(M.accuracy_at_coverage(correct, u, 2 / 3), 0.75)


@pytest.mark.parametrize("seed", range(5))
def test_risk_coverage_is_the_mean_over_every_tie_order(seed):
    g = torch.Generator().manual_seed(seed)
    n = 6
    correct = (torch.rand(n, generator=g) < 0.6).tolist()
    u = torch.randint(0, 3, (n,), generator=g).double().tolist()  # ties
    ref = risk_curve_all_tie_orders(correct, u)
    _, risk = M.risk_coverage(torch.tensor(correct), torch.tensor(u))
    assert all(close(a, b) for a, b in zip(risk.tolist(), ref))
    assert close(M.aurc(torch.tensor(correct), torch.tensor(u)), sum(ref) / n)


def test_without_ties_the_curve_is_the_plain_sorted_one_and_permutation_invariant():
    g = torch.Generator().manual_seed(7)
    correct = torch.rand(300, generator=g) < 0.7
    u = torch.rand(300, generator=g, dtype=torch.float64)
    ref = risk_curve_stable(correct.tolist(), u.tolist())
    _, risk = M.risk_coverage(correct, u)
    assert all(close(a, b) for a, b in zip(risk.tolist(), ref))
    u_tied = (u * 5).floor()
    perm = torch.randperm(300, generator=g)
    for f in (M.aurc, M.accuracy_at_coverage):
        assert close(f(correct[perm], u_tied[perm]), f(correct, u_tied))


def test_aurc_bounds():
    correct = torch.tensor([True, True, False, False])
    # errors last: oracle AURC = (0 + 0 + 1/3 + 2/4)/4 = 5/24 ; errors first: (1 + 1 + 2/3 + 2/4)/4
    assert close(M.aurc(correct, torch.tensor([0.0, 1, 2, 3])), 5 / 24)
    assert close(M.aurc(correct, torch.tensor([3.0, 2, 1, 0])), (1 + 1 + 2 / 3 + 0.5) / 4)
    # constant uncertainty: every k sees the overall error rate 1/2
    assert close(M.aurc(correct, torch.zeros(4)), 0.5)


# -- AUSE -----------------------------------------------------------------------------------------

def test_ause_by_hand_exact_grid_and_normalized():
    error = torch.tensor([3.0, 1.0, 2.0])
    u = torch.tensor([0.1, 0.2, 0.3])
    # kept by uncertainty (lowest first): 3 | 3,1 | 3,1,2 -> means 3, 2, 2
    # kept by error (oracle):             1 | 1,2 | 1,2,3 -> means 1, 1.5, 2
    # gaps at k = 1, 2, 3: 2, 0.5, 0 ; exact AUSE over fractions 0, 1/3, 2/3 = 2.5/3
    assert close(M.ause(error, u), 2.5 / 3)
    # steps=2: fractions 0 (remove 0, k=3, gap 0) and ½ (remove ⌊3/2⌋ = 1, k=2, gap 0.5)
    assert close(M.ause(error, u, steps=2), 0.25)
    # normalized by the mean error 2
    assert close(M.ause(error, u, normalize=True), 2.5 / 6)


def test_ause_zero_when_uncertainty_ranks_like_error():
    g = torch.Generator().manual_seed(8)
    error = torch.randint(0, 6, (200,), generator=g).double()  # with ties
    assert abs(M.ause(error, torch.exp(error))) < 1e-12
    assert abs(M.ause(error, 2 * error - 1, steps=100)) < 1e-12
    # ties in error, uncertainty ordering within them arbitrarily: still 0
    assert abs(M.ause(error, error + 1e-3 * torch.rand(200, generator=g))) < 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_ause_matches_a_removal_loop_and_is_nonnegative(seed):
    g = torch.Generator().manual_seed(seed)
    n = 57
    error = torch.rand(n, generator=g, dtype=torch.float64)
    u = error + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)  # no ties
    exact = M.ause(error, u)
    assert close(exact, sparsification_loop(error, u, [j / n for j in range(n)]))
    assert close(M.ause(error, u, steps=100),
                 sparsification_loop(error, u, [i / 100 for i in range(100)]))
    assert exact > 0
    assert M.ause(error, -u) > exact  # ranking backwards is worse
    assert M.ause(error, (u * 4).floor()) >= -1e-12  # with ties


def test_ause_of_01_error_is_aurc_minus_the_oracle_aurc():
    g = torch.Generator().manual_seed(9)
    correct = torch.rand(150, generator=g) < 0.6
    u = (torch.rand(150, generator=g) * 10).floor()  # ties
    err = (~correct).double()
    assert close(M.ause(err, u), M.aurc(correct, u) - M.aurc(correct, err))


def test_ause_permutation_invariant_with_ties():
    g = torch.Generator().manual_seed(10)
    error = torch.rand(120, generator=g, dtype=torch.float64)
    u = (torch.rand(120, generator=g) * 6).floor()
    perm = torch.randperm(120, generator=g)
    for steps in (None, 100, 7):
        assert close(M.ause(error[perm], u[perm], steps), M.ause(error, u, steps))


# -- over- or underconfident --------------------------------------------------------------------

def test_confidence_gap_hand_worked():
    """Top-1 confidences 0.9, 0.6, 0.5, 0.8 (mean 0.7) and 2 of 4 right: gap +0.2; the same
    predictions all right: 0.7 − 1 = −0.3 (underconfident)."""
    p = torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.5, 0.5], [0.2, 0.8]], dtype=torch.float64)
    assert abs(M.confidence_gap(p, torch.tensor([0, 1, 1, 0])) - 0.2) < 1e-15
    assert abs(M.confidence_gap(p, torch.tensor([0, 1, 0, 1])) - (-0.3)) < 1e-15
    uniform = torch.full((5, 4), 0.25, dtype=torch.float64)  # argmax: class 0 (first)
    assert abs(M.confidence_gap(uniform, torch.tensor([0, 1, 2, 3, 0])) - (0.25 - 0.4)) < 1e-15


# -- the report -----------------------------------------------------------------------------------

def test_classification_report_agrees_with_the_functions():
    p, y = random_probs(100, 3, seed=11)
    r = M.classification_report(p, y)
    correct = p.argmax(1) == y
    u = 1 - p.max(1).values
    assert set(r) == {"n", "accuracy", "nll", "ece", "bins", "brier", "aurc", "coverage",
                      "accuracy_at_coverage", "ause_01", "ause_nll", "confidence_gap"}
    assert r["n"] == 100 and r["bins"] == 15 and r["coverage"] == 0.8
    assert r["accuracy"] == float(correct.double().mean())
    assert r["nll"] == M.nll(p, y) and r["ece"] == M.ece(p, y) and r["brier"] == M.brier(p, y)
    assert r["aurc"] == M.aurc(correct, u)
    assert r["accuracy_at_coverage"] == M.accuracy_at_coverage(correct, u, 0.8)
    assert r["ause_01"] == M.ause((~correct).double(), u)
    assert r["ause_nll"] == M.ause(M.nll_per_example(p, y), u)
    assert r["confidence_gap"] == M.confidence_gap(p, y)
    other = torch.rand(100, dtype=torch.float64)
    r2 = M.classification_report(p, y, uncertainty=other, bins=5, coverage=0.5)
    assert r2["aurc"] == M.aurc(correct, other) and r2["ece"] == M.ece(p, y, 5)


# -- the benchmarks delegate ----------------------------------------------------------------------

def test_benchmark_helpers_delegate_with_the_old_values():
    sys.path.insert(0, str(BENCHMARKS))
    import _common

    p, y = random_probs(400, 6, seed=12)
    assert _common.nll_ece(p, y) == (M.nll(p, y), M.ece(p, y))
    old = old_nll_ece(p, y, 10)
    new = _common.nll_ece(p, y, 10)
    assert close(new[0], old[0]) and close(new[1], old[1])
    s_in, s_out = torch.randint(0, 5, (40,)).double(), torch.randint(0, 7, (30,)).double()
    assert close(_common.auroc(s_in, s_out), auroc_pairs(s_in, s_out))


# -- input errors ---------------------------------------------------------------------------------

P2 = torch.tensor([[0.6, 0.4], [0.3, 0.7]])
Y2 = torch.tensor([0, 1])
C2 = torch.tensor([True, False])
U2 = torch.tensor([0.1, 0.2])


@pytest.mark.parametrize("call, match", [
    (lambda: M.nll(P2[0], Y2), r"metrics\.nll: probs must be a tensor \[n, C\]"),
    (lambda: M.nll(torch.zeros(0, 2), Y2[:0]), r"probs must be a tensor \[n, C\] with n, C >= 1"),
    (lambda: M.nll(P2.long(), Y2), r"probs must be floating point"),
    (lambda: M.ece(torch.tensor([[1.5, -0.5], [0.3, 0.7]]), Y2), r"probs must lie in \[0, 1\]"),
    (lambda: M.brier(torch.tensor([[0.6, 0.6], [0.3, 0.7]]), Y2), r"rows must sum to 1"),
    (lambda: M.nll(torch.tensor([[math.nan, 1.0], [0.3, 0.7]]), Y2), r"probs must be finite"),
    (lambda: M.nll(P2, Y2[:1]), r"metrics\.nll: y must be a tensor \[n\] with n = 2"),
    (lambda: M.nll(P2, Y2.double()), r"y must hold integer labels"),
    (lambda: M.ece(P2, torch.tensor([0, 2])), r"metrics\.ece: y must lie in \[0, 2\)"),
    (lambda: M.ece(P2, Y2, bins=0), r"metrics\.ece: bins must be an integer >= 1, got 0"),
    (lambda: M.ece(P2, Y2, bins=2.5), r"bins must be an integer >= 1, got 2\.5"),
    (lambda: M.auroc(torch.zeros(0), U2), r"metrics\.auroc: score_in must be a non-empty 1-D"),
    (lambda: M.auroc(U2, torch.tensor([math.nan])), r"score_out must not contain NaN"),
    (lambda: M.risk_coverage(C2, U2[:1]), r"metrics\.risk_coverage: uncertainty must have the "
                                          r"same length as the first argument \(2\), got 1"),
    (lambda: M.aurc(torch.tensor([1, 2]), U2), r"metrics\.aurc: correct must be boolean"),
    (lambda: M.accuracy_at_coverage(C2, U2, 0), r"coverage must be a number in \(0, 1\], got 0"),
    (lambda: M.accuracy_at_coverage(C2, U2, 1.5), r"coverage must be a number in \(0, 1\]"),
    (lambda: M.ause(U2, U2, steps=0), r"metrics\.ause: steps must be None or an integer >= 1"),
    (lambda: M.ause(torch.tensor([math.inf, 1.0]), U2), r"metrics\.ause: error must be finite"),
    (lambda: M.ause(U2.reshape(2, 1), U2), r"error must be a non-empty 1-D tensor, got \(2, 1\)"),
    (lambda: M.classification_report(P2, Y2, uncertainty=U2[:1]),
     r"classification_report: uncertainty must have the same length"),
])
def test_input_errors_are_one_line_and_name_the_argument(call, match):
    with pytest.raises(QueryInputError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


def test_rounding_slack_is_accepted():
    # float32 softmax averages may leave [0, 1] or sum to 1 only up to rounding
    p = torch.tensor([[1 + 1e-7, -1e-7], [0.3, 0.7 + 1e-5]])
    assert close(M.nll(p, Y2), -(math.log(1.0) + math.log(0.70001)) / 2, 1e-6)
