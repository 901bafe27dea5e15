"""`kfac_stream.stats.loss_scale`: the loss scale ``c`` recovered from logits and output
gradients without labels, after a long masked prompt, and label smoothing flagged."""

import pytest
import torch

from kfac_stream.stats.loss_scale import FIT_ROWS, cross_entropy_scale


@pytest.mark.parametrize("c", [1.0, 1 / 37, 65536.0 / 123])
def test_cross_entropy_scale_recovers_c_without_labels(c):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 11, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 11, (20,), generator=gen)
    p = torch.softmax(logits, -1)
    grad = p.clone()
    grad[torch.arange(20), y] -= 1
    grad *= c
    grad[3] = 0  # a position without a loss term
    est, resid, used = cross_entropy_scale(logits, grad)  # 0-dim tensors (no host read)
    assert int(used) == 19
    assert float(est) == pytest.approx(c, rel=1e-12)
    assert float(resid) < 1e-12
    est, _, _ = cross_entropy_scale(logits, grad, max_rows=3)  # the first live rows suffice
    assert float(est) == pytest.approx(c, rel=1e-12)
    none, _, used = cross_entropy_scale(logits, torch.zeros_like(grad))
    assert int(used) == 0 and torch.isnan(none)


def test_cross_entropy_scale_finds_loss_rows_after_a_long_masked_prompt():
    # 200 prompt positions without a loss term, then 100 with: the fit must use the latter
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 50, generator=gen, dtype=torch.float64)
    grad = torch.softmax(logits, -1)
    grad[torch.arange(300), torch.randint(0, 50, (300,), generator=gen)] -= 1
    grad *= 0.25
    grad[:200] = 0
    c, resid, used = cross_entropy_scale(logits, grad, max_rows=128)  # 100 of 128 live
    assert int(used) == 100 and float(c) == pytest.approx(0.25, rel=1e-12)
    c, _, used = cross_entropy_scale(logits, grad)  # the default FIT_ROWS: all of them live
    assert int(used) == FIT_ROWS and float(c) == pytest.approx(0.25, rel=1e-12)
    assert float(resid) < 1e-12


def test_cross_entropy_scale_flags_label_smoothing():
    logits = torch.randn(30, 7, dtype=torch.float64)
    target = torch.full((30, 7), 0.1 / 7, dtype=torch.float64)
    target[torch.arange(30), torch.randint(0, 7, (30,))] += 0.9
    grad = torch.softmax(logits, -1) - target
    _, resid, _ = cross_entropy_scale(logits, grad)
    assert float(resid) > 1e-2
