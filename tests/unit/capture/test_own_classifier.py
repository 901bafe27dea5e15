"""A classifier of one's own (a plain ``nn.Module``, no ``can_generate``): labels ``[B]``.

kfac_stream takes a model of one's own for a causal LM (position ``t`` scored by the label of
``t + 1``) unless a pass's labels are one per sequence. A logistic regression fed ``[B, 1, d]``
(one position per example, as dattri's MNIST loaders give it) then keeps its one position:
before, the shift left it no usable position, no rows and ``N = 0``. References: the float64
brute-force factors of ``F.cross_entropy(…, reduction="sum")`` over the batch, and ``N`` = the
examples of the epoch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from kfac_stream import LaplacePosterior, Snapshot

from harness import run
from reference import rel_err

#: float64 model, float64 storage, one update: the rounding of two float64 paths only.
EXACT_TOL = 1e-10
N, D, C = 8, 5, 3


class OwnClassifier(nn.Module):
    """``x [B, 1, D]`` or ``[B, D]`` → ``logits [B, C]``; no ``can_generate``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(D, C).double()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.linear(x.reshape(x.shape[0], D))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def _examples(shape: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(*shape, generator=g, dtype=torch.float64),
             "labels": torch.tensor(i % C)} for i in range(N)]


@pytest.mark.parametrize("shape", [(1, D), (D,)], ids=["one-position", "flat"])
def test_own_classifier_factors_and_n_are_per_example(tmp_path, shape):
    model, ex = OwnClassifier(), _examples(shape)
    x = torch.stack([e["x"] for e in ex]).reshape(N, D)
    y = torch.stack([e["labels"] for e in ex])
    z = model.linear(x)
    (g,) = torch.autograd.grad(F.cross_entropy(z, y, reduction="sum"), [z])  # ∂ℓ_b/∂z_b
    a = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    want_a, want_g = a.T @ a / N, g.T @ g / N
    cb, _, _ = run(model, ex, {"include": [r"^linear$"]}, batch=N, steps=1, lr=0.0,
                   tmp_path=tmp_path, record=False)
    got_a, got_g = cb.tracker.factors()["linear"]
    assert rel_err(got_a.double(), want_a) <= EXACT_TOL
    assert rel_err(got_g.double(), want_g) <= EXACT_TOL
    assert cb.tracker.read_counters().sequences_seen == N
    post = LaplacePosterior(model.eval(), Snapshot.latest(tmp_path / "kfac"),
                            prior_precision=1.0)
    assert post.num_data == N
