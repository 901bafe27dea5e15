"""The Hydra app (`python -m kfac_stream.app`) end to end, in real subprocesses.

* one process with ``report_to=[wandb, tensorboard]`` (W&B offline): the W&B run files and
  TensorBoard event files are read back (tests/support/logreaders.py) and every logged spectrum
  statistic must equal the one recomputed from the snapshot's eigenvalues;
* 2 processes under ``accelerate launch`` with the CPU DeepSpeed ZeRO-3 config: the snapshot
  loads and the metrics appear once (one W&B run, one TensorBoard value per snapshot);
* bad overrides fail before training, naming the key;
* the hub code path (``model=hf``, ``data=hf``) on a locally saved model and local text.

``RTOL = 1e-6``: the logged statistics come from the float64 eigenvalues of the snapshot
writer, the recomputed ones from the float32 eigenvalues the shard stores (relative rounding
6e-8 per eigenvalue; measured 8e-9 on the statistics); TensorBoard stores scalars as float32
(another 6e-8).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from kfac_stream import Snapshot
from kfac_stream.stats.spectrum import spectrum_stats

import repo_paths
from logreaders import latest_wandb_run_dir, read_tensorboard_scalars, read_wandb_offline

ROOT = str(repo_paths.ROOT)
RTOL = 1e-6
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.seq_len=32",
        "trainer.max_steps=6", "trainer.per_device_train_batch_size=4", "trainer.use_cpu=true",
        "trainer.logging_steps=2", "trainer.disable_tqdm=true", "kfac.update_every=1",
        "kfac.snapshot_every=3", "kfac.token_fraction=0.5", "data.max_documents=60",
        "report.windows=2", "report.positions=2", "logging.log_every=2"]


def _env(tmp) -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="offline", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp / "hf_datasets"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for key in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    return env


def _app(tmp, run_dir, *overrides, launch=None, check=True):
    cmd = [sys.executable, "-m", "kfac_stream.app"]
    if launch:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "launch", launch), "--main_process_port", str(port),
               "-m", "kfac_stream.app"]
    # cwd: the launch configs name their DeepSpeed JSON relative to the repository root
    proc = subprocess.run(cmd + [f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT,
                          env=_env(tmp), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, out[-5000:]
    return proc.returncode, out


def _expected(snap: Snapshot) -> dict[str, float]:
    """The spectrum statistics recomputed from the snapshot's eigenvalues (independently of
    the manifest and of kfac_stream.integrations.spectrum_monitor)."""
    want = {}
    for name in snap.layer_names:
        for f in ("A", "G"):
            st = spectrum_stats(getattr(snap[name], f"{f}_eigvals"))
            for key in ("max", "trace", "eff_rank"):
                want[f"kfac/{name}/{f}/{key}"] = st[key]
            want[f"kfac/{name}/{f}/log10_cond"] = math.log10(st["cond"])
    return want


def _snapshots(run_dir) -> list[Snapshot]:
    root = os.path.join(run_dir, "kfac")
    return [Snapshot.load(os.path.join(root, e)) for e in sorted(os.listdir(root))
            if e.startswith("step-") and not e.endswith(".png")]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("app")
    run_dir = tmp / "run"
    _, out = _app(tmp, run_dir, *TINY)
    return run_dir, out


def test_app_logs_spectra_to_wandb_and_tensorboard(single_run):
    run_dir, out = single_run
    snaps = _snapshots(run_dir)
    assert [s.step for s in snaps] == [3, 6]
    rows = read_wandb_offline(latest_wandb_run_dir(str(run_dir)))
    tb = read_tensorboard_scalars(str(run_dir / "runs"))
    for snap in snaps:
        want = _expected(snap)
        logged = [r for r in rows if r.get("train/kfac/snapshot_step") == snap.step]
        assert len(logged) == 1, f"snapshot {snap.step} logged {len(logged)} times to W&B"
        # several snapshots may be logged at one step (they finish in the background): match
        # TensorBoard rows by their order, which is the logging order
        tb_order = [v for _, v in tb["train/kfac/snapshot_step"]]
        assert tb_order.count(snap.step) == 1
        j = tb_order.index(snap.step)
        estimated = not snap.in_run_eigen  # deferred: Lanczos estimates, flagged
        assert logged[0]["train/kfac/spectra_estimated"] == float(estimated)
        for key, value in want.items():
            rel = RTOL
            if estimated:  # the stated errors: λ_max 1e-3, eff. rank 2%; the trace is the
                # diagonal sum, the eigenvalues' after clipping fp16-rounding negatives at 0
                if key.endswith("log10_cond"):  # λ_min is not estimated to any bound
                    continue
                rel = {"max": 1e-3, "trace": 1e-4, "eff_rank": 0.02}[key.rsplit("/", 1)[1]]
            assert logged[0][f"train/{key}"] == pytest.approx(value, rel=rel), key
            assert tb[f"train/{key}"][j][1] == pytest.approx(value, rel=max(rel, RTOL)), key
        for f in ("A", "G"):  # the across-layer summary is that of the per-layer values
            vals = sorted(v for k, v in want.items() if k.endswith(f"/{f}/trace"))
            rel = 1e-4 if estimated else 1e-6
            assert logged[0][f"train/kfac/summary/{f}/trace_max"] == pytest.approx(vals[-1],
                                                                                    rel=rel)
            assert logged[0][f"train/kfac/summary/{f}/trace_min"] == pytest.approx(vals[0],
                                                                                    rel=rel)
    media = [r for r in rows if any(k.startswith("kfac_hist/") for k in r)]
    assert len(media) == len(snaps) and all("kfac_media/spectra" in r for r in media)
    assert any("train/kfac/tracker/positions_sampled" in r for r in rows)  # cheap, in between
    assert "kfac_stream report" in out and "uncertainty contrast" in out
    assert "AUROC out-vs-in" in out and os.path.exists(f"{snaps[-1].path}.spectra.png")
    assert "wandb sync" in out  # offline: the app says how to upload


def test_app_under_accelerate_deepspeed_zero3(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (`make test` installs it)")
    run_dir = tmp_path / "run"
    _, out = _app(tmp_path, run_dir, *TINY, "kfac.fisher=mc", launch="cpu_zero3.yaml")
    snaps = _snapshots(run_dir)
    assert [s.step for s in snaps] == [3, 6]
    assert all(s.manifest.world_size == 2 for s in snaps)
    assert sorted(os.listdir(snaps[-1].path)) == [
        "manifest.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    runs = [e for e in os.listdir(run_dir / "wandb") if e.startswith("offline-run-")]
    assert len(runs) == 1, runs  # the main process only
    rows = read_wandb_offline(latest_wandb_run_dir(str(run_dir)))
    assert sorted(r["train/kfac/snapshot_step"] for r in rows
                  if "train/kfac/snapshot_step" in r) == [3, 6]
    tb = read_tensorboard_scalars(str(run_dir / "runs"))
    assert sorted(v for _, v in tb["train/kfac/snapshot_step"]) == [3.0, 6.0]
    want = _expected(snaps[-1])
    row = next(r for r in rows if r.get("train/kfac/snapshot_step") == 6)
    for key, value in want.items():
        assert row[f"train/{key}"] == pytest.approx(value, rel=RTOL), key
    assert out.count("kfac_stream report") == 1
    # progress before the engine's silent start, and the overhead of the training loop only
    assert out.count("kfac_stream: DeepSpeed starts its engine inside trainer.train()") == 1
    m = re.search(r"; ([\d.]+) s on the training thread of ([\d.]+) s training \(([\d.]+)%\)"
                  r"(; engine start-up before training ([\d.]+) s, not counted)?", out)
    assert m, out[-3000:]
    # the share is of the training loop's seconds (both printed rounded: 2 and 1 decimals)
    assert float(m[3]) == pytest.approx(100 * float(m[1]) / float(m[2]), rel=0.05, abs=0.1)


@pytest.mark.slow
def test_deepspeed_on_cpu_without_use_cpu_is_one_line(tmp_path):
    """The CPU ZeRO-3 launch config without ``trainer.use_cpu=true``: one error line (printed
    by rank 0), before the model loads; not DeepSpeed's batch-size assertion on every rank."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (`make test` installs it)")
    rc, out = _app(tmp_path, tmp_path / "run", *[o for o in TINY if "use_cpu" not in o],
                   launch="cpu_zero3.yaml", check=False)
    assert rc != 0
    line = ("kfac-stream train: error: kfac_stream: DeepSpeed on CPU (DS_ACCELERATOR=cpu) needs "
            "TrainingArguments(use_cpu=True) (the app: trainer.use_cpu=true)")
    assert out.count(line) == 1, out[-3000:]
    assert "AssertionError" not in out and "Traceback" not in out.split(line)[0], out[-3000:]


