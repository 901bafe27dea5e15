"""`KFACStreamCallback` reports its spectra by itself: a plain ``Trainer`` with
``report_to`` and only the K-FAC callback in ``callbacks``; what the reporters wrote is read
back from W&B's offline run files and TensorBoard's event files (`logreaders`; nothing mocked).

The names tested are the documented ones (`kfac_stream.integrations.spectrum_monitor`): the
callback logs ``kfac/...``; the W&B and TensorBoard reporters show every Trainer metric under
``train/`` (``train/kfac/...``); media rows go straight to W&B as ``kfac_hist/<layer>/<F>`` and
``kfac_media/spectra`` with the Trainer's ``train/global_step``.

Each run: tiny GPT-2, 7 steps, snapshots at 3 and 6 and the final one at 7 (``on_train_end``),
the Trainer logging its loss every 2 steps (the tracker scalars come with it).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback, Snapshot, snapshot_metrics

from logreaders import (
    finish_wandb,
    latest_wandb_run_dir,
    offline_wandb_env,
    read_tensorboard_scalars,
    read_wandb_offline,
)
from models import ListDataset, text_examples, tiny_gpt2

# W&B keeps the Python floats the callback logged (JSON, shortest repr): equal up to rounding
# in nothing but the JSON round trip.
WANDB_REL = 1e-12
# TensorBoard stores float32 scalars: one rounding, 2**-24 ≈ 6e-8 relative.
TB_REL = 1e-6
STEPS, LOGGING_STEPS = 7, 2
SNAPSHOT_STEPS = [3, 6, 7]
LOSS_STEPS = [2, 4, 6]
COUNTERS = ("tokens_seen", "positions_sampled", "updates", "skipped_updates", "ms_per_step")


def train(root, report_to: list[str], **callback_kwargs) -> dict:
    """One plain Trainer run with only the K-FAC callback; the W&B run (if any) is finished
    before anything is read back."""
    env = {**offline_wandb_env(root), "TENSORBOARD_LOGGING_DIR": str(root / "tb")}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        # mc_sequences=1: one MC sequence of every micro-batch, so every update moves the
        # factors (the default share 0.05 of 2 sequences replays on ~1 update in 10)
        kfac = KFACStreamCallback(KFACConfig(token_fraction=1.0, update_every=1, mc_sequences=1,
                                             snapshot_every=3, ema_decay=0.95),
                                  **callback_kwargs)
        args = TrainingArguments(
            str(root / "out"), per_device_train_batch_size=2, max_steps=STEPS,
            learning_rate=1e-3, report_to=report_to, run_name="reporting-test",
            logging_steps=LOGGING_STEPS, save_strategy="no", use_cpu=True, disable_tqdm=True,
            seed=0)
        trainer = Trainer(model=tiny_gpt2(dtype=torch.float32), args=args,
                          train_dataset=ListDataset(text_examples(16, 32)), callbacks=[kfac])
        try:
            trainer.train()
        finally:
            if "wandb" in report_to:
                finish_wandb()  # transformers' WandbCallback never finishes its run
    out = {"kfac": kfac, "snapshots": [Snapshot.load(p) for p in kfac.snapshots],
           "log_history": trainer.state.log_history}
    if "wandb" in report_to:
        out["run_dir"] = latest_wandb_run_dir(str(root))
        out["wandb"] = read_wandb_offline(out["run_dir"])
    if "tensorboard" in report_to:
        out["tb"] = read_tensorboard_scalars(str(root / "tb"))
    return out


def documented(snap: Snapshot) -> dict[str, float]:
    """The snapshot's statistics under the names W&B and TensorBoard show."""
    return {f"train/{key}": value for key, value in snapshot_metrics(snap.manifest).items()}


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("wandb"), ["wandb"])


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("tensorboard"), ["tensorboard"])


def test_wandb_gets_every_snapshots_statistics_from_the_callback_alone(wandb_run):
    assert [s.step for s in wandb_run["snapshots"]] == SNAPSHOT_STEPS
    rows = [r for r in wandb_run["wandb"] if "train/kfac/snapshot_step" in r]
    assert [r["train/kfac/snapshot_step"] for r in rows] == SNAPSHOT_STEPS
    for row, snap in zip(rows, wandb_run["snapshots"]):
        expected = documented(snap)
        logged = {k: v for k, v in row.items() if k.startswith("train/kfac/")}
        assert set(logged) == set(expected), snap.step  # exactly the documented keys
        for key, value in expected.items():
            assert logged[key] == pytest.approx(value, rel=WANDB_REL), (snap.step, key)
        assert row["train/global_step"] >= snap.step  # logged once finished (background)
    # reporters only: the Trainer's history (and console printer) get none of the many keys
    assert not [k for entry in wandb_run["log_history"] for k in entry if "kfac" in k]


