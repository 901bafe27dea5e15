"""Writing a shard in one pass (the safetensors bytes hashed as they are written, by chunks,
in parallel), reading it back verified, and the spectra media from the eigenvalues in
memory."""

import hashlib
import io
import json
import os
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from kfac_stream.exceptions import SnapshotError
from kfac_stream.snapshot import writer
from kfac_stream.snapshot.manifest import stored_key
from kfac_stream.snapshot.media import Spectra, log10_histograms, make_media
from kfac_stream.snapshot.snapshot import Snapshot, read_manifest
from kfac_stream.snapshot.writer import safetensors_chunks, write_safetensors, write_shard
from kfac_stream.utils import files
from kfac_stream.utils.files import (
    file_chunk_digests,
    hash_chunked,
    read_verified,
    write_chunk_hashed,
    write_hashed,
)

from chunk_digests import chunked, root_of
from harness import run
from models import text_examples, tiny_gpt2

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
                                       "uint64") if hasattr(torch, n)]


def random_tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    shape = rng.choice([(), (0,), (1,), (3, 0), (1, 1), (rng.randint(1, 9),),
                        (rng.randint(1, 7), rng.randint(1, 7)), (2, 3, rng.randint(1, 4))])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 8,), dtype=torch.uint8,
                        generator=g)
    t = torch.empty(shape, dtype=dtype)
    n = t.numel() * t.element_size()
    t.reshape(-1).view(torch.uint8)[:] = raw[:n] if dtype != torch.bool else raw[:n] % 2
    return t


def random_dict(rng: random.Random) -> dict[str, torch.Tensor]:
    names = ["a", "b", "A", "z", "layer.0.A", "layer.0.A.scale", "layer.0.A.eigvals",
             "layer.10.G", "layer.2.G", "é", "x y", 'q"uote\\', "tab\tnew\nline\x01", "_"]
    chosen = rng.sample(names, rng.randint(0, len(names)))
    # one dtype for many tensors in some dicts, so that ties in dtype order fall to the names
    pool = rng.choice([DTYPES, [rng.choice(DTYPES)], rng.sample(DTYPES, 3)])
    return {k: random_tensor(rng, rng.choice(pool)) for k in chosen}


@pytest.mark.parametrize("seed", range(60))
def test_stream_writer_is_byte_identical_to_safetensors(seed):
    rng = random.Random(seed)
    tensors = random_dict(rng)
    out = io.BytesIO()
    digest, size = write_safetensors(out, tensors)
    ref = save(tensors)
    assert out.getvalue() == ref
    assert (digest, size) == (hashlib.sha256(ref).hexdigest(), len(ref))


def test_shard_on_disk_is_safetensors_and_its_sha256(tmp_path, monkeypatch):
    rng = random.Random(7)
    tensors = {f"t{i}": random_tensor(rng, dt) for i, dt in enumerate(DTYPES)}
    tensors["big"] = torch.randn(1000, 700)  # several write chunks with a small chunk size
    tensors["big64"] = torch.randn(333, 77, dtype=torch.float64)
    monkeypatch.setattr(writer, "WRITE_CHUNK", 4096 + 2)  # not a multiple of 4 or 8
    monkeypatch.setattr(files, "HASH_CHUNK_BYTES", 1 << 20)  # 3 chunks, pieces straddling them
    info = write_shard(str(tmp_path), tensors, 0, 1)
    path = tmp_path / info["file"]
    data = path.read_bytes()
    assert data == save(tensors)
    assert info == dict(chunked(data, 1 << 20), file=info["file"])
    assert len(info["chunks"]) == 3 and info["bytes"] == len(data) == os.path.getsize(path)
    assert file_chunk_digests(str(path), 1 << 20).root == info["sha256"]
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(tensors)
        for k in f.keys():
            got = f.get_tensor(k)
            assert got.dtype == tensors[k].dtype and got.shape == tensors[k].shape
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               tensors[k].reshape(-1).view(torch.uint8))


def test_shard_bytes_match_write_shard(tmp_path):
    tensors = random_dict(random.Random(3)) | {"w": torch.randn(5, 5).half()}
    blob, info = writer.shard_bytes(tensors, 1, 2)
    disk = write_shard(str(tmp_path), tensors, 1, 2)
    assert info == disk and (tmp_path / disk["file"]).read_bytes() == blob


def test_metadata_and_non_contiguous_tensors():
    t = torch.randn(4, 6).T  # not contiguous: written as its contiguous copy
    out = io.BytesIO()
    write_safetensors(out, {"t": t, "u": torch.arange(3)}, metadata={"k": "v"})
    assert out.getvalue() == save({"t": t.contiguous(), "u": torch.arange(3)},
                                  metadata={"k": "v"})
    n = int.from_bytes(out.getvalue()[:8], "little")
    assert n % 8 == 0 and json.loads(out.getvalue()[8:8 + n])["__metadata__"] == {"k": "v"}
    with pytest.raises(ValueError, match="dense"):
        list(safetensors_chunks({"s": torch.eye(2).to_sparse()}))


