"""Snapshot files: round trip, eigendecomposition, and every way a directory can be broken."""

import json
import os
import shutil

import pytest
import torch

from kfac_stream import Snapshot, SnapshotError
from kfac_stream.snapshot.manifest_types import to_json
from kfac_stream.stats.spectrum import safe_psd_eigh, spectrum_stats

from harness import run
from models import text_examples, tiny_gpt2
from reference import rel_err

# The FP16-stored factor is PSD only up to its rounding (2**-11 relative per entry), so a few
# eigenvalues come out slightly negative and are clipped to 0: Q diag(λ) Qᵀ then differs from
# the stored factor by that clipped part, measured up to 4e-5 here; float32 eigenvectors add
# ~1e-7.
EIG_FP16_TOL = 2e-4


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("snap")
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(8, 12),
                   {"storage_dtype": "float16", "snapshot_every": 2, "max_dense_dim": 60},
                   batch=2, tmp_path=tmp, record=False)
    return tmp / "kfac", cb


def copy_of(root, tmp_path, step="step-00000004"):
    dst = tmp_path / "kfac"
    shutil.copytree(root, dst)
    return dst, dst / step


def test_round_trip_is_bit_identical_and_eigendecomposition_reconstructs(snapshots):
    root, cb = snapshots
    snap = Snapshot.latest(root)
    live = cb.factors()
    assert snap.step == 4 and snap.manifest.format_version == 3
    n_diag = 0
    for name in snap.layer_names:
        lf = snap[name]
        assert torch.equal(lf.A, live[name][0]) and torch.equal(lf.G, live[name][1])
        for f in ("A", "G"):
            mat = getattr(lf, f)
            vals, vecs = getattr(lf, f"{f}_eigvals"), getattr(lf, f"{f}_eigvecs")
            assert (vals >= 0).all()
            if mat.dim() == 1:
                n_diag += 1
                assert vecs is None and torch.equal(vals, mat.clamp(min=0))
                continue
            recon = (vecs.double() * vals.double()) @ vecs.double().T
            assert rel_err(recon, mat.double()) <= EIG_FP16_TOL
            st = to_json(getattr(lf.entry, f).spectrum)
            assert st == spectrum_stats(safe_psd_eigh(mat)[0])
    assert n_diag == 4  # mlp.c_fc G (64) and mlp.c_proj A (65) > max_dense_dim=60, two blocks


def test_safe_psd_eigh_clips_and_symmetrises():
    x = torch.randn(5, 3, dtype=torch.float64)
    f = x @ x.T  # rank 3: two eigenvalues are rounding noise around 0
    f[0, 1] += 1e-12  # slightly asymmetric
    w, q = safe_psd_eigh(f)
    assert (w >= 0).all() and w[:2].max() < 1e-12
    assert rel_err(q @ torch.diag(w) @ q.T, (f + f.T) / 2) <= 1e-12
    st = spectrum_stats(torch.tensor([0.0, 1.0, 1.0, 2.0]))
    assert st["max"] == 2.0 and st["trace"] == 4.0 and st["cond"] == 2.0
    assert st["eff_rank"] == pytest.approx(2.0 ** 1.5)  # exp(H([.25, .25, .5]))


def _manifest(step_dir):
    return json.loads((step_dir / "manifest.json").read_text())


def _shard(step_dir):
    return next(step_dir.glob("*.safetensors"))


def flip_byte(step_dir):
    p = _shard(step_dir)
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


def truncate(step_dir):
    p = _shard(step_dir)
    p.write_bytes(p.read_bytes()[:-100])


def missing_shard(step_dir):
    _shard(step_dir).unlink()


def unknown_version(step_dir):
    m = _manifest(step_dir)
    m["format_version"] = 99
    (step_dir / "manifest.json").write_text(json.dumps(m))


def not_json(step_dir):
    (step_dir / "manifest.json").write_text("{ this is not json")


