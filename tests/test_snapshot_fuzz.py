"""Fuzz the snapshot reader: corrupted variants of one real snapshot, each refused cleanly.

One snapshot is written by a real Trainer run (a 1-block GPT-2, dense and diagonal factors),
then damaged in every way listed here: wrong types and nonsense values of named
keys, a type swap of every key of the manifest (each value replaced by values of the other
JSON types, a NaN and a 10 001-digit integer), deep nesting, huge integers, duplicate keys,
truncations and byte flips of the manifest and the shard, shard headers that disagree with
the manifest under a matching sha256, names that leave the directory, symlinks in and out of
it, FIFOs and directories in a file's place, and a pickle disguised as a shard.

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

from harness import run
from manifest_swaps import set_at, swap_variants
from models import text_examples, tiny_gpt2

HANG_S = 10  # watchdog per load: a load still running then counts as a hang
SLOW_S = 3.0  # every load, refused or not, must finish within this (they take milliseconds)
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

    def rehash(self):
        """Make the manifest's sha256 and bytes match the shard as it is now."""
        data = self.shard.read_bytes()
        self.m["shards"][self.shard_name].update(sha256=hashlib.sha256(data).hexdigest(),
                                                 bytes=len(data))
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
    ("fisher unknown", _set(["fisher"], "mcmc"), ['fisher is "mcmc"']),
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
    ("sha256 of another file", lambda w: _set(["shards", w.shard_name, "sha256"],
                                              "0" * 64)(w), ["{S}: sha256 mismatch"]),
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


def test_every_corrupted_variant_is_refused(pristine, guard, tmp_path, capsys):
    src, manifest = pristine
    problems, tried, slowest = [], 0, 0.0

    def attempt(name, path, inside, needles):
        nonlocal tried, slowest
        tried += 1
        snap, msg, seconds = guard.load(path, inside)
        slowest = max(slowest, seconds)
        if seconds > SLOW_S:
            problems.append(f"{name}: took {seconds:.1f} s")
        if snap is not None:
            problems.append(f"{name}: loaded instead of raising SnapshotError")
        elif not msg or not msg.strip():
            problems.append(f"{name}: SnapshotError without a message")
        else:
            if os.environ.get("FUZZ_DUMP"):
                with open(os.environ["FUZZ_DUMP"], "a") as f:
                    f.write(f"{name}\t{msg}\n")
            missing = [n for n in needles if n not in msg]
            if missing:
                problems.append(f"{name}: message lacks {missing}: {msg}")

    variants = VARIANTS + _truncations_and_flips(pristine)
    for i, (name, damage, needles) in enumerate(variants):
        w = Work(pristine, tmp_path / f"v{i}")
        damage(w)
        fill = {"{L}": layer_path(w), "{K}": w.key, "{S}": w.shard_name}
        needles = [fill_in(n, fill) for n in needles]
        attempt(name, w.dir, w.dir, needles)
        shutil.rmtree(tmp_path / f"v{i}")
    n_named = tried

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
                problems.append(f"{label}: refused, but the schema allows it")
            accepted.append(label)
            continue
        attempt(label, w.dir, w.dir, [MANIFEST, path])
    w.save(dump(manifest))
    assert guard.load(w.dir, w.dir)[0] is not None  # the copy itself was fine all along

    assert not problems, f"{len(problems)} of {tried} variants:\n" + "\n".join(problems)
    assert tried >= 50
    with capsys.disabled():
        print(f"\nsnapshot fuzz: {tried} corrupted variants ({n_named} hand-made, "
              f"{tried - n_named} type swaps of every manifest key) all refused with "
              f"SnapshotError, slowest {slowest * 1e3:.0f} ms; {len(accepted)} swaps "
              "allowed by the schema loaded")


def fill_in(text, fill):
    for k, v in fill.items():
        text = text.replace(k, v)
    return text


def test_valid_variants_load(pristine, guard, tmp_path):
    """The checks refuse only what is wrong: the pristine copy, unknown extra keys (at the top
    and in a record), the optional keys left out, and a symlinked snapshot directory given by
    the user all load, opening nothing outside the snapshot directory."""
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
    w.save()
    snap1, msg, _ = guard.load(w.dir, w.dir)
    assert msg is None and all(torch.equal(snap1[n].A, reference[n]) for n in reference)

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
