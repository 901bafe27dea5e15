"""What a new user of the callback meets in a script of their own: the one-line summary at train
begin (shown with no logging set up), ``gather_model`` saving on a single process too, and one
clear line for DeepSpeed on CPU without ``use_cpu=True``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from transformers import GPT2LMHeadModel, TrainerControl, TrainingArguments

from kfac_stream import KFACConfigError, KFACStreamCallback, gather_model
from kfac_stream.capture.preset_memory import factor_bytes
from kfac_stream.tracking.lines import tracking_summary

import repo_paths
from harness import run
from models import text_examples, tiny_gpt2

ROOT = str(repo_paths.ROOT)
SUMMARY = re.compile(
    r"^kfac_stream: tracking (\d+) layers, (\d+) factors \((\d+) dense, (\d+) diagonal\)"
    r"(?: in stack [\w.]+ \(\d+ blocks\))?, "
    r"(\w+) Fisher, (\w+) form, token_fraction=\S+, ema_decay=\S+, update_every=\d+; ([\d.]+) "
    r"(KiB|MiB) of (\w+) factors on 1 rank; (inline|async) updates, fold on (host|device)"
    r"(?: \(device budget [^)]+\))?, eigh on [^,]+, (\d+) sequences per update, "
    r"final-weight refresh: (?:on|off) \([^;]+\); snapshots "
    r"every (\d+) steps and at the end into (.+)$")


def test_summary_line_at_train_begin(tmp_path, caplog):
    """One INFO line: layers, factors, stored bytes per rank, the run plan, snapshot directory;
    the figures are the tracker's own (layers, factor sides, the store's dtype, its plan)."""
    with caplog.at_level("INFO", logger="kfac_stream"):
        cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(4, 12),
                       {"storage_dtype": "float16", "max_dense_dim": 40, "snapshot_every": 7},
                       batch=2, tmp_path=tmp_path, record=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "kfac_stream: tracking ")]
    assert len(lines) == 1, lines
    m = SUMMARY.match(lines[0])
    assert m, lines[0]
    layers, factors, dense, diagonal = map(int, m.groups()[:4])
    t = cb.tracker
    assert layers == len(t.specs) == 8 and factors == len(t.dims) == dense + diagonal
    assert diagonal == sum(diag for _, diag in t.dims.values()) > 0  # 4·32 = 128 > 40
    assert m[5] == "empirical" and m[6] == "expand" and m[9] == "float16" and m[13] == "7"
    assert (m[10], m[11], int(m[12])) == ("inline", "host", t.run.sequences_per_update) == \
        ("inline", "host", 2)  # the CPU's plan: batch 2, every sequence (empirical Fisher)
    scale = 2**10 if m[8] == "KiB" else 2**20
    assert float(m[7]) * scale == pytest.approx(factor_bytes(t.dims, 2), rel=5e-3)
    assert m[14] == os.path.join(str(tmp_path), "kfac")
    assert tracking_summary(t, "somewhere").endswith("into somewhere")


def test_summary_is_shown_when_no_logging_is_set_up(tmp_path):
    """A script that configures no logging sees the INFO lines of ``kfac_stream`` on stderr (a
    logger nobody configured shows only warnings); one that configures logging decides."""
    script = textwrap.dedent("""
        import logging, sys
        from kfac_stream.utils.log_setup import show_info_by_default
        if sys.argv[1] == "configured":
            logging.basicConfig(level=logging.WARNING)
        show_info_by_default().info("kfac_stream: tracking 8 layers")
        show_info_by_default().info("kfac_stream: once")  # idempotent: one handler
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    plain = subprocess.run([sys.executable, "-c", script, "plain"], capture_output=True,
                           text=True, env=env, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr.splitlines() == ["kfac_stream: tracking 8 layers", "kfac_stream: once"]
    configured = subprocess.run([sys.executable, "-c", script, "configured"],
                                capture_output=True, text=True, env=env, timeout=120)
    assert configured.returncode == 0 and configured.stderr == ""


def test_whole_model_saves_on_a_single_process(tmp_path):
    """Without ZeRO-3 ``gather_model(trainer, dir)`` returns the trained model and saves it, so
    ``kfac-stream query --model dir`` works without another ``save_model``."""
    model = tiny_gpt2(torch.float32)
    _, _, trainer = run(model, text_examples(4, 12), {}, batch=2, tmp_path=tmp_path / "run",
                        record=False)
    out = tmp_path / "model"
    assert gather_model(trainer, str(out)) is model
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    saved = GPT2LMHeadModel.from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("accel", ["cpu", None])
def test_deepspeed_on_cpu_needs_use_cpu(tmp_path, monkeypatch, accel):
    """Under ``accelerate launch`` with a DeepSpeed config on CPU, a Trainer without
    ``use_cpu=True`` is refused when it is built (the callback's ``on_init_end``), in one line,
    instead of DeepSpeed's batch-size assertion on every rank; with ``use_cpu=True``, with no
    DeepSpeed, or on a CUDA machine it passes."""
    if accel is None and torch.cuda.is_available():
        pytest.skip("this case needs a machine without CUDA (DeepSpeed would use the GPU)")
    args = TrainingArguments(str(tmp_path), report_to=[])
    cpu_args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    cb, control = KFACStreamCallback(), TrainerControl()
    cb.on_init_end(args, None, control)  # no DeepSpeed: nothing to say
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    if accel is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", accel)
    with pytest.raises(KFACConfigError) as e:
        cb.on_init_end(args, None, control)
    msg = str(e.value)
    why = "DS_ACCELERATOR=cpu" if accel else "no CUDA device"
    assert msg == (f"kfac_stream: DeepSpeed on CPU ({why}) needs TrainingArguments(use_cpu=True)"
                   " (the app: trainer.use_cpu=true); without it DeepSpeed's batch-size "
                   "assertion fails on every rank")
    assert cb.on_init_end(cpu_args, None, control) is control
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert cb.on_init_end(args, None, control) is control  # DeepSpeed's accelerator: a GPU


def test_overhead_is_a_share_of_the_training_loop():
    """The report's overhead: the tracker's seconds over the training loop (the callback's
    ``on_train_begin`` to ``on_train_end``), not over ``Trainer.train()``, whose time also holds
    the engine's start-up (ZeRO-3: 0.2% shown where the loop's share was 2%)."""
    from kfac_stream.app.report import overhead_text

    assert overhead_text(0.2, 100.0, 10.0) == (
        "0.20 s on the training thread of 10.0 s training (2.0%); engine start-up before "
        "training 90.0 s, not counted")
    assert overhead_text(0.2, 10.3, 10.0) == "0.20 s on the training thread of 10.0 s " \
                                             "training (2.0%)"
    assert overhead_text(0.2, 10.0, None).startswith("0.20 s on the training thread of 10.0 s")


def test_callback_times_the_training_loop(tmp_path):
    """``train_seconds``: set at ``on_train_end``, inside the time of the whole run."""
    cb = KFACStreamCallback()
    assert cb.train_seconds is None
    t0 = time.perf_counter()
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(4, 12), {}, batch=2,
                   tmp_path=tmp_path, record=False)
    assert 0 < cb.train_seconds < time.perf_counter() - t0
