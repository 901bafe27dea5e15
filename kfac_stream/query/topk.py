"""Per-position top-k next tokens with predictive mean probability and standard deviation."""

from __future__ import annotations

import torch
from torch import Tensor

from .laplace import LaplacePosterior


def topk_predictive(post: LaplacePosterior, input_ids: Tensor, k: int = 5,
                    n_samples: int = 2000, seed: int = 0) -> list[dict]:
    """For every position of one sequence: the ``k`` most likely next tokens under the MAP
    model, and for each the mean and standard deviation of its probability when its logit and
    the other top-k logits are drawn from the linearised Laplace predictive (the rest of the
    vocabulary held at its MAP logits).

    Args:
        post: The posterior.
        input_ids: ``[T]`` token ids.
        k: Tokens per position.

    Returns:
        One dict per position ``t``: ``{"position", "token_ids" [k], "map_prob" [k],
        "mean_prob" [k], "std_prob" [k]}`` (lists of floats/ints).
    """
    gen = torch.Generator().manual_seed(seed)
    batch = {"input_ids": input_ids[None], "attention_mask": torch.ones_like(input_ids)[None]}
    with torch.no_grad():
        logits = post.model(**batch).logits[0].double()  # [T, V]
    out = []
    for t in range(input_ids.shape[0]):
        top = torch.topk(logits[t], k).indices.tolist()
        mean, cov = post.predictive(batch, positions=t, token_ids=top)  # [1, k], [1, k, k]
        rest = logits[t].clone()
        rest[top] = float("-inf")
        rest_lse = torch.logsumexp(rest, 0)
        chol = torch.linalg.cholesky(cov[0] + 1e-12 * torch.eye(k, dtype=cov.dtype))
        f = mean[0] + torch.randn(n_samples, k, generator=gen, dtype=mean.dtype) @ chol.T
        lse = torch.logsumexp(torch.cat([f, rest_lse.expand(n_samples, 1)], 1), 1, keepdim=True)
        p = (f - lse).exp()  # [S, k]
        out.append({"position": t, "token_ids": top,
                    "map_prob": torch.softmax(logits[t], 0)[top].tolist(),
                    "mean_prob": p.mean(0).tolist(), "std_prob": p.std(0).tolist()})
    return out
