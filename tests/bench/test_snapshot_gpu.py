"""benchmarks/snapshot_gpu.py's dry run (the GPU snapshot-cost benchmark on a tiny Llama on the CPU:
what CI can run of it). The figures of a real run need a GPU (docs/gpu.md); this checks the
sequence end to end: a periodic snapshot from a step's end, training on until it is complete,
the final snapshot, its posterior, the reference work, the JSON and the summary (not judged
without a GPU), and that what it measures is consistent with the callback's own records."""

import json
import os
import subprocess
import sys

import pytest

from repo_paths import ROOT


@pytest.mark.slow
def test_snapshot_gpu_dry_run(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "benchmarks/snapshot_gpu.py", "--dry-run",
                           "--reference", "--tmp", str(tmp_path), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "nothing judged" in proc.stdout
    r = json.loads(out.read_text())
    tr = r["tracked"]
    p, f = tr["periodic"], tr["final"]
    assert p["complete_by_step"] is not None and p["complete_by_step"] > p["at_step"]
    assert not tr["cut_short_by_deadline"]
    assert tr["steps"] >= p["at_step"] + r["sizes"]["after"]
    assert len(tr["step_seconds"]) == tr["steps"] - 1
    # two snapshots (periodic, final), each eigendecomposed and written through the stream
    assert len(tr["phases"]["finish_s"]) == 2 and len(tr["phases"]["eigh_s"]) == 2
    assert 0 < f["eigh_s"] <= f["finish_s"] <= f["seconds"]
    assert 0 <= f["writer_waited_s"] <= f["finish_s"]
    assert f["bytes"] > 0 and tr["spare_bytes"] >= 0
    assert 0 <= p["hold_s"] < f["seconds"]
    assert r["posterior"]["tau"] > 0 and r["posterior"]["marglik_s"] >= 0
    assert r["reference"]["factors"] == 22  # 2 layers x 11 factors of the tiny Llama
    rows = {row["what"]: row for row in r["summary"]}
    assert all(row["verdict"] == "—" for row in rows.values())  # not judged on the CPU
    assert "final snapshot: last step -> train() returns" in rows
    # the periodic snapshot is deleted, the temporary directory is gone
    assert not any(tmp_path.glob("kfac-snapshot-gpu-*"))
