"""Spectra media of a finished snapshot: log10-eigenvalue histograms and the PNG plot (the
plot needs matplotlib: ``pip install kfac_stream[plot]``).

Made on the snapshot thread of rank 0 right after the snapshot is written, so that monitoring
(`kfac_stream.integrations.spectrum_monitor`) only reads the manifest on the training thread.
They need only the eigenvalues: the writer passes those it holds in memory (`make_media`'s
``eigvals``) and only the manifest is read back; without them (another process's factors,
``kfac-stream inspect``) the whole snapshot is loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..stats.spectrum import log10_histogram
from ..utils.factor_keys import FACTOR_KINDS
from .manifest import stored_key
from .snapshot import LayerView, Snapshot, read_manifest

logger = logging.getLogger("kfac_stream")


@dataclass(frozen=True)
class LayerSpectra:
    """One layer's eigenvalues (what the media read of a `LayerFactors`)."""

    A_eigvals: torch.Tensor | None
    G_eigvals: torch.Tensor | None


class Spectra(LayerView):
    """The eigenvalues of a snapshot's factors without the factors: ``layer_names``, ``step``
    and ``spectra[name].A_eigvals`` / ``.G_eigvals``, as a `Snapshot` has them (the media
    take any `LayerView`: a hand-built one too)."""

    @classmethod
    def from_memory(cls, path: str, eigvals: Mapping[str, torch.Tensor]) -> Spectra | None:
        """The spectra of the snapshot at ``path`` from its manifest (read and checked, no
        shard) and ``eigvals`` (``{stored key: [d] eigenvalues}``, the ``<key>.eigvals``
        tensors just written, by key without the suffix); None when ``eigvals`` lacks a
        factor of the snapshot (another rank's)."""
        manifest = read_manifest(path)
        layers = {}
        for name in manifest.layers:
            found = {}
            for f in FACTOR_KINDS:
                ev = eigvals.get(stored_key(manifest, name, f))
                if ev is None:
                    return None
                found[f"{f}_eigvals"] = ev.detach().cpu()
            layers[name] = LayerSpectra(**found)
        return cls(path, manifest.step, layers)


def log10_histograms(snap: LayerView, bins: int = 32
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


def make_media(path: str, bins: int = 32,
               eigvals: Mapping[str, torch.Tensor] | None = None,
               detached: bool = False) -> dict[str, Any]:
    """``{"histograms": ..., "png": path or None}`` for the snapshot at ``path``.

    ``eigvals``: ``{stored key: eigenvalues}`` of the snapshot's factors held in memory (the
    writer's ``<key>.eigvals`` tensors, keys without the suffix); then only the manifest is
    read. When it lacks a factor of the snapshot, or is None, the snapshot is loaded (and
    verified) from disk. Either way the same media.

    ``detached``: draw the PNG in a child process (`plot_spectra_detached`), as the callback's
    snapshot thread does when training on a GPU: drawing a 1.1B model's figure is ~4-6 s of
    Python holding the GIL, which the training thread needs to launch its kernels (it stalled
    steps by as much on an H200: docs/gpu.md). The child's start-up (importing torch and
    kfac_stream, ~2 s) is the price; CPU training draws in-process."""
    snap = Spectra.from_memory(path, eigvals) if eigvals is not None else None
    if snap is None:
        snap = Snapshot.load(path)
    png = None
    try:
        png = (plot_spectra_detached if detached else plot_spectra)(
            snap, spectra_png_path(path))
    except ImportError as e:  # matplotlib is an optional extra
        logger.info("kfac_stream: no spectra PNG (%s)", e)
    return {"histograms": log10_histograms(snap, bins), "png": png}


#: The longest a detached plot may take (seconds).
DETACHED_PLOT_TIMEOUT = 300


def plot_spectra_detached(snap: LayerView, path: str) -> str:
    """`plot_spectra` in a child Python process (``python -m kfac_stream.snapshot.media``):
    the eigenvalues go to it in a temporary safetensors file beside ``path``; this thread only
    waits (without the GIL). Raises ImportError where the child lacks matplotlib, RuntimeError
    if it fails otherwise."""
    from safetensors.torch import save_file

    tensors, names = {}, depth_order(snap.layer_names)
    for name in names:
        for f in FACTOR_KINDS:
            ev = getattr(snap[name], f"{f}_eigvals")
            if ev is not None:  # a copy each: layers that share an A share its tensor
                tensors[f"{name}/{f}"] = ev.detach().to("cpu", torch.float32).clone()
    root, _ = os.path.splitext(path)
    tmp = f"{root}.eigvals-{os.getpid()}.safetensors"
    save_file(tensors, tmp, metadata={"step": str(snap.step), "layers": json.dumps(names)})
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, tmp, path],
                              capture_output=True, text=True, timeout=DETACHED_PLOT_TIMEOUT)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    if proc.returncode == _NO_MATPLOTLIB:
        raise ImportError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "matplotlib")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"the spectra plot's process exited with {proc.returncode}: "
                           + " | ".join(tail))
    return path


