"""``KFACConfig.eval_prior_precision``: the prior precision and link fitted on the Trainer's
``eval_dataset`` at the final snapshot, stored beside it (`kfac_stream.query.heldout_tau`).

A classification head's eval set (or an answer-token fine-tune's) gives one label per example;
a language model's without answer tokens (a causal LM's texts, a seq2seq model's targets) its
``labels [B, T]``, and the NLL is taken per label token of the linearised next-token predictive
(`kfac_stream.query.heldout_tokens`)."""

from __future__ import annotations

import logging

import torch
from transformers import Trainer

from ..exceptions import QueryInputError
from ..query.heldout_tau import GRID, GUARD_SE, LINKS, fit_prior_precision
from ..query.heldout_tokens import FIT_METHOD
from ..query.laplace import LaplacePosterior
from ..query.prior_choice import NO_HELDOUT_LINK, NO_HELDOUT_TAU
from ..snapshot.heldout_prior import write_heldout_prior
from ..snapshot.snapshot import Snapshot
from .answer_tokens import output_vocab
from .spectrum_monitor import find_on_stack

logger = logging.getLogger("kfac_stream")

#: The rule without held-out data, in words (`kfac_stream.query.prior_choice`).
NO_HELDOUT_RULE = (f"the rule without held-out data (tau by {NO_HELDOUT_TAU}, {NO_HELDOUT_LINK} "
                   "link)").replace("by marglik", "by marginal likelihood")


def find_trainer(depth: int = 16) -> Trainer | None:
    """The `transformers.Trainer` whose callback event is running (a callback is not given
    it): the first ``self`` on the call stack that is one; None if there is none."""
    return find_on_stack(Trainer, depth)


def plan_heldout_fit(tracker, mode: bool | str) -> bool:
    """At train begin: whether the end of training fits ``τ`` and the link on the Trainer's
    eval set (``KFACConfig.eval_prior_precision`` ``mode``), each reason not to said once,
    on rank 0 (the other ranks never fit)."""
    if mode is False:
        return False
    if tracker.world_size > 1:
        if tracker.rank == 0:
            logger.info("kfac_stream: the held-out fit of tau runs in one process only; with %d "
                        "ranks, fit it after training with kfac_stream.fit_prior_precision "
                        "(queries use the rule without held-out data until then)",
                        tracker.world_size)
        return False
    trainer = find_trainer()
    if trainer is not None and trainer.eval_dataset is None:
        if mode is True:
            logger.warning("kfac_stream: eval_prior_precision=True but the Trainer has no "
                           "eval_dataset: no tau will be fitted and Snapshot.heldout_prior "
                           "will be None (pass eval_dataset=..., or call "
                           "kfac_stream.fit_prior_precision after training)")
        else:
            logger.info("kfac_stream: no eval_dataset: queries will use %s (pass "
                        "eval_dataset=... to fit tau and the link on held-out data, the "
                        "default whenever there is one)", NO_HELDOUT_RULE)
        return False
    if trainer is not None and _empty(trainer.eval_dataset):
        (logger.warning if mode is True else logger.info)(
            "kfac_stream: the eval_dataset is empty (0 examples): no tau is fitted on held-out "
            "data and Snapshot.heldout_prior will be None; queries will use %s (pass a "
            "non-empty eval_dataset=..., or call kfac_stream.fit_prior_precision after "
            "training)", NO_HELDOUT_RULE)
        return False
    return trainer is not None


def _empty(dataset) -> bool:
    """The eval set has no example: a sized dataset of length 0, or a dict of them (several
    named eval sets) all empty; one without a length (an iterable dataset) is not judged."""
    if isinstance(dataset, dict):
        return bool(dataset) and all(_empty(d) for d in dataset.values())
    try:
        return len(dataset) == 0
    except TypeError:
        return False


def fit_heldout_prior(callback, model) -> str | None:
    """Fit ``τ`` and the link on the running Trainer's eval set for the callback's last
    snapshot and write them beside the snapshot; returns the file, or None (logged why) when
    it cannot. Logs the method used before and the verdict after."""
    trainer = find_trainer()
    if trainer is None or trainer.eval_dataset is None:  # said at train begin
        return None
    if not callback.snapshots:
        logger.warning("kfac_stream: held-out fit: no snapshot was written; tau not fitted")
        return None
    path = callback.snapshots[-1]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    per_token = output_vocab(model) is not None and callback.tracker.answer_tokens is None
    if per_token:  # its cost differs from the closed form's one Jacobian pass: say it
        logger.info("kfac_stream: held-out fit: %s; MAP's own probabilities are kept unless "
                    "the posterior beats them by more than %g paired standard errors",
                    FIT_METHOD, GUARD_SE)
    else:
        logger.info("kfac_stream: held-out fit: one Jacobian pass over the eval set (a forward "
                    "and one backward per class or answer option), then the closed-form "
                    "%s links at %d candidate taus; MAP's own probabilities are kept unless "
                    "the posterior beats them by more than %g paired standard errors",
                    " and ".join(LINKS), len(GRID) + 1, GUARD_SE)
    try:
        post = LaplacePosterior(model, Snapshot.load(path, show_progress=False),
                                prior_precision=1.0)
        batches = ({k: v.to(device) for k, v in b.items() if torch.is_tensor(v)}
                   for b in trainer.get_eval_dataloader())
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