BAD_OVERRIDES = [
    ("kfac.tokn_fraction=0.1", "kfac.tokn_fraction"),
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("kfac.token_fraction=2", "token_fraction=2.0"),
    ("+trainer.extra.bogus_field=1", "trainer.extra.bogus_field"),
    # Hydra's own hint for a typo is `+kfac.token_fracton`: a "did you mean", not a TypeError
    ("+kfac.token_fracton=0.1", "error: kfac.token_fracton is not a key of the kfac config: "
     "did you mean kfac.token_fraction?"),

    ("model=hf model.name_or_path=null", "model.name_or_path"),
    ("report.top_k=0", "report.top_k=0: must be a positive integer"),
    ("report.prior_precision=-1", "report.prior_precision=-1.0: must be a positive finite float"),
]


def test_bad_override_fails_before_training(tmp_path):
    """Every case through the app's own entry point, in one process
    (`tests/support/app_overrides_job.py`: a process start per case cost ~6 s on CI's 2 cores)."""
    runs = [tmp_path / f"run{i}" for i in range(len(BAD_OVERRIDES))]
    lines = [f"hydra.run.dir={run} {override}" for run, (override, _) in zip(runs, BAD_OVERRIDES)]
    out_json = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(repo_paths.SUPPORT / "app_overrides_job.py"),
                           str(out_json), *lines], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    with open(out_json) as f:
        results = json.load(f)
    for (override, needle), run_dir, res in zip(BAD_OVERRIDES, runs, results):
        rc, out = res["rc"], res["out"]
        assert rc != 0 and needle in out, (override, out[-3000:])
        assert "Traceback" not in out and "TypeError" not in out, (override, out[-3000:])
        assert "train_runtime" not in out and not (run_dir / "kfac").exists(), override


