"""A prior precision fitted on held-out data, stored beside its snapshot (the fitting is
`kfac_stream.query.heldout_tau.fit_prior_precision`): ``step-XXXXXXXX.heldout_prior.json``
next to the snapshot directory ``step-XXXXXXXX``, written atomically after the snapshot, read
by `Snapshot.heldout_prior`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from ..files import fsync_path

#: Beside a snapshot directory ``step-XXXXXXXX``: ``step-XXXXXXXX.heldout_prior.json``.
SIDECAR = ".heldout_prior.json"


#: A fitted ``τ`` this close (relative) to the grid's largest is "at the top of the grid":
#: the posterior's probabilities equal MAP's there (`HeldoutPrior.at_map`).
TOP_OF_GRID = 1e-9


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

    @property
    def at_map(self) -> bool:
        """``τ`` at the top of its grid: the posterior's probabilities equal MAP's there (its
        variances still rank examples and flag out-of-distribution inputs)."""
        return self.tau >= max(self.grid) * (1.0 - TOP_OF_GRID)

    @property
    def map_gap(self) -> float | None:
        """MAP's held-out mean confidence minus its accuracy (> 0: overconfident)."""
        if self.map_confidence is None or self.map_accuracy is None:
            return None
        return self.map_confidence - self.map_accuracy

    def verdict(self) -> str:
        """One line: what the fit chose, the held-out NLL of MAP and of the chosen posterior,
        MAP's confidence gap, and what the posterior is good for here."""
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

    def to_dict(self) -> dict[str, Any]:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if self.link_nll is not None:
            d["link_nll"] = {k: list(v) for k, v in self.link_nll.items()}
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
        if isinstance(d.get("link_nll"), dict):
            d["link_nll"] = {k: tuple(v) for k, v in d["link_nll"].items()}
        return HeldoutPrior(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    except (OSError, ValueError, TypeError):
        return None