def lies_about_shapes(step_dir):
    m = _manifest(step_dir)
    first = next(iter(m["layers"]))
    m["layers"][first]["A"]["dim"] += 1
    (step_dir / "manifest.json").write_text(json.dumps(m))


def half_written(step_dir):
    (step_dir / "manifest.json").unlink()  # the writer puts the manifest in last


@pytest.mark.parametrize("damage,needle", [
    (flip_byte, "sha256 mismatch"), (truncate, "sha256 mismatch"),
    (missing_shard, "is missing"), (unknown_version, "unknown format_version 99"),
    (not_json, "not valid JSON"), (lies_about_shapes, "manifest says"),
    (half_written, "manifest.json: missing (snapshot incomplete)"),
])
def test_damaged_snapshot_raises_and_latest_skips_it(snapshots, tmp_path, damage, needle):
    root, _ = snapshots
    root2, newest = copy_of(root, tmp_path)
    damage(newest)
    with pytest.raises(SnapshotError) as e:
        Snapshot.load(newest)
    assert needle in str(e.value) and "step-00000004" in str(e.value)
    assert Snapshot.latest(root2).step == 2  # the previous complete snapshot


def test_temporary_directories_are_invisible(snapshots, tmp_path):
    root, _ = snapshots
    root2, newest = copy_of(root, tmp_path)
    os.rename(newest, root2 / ".step-00000004.tmp-0")
    assert Snapshot.latest(root2).step == 2
    with pytest.raises(SnapshotError, match="no complete snapshot"):
        Snapshot.latest(tmp_path / "empty")


def test_latest_on_a_run_directory_points_at_its_kfac_folder(snapshots, tmp_path):
    """``Snapshot.latest(run_dir)`` names the folder below that holds the snapshots
    (the app's ``<run>/kfac``); the same call there loads."""
    root, _ = snapshots
    run = tmp_path / "run"
    run.mkdir()
    kfac, _ = copy_of(root, run)
    (run / "checkpoint-2").mkdir()  # a Trainer checkpoint beside it: not a snapshot root
    with pytest.raises(SnapshotError) as e:
        Snapshot.latest(run)
    msg = str(e.value)
    assert "no complete snapshot found" in msg and f"snapshots are in {kfac}" in msg, msg
    assert "checkpoint-2" not in msg and "\n" not in msg
    assert Snapshot.latest(kfac).step == 4


def test_layer_table_prints_long_layer_names_whole(snapshots):
    """`kfac-stream inspect`'s table no longer cuts names from the left (two LoRA
    adapters of one module differed only in the cut part); columns stay aligned."""
    from kfac_stream.snapshot.layer_table import layer_table

    root, _ = snapshots
    snap = Snapshot.latest(root)
    prefix = "base_model.model.model.layers.0.mlp.down_proj.lora_A.default."

    class Renamed:  # the same factors under 80-character names
        path, step, manifest = snap.path, snap.step, snap.manifest
        layer_names = [prefix + n for n in snap.layer_names]

        def __getitem__(self, name):
            return snap[name[len(prefix):]]

    lines = layer_table(Renamed()).splitlines()
    rows = lines[3:]
    assert len(rows) == 2 * len(snap.layer_names)
    for name, row in zip([n for n in Renamed.layer_names for _ in "AG"], rows):
        assert row.startswith(name + " "), row
    assert len({r.index(" A ") if " A " in r else r.index(" G ") for r in rows}) == 1
    assert len({len(r) for r in rows}) == 1 and lines[1].startswith("layer ")


def test_eigh_failure_is_retried_with_a_shift(monkeypatch):
    real = torch.linalg.eigh
    calls = []

    def flaky(x):
        calls.append(1)
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("simulated: the algorithm failed to converge")
        return real(x)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    x = torch.randn(40, 6, dtype=torch.float64)
    f = x.T @ x / 40
    w, q = safe_psd_eigh(f)
    assert len(calls) == 2
    assert rel_err((q * w) @ q.T, f) <= 1e-9  # the retry's tiny shift is taken out again


