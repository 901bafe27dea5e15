"""Fuzz the snapshot reader: corrupted variants of one real snapshot, each refused cleanly.

One snapshot is written by a real Trainer run (a 1-block GPT-2, dense and diagonal factors),
then damaged in every way listed here: wrong types and nonsense values of named
keys, a type swap of every key of the manifest (each value replaced by values of the other
JSON types, a NaN and a 10 001-digit integer), deep nesting, huge integers, duplicate keys,
truncations and byte flips of the manifest and the shard, shard headers that disagree with
the manifest under a matching sha256, names that leave the directory, symlinks in and out of
it, FIFOs and directories in a file's place, and a pickle disguised as a shard. The shards'
chunked digests (one sha256 per chunk and their root) are fuzzed on a shard of several
chunks (`chunked_pristine`): a byte flipped in each chunk, chunk digests swapped, missing,
extra or malformed, a wrong ``chunk_bytes``, a root that does not match, truncations and
extensions; and the older single-sha256 form (no chunk digests) is fuzzed and still loads.

For every variant:

* `Snapshot.load` raises `SnapshotError` with a message (for the named cases, one naming the
  file and the key);
* nothing outside the snapshot directory is opened: every descriptor opened through `os.open`
  or `open` during the load is resolved (``/proc/self/fd``) and must lie inside it, and every
  symlink target outside is a valid copy, so following one would make the load succeed
  (which fails the test whatever API did the reading);
* nothing is unpickled: `pickle`/`torch.load` are replaced by functions that fail the test,
  and the disguised pickles carry a payload that would leave a marker file;
* nothing hangs: a SIGALRM watchdog ends a load after `HANG_S` seconds, and each load must
  take under `SLOW_S` seconds.

``FUZZ_DUMP=<file>`` appends every variant's name and message to ``<file>`` (to read them).
"""

import hashlib
import json
import math
import os
import pathlib
import pickle
import shutil
import signal
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from kfac_stream import Snapshot, SnapshotError
from kfac_stream.snapshot import writer
from kfac_stream.utils import files

from chunk_digests import chunked, root_of
from harness import run
from manifest_swaps import set_at, swap_variants
from models import text_examples, tiny_gpt2

HANG_S = 30  # watchdog per load: a load still running then counts as a hang
# every load, refused or not, must finish within this: they take milliseconds; loose because
# two loads took 3.8-3.9 s once on 2 cores at load average 8-13 (scheduling, not the loader)
SLOW_S = 15.0
HUGE = "1" + "0" * 10_000  # a 10 001-digit integer literal
MANIFEST = "manifest.json"

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                                reason="resolves opened descriptors through /proc/self/fd")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One real snapshot directory (never modified) and its manifest."""
    tmp = tmp_path_factory.mktemp("fuzz")
    run(tiny_gpt2(torch.float32, n_layer=1), text_examples(4, 8),
        {"storage_dtype": "float16", "max_dense_dim": 40}, batch=2, tmp_path=tmp,
        record=False)
    (snap,) = sorted((tmp / "kfac").glob("step-*[0-9]"))
    manifest = json.loads((snap / MANIFEST).read_text())
    return snap, manifest


class Payload:
    """Unpickling this writes the marker file: proof that something unpickled a shard."""

    marker = None

    def __reduce__(self):
        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "unpickled"))


class Guard:
    """Spies on opens and unpickling; runs one load under a watchdog."""

    def __init__(self, monkeypatch, marker):
        self.marker = marker
        self.opened: list[str] = []
        self.recording = False
        real_os_open, real_open = os.open, open

        def spy_os_open(path, flags, mode=0o777, *, dir_fd=None):
            fd = real_os_open(path, flags, mode, dir_fd=dir_fd)
            self._record(fd)
            return fd

        def spy_open(file, *args, **kwargs):
            f = real_open(file, *args, **kwargs)
            self._record(f.fileno())
            return f

        def forbidden(*a, **k):
            raise AssertionError("pickle/torch.load reached from Snapshot.load")

        monkeypatch.setattr(os, "open", spy_os_open)
        monkeypatch.setattr("builtins.open", spy_open)
        for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                          (torch, "load")):
            monkeypatch.setattr(mod, name, forbidden)

    def _record(self, fd):
        if self.recording:
            self.opened.append(os.readlink(f"/proc/self/fd/{fd}"))

    def load(self, path, inside):
        """``(snapshot or None, message or None, seconds)``; fails on opens outside
        ``inside``, on a marker file, on a hang."""
        def alarm(*_):
            raise TimeoutError(f"Snapshot.load({path}) hung for {HANG_S} s")

        self.opened.clear()
        old = signal.signal(signal.SIGALRM, alarm)
        signal.alarm(HANG_S)
        self.recording = True
        t0 = time.perf_counter()
        snap = msg = None
        try:
            snap = Snapshot.load(path)
        except SnapshotError as e:
            msg = str(e)
        finally:
            seconds = time.perf_counter() - t0
            self.recording = False
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        root = os.path.realpath(inside)
        outside = [p for p in self.opened if p != root and not p.startswith(root + os.sep)]
        assert not outside, f"{path}: opened outside the snapshot directory: {outside}"
        assert not os.path.exists(self.marker), f"{path}: something unpickled the payload"
        return snap, msg, seconds


@pytest.fixture
def guard(monkeypatch, tmp_path):
    Payload.marker = str(tmp_path / "UNPICKLED")
    return Guard(monkeypatch, Payload.marker)


# ---------------------------------------------------------------- variant helpers ------------


def dump(m) -> str:
    """The manifest's text, with the string "@HUGE@" replaced by a 10 001-digit integer (which
    json.dumps cannot write)."""
    return json.dumps(m, indent=1).replace('"@HUGE@"', HUGE)


class Work:
    """A fresh copy of the snapshot to damage, with helpers."""

    def __init__(self, pristine, root):
        src, manifest = pristine
        self.dir = root / src.name
        shutil.copytree(src, self.dir, symlinks=True)
        self.outside = root / "outside"  # a sibling directory with valid copies of the files
        shutil.copytree(src, self.outside)
        self.m = json.loads(json.dumps(manifest))
        (self.shard_name,) = self.m["shards"]
        self.shard = self.dir / self.shard_name
        self.layer = next(iter(self.m["layers"]))  # its A is dense, its G diagonal
        self.key = self.m["layers"][self.layer]["A"]["key"]

    def save(self, text=None):
        (self.dir / MANIFEST).write_text(dump(self.m) if text is None else text)

    @property
    def entry(self):
        return self.m["shards"][self.shard_name]

    def rehash(self):
        """Make the manifest's digests (chunked, or the one sha256 of an entry without chunks)
        and bytes match the shard as it is now."""
        data = self.shard.read_bytes()
        if "chunks" in self.entry:
            self.entry.update(chunked(data, self.entry["chunk_bytes"]))
        else:
            self.entry.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        self.save()

    def single_sha256(self):
        """The shard entry in the form written before chunked digests: the file's sha256."""
        self.entry.pop("chunk_bytes")
        self.entry.pop("chunks")
        self.rehash()

    def reroot(self):
        """Make the entry's sha256 the root over its chunk digests as they are now."""
        self.entry["sha256"] = root_of(self.entry["chunks"])
        self.save()

    def retensor(self, change):
        """Rewrite the shard with ``change(tensors)`` applied; sha256 and bytes updated."""
        tensors = load_file(self.shard)
        change(tensors)
        save_file(tensors, self.shard)
        self.rehash()

    def shard_bytes(self, change):
        data = bytearray(self.shard.read_bytes())
        self.shard.write_bytes(bytes(change(data)))


