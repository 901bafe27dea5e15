"""`kfac_stream.integrations.spectrum_monitor`: spectrum metrics of every snapshot, read back
from what the reporters wrote (W&B offline run files and TensorBoard event files; nothing mocked).

One real ``Trainer`` run (tiny GPT-2, 7 steps, snapshots at steps 3 and 6 and the final one
at 7 written in ``on_train_end``) is shared by the end-to-end tests; the expected values are
recomputed here from each snapshot's stored eigenvalues with `spectrum_stats`.
"""

from __future__ import annotations

import math
import os
import statistics

import pytest
import torch
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, Snapshot
from kfac_stream.integrations.spectrum_monitor import SpectraReporter, snapshot_metrics
from kfac_stream.snapshot.manifest_types import (
    Counts,
    FactorEntry,
    LayerEntry,
    Manifest,
    Ownership,
    Spectrum,
)
from kfac_stream.snapshot.media import LayerSpectra, Spectra, log10_histograms
from kfac_stream.stats.spectrum import spectrum_stats

from logreaders import (
    finish_wandb,
    latest_wandb_run_dir,
    offline_wandb_env,
    read_tensorboard_scalars,
    read_wandb_offline,
)
from models import ListDataset, text_examples, tiny_gpt2

# The manifest's statistics come from float64 eigenvalues; the snapshot keeps them in float32
# and TensorBoard stores float32 scalars: each rounding is 2**-24 ≈ 6e-8 relative, and the sums
# and logs over ≤ 65 eigenvalues stay far below 1e-6.
REL = 1e-6
STEPS, LOG_EVERY = 7, 2
STATS = ("max", "trace", "log10_cond", "eff_rank")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train once with W&B (offline) and TensorBoard; the W&B run is finished (files flushed,
    no run leaks into other tests) before the tests read anything back."""
    root = tmp_path_factory.mktemp("monitor")
    env = {**offline_wandb_env(root),
           "TENSORBOARD_LOGGING_DIR": str(root / "tb")}  # TrainingArguments has no logging_dir
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        # one MC sequence of every micro-batch: every step updates (the default share 0.05 of
        # 2 sequences would replay on step 0 and about one step in ten)
        kfac = KFACStreamCallback(KFACConfig(token_fraction=1.0, update_every=1, mc_sequences=1,
                                             snapshot_every=3, ema_decay=0.95,
                                             eigendecompose="final"),
                                  log_every=LOG_EVERY)
        args = TrainingArguments(
            str(root / "out"), per_device_train_batch_size=2, max_steps=STEPS,
            learning_rate=1e-3, report_to=["wandb", "tensorboard"], run_name="monitor-test",
            logging_steps=LOG_EVERY, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
        trainer = Trainer(model=tiny_gpt2(dtype=torch.float32), args=args,
                          train_dataset=ListDataset(text_examples(16, 32)),
                          callbacks=[kfac])
        try:
            trainer.train()
        finally:
            finish_wandb()  # transformers' WandbCallback never finishes the run it started
    run_dir = latest_wandb_run_dir(str(root))
    return {"snapshots": [Snapshot.load(p) for p in kfac.snapshots], "paths": kfac.snapshots,
            "run_dir": run_dir, "wandb": read_wandb_offline(run_dir),
            "tb": read_tensorboard_scalars(str(root / "tb"))}


def recomputed(snap: Snapshot) -> dict[str, float]:
    """``{kfac/<layer>/<F>/<stat>: value}`` from the snapshot's eigenvalues."""
    out = {}
    for layer in snap.layer_names:
        for f in ("A", "G"):
            s = spectrum_stats(getattr(snap[layer], f"{f}_eigvals"))
            s["log10_cond"] = math.log10(s.pop("cond"))
            out.update({f"kfac/{layer}/{f}/{stat}": s[stat] for stat in STATS})
    return out


def snapshot_rows(run) -> list[dict]:
    return [r for r in run["wandb"] if "train/kfac/snapshot_step" in r]


def test_every_snapshot_logged_once_final_included(run):
    steps = [s.step for s in run["snapshots"]]
    assert steps == [3, 6, 7]
    assert [r["train/kfac/snapshot_step"] for r in snapshot_rows(run)] == steps
    assert [v for _, v in run["tb"]["train/kfac/snapshot_step"]] == steps


