"""The spectra plot readable at 2 to 200 layers, progress on the long steps after
training, and the warning when ``num_data`` is far from the snapshot's own count."""

import logging
import math
import os
import re
import struct
import warnings

import matplotlib
import pytest
import torch
from tqdm import tqdm

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.app.contrast import uncertainty_contrast, uncertainty_contrasts
from kfac_stream.cli import main as cli_main
from kfac_stream.query.num_data import NUM_DATA_WARN_FACTOR, default_num_data
from kfac_stream.query.topk import topk_predictive
from kfac_stream.snapshot import media
from kfac_stream.snapshot.manifest_types import FactorEntry, LayerEntry
from kfac_stream.snapshot.snapshot import LayerFactors, LayerView
from kfac_stream.utils import progress as qprogress

from harness import run
from models import text_examples, tiny_gpt2

matplotlib.use("Agg")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LLAMA_TYPES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


# -- fixtures --------------------------------------------------------------------------------------

def layer_entry(name: str, d_a: int, d_g: int, diagonal: bool) -> LayerEntry:
    """The manifest entry of a made-up layer ``[d_g, d_a]`` without bias (one process)."""
    def factor(f: str, d: int) -> FactorEntry:
        return FactorEntry(key=f"{name}.{f}", dim=d, diagonal=diagonal and f == "A", owner=0,
                           shard="shard-00000-of-00001.safetensors")

    return LayerEntry(kind="linear", d_in=d_a, d_out=d_g, has_bias=False, A=factor("A", d_a),
                      G=factor("G", d_g))


def synthetic_snapshot(names: list[str], diagonal: set[str] = frozenset()) -> LayerView:
    """The layers of a made-up snapshot at step 7 (small dims, distinct spectra per layer);
    the layers in ``diagonal`` store A as a diagonal (no eigenvectors)."""
    layers = {}
    for i, name in enumerate(names):
        d_a, d_g = 6 + i % 5, 4 + i % 3
        a = torch.logspace(-4 + 0.01 * i, 1 + 0.02 * i, d_a)[torch.randperm(
            d_a, generator=torch.Generator().manual_seed(i))]  # unsorted: the plot sorts
        g = torch.logspace(-6, -1, d_g) * (1 + i / len(names))
        layers[name] = LayerFactors(
            name, a.diag(), g.diag(), layer_entry(name, d_a, d_g, name in diagonal),
            A_eigvals=a, A_eigvecs=None if name in diagonal else torch.eye(d_a),
            G_eigvals=g, G_eigvecs=torch.eye(d_g))
    return LayerView("synthetic", 7, layers)


