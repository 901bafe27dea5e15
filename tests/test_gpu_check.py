"""`make gpu-check`'s dry run (benchmarks/gpu_check.py on the CPU: what CI can run of it). The
figures of a real run need a GPU (docs/gpu.md); this checks that the script works end to end
and that its CPU parts hold: exact one-rank exchange, no host sync of kfac_stream's on the
training thread, the fold equal to the rounded rows' Gram."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# fp32 accumulation of 64 bf16 products per entry: relative error ~2^-24·8; 1e-5 is loose
FP32_ACCUMULATION_TOL = 1e-5
# the script checks Q diag(w) Qᵀ against the factor in float32 (where it built the factor):
# rounding of ~d·2^-24 of the top eigenvalue for d ≤ 96, 1e-5 with room
EIGH_CHECK_TOL = 1e-5


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "GPU_CHECK_JSON": str(out), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CUDA is not available" in proc.stdout and "dry run" in proc.stdout
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["ok"] and r["device"] == "cpu"
    assert set(r["train"]) == {"plain", "defaults", "update_every=1"}
    for name, row in r["train"].items():
        assert row["kfac_host_syncs"] == {}, (name, row["kfac_host_syncs"])
        assert row["seconds_per_step"] > 0
    assert {"updates", "waits"} <= set(r["train"]["update_every=1"])  # the tracker ran
    assert r["exchange"] == {**r["exchange"], "backend": "gloo", "exact": True}
    assert r["fold"]["fold_rel_err"] <= FP32_ACCUMULATION_TOL
    assert all(e["max_err_rel_to_top"] <= EIGH_CHECK_TOL for e in r["eigh"].values())