def test_wandb_and_tensorboard_scalars_match_recomputed_spectra(run):
    """A snapshot decomposed in the run logs its exact statistics (recomputed here from its
    eigenvalues); a deferred one logs its manifest's Lanczos estimates, flagged."""
    rows = snapshot_rows(run)
    assert any(not s.in_run_eigen for s in run["snapshots"])  # both kinds are checked
    for i, snap in enumerate(run["snapshots"]):
        assert rows[i]["train/kfac/spectra_estimated"] == float(not snap.in_run_eigen)
        if not snap.in_run_eigen:
            for key, value in snapshot_metrics(snap.manifest).items():
                assert rows[i][f"train/{key}"] == pytest.approx(value, rel=1e-12), key
            continue
        for key, value in recomputed(snap).items():
            assert rows[i][f"train/{key}"] == pytest.approx(value, rel=REL), (snap.step, key)
            logged = run["tb"][f"train/{key}"]
            assert len(logged) == len(run["snapshots"]), key
            assert logged[i][1] == pytest.approx(value, rel=REL), (snap.step, key)


def test_summaries_are_min_median_max_over_layers(run):
    layers = run["snapshots"][0].layer_names
    for row in snapshot_rows(run):
        for f in ("A", "G"):
            for stat in STATS:
                values = [row[f"train/kfac/{layer}/{f}/{stat}"] for layer in layers]
                for name, agg in (("min", min), ("median", statistics.median), ("max", max)):
                    got = row[f"train/kfac/summary/{f}/{stat}_{name}"]
                    assert got == pytest.approx(agg(values), rel=1e-12), (f, stat, name)


def test_histograms_and_spectra_image_in_wandb(run):
    media = [r for r in run["wandb"] if "kfac_media/spectra" in r]
    assert len(media) == len(run["snapshots"])
    for row, snap in zip(media, run["snapshots"]):
        image = row["kfac_media/spectra"]
        assert image["_type"] == "image-file" and image["caption"] == f"step {snap.step}"
        assert os.path.isfile(os.path.join(run["run_dir"], "files", image["path"]))
        assert os.path.isfile(snap.path + ".spectra.png")
        for layer in snap.layer_names:
            for f in ("A", "G"):
                hist = row[f"kfac_hist/{layer}/{f}"]
                ev = getattr(snap[layer], f"{f}_eigvals")
                assert hist["_type"] == "histogram" and len(hist["bins"]) == 33
                assert sum(hist["values"]) == int((ev > 0).sum())


def test_step_metrics_and_trainer_loss_logs_kept(run):
    tb, logged_steps = run["tb"], list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert [s for s, _ in tb["train/loss"]] == logged_steps  # not swallowed by our Trainer.log
    assert tb["train/kfac/tracker/updates"] == [(s, float(s)) for s in logged_steps]
    assert [v for _, v in tb["train/kfac/tracker/skipped_updates"]] == [0.0] * 3
    assert all(v > 0 for _, v in tb["train/kfac/tracker/ms_per_step"])
    # at step 6 the snapshot flushed the store just before: the live trace is that of the
    # snapshot's dequantised factor (not the eigenvalue sum: float16 rounding leaves slightly
    # negative eigenvalues, clipped to 0, which raises their sum by ~1e-5 relative)
    snap6 = run["snapshots"][1]
    for layer in snap6.layer_names:
        for f in ("A", "G"):
            live = dict(tb[f"train/kfac/{layer}/{f}/live_trace"])[6]
            factor = getattr(snap6[layer], f).double()
            trace = float(factor.diagonal().sum() if factor.dim() == 2 else factor.sum())
            assert live == pytest.approx(trace, rel=REL), (layer, f)


def test_reporter_without_a_trainer_logs_scalars_to_active_wandb_run(run, tmp_path,
                                                                     monkeypatch):
    import wandb

    for key, value in offline_wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    kfac = KFACStreamCallback()
    kfac.snapshots.extend(run["paths"])  # as if this callback had written them
    reporter = SpectraReporter(media=False)
    reporter.start(None, 0)  # no Trainer's callback handler: no reporters
    wandb.init()
    try:
        reporter.snapshots(kfac.session, None, TrainerState(), TrainerControl(), after_end=True)
    finally:
        finish_wandb()
    rows = read_wandb_offline(latest_wandb_run_dir(str(tmp_path)))
    assert [r["kfac/snapshot_step"] for r in rows] == [3, 6, 7]
    for row, snap in zip(rows, run["snapshots"]):
        assert row == pytest.approx({**snapshot_metrics(snap.manifest), "_step": row["_step"],
                                     "_runtime": row["_runtime"],
                                     "_timestamp": row["_timestamp"]})


