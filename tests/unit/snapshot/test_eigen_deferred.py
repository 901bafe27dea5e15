"""Periodic snapshots with their eigendecomposition deferred (`kfac_stream.snapshot.eigen_rule`,
`kfac_stream.snapshot.spectra_estimate`, `kfac_stream.snapshot.eigen_sidecar`): the rule,
no eigh in a deferred snapshot (counted), the fold off the training thread, the cache equal to
an eager decomposition byte for byte, concurrent first uses, kill -9 during the cache write,
and every corruption of the cache refused."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kfac_stream import Snapshot
from kfac_stream.exceptions import KFACConfigError, SnapshotError
from kfac_stream.snapshot import eigen_rule, eigen_sidecar
from kfac_stream.snapshot.contents import snapshot_contents
from kfac_stream.snapshot.eigen_rule import IN_RUN_SHARE, EighRate, decide
from kfac_stream.snapshot.manifest_types import to_json
from kfac_stream.snapshot.sequence import CapturedSnapshot, EigenPlan, finish_snapshot
from kfac_stream.stats import spectrum
from kfac_stream.tracking.factor_updates import FactorUpdater

from harness import run
from models import text_examples, tiny_gpt2
from repo_paths import ROOT as REPO

# -- the rule ------------------------------------------------------------------------------------

def test_rule_decides_by_the_predicted_share():
    assert decide("auto", final=True).decompose  # the final snapshot, always
    assert decide("always", final=False).decompose
    assert not decide("final", final=False).decompose
    assert not decide("auto", final=False, eigh_seconds=1.0).decompose  # step time unknown
    at = decide("auto", False, eigh_seconds=IN_RUN_SHARE * 500 * 0.2, step_seconds=0.2,
                snapshot_every=500)
    assert at.decompose and at.share == pytest.approx(IN_RUN_SHARE)
    above = decide("auto", False, eigh_seconds=1.01 * IN_RUN_SHARE * 100, step_seconds=1.0,
                   snapshot_every=100)
    assert not above.decompose and "above 1%" in above.reason
    with pytest.raises(ValueError):
        decide("sometimes", False)


def test_rule_on_the_measured_figures():
    """The 1.1B Llama on one H200 (its final snapshot: 18.5 s of eigh; 107 ms steps, every
    500): the prior errs high (per factor the larger of the calibrated c·d³ and the power law
    through the single-eigh timings), deferred either way; a measured rate replaces it."""
    rate = EighRate("cuda")
    sides = 22 * ([2048] * 6 + [5632] * 3 + [256] * 2)
    cubic = sum(eigen_rule.GPU_SECONDS_PER_D3 * d ** 3 + eigen_rule.GPU_SECONDS_PER_FACTOR
                for d in sides)
    assert cubic == pytest.approx(18.5 + 242 * eigen_rule.GPU_SECONDS_PER_FACTOR, rel=1e-2)
    (d1, t1), (d2, t2) = sorted(eigen_rule.GPU_SINGLE_EIGH.items())
    law = [t1 * (d / d1) ** (math.log(t2 / t1) / math.log(d2 / d1)) for d in sides]
    assert law[6] == pytest.approx(t1 * (5632 / 4096) ** 1.9570, rel=1e-3)
    expected = sum(max(eigen_rule.GPU_SECONDS_PER_D3 * d ** 3
                       + eigen_rule.GPU_SECONDS_PER_FACTOR, w) for d, w in zip(sides, law))
    assert rate.seconds(sides) == pytest.approx(expected, rel=1e-12) and expected >= cubic
    d = decide("auto", False, rate.seconds(sides), 0.107, 500)
    assert not d.decompose and d.share > 0.3
    rate.measured([1000, 2000], 9e9 * 2e-12 + 2 * eigen_rule.GPU_SECONDS_PER_FACTOR)
    assert rate.source == "measured" and rate.per_d3 == pytest.approx(2e-12)
    assert rate.seconds([3000]) == pytest.approx(27e9 * 2e-12 + eigen_rule.GPU_SECONDS_PER_FACTOR)


def test_ekfac_refuses_final_only():
    from kfac_stream import KFACConfig

    with pytest.raises(KFACConfigError, match="eigendecompose='final'"):
        KFACConfig(ekfac=True, eigendecompose="final")
    with pytest.raises(KFACConfigError, match="eigendecompose"):
        KFACConfig(eigendecompose="never")


# -- a run ---------------------------------------------------------------------------------------

def _count_eighs(monkeypatch) -> list[int]:
    """Counts the factor eigendecompositions (the CPU path's `safe_psd_eigh`, whatever thread
    calls it); the Lanczos estimates never call it."""
    calls: list[int] = []
    real = spectrum.safe_psd_eigh

    def counted(f, *a, **k):
        calls.append(int(f.shape[0]))
        return real(f, *a, **k)

    monkeypatch.setattr(spectrum, "safe_psd_eigh", counted)
    return calls


def test_default_rule_defers_periodic_snapshots_and_folds_off_the_training_thread(
        tmp_path, monkeypatch):
    """At the default rule, with eigendecompositions as costly per d³ as the mid-size proxy
    predicts for its factors (scaled so these tiny ones are too: share > 1%), the periodic
    snapshots launch no eigh and hold estimated spectra; the final one is decomposed; each
    snapshot's fold ran off the training thread."""
    monkeypatch.setattr(eigen_rule, "CPU_THREAD_SECONDS_PER_D3", 1.0)
    calls = _count_eighs(monkeypatch)
    folds: list[str] = []
    real_fold = FactorUpdater.fold_now

    def fold_now(self):
        folds.append(threading.current_thread().name)
        return real_fold(self)

    monkeypatch.setattr(FactorUpdater, "fold_now", fold_now)
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(16, 12),
                   {"storage_dtype": "float16", "snapshot_every": 3}, batch=2,
                   tmp_path=tmp_path, record=False)
    metas = [json.loads(Path(p, "manifest.json").read_text()) for p in cb.snapshots]
    assert [m["step"] for m in metas] == [3, 6, 8]
    periodic, final = metas[:-1], metas[-1]
    n_factors = len({e[f]["key"] for e in final["layers"].values() for f in ("A", "G")})
    assert len(calls) == n_factors  # the final snapshot's only
    for m in periodic:
        e = m["eigen"]
        assert not e["in_run"] and e["policy"] == "auto" and e["share"] > IN_RUN_SHARE
        assert e["device"] is None and "above 1%" in e["reason"]
        assert not list(Path(cb.output_dir, f"step-{m['step']:08d}").glob(".eigen*"))
    assert final["eigen"]["in_run"] and final["eigen"]["final"]
    assert final["eigen"]["device"] == "cpu" and final["eigen"]["seconds"] > 0
    assert folds and "MainThread" not in folds[:len(periodic)]  # the queued folds


