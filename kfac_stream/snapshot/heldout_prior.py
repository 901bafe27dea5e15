"""A prior precision fitted on held-out data, stored beside its snapshot (the fitting is
`kfac_stream.query.heldout_tau.fit_prior_precision`): ``step-XXXXXXXX.heldout_prior.json``
next to the snapshot directory ``step-XXXXXXXX``, written atomically after the snapshot, read
by `Snapshot.heldout_prior`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from ..utils.files import fsync_path

#: Beside a snapshot directory ``step-XXXXXXXX``: ``step-XXXXXXXX.heldout_prior.json``.
SIDECAR = ".heldout_prior.json"


#: A fitted ``τ`` this close (relative) to the grid's largest is "at the top of the grid":
#: the posterior's probabilities equal MAP's there (`HeldoutPrior.at_map`).
TOP_OF_GRID = 1e-9

#: The link name of MAP's own probabilities, ``softmax`` of the trained logits
#: (`kfac_stream.query.calibration.probs_from_gaussian`'s ``"map"``): the default link of a
#: posterior whose stored held-out fit kept MAP (`HeldoutPrior.probs_link`).
MAP_LINK = "map"

#: The guard, in paired standard errors (`kfac_stream.query.heldout_tau`'s module docstring;
#: the verdict also words a loss larger than this as a loss): a link other than the probit,
#: and the posterior instead of MAP's own probabilities, are chosen only when their mean eval
#: NLL beats the alternative's by more than this many paired standard errors of the
#: per-example differences. Fixed before the suite that judges it: a gain of about
#: one standard error (``ft-encoder`` seed 0: 0.016 nats on 240 examples) chose a posterior
#: that lost 1.4% on test.
GUARD_SE = 2.0


@dataclass(frozen=True)
class HeldoutPrior:
    """A prior precision and link fitted on held-out data.

    Attributes:
        tau: The ``τ`` of the candidate (``τ``, link) with the lowest held-out NLL.
        nll: Its mean NLL per example (nats; per label token for a seq2seq model's per-token
            fit, ``link`` ``"mc"``: `kfac_stream.query.heldout_tau`).
        marglik_tau: The marginal likelihood's ``τ`` (a candidate too), for comparison.
        marglik_nll: The held-out NLL at ``marglik_tau`` with the chosen link.
        examples: Held-out examples used (label tokens for that per-token fit).
        link: The chosen K-way link of the predictive probabilities.
        grid: Every candidate ``τ``, ascending; ``grid_nll`` their NLLs with the chosen link.
        map_nll: MAP's own held-out NLL (``softmax`` of the trained logits), nats; None for
            the per-token fit.
        map_accuracy: MAP's held-out accuracy; None for the per-token fit.
        map_confidence: MAP's mean top probability on the held-out set; None likewise.
        link_nll: ``{link: NLL per grid value}`` for every candidate link.
        seconds: Wall time of the fit (the Jacobian pass and the grid), seconds.
        map_kept: The guard's verdict (`GUARD_SE`): True when
            the posterior (``tau``, ``link``) did not beat MAP's own probabilities on the eval
            set by more than 2 paired standard errors, so the default probabilities are MAP's
            (`probs_link` ``"map"``; ``tau`` still sets the variances). False in files
            written before the guard (their ``tau`` and ``link`` are used as they are).
        map_gain: The posterior's eval gain over MAP, ``mean_i(NLL_MAP,i − NLL_post,i)``
            (nats; > 0: the posterior is better); None before the guard.
        map_gain_se: Its paired standard error, ``sd_i(NLL_MAP,i − NLL_post,i) / sqrt(n)``
            (sample sd, ``n − 1``); None before the guard.
        link_gain: ``{link: (gain, paired s.e.)}`` of every other candidate link's best over
            the base link's best (probit's, when it is a candidate), as ``map_gain``; a link
            replaces probit only with a gain beyond 2 s.e. None before the guard or with one
            candidate link.
    """

    tau: float
    nll: float
    marglik_tau: float
    marglik_nll: float
    examples: int
    link: str
    grid: tuple[float, ...]
    grid_nll: tuple[float, ...]
    map_nll: float | None = None
    map_accuracy: float | None = None
    map_confidence: float | None = None
    link_nll: dict[str, tuple[float, ...]] | None = None
    seconds: float | None = None
    map_kept: bool = False
    map_gain: float | None = None
    map_gain_se: float | None = None
    link_gain: dict[str, tuple[float, float]] | None = None

    @property
    def at_map(self) -> bool:
        """The default probabilities are MAP's: the guard kept them (`map_kept`), or ``τ`` is
        at the top of its grid (a fit from before the guard); the variances still rank
        examples and flag out-of-distribution inputs."""
        return self.map_kept or self.tau >= max(self.grid) * (1.0 - TOP_OF_GRID)

    @property
    def probs_link(self) -> str:
        """The default link of a posterior that uses this fit: `MAP_LINK` (MAP's own
        probabilities) when the guard kept MAP, else ``link``."""
        return MAP_LINK if self.map_kept else self.link

    @property
    def map_gap(self) -> float | None:
        """MAP's held-out mean confidence minus its accuracy (> 0: overconfident)."""
        if self.map_confidence is None or self.map_accuracy is None:
            return None
        return self.map_confidence - self.map_accuracy

    def verdict(self) -> str:
        """One line: what the fit chose, the held-out NLL of MAP and of the chosen posterior,
        MAP's confidence gap, and what the posterior is good for here; with the guard
        (`map_gain` set), which way it went and why, in paired standard errors."""
        if self.map_gain is not None:
            return self._guarded_verdict()
        unit = "examples" if self.map_nll is not None else "label tokens"
        head = (f"held-out fit on {self.examples} eval {unit}: tau {self.tau:.4g}, "
                f"{self.link} link")
        if self.map_nll is None:
            return f"{head}: NLL {self.nll:.4f} per label token (MAP's not measured)"
        gap = self.map_gap
        line = (f"{head}: eval NLL {self.nll:.4f} vs MAP's {self.map_nll:.4f}; MAP "
                f"{'over' if gap > 0 else 'under'}confident by {abs(gap):.3f} (confidence "
                f"{self.map_confidence:.3f}, accuracy {self.map_accuracy:.3f})")
        if self.at_map:
            return (line + "; Laplace = MAP here (tau at the top of its grid): use its "
                    "variances for ranking and out-of-distribution scores; its probabilities "
                    "equal MAP's")
        return line

    def _guarded_verdict(self) -> str:
        """`verdict` of a guarded fit: e.g. ``held-out fit on 240 eval examples: kept MAP's
        probabilities: the posterior's eval gain 0.016 ± 0.015 nats (tau 10, probit link) is
        within noise (2 paired s.e.); its variances still rank and flag out-of-distribution
        inputs; eval NLL …``."""
        per_token = self.link == "mc"
        unit = "label tokens" if per_token else "examples"
        gain = f"{self.map_gain:.3g} ± {self.map_gain_se:.2g} nats"
        post = f"tau {self.tau:.4g}, " + ("the linearised predictive by Monte Carlo" if per_token
                                          else f"{self.link} link")
        if self.map_kept:
            how = ("is within noise (2 paired s.e.)" if self.map_gain > -GUARD_SE
                   * self.map_gain_se else "is a loss beyond noise: worse than MAP")
            head = (f"kept MAP's probabilities: the posterior's eval gain {gain} ({post}) "
                    f"{how}; its variances still rank and flag out-of-distribution inputs")
        else:
            head = (f"the posterior's probabilities ({post}): its eval gain over MAP {gain} "
                    "is beyond noise (more than 2 paired s.e.)")
        line = f"held-out fit on {self.examples} eval {unit}: {head}"
        if per_token:
            line += (f"; eval NLL {self.nll:.4f} vs MAP's {self.map_nll:.4f} per label token "
                     "(the guard per label token)")
        else:
            gap = self.map_gap
            line += (f"; eval NLL {self.nll:.4f} vs MAP's {self.map_nll:.4f}; MAP "
                     f"{'over' if gap > 0 else 'under'}confident by {abs(gap):.3f} "
                     f"(confidence {self.map_confidence:.3f}, accuracy "
                     f"{self.map_accuracy:.3f})")
        for other, (g, se) in (self.link_gain or {}).items():
            beyond = other == self.link
            line += (f"; {other} link {'chosen' if beyond else 'not chosen'}: its gain "
                     f"{g:.3g} ± {se:.2g} nats over the probit link's is "
                     f"{'beyond' if beyond else 'within'} noise")
        return line

    def to_dict(self) -> dict[str, Any]:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        for key in ("link_nll", "link_gain"):
            if d.get(key) is not None:
                d[key] = {k: list(v) for k, v in d[key].items()}
        return d


def write_heldout_prior(snapshot_path: str, prior: HeldoutPrior) -> str:
    """Store ``prior`` beside the snapshot (`SIDECAR`), atomically; returns the file."""
    path = os.path.normpath(snapshot_path) + SIDECAR
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(prior.to_dict(), f, indent=1)
    fsync_path(tmp)
    os.replace(tmp, path)
    return path


def read_heldout_prior(snapshot_path: str) -> HeldoutPrior | None:
    """The `HeldoutPrior` stored beside a snapshot, or None (none stored, or unreadable)."""
    path = os.path.normpath(snapshot_path) + SIDECAR
    try:
        with open(path) as f:
            d = json.load(f)
        for key in ("link_nll", "link_gain"):  # link_gain: absent from files before the guard
            if isinstance(d.get(key), dict):
                d[key] = {k: tuple(v) for k, v in d[key].items()}
        return HeldoutPrior(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    except (OSError, ValueError, TypeError):
        return None