def test_write_hashed_counts_and_hashes_every_chunk():
    chunks = [b"abc", memoryview(b""), memoryview(bytes(range(256)) * 300), b"", b"z"]
    out = io.BytesIO()
    digest, size = write_hashed(out, chunks)
    assert out.getvalue() == b"".join(bytes(c) for c in chunks)
    assert (digest, size) == (hashlib.sha256(out.getvalue()).hexdigest(), len(out.getvalue()))


@pytest.mark.parametrize("threads", [1, 3])
def test_chunk_digests_of_pieces_of_any_size(threads):
    """Pieces of any sizes (empty, straddling chunk boundaries, ending on one) give the
    digests of the byte stream's fixed-size chunks, written in order."""
    rng = random.Random(threads)
    data = rng.randbytes(10 * 1000 + 17)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(data)), rng.randint(0, 12)) + [1000, 3000])
        pieces = [memoryview(data)[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        pieces.insert(rng.randint(0, len(pieces)), b"")
        out = io.BytesIO()
        got = write_chunk_hashed(out, pieces, 1000, threads)
        ref = chunked(data, 1000)
        assert out.getvalue() == data
        assert (list(got.chunks), got.root, got.size) == (ref["chunks"], ref["sha256"],
                                                          len(data))
    empty = hash_chunked([b"", b""], chunk_bytes=1000)
    assert (empty.chunks, empty.size, empty.root) == ((), 0, root_of([]))


def test_read_verified_refuses_any_chunk_altered():
    """Every chunk checked: a flipped byte in any chunk names that chunk; a file shorter or
    longer than its size, or a root that does not match the chunks, is refused."""
    data = random.Random(1).randbytes(5 * 1024 + 300)
    ref = chunked(data, 1024)
    buf = read_verified(io.BytesIO(data), len(data), ref["chunks"], 1024, name="f",
                        root=ref["sha256"], threads=2)
    assert buf.dtype == torch.uint8 and bytes(buf.numpy()) == data
    for i, at in enumerate((0, 1024 + 5, 2048 + 1023, 3072 + 500, 4096, len(data) - 1)):
        bad = bytearray(data)
        bad[at] ^= 0x10
        with pytest.raises(SnapshotError, match=rf"f: sha256 mismatch .*chunk {i} "
                                                rf".*expected key\[{i}\]"):
            read_verified(io.BytesIO(bytes(bad)), len(data), ref["chunks"], 1024, name="f",
                          key="key")
    for other in (data[:-1], data + b"\0"):
        with pytest.raises(SnapshotError, match="f: changed size while being read"):
            read_verified(io.BytesIO(other), len(data), ref["chunks"], 1024, name="f")
    with pytest.raises(SnapshotError, match="the root over chunks"):
        read_verified(io.BytesIO(data), len(data), ref["chunks"], 1024, name="f",
                      root="0" * 64)
    with pytest.raises(ValueError, match="5 chunk digests"):
        read_verified(io.BytesIO(data), len(data), ref["chunks"][:-1], 1024, name="f")


def test_finish_trusts_only_what_it_hashed_itself(tmp_path, monkeypatch):
    """Rank 0 does not re-read its own shard; another rank's shard on the shared filesystem is
    re-hashed (by chunks; an old single-sha256 report by its sha256) and a difference abandons
    the snapshot."""
    root = tmp_path / "kfac"
    reads = []
    real, real_chunked = writer.sha256_of, writer.file_chunk_digests
    monkeypatch.setattr(writer, "sha256_of", lambda p: reads.append(p) or real(p))
    monkeypatch.setattr(writer, "file_chunk_digests",
                        lambda p, c: reads.append(p) or real_chunked(p, c))
    final = writer.write_snapshot(str(root), 3, {"a": torch.ones(3)}, {"step": 3})
    assert reads == [] and sorted(os.listdir(final)) == [
        "manifest.json", "shard-00000-of-00001.safetensors"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mine = write_shard(str(tmp), {"a": torch.ones(2)}, 0, 2)
    theirs = write_shard(str(tmp), {"b": torch.ones(2)}, 1, 2)
    reports = [{"rank": 0, "shard": mine, "manifest": {"step": 5}},
               {"rank": 1, "shard": dict(theirs, sha256="0" * 64), "manifest": {"step": 5}}]
    with pytest.raises(Exception, match="differs from what rank 1 wrote"):
        writer._finish(str(root), str(tmp), str(root / "step-5"), reports, None,
                       {mine["file"]})
    assert reads == [str(tmp / theirs["file"])]  # rank 0's own shard was not read
    for step, old in ((6, True), (7, False)):  # an old single-sha256 report, a chunked one
        other = tmp_path / f"tmp{step}"
        other.mkdir()
        info = write_shard(str(other), {"b": torch.ones(2)}, 1, 2)
        if old:
            info = {"file": info["file"], "bytes": info["bytes"],
                    "sha256": hashlib.sha256((other / info["file"]).read_bytes()).hexdigest()}
        writer._finish(str(root), str(other), str(root / f"step-{step}"),
                       [{"rank": 1, "shard": info, "manifest": {"step": step}}], None, set())
        assert os.path.isdir(root / f"step-{step}") and reads[-1].endswith(info["file"])
    os.truncate(tmp / mine["file"], 10)  # its own shard is still checked for its size
    with pytest.raises(Exception, match="rank 0 is missing or differs"):
        writer._finish(str(root), str(tmp), str(root / "step-5"), reports[:1], None,
                       {mine["file"]})


def test_gathered_shard_arriving_altered_is_refused(tmp_path):
    blob, info = writer.shard_bytes({"a": torch.ones(4)}, 1, 2)
    reports = [{"rank": 0}, {"rank": 1, "shard": info}]
    assert writer._write_gathered(str(tmp_path), [b"", blob], reports) == {info["file"]}
    assert (tmp_path / info["file"]).read_bytes() == blob
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(Exception, match="arrived altered"):
        writer._write_gathered(str(tmp_path), [b"", bytes(bad)], reports)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("media")
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(8, 12),
                   {"storage_dtype": "float16", "snapshot_every": 2, "max_dense_dim": 60},
                   batch=2, tmp_path=tmp, record=False)
    return cb


def test_media_from_memory_equal_media_from_disk(written, tmp_path, monkeypatch):
    cb = written
    assert cb.snapshots and set(cb.media) == set(cb.snapshots)
    path = cb.snapshots[-1]
    snap = Snapshot.load(path)
    eigvals = {}
    meta = read_manifest(path)
    for name in snap.layer_names:
        for f in ("A", "G"):
            eigvals[stored_key(meta, name, f)] = getattr(snap[name], f"{f}_eigvals").clone()
    spectra = Spectra.from_memory(path, eigvals)
    assert spectra is not None and spectra.layer_names == snap.layer_names
    assert spectra.step == snap.step
    assert log10_histograms(spectra) == log10_histograms(snap)

    loads = []
    real_load = Snapshot.load
    monkeypatch.setattr(Snapshot, "load", classmethod(
        lambda cls, p, *a, **k: loads.append(p) or real_load(p, *a, **k)))
    from_memory = make_media(path, eigvals=eigvals)
    assert loads == []  # only the manifest was read
    png_memory = open(from_memory["png"], "rb").read() if from_memory["png"] else None
    from_disk = make_media(path)
    assert loads == [path]
    assert from_memory["histograms"] == from_disk["histograms"] == cb.media[path]["histograms"]
    assert from_memory["png"] == from_disk["png"]
    if png_memory is not None:  # the same figure: the same pixels
        from matplotlib.image import imread
        assert (imread(io.BytesIO(png_memory)) == imread(from_disk["png"])).all()

    # a factor missing (another rank's): the snapshot is loaded instead
    del eigvals[next(iter(eigvals))]
    assert Spectra.from_memory(path, eigvals) is None
    assert make_media(path, eigvals=eigvals)["histograms"] == from_disk["histograms"]
    assert loads == [path, path]


def test_callback_makes_media_without_loading_the_snapshot(tmp_path, monkeypatch):
    loads = []
    real_load = Snapshot.load
    monkeypatch.setattr(Snapshot, "load", classmethod(
        lambda cls, p, *a, **k: loads.append(str(p)) or real_load(p, *a, **k)))
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(4, 12),
                   {"storage_dtype": "float16", "snapshot_every": 2},
                   batch=2, tmp_path=tmp_path, record=False)
    assert cb.snapshots and set(cb.media) == set(cb.snapshots)
    assert not any(p in loads for p in cb.snapshots)
    for p in cb.snapshots:
        assert cb.media[p]["histograms"] == log10_histograms(real_load(p))


def test_writer_checks_its_manifest_against_the_readers_schema(written, tmp_path):
    """Writer and reader share one definition of a manifest: a snapshot the reader would
    refuse is never written (here a real snapshot's manifest with one field out of range and
    one agreement broken), and one it accepts is written as is."""
    from pathlib import Path

    from safetensors.torch import load_file

    from kfac_stream.exceptions import SnapshotError

    path = written.snapshots[-1]
    meta = json.loads((Path(path) / "manifest.json").read_text())
    meta.pop("shards")
    tensors = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    root = tmp_path / "kfac"
    ok = writer.write_snapshot(str(root), 7, tensors, dict(meta, step=7))
    assert Snapshot.load(ok).step == 7
    for bad, what in ((dict(meta, step=-1), "step"),
                      (dict(meta, world_size=3), "owner")):
        with pytest.raises(SnapshotError, match=f"would not load.*{what}"):
            writer.write_snapshot(str(root), 8, tensors, bad)
        assert not (root / "step-00000008").exists()
        assert [p.name for p in root.iterdir()] == ["step-00000007"]
