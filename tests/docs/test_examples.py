"""The README's quickstart: every `examples/` script runs as written (shortened by its own
``--steps``), the README shows `examples/causal_lm.py` verbatim, and the quickstart runs
unchanged under 2-process ZeRO-3. The README's other commands: tests/docs/test_readme.py."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest

import repo_paths

ROOT = str(repo_paths.ROOT)
EXAMPLES = {  # script: (shortening arguments, a line its output must contain)
    "causal_lm.py": (["--steps", "20"], r"next ' ': logit -?\d+\.\d+ ± \d+\.\d+"),
    "sequence_classification.py": (["--steps", "20"], r"(?m)^Laplace, held-out tau \S+ "
                                   r"(probit|meanfield|map) +\d\.\d{3} +\d\.\d{3} +\d\.\d{3} "
                                   r"+[+-]\d\.\d{3}$"),
    "lora.py": (["--steps", "10", "--pretrain-steps", "10"],
                r"tracked: \['base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A"),
}
# docs/lora.md's query of the LoRA example's saved directory (run by `_check_lora`)
LORA_QUERY = ('kfac-stream query --model out/lora/model --snapshot out/lora/kfac --text "The GNU '
              'General Public License is a free, copyleft license for Answer:" --options " A" '
              '" B" " C" " D"')
# the demo shrunk to seconds (tests/docs/test_readme.py: `make demo DEMO_ARGS=...`, then the
# README's inspect and query commands on its model and snapshot)
TINY_DEMO = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.seq_len=32",
             "trainer.max_steps=4", "trainer.per_device_train_batch_size=4",
             "trainer.report_to=[]", "trainer.disable_tqdm=true", "kfac.update_every=1",
             "kfac.snapshot_every=2", "kfac.token_fraction=0.5", "data.max_documents=40",
             "report.enabled=false"]


# the README's CPU ZeRO-3 launch of the quickstart (tests/docs/test_readme.py checks it is the
# README's line), run by test_causal_lm_example_under_zero3_from_outside_the_repo
ZERO3_EXAMPLE = ["DS_ACCELERATOR=cpu", "accelerate", "launch", "--config_file",
                 "launch/cpu_zero3.yaml", "examples/causal_lm.py", "--out", "out", "--steps", "20"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


# the classifier example (~50 s on 2 cores) in `make test-slow`; the classifier path itself is
# covered in `make test` by tests/unit/cli/test_classify.py
@pytest.mark.parametrize("script", [
    pytest.param(s, marks=pytest.mark.slow) if s == "sequence_classification.py" else s
    for s in sorted(EXAMPLES)])
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
    if script in CHECKS:
        CHECKS[script](tmp_path / "out", proc.stdout)


def _check_classification(out, stdout: str) -> None:
    """The walkthrough's figures (docs/classification.md), recomputed here from what it saved
    (``results.json``: the test labels, every row's probabilities, every "don't know" score)
    in plain Python, not by `kfac_stream.query.metrics`, and compared with what it printed."""
    r = json.loads((out / "results.json").read_text())
    y = r["test"]["labels"]
    C = len(r["classes"])
    assert len(y) == 300 and sorted(set(y)) == list(range(C))
    assert sorted(r["reports"]) == sorted(k for k in r["test"] if k != "labels")
    assert r["tau_source"] == "held-out"  # the held-out fit ran and stored its tau
    for name, probs in r["test"].items():
        if name == "labels":
            continue
        assert len(probs) == len(y) and all(len(p) == C for p in probs)
        assert all(min(p) >= 0 and abs(sum(p) - 1) < 1e-9 for p in probs), name
        conf = [max(p) for p in probs]
        hit = [float(p.index(max(p)) == t) for p, t in zip(probs, y)]
        acc = sum(hit) / len(y)
        nll = -sum(math.log(max(p[t], 1e-300)) for p, t in zip(probs, y)) / len(y)
        bins = [[] for _ in range(15)]  # equal width, right-closed, the first holds 0
        for c, h in zip(conf, hit):
            bins[max(0, math.ceil(c * 15) - 1)].append((c, h))
        ece = sum(abs(sum(h for _, h in b) - sum(c for c, _ in b)) for b in bins) / len(y)
        gap = sum(conf) / len(y) - acc
        rep = r["reports"][name]
        assert 0 <= rep["ece"] <= 1 and rep["nll"] >= 0 and 0 <= rep["accuracy"] <= 1
        for key, mine in (("accuracy", acc), ("nll", nll), ("ece", ece),
                          ("confidence_gap", gap)):
            assert rep[key] == pytest.approx(mine, abs=1e-9), (name, key)
        row = re.search(rf"(?m)^{re.escape(name)} +(\S+) +(\S+) +(\S+) +(\S+)$", stdout)
        assert row and [float(v) for v in row.groups()] == [
            round(v, 3) for v in (acc, nll, ece, gap)], (name, row)
    # tau: the stored held-out fit's choice, the candidate of the lowest eval-set NLL
    (sidecar,) = out.glob("kfac/step-*.heldout_prior.json")
    held = json.loads(sidecar.read_text())
    assert r["tau"] == held["tau"] == r["heldout_prior"]["tau"] > 0
    assert held["marglik_tau"] in held["grid"] and len(held["grid"]) == len(held["grid_nll"])
    assert held["tau"] == held["grid"][held["grid_nll"].index(min(held["grid_nll"]))]
    # the guard (heldout_tau.GUARD_SE): probit unless mean-field won beyond 2 paired s.e.;
    # MAP's probabilities kept unless the posterior won beyond 2
    gain, se = held["link_gain"]["meanfield"]
    assert held["examples"] == 300 and held["link"] == ("meanfield" if gain > 2 * se else
                                                        "probit")
    assert held["map_kept"] == (not held["map_gain"] > 2 * held["map_gain_se"])
    # N: 65 token positions per sequence ([CLS] + 64 bytes, no padding) in the blocks, one row
    # per sequence for the pooled head
    n = r["num_data"]
    assert n["classifier"] == n["bert.pooler.dense"] > 0
    assert all(v == pytest.approx(65 * n["classifier"], rel=1e-9)
               for k, v in n.items() if ".encoder.layer." in k)
    # "don't know" scores: entropies in [0, log C], variances >= 0, AUROC by pair count
    scores = r["scores"]
    assert set(scores) == {"test", *r["ood"]} and r["ood"]
    for name, per in scores.items():
        for k, v in per.items():
            hi = math.log(C) + 1e-9 if "entropy" in k else math.inf
            assert all(-1e-12 <= s <= hi for s in v), (name, k)
    for name in r["ood"]:
        assert sum(r["ood_map_labels"][name]) == pytest.approx(1)
        for k, a in r["auroc"][name].items():
            i, o = scores["test"][k], scores[name][k]
            pairs = sum((b > c) + 0.5 * (b == c) for b in o for c in i) / (len(i) * len(o))
            assert 0 <= a <= 1 and a == pytest.approx(pairs, abs=1e-12), (name, k)
    for k in scores["test"]:
        row = re.search(rf"(?m)^{re.escape(k)} +(\d\.\d{{3}}) +(\d\.\d{{3}})?", stdout)
        assert row and float(row[1]) == round(r["auroc"][r["ood"][0]][k], 3), k


def _check_lora(out, stdout: str) -> None:
    """The LoRA walkthrough (docs/lora.md): the saved directory holds the adapter and its
    base, its reload gave the in-process probabilities, the snapshot recorded the answer
    tokens, and the page's `LORA_QUERY` runs on it (paths moved to this run's output; 4
    posterior samples instead of 32)."""
    for f in ("adapter_config.json", "adapter_model.safetensors", "kfac_stream_peft.json",
              "base/config.json", "base/model.safetensors", "base/tokenizer.json"):
        assert (out / "model" / f).is_file(), f
    diff = re.search(r"reloaded from \S+: largest difference (\S+)", stdout)
    assert diff and float(diff[1]) <= 1e-6, stdout[-2000:]
    assert "answer tokens: (" in stdout and "(' A', ' B', ' C', ' D')" in stdout
    argv = [a.replace("out/lora", str(out)) for a in shlex.split(LORA_QUERY)]
    assert argv[:2] == ["kfac-stream", "query"]
    proc = subprocess.run([sys.executable, "-m", "kfac_stream.cli", *argv[1:], "--samples",
                           "4"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "PEFT adapter on base model" in proc.stderr
    assert re.search(r"(?m)^majority ' [ABCD]' \(agreement \d\.\d{4}\); MAP answer ' [ABCD]'",
                     proc.stdout), proc.stdout[-2000:]


# script: a check of its output directory and stdout, after `test_example_runs`'s own
CHECKS = {"sequence_classification.py": _check_classification, "lora.py": _check_lora}


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_shows_causal_lm_example_verbatim():
    with open(os.path.join(ROOT, "examples", "causal_lm.py")) as f:
        script = f.read()
    assert f"```python\n{script}```" in _readme()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (`make test` installs it)")
@pytest.mark.slow
def test_causal_lm_example_under_zero3_from_outside_the_repo(tmp_path):
    """The quickstart unchanged under 2-process DeepSpeed ZeRO-3 on CPU, launched from an
    unrelated directory with `launch/cpu_zero3.yaml` (inline DeepSpeed settings, no relative
    path): it trains, and its query works: `gather_model` saves the partitioned model and
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
    # 20 steps x 2 ranks x 8 windows x 63 positions: each window's last token scores nothing
    assert proc.stdout.count("snapshot of step 20: 8 layers, 20160 tokens seen") == 2
    assert len(re.findall(r"next ' ': logit -?\d+\.\d+ ± \d+\.\d+", proc.stdout)) == 1
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