def gpt2_names(blocks: int) -> list[str]:
    return [f"transformer.h.{b}.{t}" for b in range(blocks)
            for t in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


CASES = {
    2: ["fc1", "fc2"],
    14: gpt2_names(3) + ["lm_head", "score"],
    200: [f"model.layers.{b}.{t}" for b in range(29) for t in LLAMA_TYPES][:199] + ["lm_head"],
}


@pytest.fixture(scope="module")
def classified(tmp_path_factory):
    """A real tiny snapshot of 300 examples of 66 tokens, one epoch: N = 19,500 positions (the
    last token of each scores nothing: 65 positions carry the loss's gradient)."""
    tmp = tmp_path_factory.mktemp("n")
    model = tiny_gpt2(torch.float32, n_positions=80)
    run(model, text_examples(300, 66), {"storage_dtype": "float32"}, batch=50, tmp_path=tmp,
        record=False)
    model.eval()
    return model, Snapshot.latest(tmp / "kfac"), tmp


# -- the plot --------------------------------------------------------------------------------------

def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("n", sorted(CASES))
def test_spectra_png_is_readable_at_2_14_and_200_layers(n, tmp_path):
    import matplotlib.pyplot as plt

    names = CASES[n]
    assert len(names) == n
    snap = synthetic_snapshot(names, diagonal={names[0], names[-1]})
    rows = media.spectra_layout(names)
    path = tmp_path / f"spectra{n}.png"
    assert media.plot_spectra(snap, str(path)) == str(path)
    fig = media.spectra_figure(snap)
    try:
        w, h = fig.get_size_inches()
        assert png_size(path) == (round(w * media.DPI), round(h * media.DPI))
        assert not list(tmp_path.glob("*.tmp-*"))  # written whole, then renamed
        panels = [ax for ax in fig.axes if ax.get_xlabel() == "rank"]
        assert len(panels) == 2 * len(rows)
        for kind, col in (("A", panels[0::2]), ("G", panels[1::2])):
            lines = [ln for ax in col for ln in ax.get_lines()]
            # every layer drawn once per factor kind, diagonal factors included, sorted
            assert sorted(ln.get_label() for ln in lines) == sorted(
                media.short_name(x, 40) for x in names), kind
            for ln in lines:
                y = ln.get_ydata()
                assert all(y[i] >= y[i + 1] for i in range(len(y) - 1))
            colors = {tuple(ln.get_color()) for ln in lines}
            assert len(colors) == n, "one colour per depth"
        # colour follows depth: the colours are the colormap's in natural name order
        by_label = {ln.get_label(): ln.get_color() for ln in panels[0].get_lines()}
        want = media.depth_colors(n)
        for i, name in enumerate(media.depth_order(names)):
            if media.short_name(name, 40) in by_label:
                assert tuple(by_label[media.short_name(name, 40)]) == want[i]
        bars = [ax for ax in fig.axes if ax.get_ylabel() == media.DEPTH_LABEL]
        if n <= media.LEGEND_MAX_LAYERS:  # few layers: a legend on every panel, no bar
            assert len(rows) == 1 and not bars
            assert all(ax.get_legend() is not None for ax in panels)
        else:  # a colour bar over the layer indices, and one row of panels per layer type
            assert len(bars) == 1
            ticks = [t.get_text() for t in bars[0].get_yticklabels()]
            assert ticks[0].startswith("0: ") and ticks[-1].startswith(f"{n - 1}: ")
            assert len(rows) >= 2
        if n == 14:
            assert [t for t, _ in rows] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                            "mlp.c_proj", "other layers"]
        if n == 200:
            assert [t for t, _ in rows] == LLAMA_TYPES + ["lm_head"]
            assert [len(i) for _, i in rows] == [29, 29, 29, 28, 28, 28, 28, 1]
    finally:
        plt.close(fig)


def test_colour_bar_index_is_the_depth_not_the_alphabet():
    """A snapshot lists its layers sorted by name (``h.10`` before ``h.2``); the colour bar's
    index follows depth (block 2 before block 10), and its label says what it counts."""
    import matplotlib.pyplot as plt

    names = sorted(gpt2_names(12))  # as Snapshot.load gives them
    assert names[8].startswith("transformer.h.10.")
    fig = media.spectra_figure(synthetic_snapshot(names))
    try:
        (bar,) = [ax for ax in fig.axes if ax.get_ylabel() == media.DEPTH_LABEL]
        assert "natural order" in media.DEPTH_LABEL and "model order" not in media.DEPTH_LABEL
        ticks = [t.get_text() for t in bar.get_yticklabels()]
        blocks = [int(re.search(r"h\.(\d+)\.", t).group(1)) for t in ticks]
        assert blocks == sorted(blocks) and blocks[0] == 0 and blocks[-1] == 11, ticks
        colour = {ln.get_label(): tuple(ln.get_color()) for ax in fig.axes
                  for ln in ax.get_lines()}
        want = media.depth_colors(len(names))
        assert colour["transformer.h.2.attn.c_attn"] == want[8]  # blocks 0, 1 before it
        assert colour["transformer.h.10.attn.c_attn"] == want[40]
    finally:
        plt.close(fig)
    assert media.depth_order(["b.10.x", "b.2.y", "b.2.x", "a"]) == ["a", "b.2.x", "b.2.y",
                                                                   "b.10.x"]


