"""Per-position top-k next tokens with predictive mean probability and standard deviation."""

from __future__ import annotations

import torch
from torch import Tensor

from ..utils.progress import progress
from . import inputs
from .laplace import LaplacePosterior

#: Positions of one Jacobian pass (memory: this many copies of the sequence's activations and
#: of each layer's ``k·d_out·d_A`` features).
POSITIONS_PER_PASS = 8


def topk_predictive(post: LaplacePosterior, input_ids: Tensor, k: int = 5,
                    n_samples: int = 2000, seed: int = 0,
                    show_progress: bool | None = None) -> list[dict]:
    """For every position of one sequence: the ``k`` most likely next tokens under the MAP
    model, and for each the mean and standard deviation of its probability when its logit and
    the other top-k logits are drawn from the linearised Laplace predictive (the rest of the
    vocabulary held at its MAP logits).

    Args:
        post: The posterior (a `LaplacePosterior` of a language model).
        input_ids: ``[T]`` token ids (a 1-D integer tensor, ``T ≥ 1``, ids within the model's
            input embeddings).
        k: Tokens per position, an int in ``[1, V]``.
        n_samples: Draws per position, an int ≥ 2.
        seed: Seed of the draws, an int.
        show_progress: A progress bar over the positions: None (when stderr is a terminal,
            `kfac_stream.query.progress`), True or False.

    Returns:
        One dict per position ``t``: ``{"position", "token_ids" [k], "map_prob" [k],
        "mean_prob" [k], "std_prob" [k]}`` (lists of floats/ints).

    Raises:
        QueryInputError: an argument of the wrong type or out of range.
    """
    where = "topk_predictive"
    if not isinstance(post, LaplacePosterior):
        raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
    if inputs.seq2seq_lm(post.model):
        raise inputs.error(where, "post", post, "the posterior of a causal language model (an "
                           "encoder-decoder's next tokens depend on its decoder inputs: call "
                           "post.predictive with a batch holding labels or decoder_input_ids)",
                           problem="is of an encoder-decoder model")
    if not inputs.is_int_tensor(input_ids) or input_ids.dim() != 1 or input_ids.numel() == 0:
        raise inputs.error(where, "input_ids", input_ids,
                           "a [T] integer tensor of token ids with T >= 1 (one sequence)",
                           typed=not isinstance(input_ids, Tensor))
    vocab = inputs.input_vocab(post.model)
    if vocab is not None:
        inputs.check_id_range(where, "input_ids", input_ids, input_ids, vocab,
                              f"the model's {vocab} input embeddings")
    inputs.check_length(where, "input_ids", int(input_ids.shape[0]),
                        inputs.input_positions(post.model))
    k = inputs.check_int(where, "k", k, 1)
    n_samples = inputs.check_int(where, "n_samples", n_samples, 2)
    seed = inputs.check_seed(where, "seed", seed)
    gen = torch.Generator().manual_seed(seed)
    batch = {"input_ids": input_ids[None], "attention_mask": torch.ones_like(input_ids)[None]}
    with torch.no_grad():
        logits = post.model(**batch).logits[0].double()  # [T, V]
    if logits.dim() != 2:
        raise inputs.error(where, "post", post, "the posterior of a language model (logits "
                           f"[B, T, V]); this model gives logits {[1, *logits.shape]}")
    if k > logits.shape[-1]:
        raise inputs.error(where, "k", k, f"an int in [1, {logits.shape[-1]}] (the vocabulary)")
    top_all = torch.topk(logits, k).indices  # [T, k]
    T = input_ids.shape[0]
    out = []
    bar = progress(total=T, desc="top-k predictive", unit="position", show=show_progress)
    try:
        for start in range(0, T, POSITIONS_PER_PASS):
            # several positions in one Jacobian pass: the sequence repeated, one position and
            # its top-k ids per copy (the same figures as one pass per position)
            ts = list(range(start, min(start + POSITIONS_PER_PASS, T)))
            rows = {name: v.expand(len(ts), -1) for name, v in batch.items()}
            means, covs = post.predictive(rows, positions=ts, token_ids=top_all[ts])
            for j, t in enumerate(ts):
                out.append(_row(t, top_all[t].tolist(), logits[t], means[j], covs[j],
                                n_samples=n_samples, gen=gen))
            bar.update(len(ts))
    finally:
        bar.close()
    return out


def _row(t: int, top: list[int], logits: Tensor, mean: Tensor, cov: Tensor, *, n_samples: int,
         gen: torch.Generator) -> dict:
    """One position's entry of `topk_predictive` from its MAP logits ``[V]`` and the
    predictive ``mean [k]``, ``cov [k, k]`` of its top-k logits."""
    k = len(top)
    rest = logits.clone()
    rest[top] = float("-inf")
    rest_lse = torch.logsumexp(rest, 0)
    chol = torch.linalg.cholesky(cov + 1e-12 * torch.eye(k, dtype=cov.dtype))
    f = mean + torch.randn(n_samples, k, generator=gen, dtype=mean.dtype) @ chol.T
    lse = torch.logsumexp(torch.cat([f, rest_lse.expand(n_samples, 1)], 1), 1, keepdim=True)
    p = (f - lse).exp()  # [S, k]
    return {"position": t, "token_ids": top, "map_prob": torch.softmax(logits, 0)[top].tolist(),
            "mean_prob": p.mean(0).tolist(), "std_prob": p.std(0).tolist()}