def manifest(spectra: dict[str, tuple[dict, dict]]) -> Manifest:
    """The manifest of a made-up one-process snapshot at step 12 whose layers' factors have
    the spectrum statistics ``spectra`` (``{layer: (A's, G's)}``)."""
    def factor(name: str, f: str, stats: dict) -> FactorEntry:
        return FactorEntry(key=f"{name}.{f}", dim=4, diagonal=False, dtype="float32", owner=0,
                           shard=SHARD, weight=1.0, updates=1, positions=4,
                           spectrum=Spectrum(**stats))

    layers = {name: LayerEntry(kind="linear", d_in=4, d_out=4, has_bias=False,
                               A=factor(name, "A", a), G=factor(name, "G", g))
              for name, (a, g) in spectra.items()}
    return Manifest(step=12, epoch=None, created_unix=0.0, world_size=1,
                    ownership=Ownership(bytes_per_rank=[0], eigh_flops_per_rank=[0.0]),
                    fisher="mc", ema_decay=0.95, token_fraction=1.0, update_every=1,
                    storage_dtype="float32", config={}, counts=Counts(), skipped_steps=[],
                    shared_inputs=[], fingerprint="0" * 64, layers=layers)


SHARD = "shard-00000-of-00001.safetensors"


def spec(top: float, trace: float, cond: float, eff_rank: float) -> dict[str, float]:
    return {"max": top, "trace": trace, "cond": cond, "eff_rank": eff_rank}


def test_snapshot_metrics_summaries_on_hand_built_manifest():
    zero = spec(0.0, 0.0, math.inf, 0.0)
    meta = manifest({"a": (spec(4.0, 6.0, 100.0, 1.5), spec(1.0, 2.0, 10.0, 2.0)),
                     "b": (spec(1.0, 3.0, 1e4, 2.5), zero),
                     "c": (spec(2.0, 9.0, 1e3, 3.5), spec(3.0, 5.0, 1e5, 1.0))})
    m = snapshot_metrics(meta, prefix="kfac")
    assert m["kfac/snapshot_step"] == 12.0
    assert m["kfac/a/A/log10_cond"] == pytest.approx(2.0)
    assert "kfac/b/G/log10_cond" not in m and m["kfac/b/G/max"] == 0.0  # zero factor
    assert (m["kfac/summary/A/max_min"], m["kfac/summary/A/max_median"],
            m["kfac/summary/A/max_max"]) == (1.0, 2.0, 4.0)
    assert (m["kfac/summary/A/log10_cond_min"], m["kfac/summary/A/log10_cond_median"],
            m["kfac/summary/A/log10_cond_max"]) == pytest.approx((2.0, 3.0, 4.0))
    # G: the zero factor counts for max/trace/eff_rank, not for log10_cond
    assert m["kfac/summary/G/trace_median"] == 2.0 and m["kfac/summary/G/eff_rank_min"] == 0.0
    assert (m["kfac/summary/G/log10_cond_min"],
            m["kfac/summary/G/log10_cond_median"]) == pytest.approx((1.0, 3.0))
    assert m["kfac/spectra_estimated"] == 0.0  # no eigen entry: format 2, decomposed
    per_factor = 3 * 2 * 4 - 1
    assert len(m) == per_factor + 2 * 4 * 3 + 2


def test_log10_histograms_count_positive_eigenvalues():
    a = torch.tensor([0.0, 0.0, 1e-6, 1e-3, 1.0, 10.0])
    g = torch.zeros(3)
    hists = log10_histograms(Spectra("unused", 1, {"lin": LayerSpectra(a, g)}), bins=8)
    assert list(hists) == ["lin/A"]  # a factor without a positive eigenvalue is left out
    counts, edges = hists["lin/A"]
    assert sum(counts) == 4 and len(counts) == 8
    assert edges[0] == pytest.approx(-6.0) and edges[-1] == pytest.approx(1.0)