# -- the cache -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One tracker record written twice: decomposed in the run, and deferred."""
    tmp = tmp_path_factory.mktemp("pair")
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(8, 12),
                   {"storage_dtype": "float16"}, batch=2, tmp_path=tmp, record=False)
    record = cb.tracker.export()
    paths = {}
    for name, eigen in (("eager", None),
                        ("deferred", EigenPlan("final", False, 0.0, 1, EighRate(None)))):
        tensors, manifest = snapshot_contents(record, 5)
        paths[name] = finish_snapshot(CapturedSnapshot(5, tensors, manifest, {}),
                                      str(tmp / name), eigen=eigen)[0]
    return paths


def _fresh(pair, tmp_path) -> str:
    dst = tmp_path / "snap"
    shutil.copytree(pair["deferred"], dst)
    return str(dst)


def test_cached_eigendecomposition_equals_the_eager_one_byte_for_byte(pair, tmp_path):
    eager = Snapshot.load(pair["eager"])
    path = _fresh(pair, tmp_path)
    first = Snapshot.load(path, eigen=True)
    again = Snapshot.load(path)  # from the cache, at the first access
    assert not first.in_run_eigen and eager.in_run_eigen
    assert os.path.isdir(os.path.join(path, "eigen"))
    for snap in (first, again):
        for name in eager.layer_names:
            for part in ("A_eigvals", "A_eigvecs", "G_eigvals", "G_eigvecs"):
                a, b = getattr(eager[name], part), getattr(snap[name], part)
                assert (a is None) == (b is None), (name, part)
                if a is not None:
                    assert a.dtype == b.dtype and a.numpy().tobytes() == b.numpy().tobytes()
    # the record's exact spectra are the eager manifest's
    for entry in eager.manifest.layers.values():
        for f in ("A", "G"):
            want = getattr(entry, f)
            got = again.eigen_record.spectra[want.key]
            assert {k: getattr(got, k) for k in ("max", "trace", "cond", "eff_rank")} == \
                to_json(want.spectrum)
    assert again.eigen_record.finished_unix == first.eigen_record.finished_unix  # read, once


def test_deferred_manifest_has_estimates_and_no_eigen_tensors(pair):
    snap = Snapshot.load(pair["deferred"])
    from safetensors import safe_open

    shard = next(Path(pair["deferred"]).glob("shard-*.safetensors"))
    with safe_open(str(shard), "pt") as fh:
        assert not [k for k in fh.keys() if k.endswith((".eigvals", ".eigvecs"))]
    e = snap.manifest.eigen
    assert (e.in_run, e.policy, e.final, e.device) == (False, "final", False, None)
    for entry in snap.manifest.layers.values():
        st = entry.A.spectrum
        assert all(isinstance(getattr(st, k), float) for k in ("max", "trace", "cond",
                                                               "eff_rank"))


