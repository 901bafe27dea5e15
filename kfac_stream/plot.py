"""PNG of a snapshot's eigenvalue spectra (needs matplotlib: ``pip install kfac_stream[plot]``)."""

from __future__ import annotations

import os

from .snapshot.snapshot import Snapshot


def plot_spectra(snap: Snapshot, path: str) -> str:
    """Sorted eigenvalues of every A and G factor on log axes, one panel per factor kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("plotting needs matplotlib: pip install 'kfac_stream[plot]'") from e
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, f in zip(axes, ("A", "G")):
        for name in snap.layer_names:
            ev = getattr(snap[name], f"{f}_eigvals").double().flip(0)
            ev = ev[ev > 0]
            if ev.numel():
                ax.loglog(range(1, ev.numel() + 1), ev.numpy(), lw=1, label=name)
        ax.set_title(f"{f} factors (step {snap.step})")
        ax.set_xlabel("rank")
        ax.set_ylabel("eigenvalue")
        ax.grid(True, which="both", alpha=0.3)
    if len(snap.layer_names) <= 12:
        axes[1].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"  # written whole, then renamed: never a torn PNG
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path