def flip(data: bytearray, at: int) -> bytearray:
    data[at] ^= 0x01
    return data


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def layer_path(w, *keys):
    return f"layers[{w.layer!r}]" + "".join(f".{k}" for k in keys)


# Each variant: (name, damage(w), needles the message must contain). Needles name the key and
# the file; ``{L}`` is the first layer's path, ``{K}`` its A key, ``{S}`` the shard's name.
def _set(path, value):
    def damage(w):
        keys = [w.layer if k == "{L}" else k for k in path]
        obj = w.m
        for k in keys[:-1]:
            obj = obj[k]
        if value is DELETE:
            del obj[keys[-1]]
        else:
            obj[keys[-1]] = value
        w.save()
    return damage


DELETE = object()

VARIANTS = [
    # the whole document not an object: a JSON scalar or list (null raised a TypeError)
    *[(f"manifest is {text}", lambda w, text=text: w.save(text),
       [MANIFEST, "not a kfac_stream snapshot manifest", "expected an object"])
      for text in ("null", "5", "true", '"x"', "[]", "[null]")],
    # a mapping written as a list
    ("shards as a list", lambda w: _set(["shards"], list(w.m["shards"].values()))(w),
     ["shards is a list", MANIFEST]),
    ("layers as a list", lambda w: _set(["layers"], list(w.m["layers"].values()))(w),
     ["layers is a list"]),
    ("layer entry null", _set(["layers", "{L}"], None), ["{L} is null"]),
    ("layer entry without A", _set(["layers", "{L}", "A"], DELETE), ["{L}.A is missing"]),
    ("dim missing", _set(["layers", "{L}", "A", "dim"], DELETE), ["{L}.A.dim is missing"]),
    ("dim a string", _set(["layers", "{L}", "A", "dim"], "17"), ['{L}.A.dim is "17"']),
    ("dim null", _set(["layers", "{L}", "A", "dim"], None), ["{L}.A.dim is null"]),
    ("dim NaN", _set(["layers", "{L}", "A", "dim"], math.nan), ["{L}.A.dim is nan"]),
    ("dim a bool", _set(["layers", "{L}", "A", "dim"], True), ["{L}.A.dim is true"]),
    ("dim negative", _set(["layers", "{L}", "A", "dim"], -17), ["{L}.A.dim is -17"]),
    ("dim zero", _set(["layers", "{L}", "A", "dim"], 0), ["{L}.A.dim is 0"]),
    ("dim a float", _set(["layers", "{L}", "A", "dim"], 17.0), ["{L}.A.dim is 17.0"]),
    ("dim lies (+1)", lambda w: _set(["layers", "{L}", "A", "dim"],
                                     w.m["layers"][w.layer]["A"]["dim"] + 1)(w),
     ["{L}.A.dim is 18; expected 17", "manifest says"]),
    ("diagonal missing", _set(["layers", "{L}", "A", "diagonal"], DELETE),
     ["{L}.A.diagonal is missing"]),
    ("diagonal flipped", _set(["layers", "{L}", "A", "diagonal"], True),
     ["tensor '{K}' is F16 [17, 17], manifest says float16 [17]", "{S}"]),
    ("d_in lies", _set(["layers", "{L}", "d_in"], 15), ["{L}.A.dim is 17; expected 16"]),
    ("step -3", _set(["step"], -3), ["step is -3; expected an integer ≥ 0"]),
    ('step "eight"', _set(["step"], "eight"), ['step is "eight"']),
    ("step 10 001 digits", _set(["step"], "@HUGE@"), ["step is an integer of 10001 digits"]),
    ("tokens_seen -1000", _set(["counts", "tokens_seen"], -1000),
     ["counts.tokens_seen is -1000"]),
    ("tokens_seen missing", _set(["counts", "tokens_seen"], DELETE),
     ["counts.tokens_seen is missing"]),
    ("ema_decay NaN", _set(["ema_decay"], math.nan), ["ema_decay is nan"]),
    ("ema_decay 2", _set(["ema_decay"], 2.0), ["ema_decay is 2.0"]),
    ("created_unix Infinity", _set(["created_unix"], math.inf), ["created_unix is inf"]),
    ("epoch -1", _set(["epoch"], -1.0), ["epoch is -1.0"]),
    ("token_fraction 0", _set(["token_fraction"], 0.0), ["token_fraction is 0.0"]),
    ("world_size 0", _set(["world_size"], 0), ["world_size is 0"]),
    ("owner beyond world", _set(["layers", "{L}", "A", "owner"], 1),
     ["{L}.A.owner is 1; expected a rank below world_size=1"]),
    ("spectrum cond NaN", _set(["layers", "{L}", "G", "spectrum", "cond"], math.nan),
     ["{L}.G.spectrum.cond is nan"]),
    ("spectrum max -Infinity", _set(["layers", "{L}", "G", "spectrum", "max"], -math.inf),
     ["{L}.G.spectrum.max is -inf"]),
    ("fisher empty", _set(["fisher"], ""), ['fisher is ""']),
    ("storage_dtype int8", _set(["storage_dtype"], "int8"), ['storage_dtype is "int8"']),
    ("factor dtype float32", _set(["layers", "{L}", "A", "dtype"], "float32"),
     ['{L}.A.dtype is "float32"; expected "float16"']),
    ("fingerprint not hex", _set(["fingerprint"], "xyz"), ['fingerprint is "xyz"']),
    ("format other", _set(["format"], "other"), ['format is "other"']),
    ("format_version 4", _set(["format_version"], 4), ["unknown format_version 4"]),
    ("format_version 1 (never released)", _set(["format_version"], 1),
     ["unknown format_version 1", "reads 2 and 3"]),
    ("format_version true", _set(["format_version"], True), ["unknown format_version true"]),
    ('format_version "2"', _set(["format_version"], "2"), ['unknown format_version "2"']),
    ("factor entry without key", _set(["layers", "{L}", "A", "key"], DELETE),
     ["{L}.A.key is missing"]),
    ("factor entry without shard", _set(["layers", "{L}", "G", "shard"], DELETE),
     ["{L}.G.shard is missing"]),
    ("factor entry without owner", _set(["layers", "{L}", "A", "owner"], DELETE),
     ["{L}.A.owner is missing"]),
    ("counts without a store counter", _set(["counts", "flush_syncs"], DELETE),
     ["counts.flush_syncs is missing"]),
    ("counts without sequences_seen", _set(["counts", "sequences_seen"], DELETE),
     ["counts.sequences_seen is missing"]),
    ("device_budget -2", _set(["counts", "device_budget"], -2),
     ["counts.device_budget is -2; expected an integer ≥ -1"]),
    ("ownership missing", _set(["ownership"], DELETE), ["ownership is missing"]),
    ("shard entry without rank", lambda w: _set(["shards", w.shard_name, "rank"], DELETE)(w),
     ["shards['{S}'].rank is missing"]),
    ("key of another layer, no group", lambda w: _set(
        ["layers", "{L}", "A", "key"], list(w.m["layers"])[1] + ".A")(w), ["{L}.A.key is"]),
    ("key of no layer", _set(["layers", "{L}", "G", "key"], "nowhere.G"), ["{L}.G.key is"]),
    ("shared_inputs names no layer", _set(["shared_inputs"], [["x", "y"]]),
     ['shared_inputs[0][0] is "x"']),
    ("shared_inputs missing", _set(["shared_inputs"], DELETE),
     ["shared_inputs is missing"]),
    ("factor shard not listed", _set(["layers", "{L}", "A", "shard"],
                                     "shard-00001-of-00002.safetensors"), ["{L}.A.shard is"]),
    ("ownership length", _set(["ownership", "bytes_per_rank"], [1, 2]),
     ["ownership.bytes_per_rank has 2 items; expected world_size=1"]),
    # JSON-level damage
    ("deep nesting, whole file", lambda w: w.save(nested(100_000)),
     [MANIFEST, "nested deeper"]),
    ("deep nesting under an unknown key", lambda w: w.save(
        dump(w.m)[:-1] + f', "extra": {nested(5000)}}}'), [MANIFEST, "nested deeper"]),
    ("nesting 40 deep under an unknown key", lambda w: w.save(
        dump(w.m)[:-1] + f', "extra": {nested(40)}}}'), ["extra", "levels deep"]),
    ("deep nesting as dim", lambda w: w.save(dump(w.m).replace(
        '"dim": 17', f'"dim": {nested(50)}', 1)), ["{L}.A.dim", "levels deep"]),
    ("10 001-digit int under an unknown key", _set(["extra"], "@HUGE@"),
     ["extra is an integer of 10001 digits"]),
    ("negative 10 001-digit dim", lambda w: w.save(dump(w.m).replace(
        '"dim": 17', f'"dim": -{HUGE}', 1)), ["{L}.A.dim is an integer of 10001 digits"]),
    ("duplicate key", lambda w: w.save('{"step": 1, ' + dump(w.m)[1:]),
     ["'step' appears twice"]),
    ("not UTF-8", lambda w: (w.dir / MANIFEST).write_bytes(b"\xff\xfe" + dump(w.m).encode(
        "utf-16-le")), [MANIFEST, "not UTF-8"]),
    ("UTF-8 BOM", lambda w: (w.dir / MANIFEST).write_bytes(b"\xef\xbb\xbf" + dump(
        w.m).encode()), [MANIFEST, "not valid JSON"]),
    ("manifest 65 MiB", lambda w: os.truncate(w.dir / MANIFEST, 65 * 2**20),
     [MANIFEST, "expected at most 67108864"]),
    ("manifest empty", lambda w: w.save(""), [MANIFEST, "not valid JSON"]),
    ("manifest a list", lambda w: w.save("[1, 2]"), [MANIFEST, "the document is a list"]),
    ("manifest missing", lambda w: (w.dir / MANIFEST).unlink(), ["missing"]),
    # shard contents that disagree with the manifest under a matching sha256
    ("scale of wrong shape", lambda w: w.retensor(
        lambda t: t.update({f"{w.key}.scale": torch.ones(2)})),
     ["tensor '{K}.scale' is F32 [2], manifest says float32 [1]", "{S}"]),
    ("scale of wrong dtype", lambda w: w.retensor(
        lambda t: t.update({f"{w.key}.scale": torch.ones(1, dtype=torch.float64)})),
     ["tensor '{K}.scale' is F64 [1]", "{S}"]),
    ("scale negative", lambda w: w.retensor(
        lambda t: t.update({f"{w.key}.scale": -torch.ones(1)})),
     ["'{K}.scale' has negative values", "{S}"]),
    ("factor with NaN", lambda w: w.retensor(
        lambda t: t[w.key].view(-1).__setitem__(0, math.nan)), ["'{K}' has non-finite"]),
    ("factor with -Infinity last", lambda w: w.retensor(
        lambda t: t[w.key].view(-1).__setitem__(-1, -math.inf)), ["'{K}' has non-finite"]),
    ("eigenvectors with Infinity", lambda w: w.retensor(
        lambda t: t[f"{w.key}.eigvecs"].view(-1).__setitem__(5, math.inf)),
     ["'{K}.eigvecs' has non-finite"]),
    ("eigenvectors with a negative NaN", lambda w: w.retensor(
        lambda t: t[f"{w.key}.eigvecs"].view(-1).__setitem__(7, -torch.tensor(math.nan))),
     ["'{K}.eigvecs' has non-finite"]),
    ("eigenvalues negative", lambda w: w.retensor(
        lambda t: t[f"{w.key}.eigvals"].__setitem__(0, -1.0)),
     ["'{K}.eigvals' has negative values"]),
    ("eigenvectors missing", lambda w: w.retensor(lambda t: t.pop(f"{w.key}.eigvecs")),
     ["'{K}.eigvecs' is missing from shard"]),
    ("eigenvalues of wrong length", lambda w: w.retensor(
        lambda t: t.update({f"{w.key}.eigvals": torch.ones(16)})),
     ["tensor '{K}.eigvals' is F32 [16]"]),
    ("factor stored as float32", lambda w: w.retensor(
        lambda t: t.update({w.key: t[w.key].float()})), ["tensor '{K}' is F32 [17, 17]"]),
    ("extra tensor", lambda w: w.retensor(lambda t: t.update({"evil": torch.ones(3)})),
     ["tensor 'evil' is in this shard"]),
    ("junk after the data", lambda w: (w.shard_bytes(lambda b: b + b"\0" * 64), w.rehash()),
     ["{S}: not a readable safetensors file"]),
    ("header length beyond the file", lambda w: (w.shard_bytes(
        lambda b: (2**62).to_bytes(8, "little") + b[8:]), w.rehash()),
     ["{S}: not a readable safetensors file: its header length"]),
    ("bytes lies", lambda w: _set(["shards", w.shard_name, "bytes"],
                                  w.m["shards"][w.shard_name]["bytes"] - 1)(w),
     ["{S}: size/sha256 mismatch"]),
    ("bytes far beyond the tensors", lambda w: _set(["shards", w.shard_name, "bytes"],
                                                    10**15)(w),
     ["shards['{S}'].bytes is 1000000000000000"]),
    ("single sha256 of another file", lambda w: (w.single_sha256(), _set(
        ["shards", w.shard_name, "sha256"], "0" * 64)(w)), ["{S}: sha256 mismatch"]),
    ("single sha256, byte flipped", lambda w: (w.single_sha256(), w.shard_bytes(
        lambda b: flip(b, len(b) // 2))), ["{S}: sha256 mismatch", "it is"]),
    ("single sha256, cut", lambda w: (w.single_sha256(), w.shard_bytes(lambda b: b[:-1])),
     ["{S}: size/sha256 mismatch"]),
    ("root of another file", lambda w: _set(["shards", w.shard_name, "sha256"], "0" * 64)(w),
     ["shards['{S}'].sha256 is", "the root over shards['{S}'].chunks"]),
    ("root: the whole file's sha256", lambda w: _set(
        ["shards", w.shard_name, "sha256"], hashlib.sha256(w.shard.read_bytes()).hexdigest())(w),
     ["shards['{S}'].sha256 is", "the root over"]),
    ("shard missing", lambda w: w.shard.unlink(), ["shard '{S}' listed in the manifest is "
                                                    "missing"]),
    ("shard empty", lambda w: (w.shard.write_bytes(b""), w.rehash()), ["{S}"]),
    ("shard a directory", lambda w: (w.shard.unlink(), w.shard.mkdir()),
     ["{S}: is a directory"]),
    ("shard a FIFO", lambda w: (w.shard.unlink(), os.mkfifo(w.shard)), ["{S}: is a FIFO"]),
    ("manifest a FIFO", lambda w: ((w.dir / MANIFEST).unlink(), os.mkfifo(w.dir / MANIFEST)),
     [f"{MANIFEST}: is a FIFO"]),
    # names that are not plain file names inside the directory
    ("shard name ../", lambda w: rename_shard(w, "../outside/" + w.shard_name),
     ["shards['../outside/{S}']: the name is a path"]),
    ("shard name absolute", lambda w: rename_shard(w, str(w.outside / w.shard_name)),
     ["the name is a path"]),
    ("shard name with NUL", lambda w: rename_shard(w, w.shard_name + "\0.x"),
     ["the name is a name with a NUL"]),
    ("shard name ..", lambda w: rename_shard(w, ".."), ["shards['..']: the name is a "
                                                        "directory reference"]),
    ("shard name manifest.json", lambda w: rename_shard(w, MANIFEST),
     ["shards['manifest.json']: the name is not a shard file name"]),
    ("shard name empty", lambda w: rename_shard(w, ""), ["shards['']: the name is an empty"]),
    # symlinks in and out of the directory (every target is a valid copy)
    ("manifest -> outside copy", lambda w: relink(w.dir / MANIFEST, w.outside / MANIFEST),
     [f"{MANIFEST}: is a symbolic link"]),
    ("manifest -> copy inside", lambda w: (
        shutil.copy(w.dir / MANIFEST, w.dir / "copy.json"),
        relink(w.dir / MANIFEST, "copy.json")), [f"{MANIFEST}: is a symbolic link"]),
    ("shard -> outside copy", lambda w: relink(w.shard, w.outside / w.shard_name),
     ["{S}: is a symbolic link"]),
    ("shard -> relative ../outside copy", lambda w: relink(
        w.shard, os.path.join("..", "outside", w.shard_name)), ["{S}: is a symbolic link"]),
    ("shard -> another file inside", lambda w: (
        os.rename(w.shard, w.dir / "real.safetensors"),
        relink(w.shard, "real.safetensors")), ["{S}: is a symbolic link"]),
    ("shard -> /dev/zero", lambda w: relink(w.shard, "/dev/zero"), ["{S}: is a symbolic link"]),
    # a pickle disguised as a shard, sha256 and bytes matching
    ("pickle as shard", lambda w: (w.shard.write_bytes(pickle.dumps({w.key: Payload()})),
                                   w.rehash()), ["{S}"]),
    ("pickle as shard, padded to size", lambda w: (w.shard.write_bytes(pad(
        pickle.dumps({w.key: Payload()}), w.shard.stat().st_size)), w.rehash()),
     ["{S}: not a readable safetensors file"]),
    ("torch.save zip as shard", lambda w: (torch.save({w.key: Payload()}, w.shard),
                                           w.rehash()), ["{S}"]),
]


def rename_shard(w, name):
    w.m["shards"] = {name: w.m["shards"][w.shard_name]}
    w.save()


def relink(link, target):
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(target, link)


def pad(data: bytes, size: int) -> bytes:
    assert len(data) < size
    return data + b"\0" * (size - len(data))


def _truncations_and_flips(pristine):
    """Truncations and byte flips of the manifest and the shard at several offsets."""
    src, manifest = pristine
    n_m = (src / MANIFEST).stat().st_size
    n_s = next(src.glob("*.safetensors")).stat().st_size
    header = 8 + int.from_bytes(next(src.glob("*.safetensors")).read_bytes()[:8], "little")
    out = []
    for at in (0, 1, 100, n_m // 2, n_m - 1):
        out.append((f"manifest cut at {at}", lambda w, at=at: w.save(dump(w.m)[:at]),
                    [MANIFEST, "not valid JSON"]))
    for token in ('"format":', '"format_version":', '"step":', '"layers":', '"shards":',
                  '"counts":', '"dim":', '"diagonal":', '"sha256":', '"bytes":'):
        def damage(w, token=token):
            text = bytearray(dump(w.m).encode())
            w.save(flip(text, text.index(token.encode()) + 1).decode())
        out.append((f"manifest key {token} flipped", damage, [MANIFEST, token.strip('":')]))
    out.append(("manifest first brace flipped", lambda w: w.save("z" + dump(w.m)[1:]),
                [MANIFEST, "not valid JSON"]))
    # short cuts fail the size check against the manifest, long ones the header's offsets
    for at in (0, 4, 8, 9, header - 1, header, header + 7, n_s // 2,
               n_s - 2000, n_s - 1000, n_s - 100, n_s - 8, n_s - 1):
        out.append((f"shard cut at {at}, sha256 updated",
                    lambda w, at=at: (w.shard_bytes(lambda b: b[:at]), w.rehash()), ["{S}"]))
        out.append((f"shard cut at {at}", lambda w, at=at: w.shard_bytes(lambda b: b[:at]),
                    ["{S}: size/sha256 mismatch"]))
    for at in (0, 7, 8, 20, header // 2, header - 1, header, n_s // 2, n_s - 1):
        out.append((f"shard byte {at} flipped", lambda w, at=at: w.shard_bytes(
            lambda b: flip(b, at)), ["{S}: sha256 mismatch"]))
    for at in (0, 3, 7, 8, 9, 20, 60, header // 2, header - 2):  # header bytes, sha updated
        out.append((f"shard header byte {at} flipped, sha256 updated", lambda w, at=at: (
            w.shard_bytes(lambda b: flip(b, at)), w.rehash()), ["{S}"]))
    return out


# ---------------------------------------------------------------- the tests ------------------


class Tally:
    """Loads of damaged copies, each of which must raise `SnapshotError` with a message that
    holds every needle; what went otherwise is in ``problems`` (accepted: loaded; silent: no
    message)."""

    def __init__(self, guard):
        self.guard = guard
        self.problems: list[str] = []
        self.tried, self.accepted, self.silent, self.slowest = 0, 0, 0, 0.0

    def attempt(self, name, path, inside, needles):
        self.tried += 1
        snap, msg, seconds = self.guard.load(path, inside)
        self.slowest = max(self.slowest, seconds)
        if seconds > SLOW_S:
            self.problems.append(f"{name}: took {seconds:.1f} s")
        if snap is not None:
            self.accepted += 1
            self.problems.append(f"{name}: loaded instead of raising SnapshotError")
        elif not msg or not msg.strip():
            self.silent += 1
            self.problems.append(f"{name}: SnapshotError without a message")
        else:
            if os.environ.get("FUZZ_DUMP"):
                with open(os.environ["FUZZ_DUMP"], "a") as f:
                    f.write(f"{name}\t{msg}\n")
            missing = [n for n in needles if n not in msg]
            if missing:
                self.problems.append(f"{name}: message lacks {missing}: {msg}")

    def damaged_copies(self, pristine, variants, tmp_path):
        """Each variant's damage on a fresh copy of ``pristine``, attempted."""
        for i, (name, damage, needles) in enumerate(variants):
            w = Work(pristine, tmp_path / f"v{i}")
            damage(w)
            fill = {"{L}": layer_path(w), "{K}": w.key, "{S}": w.shard_name}
            self.attempt(name, w.dir, w.dir, [fill_in(n, fill) for n in needles])
            shutil.rmtree(tmp_path / f"v{i}")


def test_every_corrupted_variant_is_refused(pristine, guard, tmp_path, capsys):
    src, manifest = pristine
    tally = Tally(guard)
    attempt = tally.attempt
    tally.damaged_copies(pristine, VARIANTS + _truncations_and_flips(pristine), tmp_path)
    n_named = tally.tried

    # a type swap of every key: one working copy, the manifest rewritten each time
    w = Work(pristine, tmp_path / "swaps")
    accepted = []
    for path, keys, new, ok in swap_variants(manifest):
        m = json.loads(json.dumps(manifest))
        set_at(m, keys, new)
        w.save(dump(m))
        label = f"swap {path} -> {'a 10001-digit int' if new == '@HUGE@' else repr(new)}"
        if ok:
            snap, _, _ = guard.load(w.dir, w.dir)
            if snap is None:
                tally.problems.append(f"{label}: refused, but the schema allows it")
            accepted.append(label)
            continue
        attempt(label, w.dir, w.dir, [MANIFEST, path])
    w.save(dump(manifest))
    assert guard.load(w.dir, w.dir)[0] is not None  # the copy itself was fine all along

    tried = tally.tried
    assert not tally.problems, (f"{len(tally.problems)} of {tried} variants:\n"
                                + "\n".join(tally.problems))
    assert tried >= 50
    with capsys.disabled():
        print(f"\nsnapshot fuzz: {tried} corrupted variants ({n_named} hand-made, "
              f"{tried - n_named} type swaps of every manifest key) all refused with "
              f"SnapshotError, slowest {tally.slowest * 1e3:.0f} ms; {len(accepted)} swaps "
              "allowed by the schema loaded")


def fill_in(text, fill):
    for k, v in fill.items():
        text = text.replace(k, v)
    return text


def test_valid_variants_load(pristine, guard, tmp_path):
    """The checks refuse only what is wrong: the pristine copy, unknown extra keys (at the top
    and in a record), the optional keys left out, a Fisher estimator's name not registered
    here (one its writer registered), and a symlinked snapshot directory given by the user
    all load, opening nothing outside the snapshot directory."""
    src, manifest = pristine
    w = Work(pristine, tmp_path / "ok")
    snap, msg, _ = guard.load(w.dir, w.dir)
    assert msg is None and len(snap.layer_names) == 4
    reference = {n: snap[n].A.clone() for n in snap.layer_names}

    for optional in ("run_id", "weights", "model"):  # absent without a run id or a model
        w.m.pop(optional)
    for entry in w.m["layers"].values():
        for f in ("A", "G"):
            entry[f].pop("sampling", None)  # absent where not recorded
            entry[f]["added_by_a_later_writer"] = 1
    w.m["added_by_a_later_writer"] = {"anything": [1, 2.5, None]}
    w.m["fisher"] = w.m["config"]["fisher"] = "mcmc"
    if "run_plan" in w.m:
        w.m["run_plan"]["fisher"] = "mcmc"
    w.save()
    snap1, msg, _ = guard.load(w.dir, w.dir)
    assert msg is None and all(torch.equal(snap1[n].A, reference[n]) for n in reference)
    assert snap1.meta["fisher"] == "mcmc"

    link = tmp_path / "link-to-snapshot"
    os.symlink(src, link)
    snap2, msg, _ = guard.load(link, src)
    assert msg is None and snap2.step == snap.step


def test_latest_skips_a_symlinked_step_directory(pristine, tmp_path):
    """`Snapshot.latest` follows no symlinked ``step-*`` entry out of its root."""
    src, _ = pristine
    root = tmp_path / "kfac"
    shutil.copytree(src, root / "step-00000001")
    os.symlink(src, root / "step-99999999")  # newer, valid, but a link
    assert Snapshot.latest(root).step == json.loads((src / MANIFEST).read_text())["step"]
    assert Snapshot.latest(root).path.endswith("step-00000001")


# ---------------------------------------------------------------- chunked digests ------------

CHUNK = 1 << 20  # the chunk size the chunked snapshot is written with (the smallest allowed)
BIG_DIM = 640  # its first layer's A: fp16 [640, 640] and float32 eigenvectors, 2.4 MB


@pytest.fixture(scope="module")
def chunked_pristine(pristine, tmp_path_factory):
    """The real snapshot with its first layer's A widened to `BIG_DIM` (random values),
    written by kfac_stream's writer with 1 MiB chunk digests: a shard of 3 chunks, the last
    one shorter; its manifest; the tensors written."""
    src, manifest = pristine
    meta = json.loads(json.dumps(manifest))
    meta.pop("shards")
    layer = next(iter(meta["layers"]))
    entry = meta["layers"][layer]
    key = entry["A"]["key"]
    assert key == f"{layer}.A" and not entry["A"]["diagonal"] and "ekfac" not in entry
    entry["d_in"], entry["A"]["dim"] = BIG_DIM - entry["has_bias"], BIG_DIM
    tensors = load_file(next(src.glob("*.safetensors")))
    g = torch.Generator().manual_seed(0)
    tensors.update({key: torch.randn(BIG_DIM, BIG_DIM, generator=g).half(),
                    f"{key}.eigvals": torch.rand(BIG_DIM, generator=g),
                    f"{key}.eigvecs": torch.randn(BIG_DIM, BIG_DIM, generator=g)})
    root = tmp_path_factory.mktemp("chunked") / "kfac"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files, "HASH_CHUNK_BYTES", CHUNK)
        path = pathlib.Path(writer.write_snapshot(str(root), meta["step"], tensors, meta))
    return path, json.loads((path / MANIFEST).read_text()), tensors


def _chunk_variants(big):
    """Damage to the chunked digests of a 3-chunk shard of ``size`` bytes."""
    size = next(big.glob("*.safetensors")).stat().st_size
    assert 2 * CHUNK < size < 3 * CHUNK
    bad = "shards['{S}']"
    out = [(f"byte {at} flipped (chunk {at // CHUNK})", lambda w, at=at: w.shard_bytes(
        lambda b: flip(b, at)), ["{S}: sha256 mismatch", f"chunk {at // CHUNK} ",
                                 f"{bad}.chunks[{at // CHUNK}]"])
           for at in (0, CHUNK // 2, CHUNK - 1, CHUNK, CHUNK + 77, 2 * CHUNK,
                      (2 * CHUNK + size) // 2, size - 1)]

    def chunks(change, reroot=True):
        def damage(w):
            w.entry["chunks"] = change(list(w.entry["chunks"]))
            w.reroot() if reroot else w.save()
        return damage

    out += [
        ("digests 0 and 1 swapped", chunks(lambda c: [c[1], c[0], c[2]]),
         ["{S}: sha256 mismatch", "chunk 0 "]),
        ("digests 1 and 2 swapped", chunks(lambda c: [c[0], c[2], c[1]]), ["chunk 1 "]),
        ("digests swapped, root kept", chunks(lambda c: [c[1], c[0], c[2]], reroot=False),
         [f"{bad}.sha256 is", "the root over"]),
        ("digest 1 a copy of 0", chunks(lambda c: [c[0], c[0], c[2]]), ["chunk 1 "]),
        ("last digest missing", chunks(lambda c: c[:2]), [f"{bad}.bytes is", "lists 2 chunk"]),
        ("first digest missing", chunks(lambda c: c[1:]), [f"{bad}.bytes is", "lists 2 chunk"]),
        ("an extra digest", chunks(lambda c: c + c[-1:]), [f"{bad}.bytes is", "lists 4 chunk"]),
        ("an extra digest, root kept", chunks(lambda c: c + c[-1:], reroot=False),
         [f"{bad}.bytes is"]),
        ("one digest only", chunks(lambda c: c[:1]), [f"{bad}.bytes is", "lists 1 chunk "]),
        ("no digests", chunks(lambda c: []), [f"{bad}.chunks is a list of 0 items"]),
        ("a digest uppercase", chunks(lambda c: [c[0], c[1].upper(), c[2]], reroot=False),
         [f"{bad}.chunks[1] is", "64 lowercase hex"]),
        ("a digest of 63 digits", chunks(lambda c: [c[0], c[1], c[2][:63]], reroot=False),
         [f"{bad}.chunks[2] is"]),
        ("a digest null", chunks(lambda c: [None, c[1], c[2]], reroot=False),
         [f"{bad}.chunks[0] is null"]),
        ("chunks a string", lambda w: _set(["shards", w.shard_name, "chunks"], "ab" * 32)(w),
         [f"{bad}.chunks is"]),
        ("chunks missing", lambda w: (w.entry.pop("chunks"), w.save()),
         [f"{bad}.chunks is missing", "chunk_bytes"]),
        ("chunk_bytes missing", lambda w: (w.entry.pop("chunk_bytes"), w.save()),
         [f"{bad}.chunk_bytes is missing"]),
        ("chunk fields missing, sha256 the root", lambda w: (
            w.entry.pop("chunks"), w.entry.pop("chunk_bytes"), w.save()),
         ["{S}: sha256 mismatch", f"{bad}.sha256"]),
        ("root zeros", lambda w: _set(["shards", w.shard_name, "sha256"], "0" * 64)(w),
         [f"{bad}.sha256 is", "the root over"]),
        ("chunk_bytes 2 MiB (3 digests)", _chunk_bytes(2 * CHUNK),
         [f"{bad}.bytes is", "chunk_bytes=2097152"]),
        ("chunk_bytes 512 KiB, digests remade for it", _chunk_bytes(CHUNK // 2, remake=True),
         [f"{bad}.chunk_bytes is 524288", "a power of two in [1048576, 1073741824]"]),
        ("chunk_bytes 3 MiB, digests remade for it", _chunk_bytes(3 * CHUNK, remake=True),
         [f"{bad}.chunk_bytes is 3145728", "a power of two"]),
        *[(f"chunk_bytes {v!r}", _chunk_bytes(v), [f"{bad}.chunk_bytes is"])
          for v in (0, -CHUNK, 2**31, 2**40, CHUNK + 1, float(CHUNK), str(CHUNK), True, None,
                    [CHUNK])],
        ("appended a byte", lambda w: w.shard_bytes(lambda b: b + b"\0"),
         ["{S}: size/sha256 mismatch"]),
        ("appended a byte, bytes updated", lambda w: (w.shard_bytes(lambda b: b + b"\0"), _set(
            ["shards", w.shard_name, "bytes"], size + 1)(w)), ["{S}: sha256 mismatch",
                                                              "chunk 2 "]),
        ("appended a chunk, digests remade", lambda w: (
            w.shard_bytes(lambda b: b + b"\0" * CHUNK), w.rehash()),
         ["{S}: not a readable safetensors file"]),
        ("file chunks 0 and 1 swapped, digests to match", lambda w: (w.shard_bytes(
            lambda b: b[CHUNK:2 * CHUNK] + b[:CHUNK] + b[2 * CHUNK:]),
            chunks(lambda c: [c[1], c[0], c[2]])(w)), ["{S}: not a readable safetensors"]),
    ]
    for at in (0, 8, CHUNK - 1, CHUNK, CHUNK + 5, 2 * CHUNK, 2 * CHUNK + 1, size - 1):
        out += [(f"cut at {at}", lambda w, at=at: w.shard_bytes(lambda b: b[:at]),
                 ["{S}: size/sha256 mismatch"]),
                (f"cut at {at}, bytes updated", lambda w, at=at: (
                    w.shard_bytes(lambda b: b[:at]),
                    _set(["shards", w.shard_name, "bytes"], at)(w)), ["{S}"]),
                (f"cut at {at}, digests remade", lambda w, at=at: (
                    w.shard_bytes(lambda b: b[:at]), w.rehash()), ["{S}"])]
    return out


def _chunk_bytes(value, remake=False):
    def damage(w):
        w.entry["chunk_bytes"] = value
        if remake:
            w.entry.update(chunked(w.shard.read_bytes(), value))
        w.save()
    return damage


def _single_sha256_variants(big):
    """Damage to the older form (one sha256 of the file) of the same shard."""
    size = next(big.glob("*.safetensors")).stat().st_size
    out = [(f"single sha256, byte {at} flipped", lambda w, at=at: (
        w.single_sha256(), w.shard_bytes(lambda b: flip(b, at))), ["{S}: sha256 mismatch"])
           for at in (0, CHUNK, 2 * CHUNK + 3, size - 1)]
    out += [(f"single sha256, cut at {at}", lambda w, at=at: (
        w.single_sha256(), w.shard_bytes(lambda b: b[:at])), ["{S}: size/sha256 mismatch"])
            for at in (CHUNK, size - 1)]
    out.append(("single sha256 with a chunk_bytes", lambda w: (
        w.single_sha256(), _set(["shards", w.shard_name, "chunk_bytes"], CHUNK)(w)),
        ["shards['{S}'].chunks is missing"]))
    return out


def test_every_chunk_digest_corruption_is_refused(chunked_pristine, guard, tmp_path, capsys):
    """0 accepted, 0 silent: every damage to a 3-chunk shard or its digests raises
    `SnapshotError` naming the file and what differs (the chunk, or the manifest key)."""
    big, manifest, _ = chunked_pristine
    entry = next(iter(manifest["shards"].values()))
    assert entry["chunk_bytes"] == CHUNK and len(entry["chunks"]) == 3
    tally = Tally(guard)
    variants = _chunk_variants(big) + _single_sha256_variants(big)
    tally.damaged_copies(chunked_pristine[:2], variants, tmp_path)
    assert (tally.accepted, tally.silent) == (0, 0) and not tally.problems, (
        f"{len(tally.problems)} of {tally.tried} variants:\n" + "\n".join(tally.problems))
    assert tally.tried == len(variants) >= 60
    with capsys.disabled():
        print(f"\nchunked digests fuzz: {tally.tried} corrupted variants, 0 accepted, 0 silent, "
              f"slowest {tally.slowest * 1e3:.0f} ms")


@pytest.mark.parametrize("threads", [1, 3])
def test_chunked_round_trip(chunked_pristine, guard, monkeypatch, threads):
    """A shard of several chunks (the last one shorter) loads with every tensor equal to what
    was written, as views of one buffer; the manifest's digests are those of the file."""
    big, manifest, tensors = chunked_pristine
    monkeypatch.setattr(files, "HASH_THREADS", threads)
    ((name, entry),) = manifest["shards"].items()
    data = (big / name).read_bytes()
    assert len(data) % CHUNK and entry == dict(chunked(data, CHUNK), rank=0)
    snap, msg, _ = guard.load(big, big)
    assert msg is None
    layer = snap.layer_names[0]
    key = manifest["layers"][layer]["A"]["key"]
    lf = snap[layer]
    assert lf.A_eigvecs.shape == (BIG_DIM, BIG_DIM)
    assert torch.equal(lf.A, tensors[key].float() * tensors[f"{key}.scale"])
    assert torch.equal(lf.A_eigvals, tensors[f"{key}.eigvals"])
    assert torch.equal(lf.A_eigvecs, tensors[f"{key}.eigvecs"])
    reference = load_file(big / name)  # safetensors' own reader
    for n in snap.layer_names:
        for f in ("A", "G"):
            k = manifest["layers"][n][f]["key"]
            assert torch.equal(getattr(snap[n], f"{f}_eigvals"), reference[f"{k}.eigvals"])
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    start = {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    assert (lf.A_eigvecs.data_ptr() - lf.A_eigvals.data_ptr()
            == start[f"{key}.eigvecs"] - start[f"{key}.eigvals"])  # views of one buffer


def test_single_sha256_form_and_other_chunk_sizes_load(chunked_pristine, pristine, guard,
                                                       tmp_path):
    """A snapshot written before chunked digests (each shard's sha256 over the whole file, no
    chunk keys) still loads, to the same tensors; so does any chunk size within limits."""
    big, manifest, _ = chunked_pristine
    want = Snapshot.load(big)
    for i, (src, change) in enumerate([
            (chunked_pristine[:2], Work.single_sha256), (pristine, Work.single_sha256),
            (chunked_pristine[:2], _chunk_bytes(2 * CHUNK, remake=True)),
            (chunked_pristine[:2], _chunk_bytes(1 << 30, remake=True))]):
        w = Work(src, tmp_path / f"ok{i}")
        change(w)
        snap, msg, _ = guard.load(w.dir, w.dir)
        assert msg is None, msg
        assert ("chunks" in w.entry) == (i >= 2)
        if src[0] == big:
            for n in want.layer_names:
                assert torch.equal(snap[n].A, want[n].A) and torch.equal(snap[n].G, want[n].G)