def test_detached_plot_is_the_same_image(tmp_path):
    """The callback draws the PNG in a child process (the snapshot thread only waits, without
    the GIL the training thread needs): the same pixels as drawing it here, diagonal factors
    and a layer without an A spectrum included; nothing left beside it."""
    from matplotlib.image import imread

    names = CASES[14]
    snap = synthetic_snapshot(names, diagonal={names[0]})
    here, child = tmp_path / "here.png", tmp_path / "child.png"
    media.plot_spectra(snap, str(here))
    assert media.plot_spectra_detached(snap, str(child)) == str(child)
    a, b = imread(here), imread(child)
    assert a.shape == b.shape and (a == b).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.png", "here.png"]
    # layers that share an A factor share its eigenvalue tensor (q/k/v, gate/up)
    shared = torch.logspace(-3, 1, 6)
    spectra = media.Spectra("s", 3, {
        n: media.LayerSpectra(shared, torch.logspace(-2, 0, 4) * (i + 1))
        for i, n in enumerate(["l.0.q_proj", "l.0.k_proj", "l.0.v_proj"])})
    assert media.plot_spectra_detached(spectra, str(tmp_path / "shared.png"))


def test_detached_plot_failure_names_the_child_error(tmp_path, monkeypatch):
    snap = synthetic_snapshot(["fc1", "fc2"])
    monkeypatch.setattr(media, "DETACHED_PLOT_TIMEOUT", 120)
    taken = tmp_path / "taken.png"
    taken.mkdir()  # the child cannot put its image there
    with pytest.raises(RuntimeError, match="spectra plot's process exited with 1: .*Error"):
        media.plot_spectra_detached(snap, str(taken))
    # the eigenvalues' temporary file and the child's partial image are gone
    assert [p.name for p in tmp_path.iterdir()] == ["taken.png"]


def test_layer_types_and_the_one_row_fallback():
    assert media.layer_type("model.layers.3.self_attn.q_proj") == "self_attn.q_proj"
    assert media.layer_type("transformer.h.0.mlp.c_proj") == "mlp.c_proj"
    assert media.layer_type("lm_head") == "lm_head"
    assert media.layer_type("blocks.7") == "blocks.7"
    flat = [f"dense{i}" for i in range(200)]  # no repeated types: every layer on one row
    assert media.spectra_layout(flat) == [("all layers", list(range(200)))]