def test_loading_never_unpickles(snapshots, monkeypatch):
    import pickle

    def forbidden(*a, **k):
        raise AssertionError("pickle/torch.load reached from Snapshot.load")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                      (torch, "load")):
        monkeypatch.setattr(mod, name, forbidden)
    root, _ = snapshots
    snap = Snapshot.latest(root)
    assert len(snap.layer_names) == 8


@pytest.mark.parametrize("bad", [123, None, b"/tmp", ["step-00000004"]])
def test_a_path_argument_that_is_not_a_path_is_refused(bad):
    for call, arg in ((Snapshot.load, "path"), (Snapshot.latest, "root")):
        with pytest.raises(SnapshotError, match=rf"{arg}=.* is not allowed: must be a str or "
                                                r"os\.PathLike"):
            call(bad)


def test_manifest_alone_is_checked_against_the_schema(snapshots, tmp_path):
    """`read_manifest` (what the spectrum monitor reads on the training thread) applies the
    same schema as `Snapshot.load`, without opening a shard; `read_manifest_json` gives the
    same document as its JSON dict."""
    from kfac_stream.snapshot.snapshot import read_manifest, read_manifest_json

    root, _ = snapshots
    _, newest = copy_of(root, tmp_path)
    assert read_manifest(newest).step == 4
    _shard(newest).unlink()
    assert read_manifest(newest).step == 4  # shards are not its business
    assert read_manifest_json(newest) == _manifest(newest) == read_manifest(newest).to_json()
    m = _manifest(newest)
    m["counts"]["tokens_seen"] = -1000
    (newest / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SnapshotError, match=r"manifest\.json: counts\.tokens_seen is -1000; "
                                            r"expected an integer ≥ 0"):
        read_manifest(newest)


def test_manifest_dataclasses_hold_every_key_written(snapshots):
    """The manifest a run writes reads into `Manifest` and serialises back to the same JSON:
    every key written is a field of the dataclasses the schema is generated from."""
    import dataclasses

    from kfac_stream.snapshot.manifest_types import SCHEMA, Manifest
    from kfac_stream.snapshot.schema import MapOf, Record

    root, _ = snapshots
    snap = Snapshot.latest(root)
    meta = snap.meta
    assert Manifest.from_json(meta).to_json() == meta
    assert snap.manifest == Manifest.from_json(meta)  # what the package reads

    def unknown(value, rule, path):
        if isinstance(rule, MapOf):
            return [k for name, v in value.items() for k in unknown(v, rule.value, path)]
        if not isinstance(rule, Record) or not isinstance(value, dict):
            return []
        return [f"{path}.{k}" for k in value if k not in rule.fields] + [
            k for key, f in rule.fields.items() if key in value
            for k in unknown(value[key], f.rule, f"{path}.{key}")]

    assert unknown(meta, SCHEMA, "") == []
    assert [f.name for f in dataclasses.fields(Manifest)] == list(SCHEMA.fields)


def test_manifest_counts_are_the_tracker_counters():
    """`Counts` is the tracker's `Counters` without ``skipped_steps`` (beside the counts in
    the manifest), the store's `Traffic` fields included, each one required by the schema."""
    import dataclasses

    from kfac_stream.snapshot.manifest_types import SCHEMA, Counts
    from kfac_stream.store.traffic import Traffic
    from kfac_stream.tracking.factor_updates import Counters

    counts = {f.name for f in dataclasses.fields(Counts)}
    assert counts == {f.name for f in dataclasses.fields(Counters)} - {"skipped_steps"}
    assert {f.name for f in dataclasses.fields(Traffic)} <= counts
    record = SCHEMA.fields["counts"].rule
    assert set(record.fields) == counts and all(f.required for f in record.fields.values())
    assert record.fields["device_budget"].rule.lo == -1  # -1: not decided yet
