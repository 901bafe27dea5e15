"""When a snapshot eigendecomposes its factors: the ``KFACConfig.eigendecompose`` rule.

A periodic snapshot always holds the exact factors and estimated spectra
(`kfac_stream.stats.lanczos`); its eigendecomposition is deferred to its first use
(`kfac_stream.snapshot.eigen_sidecar`) unless the rule decomposes it in the run:

==========  ===================================================================================
``"auto"``  in-run when the predicted GPU (or CPU) share is at most `IN_RUN_SHARE`: the
            eigendecomposition's seconds on the busiest rank ÷ (``snapshot_every`` × the step
            time), the step time measured by the tracker. The final snapshot always.
``"always"`` every snapshot in the run (as before this rule; EK-FAC runs need it: each
            snapshot's eigenbasis is the next correction's basis).
``"final"`` only the final snapshot.
==========  ===================================================================================

The eigendecomposition's seconds are predicted from the factor sides, ``c · Σ d³``, with ``c``
measured: the first snapshot this run decomposes sets it (`EighRate.measured`); before that,
the figures below. A dense ``eigh`` costs ~``d³`` work for its tridiagonal reduction and the
back-transformation of the eigenvectors; diagonal factors cost nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

#: The largest predicted share of the run's time a periodic snapshot's eigendecomposition may
#: take under ``"auto"``.
IN_RUN_SHARE = 0.01
#: Seconds per ``d³`` of a float32 ``eigh`` on a GPU: the final snapshot of the ~1.1B Llama on an
#: H200 took 18.5 s of eigendecompositions (benchmarks/results/snapshot_gpu.json,
#: ``tracked.final.eigh_s``) for 242 factors with Σ d³ = 1.29e13 (22 layers × (6 × 2048³ +
#: 3 × 5632³ + 2 × 256³)).
GPU_SECONDS_PER_D3 = 18.5 / 1.29e13
#: Thread-seconds per ``d³`` of a float64 LAPACK ``eigh`` on the CPU: the mid-size Llama's 44
#: factors (Σ d³ = 3.0e11) took 33 s on 2 threads (benchmarks/results/snapshot_scale.json,
#: ``median.eigh_s``).
CPU_THREAD_SECONDS_PER_D3 = 33.0 * 2 / 3.0e11
#: A GPU eigh's fixed cost (launches, the host copy): small factors are not free.
GPU_SECONDS_PER_FACTOR = 2e-3
#: A CPU eigh's fixed cost (the float64 copy, symmetrising, the thread switch): 7 ms per factor
#: measured on the 2-core CPU for the 22 factors of side 64-256 of benchmarks/
#: snapshot_periodic.py --quick.
CPU_SECONDS_PER_FACTOR = 5e-3
#: Single float32 eighs timed on the H200 (benchmarks/scale.py ``EIGH_MEASURED``): ``{side:
#: seconds}``. The prior takes, per factor, the larger of ``c · d³`` and the power law through
#: these two (side 4096: 2.5x the ``c · d³`` figure): a rule that must not slow training
#: errs towards deferring.
GPU_SINGLE_EIGH = {4096: 0.231, 11008: 1.599}
POLICIES = ("auto", "always", "final")


class EighRate:
    """Seconds per ``d³`` of this run's eigendecompositions: the figures above until a snapshot
    is decomposed, then what it measured (`measured`)."""

    def __init__(self, device: torch.device | None, threads: int | None = None) -> None:
        self.on_gpu = device is not None and torch.device(device).type == "cuda"
        self.per_d3 = GPU_SECONDS_PER_D3 if self.on_gpu else \
            CPU_THREAD_SECONDS_PER_D3 / max(1, threads or torch.get_num_threads())
        self.fixed = GPU_SECONDS_PER_FACTOR if self.on_gpu else CPU_SECONDS_PER_FACTOR
        self.source = "prior"  # "prior": the figures above; "measured": this run's

    def seconds(self, sides: Iterable[int]) -> float:
        """Predicted seconds to decompose dense factors of these ``sides``."""
        sides = list(sides)
        if self.on_gpu and self.source == "prior":
            return sum(max(self.per_d3 * float(d) ** 3 + self.fixed, single_eigh_seconds(d))
                       for d in sides)
        return self.per_d3 * sum(float(d) ** 3 for d in sides) + self.fixed * len(sides)

    def measured(self, sides: Iterable[int], seconds: float) -> None:
        """A decomposition of ``sides`` took ``seconds``: use its rate from now on."""
        sides = list(sides)
        work = sum(float(d) ** 3 for d in sides)
        fixed = self.fixed * len(sides)
        if work > 0 and seconds > fixed:
            self.per_d3, self.source = (seconds - fixed) / work, "measured"


def single_eigh_seconds(d: int) -> float:
    """One float32 GPU eigh of side ``d``: the power law through `GPU_SINGLE_EIGH`."""
    (d1, t1), (d2, t2) = sorted(GPU_SINGLE_EIGH.items())
    return t1 * (d / d1) ** (math.log(t2 / t1) / math.log(d2 / d1))


@dataclasses.dataclass(frozen=True)
class EigenDecision:
    """Whether a snapshot eigendecomposes in the run, and why (the manifest's ``eigen``).

    ``share``: predicted eigendecomposition seconds ÷ the interval's seconds (None when not
    predicted: ``"always"``/``"final"``, or the step time unknown)."""

    decompose: bool
    policy: str
    final: bool
    share: float | None = None
    eigh_seconds: float | None = None
    interval_seconds: float | None = None
    rate: str | None = None

    @property
    def reason(self) -> str:
        """One line: why."""
        if self.final:
            return "the final snapshot is always decomposed"
        if self.policy != "auto":
            return f"eigendecompose={self.policy!r}"
        if self.share is None:
            return "the step time is not known yet: deferred to the snapshot's first use"
        verdict = "at most" if self.decompose else "above"
        return (f"predicted share {self.share:.3%} ({self.eigh_seconds:.3g} s of "
                f"eigendecomposition over a {self.interval_seconds:.3g} s interval, "
                f"{self.rate} rate) is {verdict} {IN_RUN_SHARE:.0%}")

    def to_json(self) -> dict[str, Any]:
        return {"in_run": self.decompose, "policy": self.policy, "final": self.final,
                "share": self.share, "reason": self.reason}


def decide(policy: str, final: bool, eigh_seconds: float | None = None,
           step_seconds: float = 0.0, snapshot_every: int = 1,
           rate: str | None = None) -> EigenDecision:
    """The rule (module docstring) for one snapshot. ``eigh_seconds``: predicted on the
    busiest rank (`EighRate.seconds`); ``step_seconds``: the measured step time (0: unknown)."""
    if policy not in POLICIES:
        raise ValueError(f"eigendecompose={policy!r}: expected one of {POLICIES}")
    if final or policy != "auto":
        return EigenDecision(final or policy == "always", policy, final)
    if eigh_seconds is None or step_seconds <= 0:
        return EigenDecision(False, policy, final)
    interval = snapshot_every * step_seconds
    share = eigh_seconds / interval
    return EigenDecision(share <= IN_RUN_SHARE, policy, final, share=share,
                         eigh_seconds=eigh_seconds, interval_seconds=interval, rate=rate)


def dense_sides(dims: dict[str, tuple[int, bool]], keys: Iterable[str]) -> list[int]:
    """The sides of the dense factors among ``keys`` (``dims``: ``{key: (side, diagonal)}``)."""
    return [dims[k][0] for k in keys if not dims[k][1]]
