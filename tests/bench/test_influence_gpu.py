"""benchmarks/influence_gpu.py's dry run: influence scores at 1.1B on a GPU (ours from the
streamed factors, kronfluence's fit + score) run on a tiny Llama on the CPU, through the same
code. The figures of a real run need a GPU (the script's docstring); this checks the sequence
end to end, the JSON's structure, that every figure is finite and positive, and that ours
read each training example once with the 64 queries in one pass."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest

from repo_paths import BENCHMARKS, ROOT

sys.path.insert(0, str(BENCHMARKS))

import influence_gpu  # noqa: E402


def _env(**extra):
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra,
            "PYTHONPATH": os.pathsep.join(filter(None, [extra.get("PYTHONPATH"), str(ROOT),
                                                        os.environ.get("PYTHONPATH")]))}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_influence_gpu_dry_run(tmp_path):
    out = tmp_path / "influence_gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/influence_gpu.py", "--dry-run",
                           "--tmp", str(tmp_path), "--json", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    n, q = r["sizes"]["n"], r["sizes"]["queries"]
    assert r["dry_run"] and q == 64 and r["device"] == "cpu (dry run)"
    o = r["parts"]["ours"]
    assert o["status"] == "ok", o
    for key in ("build_s", "train_and_snapshot_s", "load_s", "posterior_s", "scores_s",
                "precondition_s", "read_s", "examples_per_s", "query_examples_per_s",
                "peak_memory_bytes", "snapshot_bytes", "query_bytes_per_group"):
        assert _positive(o[key]), (key, o[key])
    assert o["updates"] >= 1
    assert o["precondition_s"] < o["scores_s"]
    assert o["examples_per_s"] == pytest.approx(n / o["read_s"])
    # every training example read once: the 64 queries in one pass
    assert o["examples_read"] == n and o["one_pass"] and o["query_groups"] == 1
    assert o["queries_per_group"] == [q] and len(o["groups_done"]) == 1
    assert o["groups_done"][0]["examples_read"] == n
    assert o["scores_shape"] == [q, n] and o["scores_finite"] and _positive(o["scores_abs_mean"])
    assert o["memory_plan"]["query_rows"] == q * o["memory_plan"]["tracked_weights"] * 4
    assert o["feature_dtype"] == "torch.float32"  # a bf16 model's influence features
    assert len(o["layers"]) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    k = r["parts"]["kronfluence"]
    if importlib.util.find_spec("kronfluence") is None:
        assert k["status"] == "absent" and "not importable" in k["reason"], k
        assert "kronfluence: absent" in proc.stdout
    else:
        assert k["status"] == "ok", k
        assert r["kronfluence"] == influence_gpu.KF_VERSION
        assert sorted(k["layers"]) == sorted(o["layers"])  # the same modules on both sides
        assert set(k["stages"]) == {"covariance", "eigendecomposition", "lambda", "score"}
        for key in ("fit_s", "score_s", "total_s", "examples_per_s",
                    "fit_and_score_examples_per_s", "peak_memory_bytes"):
            assert _positive(k[key]), (key, k[key])
        assert all(_positive(v["s"]) and _positive(v["peak_memory_bytes"])
                   for v in k["stages"].values())
        assert k["fit_s"] == pytest.approx(sum(k["stages"][s]["s"] for s in
                                               ("covariance", "eigendecomposition", "lambda")))
        assert k["examples_per_s"] == pytest.approx(n / k["score_s"])
        assert k["query_batch"] == q and k["training_set_reads"] == 3
        assert k["examples_read"] == 3 * n
        assert k["scores_shape"] == [q, n] and k["scores_finite"]
        assert k["factor_args"]["strategy"] == "ekfac"
        assert k["score_args"]["damping_factor"] in (None, "None")  # its heuristic
    # the table, last
    assert "training examples / s" in proc.stdout and f"of N = {n}" in proc.stdout
    assert [row[0] for row in r["table"]][-1] == "training examples read"
    assert not any(tmp_path.glob("kfac-infl-gpu-*")) and not any(tmp_path.glob("kf-infl-gpu-*"))


def test_kronfluence_absent_is_reported_with_its_reason(tmp_path):
    """A kronfluence that cannot be imported: the part is reported absent, with the import
    error, and the run still succeeds (ours is left out here: the dry run above runs it)."""
    fake = tmp_path / "site" / "kronfluence"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no kronfluence in this test')\n")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "benchmarks/influence_gpu.py", "--dry-run",
                           "--only", "kronfluence", "--json", str(out)], cwd=ROOT,
                          env=_env(PYTHONPATH=str(tmp_path / "site")), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    k = json.loads(out.read_text())["parts"]["kronfluence"]
    assert k["status"] == "absent"
    assert "no kronfluence in this test" in k["reason"] and "bench-peers" in k["reason"]
    assert "kronfluence: absent: kronfluence is not importable" in proc.stdout


def test_a_part_past_its_limit_is_killed_and_reported(tmp_path):
    job = influence_gpu.Limited([sys.executable, "-c", "import time; print('up', flush=True);"
                                 " time.sleep(60)"], 2.0, dict(os.environ), "")
    t = time.perf_counter()
    rc, tail, secs = job.wait()
    assert rc is None and tail == ["up"] and secs < 20 and time.perf_counter() - t < 20
    report = {"sizes": {"n": 512}, "parts": {
        "ours": {"status": "timeout", "seconds": 150, "limit_s": 150, "build_s": 3.0,
                 "train_and_snapshot_s": 40.0},
        "kronfluence": {"status": "absent", "limit_s": 170, "reason": "x"}}}
    rows = {r[0]: r[1:] for r in influence_gpu.table(report)}
    assert rows["status"] == ["timeout", "absent"]
    assert rows["training examples / s"][0] == "—"
    assert "40.0" in rows["factors"][0]


def test_query_plans_at_one_h200():
    """The passes planned for the ~1.1B Llama on one H200 (figures of the docstring): ours,
    float32 rows of 0.969e9 weights (kept in blocks, held once), ~136e9 bytes free beside
    31e9 of batches and reserve: 27 queries per group, 3 groups; kronfluence, bf16 query
    gradients beside ~15e9 of factors: a query batch of 32, two reads."""
    w = 22 * (2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 5632 * 2048)
    assert w == pytest.approx(0.969e9, rel=1e-3)
    assert influence_gpu.query_groups(64, 4 * w, int(136e9), int(31e9)) == 3
    assert influence_gpu.query_groups(64, 4 * w, None, 0) == 1  # the CPU: no limit
    assert influence_gpu.query_groups(64, 4 * w, int(40e9), int(36e9)) == 64  # one per group
    assert influence_gpu.query_groups(8, 100, 10_000, 0) == 1
    assert influence_gpu.query_groups(8, 100, 500, 0) == 2  # 5 per group -> 2 groups
    assert influence_gpu.kf_query_batch(64, w, int(15e9), int(147e9), int(12e9)) == 32
    assert influence_gpu.kf_query_batch(64, w, int(15e9), None, 0) == 64
    assert influence_gpu.kf_query_batch(64, w, int(15e9), int(20e9), int(12e9)) == 1