_NO_MATPLOTLIB = 3  # the child's exit status without matplotlib


def _plot_from_file(eigvals_file: str, png: str) -> int:
    """The child of `plot_spectra_detached`."""
    from safetensors import safe_open

    with safe_open(eigvals_file, "pt") as fh:
        header = fh.metadata()
        names = json.loads(header["layers"])
        keys = set(fh.keys())
        layers = {n: LayerSpectra(*(fh.get_tensor(f"{n}/{f}") if f"{n}/{f}" in keys else None
                                    for f in FACTOR_KINDS)) for n in names}
    try:
        plot_spectra(Spectra(eigvals_file, int(header["step"]), layers), png)
    except ImportError as e:
        print(e, file=sys.stderr)
        return _NO_MATPLOTLIB
    return 0


#: Up to this many layers each line gets a legend entry (on every panel); above it the colour
#: bar (layer index in `depth_order`, a few names) says which line is which.
LEGEND_MAX_LAYERS = 8
#: With more layers than the legend shows, one row of panels per layer type when the model has
#: between 2 and this many types (repeated blocks); else every layer on one row.
MAX_TYPE_ROWS = 8
#: The colour map of depth (layer index in `depth_order`); its last tenth (pale yellow) is
#: left out so that every line shows on white.
DEPTH_CMAP = "viridis"
PANEL_SIZE = (5.5, 3.2)  # inches per panel (width, height)
DPI = 120
#: Fixed margins of the panel grid (inches), instead of a layout engine (constrained layout
#: measured every axis's tick labels twice and drew the figure twice: over half the plot's
#: time): the suptitle and the first row's titles above, the log axes' tick labels
#: (``10^{-10}``) and axis labels left and below, the same between the columns, and between
#: the rows a row's x labels and the next row's titles.
MARGINS = {"top": 0.6, "bottom": 0.5, "left": 0.7, "right": 0.2, "wspace": 0.75,
           "hspace": 0.75}
#: Extra room (inches) left of the y axis where a panel spans at most a decade: its minor
#: ticks are labelled too (``3x10^{-1}``), wider than the decades.
SHORT_AXIS_ROOM = 0.3
#: Room (inches) right of the panels for the colour bar besides its width and its tick labels
#: (measured): the gap before it (0.25), its ticks, and its axis label.
BAR_PAD = 0.7


#: The colour bar's label: what the layer index counts.
DEPTH_LABEL = "layer index (names in natural order: block 2 before block 10)"


def depth_order(layer_names: list[str]) -> list[str]:
    """``layer_names`` in natural order: sorted by name with every run of digits compared as a
    number, so block 2 comes before block 10 (``transformer.h.2.mlp`` < ``transformer.h.10.attn``)
    and the index grows with depth. A snapshot stores no module order (its manifest lists the
    layers sorted by name, where ``h.10`` sorts before ``h.2``); within a block the layers keep
    name order (``attn`` before ``mlp``), which need not be the order of the forward pass."""
    def key(name: str) -> list[tuple[int, int | str]]:
        return [(1, int(p)) if p.isdigit() else (0, p) for p in re.split(r"(\d+)", name)]

    return sorted(layer_names, key=key)