_LOADER = """
import sys, json, time
from kfac_stream import Snapshot
{patch}
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
s = Snapshot.load(sys.argv[1], eigen=True)
print(json.dumps(s.eigen_record.finished_unix))
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_two_concurrent_first_loads_make_one_valid_cache(pair, tmp_path):
    path = _fresh(pair, tmp_path)
    start = str(time.time() + 3.0)  # both past their imports, then together
    procs = [_python(_LOADER.format(patch=""), path, start) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    stamps = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert stamps[0] == stamps[1]  # one computed it, the other read its cache
    entries = sorted(os.listdir(path))
    assert "eigen" in entries and not [e for e in entries if e.startswith(".eigen.tmp")]
    assert Snapshot.load(path, eigen=True).eigen_record.finished_unix == stamps[0]


_KILLED_WRITER = """
import os, time
from kfac_stream.snapshot import eigen_sidecar
real = eigen_sidecar.write_shard
def slow(tmp, *a, **k):
    out = real(tmp, *a, **k)
    open(os.environ["KFAC_READY"], "w").close()
    time.sleep(600)  # killed here: the tensors written, no record, not renamed
    return out
eigen_sidecar.write_shard = slow
"""


def test_kill_9_during_the_cache_write_leaves_the_snapshot_valid(pair, tmp_path):
    path = _fresh(pair, tmp_path)
    ready = tmp_path / "ready"
    os.environ["KFAC_READY"] = str(ready)
    try:
        proc = _python(_LOADER.format(patch=_KILLED_WRITER), path, "0")
    finally:
        del os.environ["KFAC_READY"]
    deadline = time.time() + 300
    while not ready.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert ready.exists(), proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(os.path.join(path, "eigen"))  # absent, not half-written
    assert [e for e in os.listdir(path) if e.startswith(".eigen.tmp")]  # the leftover
    snap = Snapshot.load(path)  # the snapshot itself: valid
    assert snap[snap.layer_names[0]].A_eigvals is not None  # recomputed and cached now
    assert os.path.isdir(os.path.join(path, "eigen"))
    assert not [e for e in os.listdir(path) if e.startswith(".eigen.tmp")]
    Snapshot.load(path, eigen=True)  # the new cache verifies


def _cached(pair, tmp_path) -> str:
    path = _fresh(pair, tmp_path)
    Snapshot.load(path, eigen=True)
    return path


def _corruptions(path: str):
    """``(label, how)`` of every corruption of a cache (each applied to a fresh copy)."""
    cache = Path(path, "eigen")
    tensors = next(cache.glob("*.safetensors"))
    size = tensors.stat().st_size
    record = json.loads((cache / eigen_sidecar.RECORD).read_text())

    def flip(at):
        def how(c):
            f = next(c.glob("*.safetensors"))
            b = bytearray(f.read_bytes())
            b[at] ^= 0x40
            f.write_bytes(bytes(b))
        return how

    def edit(fn):
        def how(c):
            r = json.loads((c / eigen_sidecar.RECORD).read_text())
            fn(r)
            (c / eigen_sidecar.RECORD).write_text(json.dumps(r))
        return how

    for at in sorted({0, 8, 20, size // 3, size // 2, size - 5, size - 1}):
        yield f"flip byte {at}", flip(at)
    yield "truncate", lambda c: next(c.glob("*.safetensors")).write_bytes(
        next(c.glob("*.safetensors")).read_bytes()[:-4])
    yield "other snapshot", edit(lambda r: r.update(manifest_sha256="0" * 64))
    yield "wrong size", edit(lambda r: r["tensors"].update(bytes=r["tensors"]["bytes"] + 1))
    yield "wrong digest", edit(lambda r: r["tensors"].update(sha256="f" * 64))
    yield "file outside", edit(lambda r: r.update(file="../manifest.json"))
    yield "no spectra", edit(lambda r: r.pop("spectra"))
    yield "no chunk digests", edit(lambda r: (r["tensors"].pop("chunks"),
                                              r["tensors"].pop("chunk_bytes")))
    yield "chunk digest altered", edit(lambda r: r["tensors"].update(
        chunks=["0" * 64] * len(r["tensors"]["chunks"])))
    yield "format", edit(lambda r: r.update(format="other"))
    yield "version", edit(lambda r: r.update(version=2))
    yield "not json", lambda c: (c / eigen_sidecar.RECORD).write_text("{")
    yield "record missing", lambda c: (c / eigen_sidecar.RECORD).unlink()
    yield "tensors missing", lambda c: next(c.glob("*.safetensors")).unlink()
    yield "a file, not a directory", lambda c: (shutil.rmtree(c), c.write_text("x"))
    yield "a symlink", lambda c: (shutil.move(str(c), str(c) + ".real"),
                                  os.symlink(str(c) + ".real", c))
    assert record["format"] == eigen_sidecar.FORMAT


def test_every_corrupted_cache_is_refused(pair, tmp_path):
    pristine = _cached(pair, tmp_path)
    problems, tried = [], 0
    for label, how in _corruptions(pristine):
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work, symlinks=True)
        how(work / "eigen")
        tried += 1
        try:
            Snapshot.load(str(work), eigen=True)
        except SnapshotError as e:
            if "eigen" not in str(e):
                problems.append(f"{label}: the error does not name the cache: {e}")
            continue
        problems.append(f"{label}: loaded instead of raising SnapshotError")
    print(f"{tried} corruptions of the cache, {len(problems)} not refused")
    assert tried >= 20 and not problems, problems
    Snapshot.load(pristine, eigen=True)  # the pristine copy still loads
