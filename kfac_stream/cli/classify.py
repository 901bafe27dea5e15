"""``kfac-stream query`` of a sequence classifier: per input the MAP and Laplace class
probabilities, the predicted label and its uncertainty."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .data import class_batches, label_names, read_texts, token_ids
from .loading import (
    CLASSIFIER,
    base_meta,
    load_model,
    load_snapshot,
    model_shown,
    prior_meta,
    query_posterior,
)
from .output import class_document, class_footer, class_table, query_status

if TYPE_CHECKING:
    from torch import Tensor


# -- a sequence classifier's query: per input the MAP class probabilities, the Laplace
# predictive's (from `LaplacePosterior.predictive`: mean [B, C], cov [B, C, C], and
# `probs_from_gaussian`), the predicted label and its uncertainty; records are plain dicts
# (JSON-ready) and the table is built from them, so the text and --json print the same.

def _entropy_nats(p: Tensor) -> Tensor:
    """``[B]`` entropy in nats of the rows of ``p [B, C]`` (``0 log 0 = 0``)."""
    import torch

    return torch.special.entr(p).sum(-1)


def _class_records(texts: Sequence[str], lengths: Sequence[int], names: Sequence[str],
                   mean: Tensor, cov: Tensor, probs: Tensor) -> list[dict]:
    """One record per input.

    Args:
        texts: The ``B`` input texts.
        lengths: Their token counts.
        names: The ``C`` label names (`label_names`).
        mean: ``[B, C]`` MAP logits (the predictive mean).
        cov: ``[B, C, C]`` the logits' posterior covariance.
        probs: ``[B, C]`` the Laplace predictive probabilities.

    Returns:
        Dicts with ``index``, ``text``, ``tokens``, ``label_id``, ``label`` (the argmax of
        ``probs``), ``map_label_id``, ``map_label``, ``entropy`` (of ``probs``),
        ``map_entropy``, ``label_logit_std``, and per class ``map_probs``, ``probs``,
        ``logit_mean``, ``logit_std``.
    """
    import torch

    mean, cov, probs = (x.detach().double().cpu() for x in (mean, cov, probs))
    map_probs = torch.softmax(mean, -1)  # [B, C]
    std = torch.diagonal(cov, dim1=-2, dim2=-1).clamp(min=0).sqrt()  # [B, C]
    label, map_label = probs.argmax(-1), map_probs.argmax(-1)  # [B]
    entropy, map_entropy = _entropy_nats(probs), _entropy_nats(map_probs)
    out = []
    for b, text in enumerate(texts):
        k, m = int(label[b]), int(map_label[b])
        out.append({"index": b, "text": text, "tokens": int(lengths[b]), "label_id": k,
                    "label": names[k], "map_label_id": m, "map_label": names[m],
                    "entropy": float(entropy[b]), "map_entropy": float(map_entropy[b]),
                    "label_logit_std": float(std[b, k]),
                    "map_probs": map_probs[b].tolist(), "probs": probs[b].tolist(),
                    "logit_mean": mean[b].tolist(), "logit_std": std[b].tolist()})
    return out


def _class_predictive(post, batches: list[dict]) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean [B, C], cov [B, C, C], probs [B, C])`` over every input: the linearised
    predictive of all classes (`LaplacePosterior.predictive`) and its probabilities by the
    posterior's link (`probs_from_gaussian`, as `predictive_probs` gives them)."""
    import torch

    from ..query.calibration import probs_from_gaussian

    means, covs = zip(*(post.predictive(b) for b in batches))
    mean, cov = torch.cat(means), torch.cat(covs)
    return mean, cov, probs_from_gaussian(mean, cov, post.link)


def classify(args, tau, arch: str, tokenizer, t0: float) -> int:
    """A sequence classifier's query: per input the MAP and Laplace class probabilities, the
    predicted label and its uncertainty (a table, or ``--json``)."""
    texts = read_texts(args)
    query_status(f"loading snapshot {args.snapshot} ...")
    snap = load_snapshot("--snapshot", args.snapshot)
    query_status(f"snapshot {snap.path}: {len(snap)} layers; loading {arch} "
                 f"{model_shown(args)} ...")
    model = load_model(args.model, CLASSIFIER, args.adapter)
    ids = [token_ids(args, tokenizer, model, text, where) for text, where in texts]
    post = query_posterior(args, model, snap, tau)
    query_status(f"{len(ids)} input{'s' if len(ids) != 1 else ''} x {model.config.num_labels} "
                 f"classes ({time.perf_counter() - t0:.1f} s so far) ...")
    mean, cov, probs = _class_predictive(post, class_batches(ids, model.config.pad_token_id))
    names = label_names(model.config.id2label, mean.shape[1])
    records = _class_records([t for t, _ in texts], [len(x) for x in ids], names, mean, cov,
                             probs)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **base_meta(args), "task": CLASSIFIER, "architecture": arch, "file": args.file,
            **prior_meta(post), "labels": names,
            "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(class_document(meta, records))
    else:
        print(class_table(records, names))
        print(class_footer(meta, len(records)))
    query_status(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