def layer_type(name: str) -> str:
    """A layer's type: the part of its module name after the last block index
    (``model.layers.3.self_attn.q_proj`` -> ``self_attn.q_proj``; ``transformer.h.0.mlp.c_proj``
    -> ``mlp.c_proj``); a name without an all-digit component is its own type."""
    parts = name.split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[digits[-1] + 1:]) if digits and digits[-1] + 1 < len(parts) else name


def spectra_layout(layer_names: list[str]) -> list[tuple[str, list[int]]]:
    """Rows of panels: ``[(row title, indices of its layers in ``layer_names``)]``.

    One row ("all layers") when the legend still names every line, or when the layers do not
    fall into 2..`MAX_TYPE_ROWS` rows; else one row per layer type (`layer_type`) in order of
    first appearance, the types of a single layer (a head, a classifier) together in a last
    row "other layers"."""
    every = [("all layers", list(range(len(layer_names))))]
    if len(layer_names) <= LEGEND_MAX_LAYERS:
        return every
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(layer_names):
        groups.setdefault(layer_type(name), []).append(i)
    rows = [(t, idx) for t, idx in groups.items() if len(idx) > 1]
    single = [idx[0] for idx in groups.values() if len(idx) == 1]
    if len(single) == 1:
        rows.append((layer_names[single[0]], single))
    elif single:
        rows.append(("other layers", single))
    return rows if 2 <= len(rows) <= MAX_TYPE_ROWS else every


