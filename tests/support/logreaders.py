"""Read back what a run logged: W&B offline run files and TensorBoard event files.

* ``latest_wandb_run_dir(wandb_dir) -> str``: the newest offline run directory under
  ``WANDB_DIR`` (``<wandb_dir>/wandb/offline-run-*``).
* ``read_wandb_offline(run_dir) -> list[dict]``: the history rows of an offline run, in order
  (``{key: value}``; a media value such as ``wandb.Histogram`` is its JSON dict, e.g.
  ``{"_type": "histogram", "values": [...], "bins": [...]}``).
* ``read_tensorboard_scalars(logdir) -> dict[str, list[(step, value)]]``: every scalar under
  ``logdir`` (all event files, merged, sorted by step).
* ``Lines``: a context manager that collects every ``kfac_stream`` log message of a block
  (``.lines``), at INFO; a module fixture cannot use ``caplog``.
* ``offline_wandb_env(root)`` / ``finish_wandb()``: set up and finish an offline W&B run whose
  files stay under ``root``.

wandb ≥ 0.19 writes its transaction log (``run-<id>.wandb``) from the Go ``wandb-core``
process and no longer ships the Python reader (``wandb.sdk.internal.datastore``), so the
framing is read here: a 7-byte header (``":W&B"``, magic ``0xBEE1``, version 0), then
LevelDB-log records in 32 KiB blocks (``crc32 | length uint16 | type uint8 | data``, types
FULL/FIRST/MIDDLE/LAST; a block tail shorter than a record header is zero padding), each
payload a ``wandb.proto.wandb_internal_pb2.Record`` parsed by the wandb package itself.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator


def offline_wandb_env(root) -> dict[str, str]:
    """Environment for an offline W&B run whose files all stay under ``root``."""
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_PROJECT": "kfac-stream-test",
            "WANDB_CONFIG_DIR": str(root / "wandb-config"), "WANDB_CACHE_DIR": str(root / "cache"),
            "WANDB_DATA_DIR": str(root / "data"), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}


def finish_wandb() -> None:
    """Finish the run (flushes its files) and stop wandb's service, so nothing leaks."""
    import wandb

    wandb.finish()
    wandb.teardown()
    assert wandb.run is None

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_RECORD = struct.Struct("<IHB")  # crc32, length, type
_BLOCK = 32768
_FULL, _LAST = 1, 4  # a FIRST (2) chunk and MIDDLE (3) ones are joined up to the LAST


def latest_wandb_run_dir(wandb_dir: str) -> str:
    """The most recently modified ``offline-run-*`` directory under ``wandb_dir``."""
    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*"))
    if not runs:
        raise FileNotFoundError(f"no offline W&B run under {wandb_dir}")
    return max(runs, key=os.path.getmtime)


def _payloads(path: str) -> Iterator[bytes]:
    """The record payloads of a W&B transaction log, checksums verified."""
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = _HEADER.unpack_from(data)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B transaction log")
    pos, parts = _HEADER.size, []
    while pos + _RECORD.size <= len(data):
        if _BLOCK - pos % _BLOCK < _RECORD.size:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = _RECORD.unpack_from(data, pos)
        chunk = data[pos + _RECORD.size:pos + _RECORD.size + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: bad record checksum at byte {pos}")
        pos += _RECORD.size + length
        parts.append(chunk)
        if kind in (_FULL, _LAST):
            yield b"".join(parts)
            parts = []


def read_wandb_offline(run_dir: str) -> list[dict]:
    """History rows (``{key: value}``, values decoded from JSON) of an offline W&B run."""
    from wandb.proto.wandb_internal_pb2 import Record

    files = glob.glob(os.path.join(run_dir, "*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{run_dir}: expected one .wandb file, found {files}")
    rows = []
    for payload in _payloads(files[0]):
        record = Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            row: dict = {}
            for item in record.history.item:
                _set(row, [item.key] if item.key else list(item.nested_key), _value(item))
            rows.append(row)
    return rows


def _set(row: dict, path: list[str], value) -> None:
    """``row[path[0]][path[1]]... = value``: media (a dict) is stored one leaf per item."""
    for part in path[:-1]:
        row = row.setdefault(part, {})
    row[path[-1]] = value


def _value(item):
    """A history item's value: the legacy ``value_json`` or the typed ``value`` field."""
    kind = item.WhichOneof("value")
    if kind is None:
        return json.loads(item.value_json)
    if kind == "none":
        return None
    return json.loads(item.json) if kind == "json" else getattr(item, kind)


def read_tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every event file under ``logdir``.

    Each file is read on its own (an accumulator over a directory purges "orphaned" data when
    a later file restarts at an earlier step) and the results are merged, sorted by step.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    pattern = os.path.join(logdir, "**", "events.out.tfevents.*")
    for path in sorted(glob.glob(pattern, recursive=True)):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(values, key=lambda sv: sv[0]) for tag, values in out.items()}


class Lines(logging.Handler):
    """Every ``kfac_stream`` log message of a block (a module fixture cannot use caplog)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        log = logging.getLogger("kfac_stream")
        self._level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *exc):
        log = logging.getLogger("kfac_stream")
        log.removeHandler(self)
        log.setLevel(self._level)
