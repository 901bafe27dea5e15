"""Which prior precision ``τ`` and which K-way link a posterior uses when the caller does not
say (``LaplacePosterior(model, snap)``, ``kfac-stream query`` without ``--prior-precision``),
and where they came from.

``prior_precision="auto"`` (the default):

1. the held-out choice stored beside the snapshot (``snap.heldout_prior``: ``τ`` and link
   fitted on the Trainer's eval set at the end of training under the guard,
   `kfac_stream.query.heldout_tau.fit_prior_precision`) when there is one and it applies
   (the posterior over the snapshot's layers with its own ``N``: a fit made for those); when
   the guard kept MAP the link is ``"map"`` (MAP's own probabilities) and ``τ`` the fit's;
2. otherwise the rule for runs without held-out data (`NO_HELDOUT_TAU`, `NO_HELDOUT_LINK`):
   the field's pre-registered default, laplace-torch's (marginal-likelihood ``τ``, probit
   link), not tuned on this library's suite (the mean-field link it replaces was
   the suite's pick and its worst case was 1.59 × laplace-torch's NLL).

``"heldout"`` insists on 1 (an error when none is stored); ``"marglik"`` and a number skip it.
``link=None`` takes the link of the same source (the stored one for the held-out choice,
`NO_HELDOUT_LINK` otherwise); a link given by name is used as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..exceptions import QueryInputError
from ..snapshot.heldout_prior import HeldoutPrior

#: The ``τ`` rule without held-out data: the Laplace marginal likelihood (the field's default,
#: laplace-torch's ``optimize_prior_precision(method="marglik")``).
NO_HELDOUT_TAU = "marglik"
#: The link without held-out data: the probit, laplace-torch's default ``link_approx``, chosen
#: because it is the field's pre-registered default, not by this library's suite (no rule
#: without held-out data met the bar on every suite task: docs/queries.md).
NO_HELDOUT_LINK = "probit"

#: The words ``prior_precision`` may be, besides a number or a per-layer dict.
PRIOR_WORDS = ("auto", "heldout", "marglik")


@dataclass(frozen=True)
class PriorChoice:
    """What a posterior starts with.

    Attributes:
        tau: A float, a per-layer dict, or ``"marglik"`` (maximise the marginal likelihood).
        link: The default link of ``predictive_probs`` and every probability query.
        source: Where ``τ`` came from, in words (``"held-out fit"``, ``"marginal
            likelihood"``, ``"given"``) with what it rests on.
        link_source: Where the link came from, in words.
        heldout: The stored held-out fit that was used, or None.
    """

    tau: Any
    link: str
    source: str
    link_source: str
    heldout: HeldoutPrior | None


def resolve_prior(where: str, prior_precision: Any, link: str | None,
                  heldout: HeldoutPrior | None, applies: bool, links: tuple[str, ...]
                  ) -> PriorChoice:
    """The `PriorChoice` for a posterior's arguments.

    Args:
        where: The caller, for errors.
        prior_precision: ``"auto"``, ``"heldout"``, ``"marglik"``, a number or a dict (checked
            by the caller).
        link: None or one of ``links``.
        heldout: The snapshot's stored held-out fit, or None.
        applies: Whether that fit applies to this posterior (its layers and ``N`` are the
            snapshot's own).
        links: The allowed link names.
    """
    if link is not None and link not in links:
        raise QueryInputError(f"{where}: link={link!r} is not allowed: one of {links}, or None "
                              "(the held-out fit's link when one is stored, else "
                              f"{NO_HELDOUT_LINK!r})")
    fit = heldout if applies and heldout is not None and heldout.probs_link in links else None
    if prior_precision == "heldout" and fit is None:
        why = ("no held-out fit is stored beside this snapshot (train with an eval_dataset, "
               "HeldoutConfig(prior_precision='auto'), or fit one with "
               "kfac_stream.fit_prior_precision)" if heldout is None else
               "the stored held-out fit was made for the snapshot's own layers and N, not "
               "for the layers or num_data asked for here")
        raise QueryInputError(f"{where}: prior_precision='heldout': {why}")
    if prior_precision in ("auto", "heldout") and fit is not None:
        where_from = f"held-out fit on {fit.examples} eval examples"
        return PriorChoice(fit.tau, link or fit.probs_link, where_from,
                           where_from if link is None else "given", fit)
    if prior_precision == "auto":
        return PriorChoice(NO_HELDOUT_TAU, link or NO_HELDOUT_LINK,
                           "marginal likelihood (no held-out fit stored: the rule without "
                           "held-out data)", "the rule without held-out data" if link is None
                           else "given", None)
    source = "marginal likelihood" if prior_precision == "marglik" else "given"
    return PriorChoice(prior_precision, link or NO_HELDOUT_LINK, source,
                       "the default link" if link is None else "given", None)
