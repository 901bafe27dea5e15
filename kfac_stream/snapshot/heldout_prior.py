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


@dataclass(frozen=True)
class HeldoutPrior:
    """A prior precision fitted on held-out data.

    Attributes:
        tau: The candidate with the lowest held-out NLL.
        nll: Its mean NLL per example (nats; per label token for a seq2seq model's per-token
            fit, ``link`` ``"mc"``: `kfac_stream.query.heldout_tau`).
        marglik_tau: The marginal likelihood's ``τ`` (a candidate too), for comparison.
        marglik_nll: The held-out NLL at ``marglik_tau``.
        examples: Held-out examples used (label tokens for that per-token fit).
        link: The K-way link of the predictive probabilities.
        grid: Every candidate ``τ``, ascending; ``grid_nll`` their NLLs.
    """

    tau: float
    nll: float
    marglik_tau: float
    marglik_nll: float
    examples: int
    link: str
    grid: tuple[float, ...]
    grid_nll: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


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
        return HeldoutPrior(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    except (OSError, ValueError, TypeError):
        return None
