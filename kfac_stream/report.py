"""Plain-text per-layer tables of a snapshot (used by the CLI and the demo)."""

from __future__ import annotations

import torch

from .snapshot.snapshot import Snapshot


def spectrum_stats(factor: torch.Tensor) -> dict[str, float]:
    """Largest eigenvalue, trace, condition number and effective rank of a PSD factor.

    Args:
        factor: ``[d, d]`` dense or ``[d]`` diagonal.
    """
    ev = factor if factor.dim() == 1 else torch.linalg.eigvalsh(factor.double())
    ev = ev.double().clamp(min=0.0)
    top = float(ev.max())
    pos = ev[ev > top * 1e-12] if top > 0 else ev
    p = ev / ev.sum() if float(ev.sum()) > 0 else ev
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    return {"max": top, "trace": float(ev.sum()),
            "cond": top / float(pos.min()) if top > 0 else float("nan"),
            "eff_rank": float(entropy.exp())}


def layer_table(snap: Snapshot) -> str:
    """One line per layer and factor: shape, positions, largest eigenvalue, trace, cond, erank."""
    head = (f"{'layer':<40} {'f':1} {'shape':>11} {'positions':>9} {'λ_max':>10} "
            f"{'trace':>10} {'cond':>9} {'erank':>7}")
    lines = [f"snapshot {snap.path} (step {snap.step}, {snap.meta['fisher']} Fisher, "
             f"tokens seen {snap.meta['counts']['tokens_seen']})", head, "-" * len(head)]
    for name in snap.layer_names:
        lf = snap[name]
        for f in ("A", "G"):
            t = getattr(lf, f)
            st = spectrum_stats(t)
            shape = "x".join(map(str, t.shape)) + ("(diag)" if t.dim() == 1 else "")
            lines.append(f"{name[-40:]:<40} {f} {shape:>11} {lf.meta[f]['positions']:>9d} "
                         f"{st['max']:>10.3e} {st['trace']:>10.3e} {st['cond']:>9.2e} "
                         f"{st['eff_rank']:>7.1f}")
    return "\n".join(lines)