def test_hub_code_path_on_local_files(tmp_path):
    """``model=hf`` / ``data=hf`` take from_pretrained / load_dataset, here on local files."""
    from kfac_stream.app.models import tiny_gpt2

    from models import save_bpe_tokenizer

    model_dir, text = tmp_path / "model", tmp_path / "corpus.txt"
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i * i}" for i in range(400)]
    text.write_text("\n".join(lines))
    tok = save_bpe_tokenizer(str(model_dir), lines)
    tiny_gpt2(vocab_size=len(tok), n_layer=1, n_embd=32, n_head=2, seq_len=32).save_pretrained(
        model_dir)
    run_dir = tmp_path / "run"
    _, out = _app(tmp_path, run_dir, *[o for o in TINY if not o.startswith("model.")],
                  "model=hf", f"model.name_or_path={model_dir}", "model.seq_len=32",
                  "model.dtype=float32", "data=hf", "data.path=text",
                  f"data.data_files={text}", "data.name=null", "trainer.report_to=[]")
    snap = _snapshots(run_dir)[-1]
    manifest = json.load(open(os.path.join(snap.path, "manifest.json")))
    # 6 steps x 4 windows x 31 positions: each window's last token scores nothing
    assert manifest["counts"]["tokens_seen"] == 6 * 4 * 31
    assert "kfac_stream report" in out and "uncertainty contrast" in out
    assert torch.isfinite(snap[snap.layer_names[0]].G).all()