def depth_colors(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` distinct RGBA colours of a sequential map, first layer darkest:
    `DEPTH_CMAP` from 0 to 0.9, interpolated (its 256 entries would repeat at 200 layers)."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LinearSegmentedColormap

    ramp = LinearSegmentedColormap.from_list(
        "depth", colormaps[DEPTH_CMAP](np.linspace(0.0, 0.9, 256)), N=max(256, 4 * n))
    return [tuple(float(v) for v in ramp(i / max(n - 1, 1))) for i in range(n)]


def spectra_figure(snap: LayerView):
    """The matplotlib ``Figure`` of `plot_spectra` (not saved; close it with
    ``matplotlib.pyplot.close(fig)``).

    Columns: the A and the G factors. Rows: `spectra_layout`. Each line is one layer's sorted
    eigenvalues (a diagonal factor: its sorted diagonal) against their rank, log-log, coloured
    by depth (layer index in `depth_order`, `depth_colors`); a legend names the lines when there
    are at most `LEGEND_MAX_LAYERS` layers, else a colour bar maps colour to layer index (ticks
    labelled with a few layer names), and every panel of at most that many lines has a legend
    too."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import BoundaryNorm, ListedColormap
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("plotting needs matplotlib: pip install 'kfac_stream[plot]'") from e
    names = depth_order(snap.layer_names)  # a snapshot lists its layers sorted by name
    n = len(names)
    rows = spectra_layout(names)
    colors = depth_colors(n)
    legend = n <= LEGEND_MAX_LAYERS
    lw, alpha = (1.4, 1.0) if n <= 16 else (0.9, 0.85) if n <= 64 else (0.7, 0.7)
    short_axes = False  # a panel spanning at most a decade (labelled minor ticks)
    fig, axes = plt.subplots(len(rows), 2, squeeze=False, dpi=DPI,
                             figsize=(2 * PANEL_SIZE[0], PANEL_SIZE[1] * len(rows) + 0.4))
    height = fig.get_figheight()
    fig.suptitle(f"K-FAC factor spectra, step {snap.step}, {n} layer{'s' * (n != 1)}"
                 + ("" if legend else ", colour = depth"), y=1 - 0.1 / height)
    for r, (title, idx) in enumerate(rows):
        for c, f in enumerate(FACTOR_KINDS):
            ax = axes[r, c]
            for i in idx:
                ev = getattr(snap[names[i]], f"{f}_eigvals")
                ev = ev.double().sort(descending=True).values if ev is not None else ev
                ev = ev[ev > 0] if ev is not None else ev
                if ev is not None and ev.numel():
                    if not ax.lines:  # as `loglog` does, once per panel rather than per line
                        ax.set_xscale("log")
                        ax.set_yscale("log")
                    ax.plot(range(1, ev.numel() + 1), ev.numpy(), lw=lw, alpha=alpha,
                            color=colors[i], label=short_name(names[i], 40))
            side = "input" if f == "A" else "output-gradient"
            what = title if len(rows) == 1 else f"{title} ({len(idx)} layer{'s' * (len(idx) != 1)})"
            # y given: no automatic placement (it measured every y axis's tick labels to keep
            # clear of ticks on top, which these panels do not have): the same place
            ax.set_title(f"{f} ({side}) factors: {what}", fontsize=9, y=1.0)
            ax.set_xlabel("rank", fontsize=8)
            ax.set_ylabel("eigenvalue", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
            if len(idx) <= LEGEND_MAX_LAYERS and ax.lines:  # few lines: name each one
                ax.legend(fontsize=6, loc="lower left")
            if not ax.lines:
                continue
            _minor_ticks_as_collections(ax.xaxis)  # unlabelled: no "2x10^0" on short axes
            low, high = ax.get_ylim()
            if math.log10(high / low) > 1:  # more than a decade: minor ticks go unlabelled
                _minor_ticks_as_collections(ax.yaxis)
            else:
                short_axes = True
    ticks = [] if legend else sorted({round(k * (n - 1) / 5) for k in range(6)})
    tick_labels = [f"{i}: {short_name(names[i])}" for i in ticks]
    bar_box = _place_panels(fig, len(rows), short_axes, tick_labels)
    if not legend:
        cmap = ListedColormap(colors)
        mappable = ScalarMappable(BoundaryNorm([i - 0.5 for i in range(n + 1)], n), cmap)
        bar = fig.colorbar(mappable, cax=fig.add_axes(bar_box))
        bar.set_ticks(ticks)
        bar.set_ticklabels(tick_labels, fontsize=6)
        bar.set_label(DEPTH_LABEL, fontsize=8)
        _minor_ticks_as_collections(bar.ax.yaxis)  # a mark between layers (241 at 1.1B)
        bar.minorticks_off()  # as the bar knows them, should it set its ticks again
    return fig


def _minor_ticks_as_collections(axis) -> None:
    """Draw the minor ticks of ``axis`` (unlabelled, its limits final) as one collection of
    tick marks per side and one of grid lines, in the style of the axis's own minor tick and
    at the places its locator gives, instead of a `Tick` of five artists each (~80 on a log
    axis of ten decades: made, and placed at every draw, they took half of a 24-layer figure's
    time). The image is the `Tick`s' to 1 level of 255 in matplotlib's default style but at
    the marks' tips: markers are put on whole pixels, these are not, so a tip may end half a
    pixel apart (with ticks inside the axes, also a few levels where grid lines cross marks:
    all grid lines are drawn before all marks)."""
    from matplotlib.collections import LineCollection
    from matplotlib.markers import MarkerStyle
    from matplotlib.ticker import NullLocator
    from matplotlib.transforms import Affine2D

    ax, across = axis.axes, axis.axis_name == "x"  # an x axis: its ticks cross it upright
    low, high = sorted(axis.get_view_interval())
    locs = [v for v in axis.get_minorticklocs() if low <= v <= high]
    proto = axis.get_minor_ticks(1)[0]  # the tick every minor tick copies its style from
    axis.set_minor_locator(NullLocator())
    if not locs:
        return

    def at(loc: float, side: float) -> tuple[float, float]:  # (data along, axes across)
        return (loc, side) if across else (side, loc)

    along = ax.get_xaxis_transform() if across else ax.get_yaxis_transform()
    zorder = axis.get_zorder() + 1e-3  # just after the axis, as its ticks would be
    grid = proto.gridline
    if grid.get_visible():
        ax.add_collection(LineCollection(
            [[at(v, 0), at(v, 1)] for v in locs], transform=along, colors=[grid.get_color()],
            linewidths=grid.get_linewidth(), linestyles=grid.get_linestyle(),
            alpha=grid.get_alpha(), zorder=zorder), autolim=False)
    points = Affine2D().scale(1 / 72) + ax.get_figure().dpi_scale_trans
    for mark, side in ((proto.tick1line, 0), (proto.tick2line, 1)):  # bottom/left, top/right
        if mark.get_visible():
            style = MarkerStyle(mark.get_marker())
            shape = style.get_path().transformed(
                Affine2D(style.get_transform().get_matrix()).scale(mark.get_markersize()))
            ax.add_collection(LineCollection(
                [shape.vertices], offsets=[at(v, side) for v in locs], offset_transform=along,
                transform=points, colors=[mark.get_markeredgecolor()],
                linewidths=mark.get_markeredgewidth(), zorder=zorder, clip_on=False),
                autolim=False)


def _place_panels(fig, rows: int, short_axes: bool, bar_tick_labels: list[str]
                  ) -> tuple[float, float, float, float]:
    """Set the margins of ``fig``'s grid of ``rows`` x 2 panels (`MARGINS`, more left of each
    column with ``short_axes``) and widen ``fig`` by the colour bar's room when there are
    ``bar_tick_labels`` (their width measured); returns the bar's (left, bottom, width,
    height) in figure fractions: as tall as the panel rows times 0.7 + 0.05 per row (at most
    all of it), centred on them, its width 1 / (20 + 15 per row) of its height."""
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties

    left = MARGINS["left"] + (SHORT_AXIS_ROOM if short_axes else 0.0)
    wspace = MARGINS["wspace"] + (SHORT_AXIS_ROOM if short_axes else 0.0)
    width, height = fig.get_size_inches()
    bottom, top = MARGINS["bottom"], height - MARGINS["top"]
    bar_h = min(1.0, 0.7 + 0.05 * rows) * (top - bottom)
    bar_w = bar_h / (20 + 15 * rows)
    right = width - MARGINS["right"]
    if bar_tick_labels:
        renderer, font = RendererAgg(1, 1, fig.dpi), FontProperties(size=6)
        label_w = max(renderer.get_text_width_height_descent(t, font, ismath=False)[0]
                      for t in bar_tick_labels) / fig.dpi
        width += BAR_PAD + bar_w + label_w
        fig.set_size_inches(width, height)
        right = width - BAR_PAD - bar_w - label_w
    panel_w = (right - left - wspace) / 2
    panel_h = (top - bottom - MARGINS["hspace"] * (rows - 1)) / rows
    fig.subplots_adjust(left=left / width, right=right / width, bottom=bottom / height,
                        top=top / height, wspace=wspace / panel_w,
                        hspace=MARGINS["hspace"] / panel_h)
    bar_x = right + 0.25
    return (bar_x / width, (bottom + (top - bottom - bar_h) / 2) / height, bar_w / width,
            bar_h / height)


def short_name(name: str, width: int = 28) -> str:
    """``name``, or its last ``width - 1`` characters after "…" when longer."""
    return name if len(name) <= width else "…" + name[-(width - 1):]


def plot_spectra(snap: LayerView, path: str) -> str:
    """Draw `spectra_figure` of ``snap`` into the image ``path`` (written whole, then renamed:
    never a torn file); returns ``path``."""
    fig = spectra_figure(snap)
    import matplotlib.pyplot as plt

    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp-{os.getpid()}{ext or '.png'}"
    try:
        fig.savefig(tmp, dpi=DPI)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    finally:
        plt.close(fig)
    return path


if __name__ == "__main__":  # the child of plot_spectra_detached
    sys.exit(_plot_from_file(sys.argv[1], sys.argv[2]))