def test_wandb_media_on_the_trainers_step_axis(wandb_run):
    scalar_steps = [r["train/global_step"] for r in wandb_run["wandb"]
                    if "train/kfac/snapshot_step" in r]
    media = [r for r in wandb_run["wandb"] if "kfac_media/spectra" in r]
    assert [r["train/global_step"] for r in media] == scalar_steps
    for row, snap in zip(media, wandb_run["snapshots"]):
        assert row["kfac_media/spectra"]["caption"] == f"step {snap.step}"
        for layer in snap.layer_names:
            for f in ("A", "G"):
                hist = row[f"kfac_hist/{layer}/{f}"]
                assert hist["_type"] == "histogram"
                assert sum(hist["values"]) == int((getattr(snap[layer], f"{f}_eigvals") > 0).sum())


def test_wandb_tracker_scalars_with_the_trainers_loss_logs(wandb_run):
    rows = wandb_run["wandb"]
    loss_steps = [r["train/global_step"] for r in rows if "train/loss" in r]
    tracker = {r["train/global_step"]: r for r in rows if "train/kfac/tracker/updates" in r}
    assert loss_steps == LOSS_STEPS  # the Trainer's own logs are untouched
    assert sorted(tracker) == LOSS_STEPS
    for step, row in tracker.items():
        assert row["train/kfac/tracker/updates"] == float(step)  # update_every=1
        assert all(f"train/kfac/tracker/{name}" in row for name in COUNTERS)
        layers = wandb_run["snapshots"][0].layer_names
        assert all(f"train/kfac/{layer}/{f}/live_trace" in row for layer in layers
                   for f in ("A", "G"))


def test_tensorboard_gets_every_snapshots_statistics_from_the_callback_alone(tb_run):
    tb, snaps = tb_run["tb"], tb_run["snapshots"]
    assert [s.step for s in snaps] == SNAPSHOT_STEPS
    assert [v for _, v in tb["train/kfac/snapshot_step"]] == SNAPSHOT_STEPS
    expected = [documented(snap) for snap in snaps]
    spectra_tags = {t for t in tb if t.startswith("train/kfac/")
                    and "/tracker/" not in t and not t.endswith("/live_trace")}
    assert spectra_tags == set(expected[0])  # exactly the documented keys
    for key in expected[0]:
        logged = [v for _, v in tb[key]]
        assert logged == pytest.approx([e[key] for e in expected], rel=TB_REL), key
    assert [s for s, _ in tb["train/loss"]] == LOSS_STEPS  # the Trainer's own logs untouched
    assert tb["train/kfac/tracker/updates"] == [(s, float(s)) for s in LOSS_STEPS]


def test_report_spectra_off_logs_no_kfac_key(tmp_path):
    run = train(tmp_path, ["wandb", "tensorboard"], report_spectra=False)
    assert [s.step for s in run["snapshots"]] == SNAPSHOT_STEPS  # snapshots still written
    wandb_keys = {k for row in run["wandb"] for k in row}
    assert "train/loss" in wandb_keys and "train/loss" in run["tb"]
    assert not [k for k in wandb_keys | set(run["tb"]) if "kfac" in k]


def test_log_every_and_report_media_off(tmp_path):
    run = train(tmp_path, ["wandb"], log_every=3, report_media=False)
    rows = run["wandb"]
    assert [r["train/global_step"] for r in rows if "train/kfac/tracker/updates" in r] == [3, 6]
    assert [r["train/kfac/snapshot_step"] for r in rows
            if "train/kfac/snapshot_step" in r] == SNAPSHOT_STEPS
    assert not [k for r in rows for k in r if k.startswith(("kfac_hist/", "kfac_media/"))]
    assert all(s.path and s.step for s in run["snapshots"])
    assert run["kfac"].media  # made on the snapshot thread (the PNG beside each snapshot)


def test_negative_log_every_is_refused():
    from kfac_stream import KFACConfigError

    with pytest.raises(KFACConfigError, match="log_every"):
        KFACStreamCallback(log_every=-1)
