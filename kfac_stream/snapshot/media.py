"""Spectra media of a finished snapshot: log10-eigenvalue histograms and the PNG plot.

Made on the snapshot thread of rank 0 right after the snapshot is written (it reads the whole
snapshot back), so that monitoring (`kfac_stream.integrations.spectrum_monitor`) only reads the manifest on the
training thread.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..stats.spectrum import log10_histogram
from .snapshot import Snapshot

logger = logging.getLogger("kfac_stream")


def log10_histograms(snap: Snapshot, bins: int = 32
                     ) -> dict[str, tuple[list[int], list[float]]]:
    """``{"<layer>/<A|G>": (counts [bins], edges [bins + 1])}`` of log10 of the positive
    eigenvalues; factors without a positive eigenvalue are left out."""
    out = {}
    for name in snap.layer_names:
        for f in ("A", "G"):
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
        from ..plot import plot_spectra

        png = plot_spectra(snap, spectra_png_path(path))
    except ImportError as e:  # matplotlib is an optional extra
        logger.info("kfac_stream: no spectra PNG (%s)", e)
    return {"histograms": log10_histograms(snap, bins), "png": png}
