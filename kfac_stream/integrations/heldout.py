"""``KFACConfig.eval_prior_precision``: the prior precision fitted on the Trainer's
``eval_dataset`` at the final snapshot, stored beside it (`kfac_stream.query.heldout_tau`).

A classification head's eval set gives one label per example; a seq2seq model's (T5, BART) its
targets ``labels [B, T']``, from which the decoder inputs are made as in training, and the NLL
is taken per label token (`kfac_stream.query.heldout_tau`, module docstring)."""

from __future__ import annotations

import logging

import torch
from transformers import Trainer

from ..exceptions import QueryInputError
from ..query.heldout_tau import GRID, TOKEN_SAMPLES, fit_prior_precision
from ..query.inputs import seq2seq_lm
from ..query.laplace import LaplacePosterior
from ..snapshot.heldout_prior import write_heldout_prior
from ..snapshot.snapshot import Snapshot
from .spectrum_monitor import find_on_stack

logger = logging.getLogger("kfac_stream")


def find_trainer(depth: int = 16) -> Trainer | None:
    """The `transformers.Trainer` whose callback event is running (a callback is not given
    it): the first ``self`` on the call stack that is one; None if there is none."""
    return find_on_stack(Trainer, depth)


def check_eval_set(tracker) -> None:
    """At train begin, on rank 0: one warning line when ``eval_prior_precision`` cannot run
    (no ``eval_dataset``), or an info line with several ranks (fitted after training by hand)."""
    if tracker.rank != 0:
        return
    if tracker.world_size > 1:
        logger.info("kfac_stream: eval_prior_precision runs in one process only; with %d ranks, "
                    "fit tau after training with kfac_stream.fit_prior_precision",
                    tracker.world_size)
        return
    trainer = find_trainer()
    if trainer is not None and trainer.eval_dataset is None:
        logger.warning("kfac_stream: eval_prior_precision=True but the Trainer has no "
                       "eval_dataset: no tau will be fitted and Snapshot.heldout_prior will be "
                       "None (pass eval_dataset=..., or call kfac_stream.fit_prior_precision "
                       "after training)")


def fit_heldout_prior(callback, model) -> str | None:
    """Fit ``τ`` on the running Trainer's eval set for the callback's last snapshot and write
    it beside the snapshot; returns the file, or None (logged why) when it cannot."""
    if callback.tracker.world_size > 1:  # said at train begin (`check_eval_set`)
        return None
    trainer = find_trainer()
    if trainer is None or trainer.eval_dataset is None:  # warned at train begin
        return None
    if not callback.snapshots:
        logger.warning("kfac_stream: eval_prior_precision: no snapshot was written; tau not "
                       "fitted")
        return None
    path = callback.snapshots[-1]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    seq2seq = seq2seq_lm(model)
    if seq2seq:  # its cost differs from the classifier's one Jacobian pass: say it
        logger.info("kfac_stream: eval_prior_precision on a seq2seq model: the held-out NLL per "
                    "label token of the linearised predictive, by Monte Carlo over %d draws for "
                    "each of %d candidate taus (about %d forwards per eval batch)",
                    TOKEN_SAMPLES, len(GRID) + 1, 2 * TOKEN_SAMPLES * (len(GRID) + 1))
    try:
        post = LaplacePosterior(model, Snapshot.load(path, show_progress=False))
        batches = ({k: v.to(device) for k, v in b.items() if torch.is_tensor(v)}
                   for b in trainer.get_eval_dataloader())
        prior = fit_prior_precision(post, batches)
    except Exception as e:  # an extra at the end of training never fails the run
        kind = "" if isinstance(e, QueryInputError) else f"{type(e).__name__}: "
        logger.warning("kfac_stream: eval_prior_precision: %s%s; tau not fitted", kind, e)
        return None
    finally:
        model.train(was_training)
    out = write_heldout_prior(path, prior)
    logger.info("kfac_stream: prior precision fitted on %d held-out %s: tau %.4g (NLL "
                "%.4f; marginal likelihood's tau %.4g: NLL %.4f) -> %s", prior.examples,
                "label tokens" if seq2seq and prior.link == "mc" else "examples",
                prior.tau, prior.nll, prior.marglik_tau, prior.marglik_nll, out)
    return out
