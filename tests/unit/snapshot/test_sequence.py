"""The snapshot sequence in one place (`kfac_stream.snapshot.sequence`): the callback's final
snapshot, `take_snapshot` on the same tracker and `write_record` of its record hold the same
factors and eigendecompositions; the stored tensors a capture lent stay the snapshot's until
released."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from kfac_stream import Snapshot
from kfac_stream.snapshot.sequence import capture_snapshot, take_snapshot, write_record

from harness import run
from models import text_examples, tiny_gpt2


def _tensors(path):
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_callback_take_snapshot_and_write_record_agree(tmp_path):
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(8, 12),
                   {"storage_dtype": "float16"}, batch=2, tmp_path=tmp_path, record=False)
    final = cb.snapshots[-1]
    tracker = cb.tracker  # closed: no more updates, the store as the final snapshot saw it
    again = take_snapshot(tracker, str(tmp_path / "again"), 99)
    record = write_record(tracker.export(), str(tmp_path / "record"), 98)
    ref = _tensors(Path(final))
    for path in (again, record):
        got = _tensors(Path(path))
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(got[k], ref[k]), k  # the same factors and eigenvectors
    snaps = [Snapshot.load(p) for p in (final, again, record)]
    # no model there
    assert snaps[1].manifest.weights is not None and snaps[2].manifest.weights is None
    name = snaps[0].layer_names[0]
    assert torch.equal(snaps[0][name].A_eigvals, snaps[1][name].A_eigvals)

    captured = capture_snapshot(tracker, 100)
    key = next(iter(captured.lent))
    assert captured.lent[key] is tracker.store._factors[key].data  # lent, not copied
    tracker.release(captured.lent)
    assert not tracker.store._factors[key].lent


def test_checkpoints_after_a_snapshot_write_in_place(tmp_path):
    """The callback releases what a written snapshot was lent before the next checkpoint's or
    snapshot's flush, so that flush writes the stored factors in place: no spare is ever
    allocated (device path, the CPU standing in for the device, the worker on)."""
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(16, 12),
                   {"storage_dtype": "float16", "snapshot_every": 3, "fold_on": "device",
                    "async_updates": True}, batch=2, tmp_path=tmp_path, record=False,
                   save_strategy="steps", save_steps=2)
    assert len(cb.snapshots) >= 3 and sorted(tmp_path.glob("checkpoint-*"))
    assert cb.tracker.store.spare_bytes() == 0
    for path in cb.snapshots:
        Snapshot.load(path)  # every snapshot verifies: nothing wrote its tensors meanwhile
