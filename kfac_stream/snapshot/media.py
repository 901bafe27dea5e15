"""Spectra media of a finished snapshot: log10-eigenvalue histograms and the PNG plot (the
plot needs matplotlib: ``pip install kfac_stream[plot]``).

Made on the snapshot thread of rank 0 right after the snapshot is written (it reads the whole
snapshot back), so that monitoring (`kfac_stream.integrations.spectrum_monitor`) only reads
the manifest on the training thread.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..factor_keys import FACTOR_KINDS
from ..stats.spectrum import log10_histogram
from .snapshot import Snapshot

logger = logging.getLogger("kfac_stream")


def log10_histograms(snap: Snapshot, bins: int = 32
                     ) -> dict[str, tuple[list[int], list[float]]]:
    """``{"<layer>/<A|G>": (counts [bins], edges [bins + 1])}`` of log10 of the positive
    eigenvalues; factors without a positive eigenvalue are left out."""
    out = {}
    for name in snap.layer_names:
        for f in FACTOR_KINDS:
            hist = log10_histogram(getattr(snap[name], f"{f}_eigvals"), bins)
            if hist is not None:
                out[f"{name}/{f}"] = hist
    return out


def spectra_png_path(snapshot_path: str) -> str:
    """``<snapshot dir>.spectra.png`` (beside the directory, not inside the verified set)."""
    return snapshot_path.rstrip("/" + os.sep) + ".spectra.png"


def make_media(path: str, bins: int = 32) -> dict[str, Any]:
    """``{"histograms": ..., "png": path or None}`` for the snapshot at ``path``."""
    snap = Snapshot.load(path)
    png = None
    try:
        png = plot_spectra(snap, spectra_png_path(path))
    except ImportError as e:  # matplotlib is an optional extra
        logger.info("kfac_stream: no spectra PNG (%s)", e)
    return {"histograms": log10_histograms(snap, bins), "png": png}


def plot_spectra(snap: Snapshot, path: str) -> str:
    """Sorted eigenvalues of every A and G factor on log axes, one panel per factor kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("plotting needs matplotlib: pip install 'kfac_stream[plot]'") from e
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, f in zip(axes, FACTOR_KINDS):
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
