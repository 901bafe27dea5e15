"""`kfac_stream.stats.covariance`: the Gram matrix with a bias column, dense and diagonal,
against a sum of outer products."""

import torch

from kfac_stream.stats.covariance import gram, with_bias_column


def test_gram_with_bias_and_diagonal():
    x = torch.randn(5, 3, dtype=torch.float64)
    xb = with_bias_column(x)
    dense = gram(xb) / 5
    manual = sum(torch.outer(r, r) for r in xb) / 5
    assert torch.allclose(dense, manual, rtol=1e-14, atol=1e-15)
    assert torch.allclose(dense[-1, -1], torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(gram(xb, diagonal=True) / 5, manual.diagonal(), rtol=1e-14)
