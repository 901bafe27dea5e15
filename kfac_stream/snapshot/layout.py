"""Names and small pure helpers of the snapshot format.

::

    <output_dir>/step-00000500/
        manifest.json                       # written last, by rank 0
        shard-00000-of-00002.safetensors    # factors owned by rank 0
        shard-00001-of-00002.safetensors    # factors owned by rank 1

Tensor keys in a shard: ``"<layer>.A"`` / ``"<layer>.G"`` (storage dtype; ``[d, d]`` or ``[d]``
for diagonal factors) and ``"<layer>.A.scale"`` / ``"<layer>.G.scale"`` (float32 ``[1]``;
the factor is ``scale · data``). Every factor entry of the manifest names its stored key
(``layers[name]["A"]["key"]``): a layer whose A is shared with other layers (same input,
`capture.sharing`) names the group leader's ``"<leader>.A"``; the manifest's
``shared_inputs`` lists the groups. A snapshot is first written to
``.step-XXXXXXXX.tmp-<tag>`` and renamed when complete, so a directory under a final name
is always whole.

The manifest's keys are the dataclasses of `kfac_stream.snapshot.manifest_types` (its schema,
every key's type and range, is generated from them; `kfac_stream.snapshot.manifest` checks
it); the limits below bound what a reader accepts before it reads or parses anything.
"""

from __future__ import annotations

import hashlib
import os
import re

FORMAT_NAME = "kfac_stream.snapshot"
#: The format written. 3: a snapshot may defer its eigendecomposition (the manifest's
#: ``eigen``: then its shards hold no eigenvalues or eigenvectors, and each factor's spectrum is
#: estimated) and its shards may carry chunk digests.
FORMAT_VERSION = 3
#: The formats read: 2 (every snapshot eigendecomposed) and 3.
READ_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
#: Where a new training run sets the snapshots of earlier runs aside (``<root>/earlier-runs/
#: <run id>/step-*``, `writer.set_aside_other_runs`).
EARLIER_RUNS_DIR = "earlier-runs"
STEP_DIR_RE = re.compile(r"^step-(\d{8})$")
TMP_DIR_RE = re.compile(r"^\.(step-\d{8})\.tmp-(.+)$")  # hidden name of a snapshot in writing
SHARD_RE = re.compile(r"^shard-(\d{5,})-of-(\d{5,})\.safetensors$")  # what `shard_name` makes

#: Largest ``manifest.json`` a reader accepts, in bytes. A manifest takes about 1.1 KiB per
#: tracked layer (8.8 KiB measured for 8 layers), so 64 MiB is ~60 000 layers, far beyond any
#: model; a larger file is refused from its size, before one byte is read, so a wrong file
#: (a log, a disk image) cannot exhaust memory.
MAX_MANIFEST_BYTES = 64 * 2**20
#: Longest integer literal (digits, without the sign) in a manifest or shard header. Every
#: integer of the format (step, counts, byte sizes, dims, offsets, ranks) fits in 64 bits, i.e.
#: at most 20 digits; a longer literal is refused before Python converts it (Python's own
#: limit, 4300 digits, raises a bare ValueError; below it, conversion is quadratic).
MAX_INT_DIGITS = 20
#: Deepest nesting of JSON containers accepted. The manifest's own structure is 5 levels
#: deep (manifest → layers → layer → factor → spectrum); 32 leaves room for additions. Deeper
#: documents are refused whole (the parser's recursion would otherwise end in RecursionError).
MAX_JSON_DEPTH = 32
#: Largest safetensors header, in bytes: safetensors' own limit (its reader refuses more).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000


def step_dir_name(step: int) -> str:
    """``step-00000500``."""
    return f"step-{int(step):08d}"


def tmp_dir_name(step: int, tag: str) -> str:
    """Hidden temporary name of a snapshot being written."""
    return f".{step_dir_name(step)}.tmp-{tag}"


def shard_name(rank: int, world_size: int) -> str:
    """``shard-00000-of-00001.safetensors``."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def file_name_problem(name: str) -> str | None:
    """Why ``name`` is not a plain file name that stays inside its directory, or None.

    A plain name has no path separator, is not ``.`` or ``..``, is not absolute, has no NUL
    or other control character and is at most 255 bytes (the usual file system limit).
    """
    if not name:
        return "an empty name"
    if "/" in name or "\\" in name:
        return "a path with a separator, not a plain file name"
    if name in (".", ".."):
        return "a directory reference, not a file name"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "a name with a NUL or control character"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "a name that is not valid Unicode text"
    if len(encoded) > 255:
        return "a name longer than 255 bytes"
    return None


def layer_fingerprint(layers: dict[str, tuple[int, int, bool]]) -> str:
    """sha256 over the tracked layers' ``name:d_in:d_out:bias`` lines, in order."""
    text = "\n".join(f"{n}:{d_in}:{d_out}:{int(b)}" for n, (d_in, d_out, b) in layers.items())
    return hashlib.sha256(text.encode()).hexdigest()


def snapshot_roots_below(root: str, depth: int = 2) -> list[str]:
    """Folders up to ``depth`` levels below ``root`` that hold ``step-*`` entries (a run
    directory's ``kfac/``, a Trainer output's ``<run>/kfac``), in sorted order."""
    found, level = [], [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                subs = sorted(e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
            for sub in subs:
                try:
                    if any(STEP_DIR_RE.match(e) for e in os.listdir(sub)):
                        found.append(sub)
                        continue
                except OSError:
                    continue
                nxt.append(sub)
        level = nxt
    return found[:3]


#: Files that mark a model folder (``save_pretrained``'s, a Trainer checkpoint's, a PEFT
#: adapter's), which holds no snapshot.
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "adapter_config.json", "adapter_model.safetensors")


def where_snapshots_are(root: str) -> str:
    """What ``Snapshot.latest(root)`` says when ``root`` holds no ``step-*`` entry ("" when it
    has nothing to add), in one line: the folders below ``root`` that hold snapshots (a run
    directory's ``kfac/``); for a model folder (`MODEL_FILES`), that it is one, where the
    callback writes snapshots, and the folders beside it that hold them."""
    below = snapshot_roots_below(root)
    hint = ""
    if below:
        hint = (f"; snapshots are in {' and '.join(below)} (a run directory holds them in its "
                "kfac/ folder): pass that")
    marks = [f for f in MODEL_FILES if os.path.isfile(os.path.join(root, f))]
    if not marks:
        return hint
    beside = snapshot_roots_below(os.path.normpath(os.path.join(root, os.pardir)), depth=1)
    hint = (f"; {root} is a model folder (it holds {', '.join(marks)}), not a snapshot folder: "
            "the callback writes its snapshots as step-XXXXXXXX folders into "
            "KFACConfig.output_dir (default: <TrainingArguments.output_dir>/kfac)") + hint
    if beside:
        hint += f"; beside it, snapshots are in {' and '.join(beside)}: pass that"
    return hint
