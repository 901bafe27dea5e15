"""Names and small pure helpers of the snapshot format (brief §2).

::

    <output_dir>/step-00000500/
        manifest.json                       # written last, by rank 0
        shard-00000-of-00002.safetensors    # factors owned by rank 0
        shard-00001-of-00002.safetensors    # factors owned by rank 1

Tensor keys in a shard: ``"<layer>.A"`` / ``"<layer>.G"`` (storage dtype; ``[d, d]`` or ``[d]``
for diagonal factors) and ``"<layer>.A.scale"`` / ``"<layer>.G.scale"`` (float32 ``[1]``;
the factor is ``scale · data``). Format 2: a layer whose A is shared with other layers (same
input, `capture.sharing`) names the stored key in its manifest entry (``layers[name]["A"]
["key"]``, the group leader's ``"<leader>.A"``); the manifest's ``shared_inputs`` lists the
groups. Format 1 (no ``key``, no sharing) is still read. A snapshot is first written to
``.step-XXXXXXXX.tmp-<tag>`` and renamed when complete, so a directory under a final name
is always whole.
"""

from __future__ import annotations

import hashlib
import re

FORMAT_NAME = "kfac_stream.snapshot"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
STEP_DIR_RE = re.compile(r"^step-(\d{8})$")
TMP_DIR_RE = re.compile(r"^\.(step-\d{8})\.tmp-(.+)$")  # hidden name of a snapshot in writing


def step_dir_name(step: int) -> str:
    """``step-00000500``."""
    return f"step-{int(step):08d}"


def tmp_dir_name(step: int, tag: str) -> str:
    """Hidden temporary name of a snapshot being written."""
    return f".{step_dir_name(step)}.tmp-{tag}"


def shard_name(rank: int, world_size: int) -> str:
    """``shard-00000-of-00001.safetensors``."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def layer_fingerprint(layers: dict[str, tuple[int, int, bool]]) -> str:
    """sha256 over the tracked layers' ``name:d_in:d_out:bias`` lines, in order."""
    text = "\n".join(f"{n}:{d_in}:{d_out}:{int(b)}" for n, (d_in, d_out, b) in layers.items())
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
