"""The README's quickstart: every `examples/` script runs as written (shortened by its own
``--steps``), the README shows `examples/causal_lm.py` verbatim, and the quickstart runs
unchanged under 2-process ZeRO-3. The README's other commands: tests/test_readme.py."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {  # script: (shortening arguments, a line its output must contain)
    "causal_lm.py": (["--steps", "20"], r"next ' ': logit -?\d+\.\d+ ± \d+\.\d+"),
    "sequence_classification.py": (["--steps", "20"], r"Laplace: accuracy \d\.\d+, NLL"),
    "lora.py": (["--steps", "10"], r"tracked: \['base_model\.model\.transformer\.h\.0\.attn"),
}
# the demo shrunk to seconds (tests/test_readme.py: `make demo DEMO_ARGS=...`, then the README's
# inspect and query commands on its model and snapshot)
TINY_DEMO = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.seq_len=32",
             "trainer.max_steps=4", "trainer.per_device_train_batch_size=4",
             "trainer.report_to=[]", "trainer.disable_tqdm=true", "kfac.update_every=1",
             "kfac.snapshot_every=2", "kfac.token_fraction=0.5", "data.max_documents=40",
             "report.enabled=false"]


# the README's CPU ZeRO-3 launch of the quickstart (tests/test_readme.py checks it is the
# README's line), run by test_causal_lm_example_under_zero3_from_outside_the_repo
ZERO3_EXAMPLE = ["DS_ACCELERATOR=cpu", "accelerate", "launch", "--config_file",
                 "launch/cpu_zero3.yaml", "examples/causal_lm.py", "--out", "out", "--steps", "20"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(tmp_path, script):
    args, expect = EXAMPLES[script]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script),
                           "--out", str(tmp_path / "out"), *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    print(proc.stdout[-1500:])
    assert re.search(expect, proc.stdout), proc.stdout[-3000:]
    # the callback's one-line summary reaches a script that configured no logging
    assert re.search(r"^kfac_stream: tracking \d+ layers, \d+ factors .* snapshots every \d+ "
                     r"steps and at the end into .*kfac$", proc.stderr, re.M), proc.stderr[-3000:]
    assert any(p.startswith("step-") for p in os.listdir(tmp_path / "out" / "kfac"))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_shows_causal_lm_example_verbatim():
    with open(os.path.join(ROOT, "examples", "causal_lm.py")) as f:
        script = f.read()
    assert f"```python\n{script}```" in _readme()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (`make test` installs it)")
def test_causal_lm_example_under_zero3_from_outside_the_repo(tmp_path):
    """The quickstart unchanged under 2-process DeepSpeed ZeRO-3 on CPU, launched from an
    unrelated directory with `launch/cpu_zero3.yaml` (inline DeepSpeed settings, no relative
    path): it trains, and its query works: `whole_model` saves the partitioned model and
    reloads it whole on the main process (the saved weights prove that path ran; without it
    `LaplacePosterior` raises `PartitionedModelError`, see test_query_validation)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    var, accelerate, launch, flag, config, script, *rest = ZERO3_EXAMPLE
    assert (accelerate, launch, flag) == ("accelerate", "launch", "--config_file")
    key, value = var.split("=")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", flag, os.path.join(ROOT, config),
           "--main_process_port", str(port), os.path.join(ROOT, script), *rest]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(_env(), **{key: value}),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    print(proc.stdout[-1500:])
    # both ranks trained and read the snapshot; only the main process queried
    assert proc.stdout.count("snapshot of step 20: 8 layers, 20480 tokens seen") == 2
    assert len(re.findall(r"next ' ': logit -?\d+\.\d+ ± \d+\.\d+", proc.stdout)) == 1
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
