"""`make gpu-check`'s dry run (benchmarks/gpu_check.py on the CPU: what CI can run of it). The
figures of a real run need a GPU (docs/gpu.md); this checks that the script works end to end
(every part in its subprocess under its time limit, the JSON with every part, the one summary
table) and that its CPU parts hold: the fold equal to the rounded rows' Gram, the store's
device path (the CPU standing in for the device) equal to the float64 EMA within its stated
tolerance with no bytes moved and no host entries touched per update, no host sync of
kfac_stream's on the training thread, the exact one-rank exchange. Plus the parent's
bookkeeping on made-up input: a part past its limit is killed and reported, and a part that
did not finish is a MISS in the table."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from repo_paths import ROOT

# fp32 accumulation of 64 bf16 products per entry: relative error ~2^-24·8; 1e-5 is loose
FP32_ACCUMULATION_TOL = 1e-5
# the script checks Q diag(w) Qᵀ against the factor in float32 (where it built the factor):
# rounding of ~d·2^-24 of the top eigenvalue for d ≤ 96, 1e-5 with room
EIGH_CHECK_TOL = 1e-5
# the store's flushed FP16 factor against the float64 EMA of the unrounded rows: fp16 storage
# (2^-11) plus the rows' bf16 rounding (≤ 1.5e-3 relative Frobenius), as the script states
STORE_TOL = 2e-3


@functools.cache
def _gpu_check():
    """The script as a module (its helpers; importing it runs nothing)."""
    spec = importlib.util.spec_from_file_location("gpu_check",
                                                  ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "GPU_CHECK_JSON": str(out), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    took = time.perf_counter() - t
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "CUDA is not available" in text and "dry run" in text
    assert "min_window_sequences=0 keeps the long-run MC share" in text  # says so, and why
    # one summary table, printed last, one row per part / setting
    assert text.count("gpu_check summary") == 1
    table = text[text.index("gpu_check summary"):]
    for row in ("1 CUDA tests", "2 eigh", "2 fold", "2 store device path",
                "3a fp32+autocast plain", "3a fp32+autocast defaults",
                "3a fp32+autocast update_every=1", "3b bf16 plain", "3b bf16 defaults",
                "3b bf16 update_every=1", "3a fp32+autocast replay only",
                "3a fp32+autocast fold only", "4 exchange", "total"):
        assert f"\n{row}" in table, row
    assert "MISS" not in table

    r = json.loads(out.read_text())
    assert r["dry_run"] and r["ok"] and r["device"] == "cpu"
    gc = _gpu_check()
    assert set(r["parts"]) == {p.name for p in gc.PARTS}
    assert all(p["status"] == "ok" for p in r["parts"].values()), \
        {k: p["status"] for k, p in r["parts"].items()}
    assert len(r["summary"]) == 16  # with the ablation's two rows per training setting

    tests = r["parts"]["cuda_tests"]
    assert "tests/unit/tracking/test_worker_eigh_and_cuda.py" in tests["files"]
    assert tests["collected"] > 0
    assert "tests/bench/test_gpu_check.py" not in tests["files"]  # no dry run inside part 1

    micro = r["parts"]["micro"]
    assert all(e["max_err_rel_to_top"] <= EIGH_CHECK_TOL for e in micro["eigh"].values())
    assert micro["fold"]["rel_err"] <= FP32_ACCUMULATION_TOL
    store = micro["store"]
    assert store["ok"] and store["rel_err"] <= STORE_TOL
    assert store["bytes_moved_by_updates"] == 0
    assert store["traffic_before_flush"]["host_entries"] == 0
    assert store["flush_bytes"] > 0 and store["traffic_after_flush"]["flush_syncs"] == 1

    for setting in ("train_fp32_autocast", "train_bf16"):
        runs = r["parts"][setting]["runs"]
        assert set(runs) == {*gc.RUNS, gc.FINAL_RUN}
        assert all(len(rows) == gc.DRY["blocks"] for name, rows in
                   r["parts"][setting]["blocks"].items() if name != gc.FINAL_RUN)
        for name, row in runs.items():
            assert row["mean_s_per_step"] > 0 and row["median_s_per_step"] > 0
            assert len(row["step_seconds"]) == row["steps"] - 1
            assert row["kfac_host_syncs"] == {}, (setting, name, row["kfac_host_syncs"])
        for name in ("defaults", "update_every=1"):
            row = runs[name]
            assert row["updates"] >= 1, (setting, name)  # the tracker ran (step 0 updates)
            assert row["mc_sequences"] == 0.05  # the long-run share, not raised
            # the device path (CPU stand-in): no host work and no copies per update; the
            # final flush moves every stored entry each way, with one host read
            assert row["host_entries"] == 0 and row["budget_flushes"] == 0
            assert row["bytes_to_host_per_update"] == 0 == row["bytes_to_device_per_update"]
            assert row["final_flush_bytes_to_host"] > 0 and row["final_flush_syncs"] == 1
            assert row["device_budget"] > 0 and row["peak_resident_bytes"] > 0
            assert row["ratio_to_plain"] > 0
        assert runs["defaults"]["projected_ratio"] is not None

    assert r["parts"]["exchange"]["backend"] == "gloo" and r["parts"]["exchange"]["exact"]
    # not a timing claim: only catches a dry run that ran the GPU sizes (~30 s alone here, 196 s
    # once on 2 cores shared with other jobs; the real sizes take hours on a CPU)
    assert took < 900, took


def test_a_part_past_its_limit_is_killed_and_the_table_says_so():
    gc = _gpu_check()
    t = time.perf_counter()
    rc, tail, secs = gc._run_limited(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        1.0, dict(os.environ))
    assert rc is None and time.perf_counter() - t < 20 and tail == ["started"]

    report = {"seconds": 400.0, "sizes": gc.FULL,
              "parts": {"cuda_tests": {"status": "ok", "passed": 20, "seconds": 30},
                        "micro": {"status": "timeout", "seconds": 45}}}
    rows = {row["part"]: row for row in gc.summarise(report, dry=False)}
    assert rows["1 CUDA tests"]["verdict"] == "PASS"
    for part in ("2 eigh", "2 store device path", "3a fp32+autocast plain", "3b bf16 plain",
                 "4 exchange"):
        assert rows[part]["verdict"] == "MISS", rows[part]  # not reached / timed out
    assert rows["total"]["verdict"] == "MISS"  # 400 s > 6 min


def test_pytest_summary_is_parsed():
    gc = _gpu_check()
    counts = gc._pytest_counts([
        "FAILED tests/unit/tracking/test_worker_eigh_and_cuda.py::test_x - AssertionError: bad",
        "SKIPPED [1] tests/unit/tracking/test_worker_eigh_and_cuda.py:66: needs a CUDA GPU",
        "1 failed, 18 passed, 1 skipped, 2 warnings in 31.2s"])
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (18, 1, 1)
    assert len(counts["failures"]) == 1 and len(counts["skips"]) == 1