def test_make_media_on_a_real_snapshot(classified):
    _, snap, _ = classified
    out = media.make_media(snap.path)
    assert out["png"] == media.spectra_png_path(snap.path)
    with open(out["png"], "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert set(out["histograms"]) == {f"{n}/{f}" for n in snap.layer_names for f in "AG"}


# -- num_data --------------------------------------------------------------------------------------

def test_num_data_far_from_the_snapshots_count_warns(classified):
    model, snap, _ = classified
    own = default_num_data(snap.manifest)
    assert own == 300 * 65
    with pytest.warns(UserWarning, match="num_data=300 is 65x below") as rec:
        post = LaplacePosterior(model, snap, num_data=300)
    message = str(rec[0].message)
    assert "N=19,500" in message and "token positions" in message and "laplace-torch" in message
    assert "scales with N" in message and rec[0].filename == __file__  # points at the caller
    assert post.num_data == 300  # a warning, not a change
    with pytest.warns(UserWarning, match="x above"):
        LaplacePosterior(model, snap, num_data=own * NUM_DATA_WARN_FACTOR * 1.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (None, own, own / NUM_DATA_WARN_FACTOR, own * NUM_DATA_WARN_FACTOR, own / 3):
            LaplacePosterior(model, snap, num_data=n)


# -- progress --------------------------------------------------------------------------------------

def test_progress_switch(monkeypatch):
    monkeypatch.delenv(qprogress.ENV, raising=False)
    from transformers.utils import logging as hf_logging

    assert qprogress.enabled(None) is None and qprogress.enabled(True) is True
    assert qprogress.enabled(False) is False
    hf_logging.disable_progress_bar()
    try:
        assert qprogress.enabled(None) is False and qprogress.enabled(True) is True
    finally:
        hf_logging.enable_progress_bar()
    monkeypatch.setenv(qprogress.ENV, "0")
    assert qprogress.enabled(True) is False
    monkeypatch.setenv(qprogress.ENV, "1")
    assert qprogress.enabled(False) is True


def test_progress_of_topk_marglik_and_contrast(classified, capsys, caplog, monkeypatch):
    monkeypatch.delenv(qprogress.ENV, raising=False)
    model, snap, _ = classified
    post = LaplacePosterior(model, snap, prior_precision=1.0)
    ids = torch.tensor(list(b"def f(x):"))
    quiet = topk_predictive(post, ids, k=2, n_samples=50)  # stderr is no terminal: no bar
    assert "top-k predictive" not in capsys.readouterr().err
    loud = topk_predictive(post, ids, k=2, n_samples=50, show_progress=True)
    err = capsys.readouterr().err
    assert "top-k predictive" in err and "/9 " in err
    assert loud == quiet

    with caplog.at_level(logging.INFO, logger="kfac_stream"):
        tau = post.optimize_prior_precision(grid=5, iters=4, show_progress=True)
    err = capsys.readouterr().err
    assert f"marglik prior precision ({len(snap)} layers)" in err and "/11 " in err
    assert any("marginal-likelihood prior precision" in r.getMessage() and "11 evaluations"
               in r.getMessage() for r in caplog.records)
    assert math.isfinite(tau) and tau > 0

    post.prior_precision = 1.0
    held = [e["input_ids"][:20] for e in text_examples(2, 20, seed=1)]
    ood = {"a": [torch.arange(20) % 7 + 40], "b": [torch.arange(20) + 100] * 2}
    cons = uncertainty_contrasts(post, held, ood, positions=2, top_k=2, show_progress=True)
    err = capsys.readouterr().err
    assert "uncertainty contrast" in err and "/5 " in err  # 2 held-out + 3 out-of-domain
    for name, windows in ood.items():  # in-domain scored once, same figures as one by one
        one = uncertainty_contrast(post, held, windows, positions=2, top_k=2)
        assert torch.equal(one.variance["out"], cons[name].variance["out"])
        assert torch.equal(one.variance["in"], cons[name].variance["in"])
        assert torch.equal(one.entropy["out"], cons[name].entropy["out"])
    assert "uncertainty contrast" not in capsys.readouterr().err


def test_progress_of_snapshot_loading(classified, capsys, monkeypatch):
    """Loading counts the shard bytes read and verified: hidden off a terminal by default,
    shown on request, with the manifest's byte total; the same snapshot either way."""
    monkeypatch.delenv(qprogress.ENV, raising=False)
    _, snap, _ = classified
    quiet = Snapshot.load(snap.path)
    assert "loading snapshot" not in capsys.readouterr().err
    loud = Snapshot.latest(os.path.dirname(snap.path), show_progress=True)
    err = capsys.readouterr().err
    total = sum(i.bytes for i in snap.manifest.shards.values())
    assert f"loading snapshot {os.path.basename(snap.path)}" in err, err
    assert f"/{tqdm.format_sizeof(total, divisor=1024)}" in err, (total, err)  # bytes, 1024-based
    assert loud.layer_names == quiet.layer_names
    for name in quiet.layer_names:
        assert torch.equal(loud[name].A, quiet[name].A) and torch.equal(loud[name].G, quiet[name].G)


def test_cli_query_says_what_it_loads(classified, capsys, monkeypatch):
    monkeypatch.setenv(qprogress.ENV, "1")
    model, snap, tmp = classified
    model.save_pretrained(tmp / "model")
    argv = ["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--text", "def f(x):", "--byte-level", "--top-k", "2", "--samples", "50"]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    err = captured.err
    for needle in ("kfac-stream query: loading snapshot", "loading model",
                   f"choosing the prior precision by marginal likelihood over {len(snap)} layers",
                   "9 positions x top-2 next tokens", "top-k predictive", "/9 ",
                   "kfac-stream query: done in"):
        assert needle in err, needle
    assert "kfac-stream query" not in captured.out
    assert "(marginal likelihood (no held-out fit stored" in captured.out  # the default, said
