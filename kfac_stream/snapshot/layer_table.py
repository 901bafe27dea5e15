"""The plain-text per-layer table of a snapshot (``kfac-stream inspect``, the app's report)."""

from __future__ import annotations

from ..stats.spectrum import spectrum_stats
from ..utils.factor_keys import FACTOR_KINDS
from .snapshot import Snapshot


def layer_table(snap: Snapshot) -> str:
    """One line per layer and factor: shape, positions, largest eigenvalue, trace, cond, erank
    (from the snapshot's eigenvalues). The layer column is as wide as the longest name: names
    are printed whole (a LoRA adapter's differ only at their ends)."""
    w = max([len("layer"), *map(len, snap.layer_names)])
    head = (f"{'layer':<{w}} {'f':1} {'shape':>11} {'positions':>9} {'λ_max':>10} "
            f"{'trace':>10} {'cond':>9} {'erank':>7}")
    m = snap.manifest
    lines = [f"snapshot {snap.path} (step {snap.step}, {m.fisher} Fisher, "
             f"tokens seen {m.counts.tokens_seen})", head, "-" * len(head)]
    for name in snap.layer_names:
        lf = snap[name]
        for f in FACTOR_KINDS:
            t = getattr(lf, f)
            st = spectrum_stats(getattr(lf, f"{f}_eigvals"))
            shape = "x".join(map(str, t.shape)) + ("(diag)" if t.dim() == 1 else "")
            lines.append(f"{name:<{w}} {f} {shape:>11} {getattr(lf.entry, f).positions:>9d} "
                         f"{st['max']:>10.3e} {st['trace']:>10.3e} {st['cond']:>9.2e} "
                         f"{st['eff_rank']:>7.1f}")
    return "\n".join(lines)
