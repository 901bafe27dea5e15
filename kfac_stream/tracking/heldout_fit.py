"""``HeldoutConfig.prior_precision``: the prior precision and link fitted on the eval set at
the final snapshot, stored beside it (`kfac_stream.query.heldout_tau`).

The run's plan decides whether the fit runs (`kfac_stream.tracking.plan.plan_heldout`, on the
eval set the front end hands the session: `EvalBatches`); this module says why not at train
begin (`heldout_lines`) and fits at train end (`fit_heldout_prior`).

A classification head's eval set (or an answer-token fine-tune's) gives one label per example;
a language model's without answer tokens (a causal LM's texts, a seq2seq model's targets) its
``labels [B, T]``, and the NLL is taken per label token of the linearised next-token predictive
(`kfac_stream.query.heldout_tokens`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..exceptions import QueryInputError
from ..query.heldout_tau import GRID, GUARD_SE, LINKS, fit_prior_precision
from ..query.heldout_tokens import FIT_METHOD
from ..query.inputs import output_vocab
from ..query.laplace import LaplacePosterior
from ..query.prior_choice import NO_HELDOUT_LINK, NO_HELDOUT_TAU
from ..snapshot.heldout_prior import write_heldout_prior
from ..snapshot.snapshot import Snapshot
from .plan import EvalBatches, HeldoutPlan

logger = logging.getLogger("kfac_stream")

#: The rule without held-out data, in words (`kfac_stream.query.prior_choice`).
NO_HELDOUT_RULE = (f"the rule without held-out data (tau by {NO_HELDOUT_TAU}, {NO_HELDOUT_LINK} "
                   "link)").replace("by marglik", "by marginal likelihood")


def heldout_lines(heldout: HeldoutPlan) -> list[tuple[str, str]]:
    """``[(log level, line)]`` rank 0 says at train begin about the held-out fit: why it
    will not run, once (nothing when it runs, is off, or no front end handed an eval set)."""
    if heldout.why == "ranks":
        return [("info", "kfac_stream: the held-out fit of tau runs in one process only; "
                         f"with {heldout.world} ranks, fit it after training with "
                         "kfac_stream.fit_prior_precision (queries use the rule without "
                         "held-out data until then)")]
    if heldout.why == "no eval set" and heldout.asked:
        return [("warning", "kfac_stream: HeldoutConfig(prior_precision=True) but the Trainer "
                            "has no eval_dataset: no tau will be fitted and "
                            "Snapshot.heldout_prior will be None (pass eval_dataset=..., or "
                            "call kfac_stream.fit_prior_precision after training)")]
    if heldout.why == "no eval set":
        return [("info", f"kfac_stream: no eval_dataset: queries will use {NO_HELDOUT_RULE} "
                         "(pass eval_dataset=... to fit tau and the link on held-out data, "
                         "the default whenever there is one)")]
    if heldout.why == "empty":
        return [("warning" if heldout.asked else "info",
                 "kfac_stream: the eval_dataset is empty (0 examples): no tau is fitted on "
                 "held-out data and Snapshot.heldout_prior will be None; queries will use "
                 f"{NO_HELDOUT_RULE} (pass a non-empty eval_dataset=..., or call "
                 "kfac_stream.fit_prior_precision after training)")]
    return []


def _say_method(per_token: bool) -> None:
    """The fit's method, before it runs (the per-token fit's cost differs from the closed
    form's one Jacobian pass)."""
    if per_token:
        logger.info("kfac_stream: held-out fit: %s; MAP's own probabilities are kept unless "
                    "the posterior beats them by more than %g paired standard errors",
                    FIT_METHOD, GUARD_SE)
    else:
        logger.info("kfac_stream: held-out fit: one Jacobian pass over the eval set (a forward "
                    "and one backward per class or answer option), then the closed-form "
                    "%s links at %d candidate taus; MAP's own probabilities are kept unless "
                    "the posterior beats them by more than %g paired standard errors",
                    " and ".join(LINKS), len(GRID) + 1, GUARD_SE)


def fit_heldout_prior(snapshots: Sequence[str], model: nn.Module, eval_set: EvalBatches,
                      answer_tokens: Mapping[str, list] | None) -> str | None:
    """Fit ``τ`` and the link on ``eval_set`` for the last of ``snapshots`` (the run's, in
    order) and write them beside that snapshot; returns the file, or None (logged why) when it
    cannot. ``answer_tokens``: the run's resolved answer options (None: a language model's
    fit is per label token). Logs the method used before and the verdict after."""
    if eval_set.dataset is None:  # said at train begin
        return None
    if not snapshots:
        logger.warning("kfac_stream: held-out fit: no snapshot was written; tau not fitted")
        return None
    path = snapshots[-1]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    _say_method(output_vocab(model) is not None and answer_tokens is None)
    try:
        post = LaplacePosterior(model, Snapshot.load(path, show_progress=False),
                                prior_precision=1.0)
        batches = ({k: v.to(device) for k, v in b.items() if torch.is_tensor(v)}
                   for b in eval_set.batches())
        prior = fit_prior_precision(post, batches)
    except Exception as e:  # an extra at the end of training never fails the run
        kind = "" if isinstance(e, QueryInputError) else f"{type(e).__name__}: "
        logger.warning("kfac_stream: held-out fit: %s%s; tau not fitted (queries use %s)",
                       kind, e, NO_HELDOUT_RULE)
        return None
    finally:
        model.train(was_training)
    out = write_heldout_prior(path, prior)
    logger.info("kfac_stream: %s (marginal likelihood's tau %.4g: eval NLL %.4f; fit %.1f s) "
                "-> %s", prior.verdict(), prior.marglik_tau, prior.marglik_nll, prior.seconds,
                out)
    return out
