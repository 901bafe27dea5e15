"""A new tracker extension is one class: registered by name, enabled by the configuration, and
called by the tracker at its declared points (each step's begin, each captured call and its
output gradient, each update, each snapshot), with no change to the tracker.

The toy extension below counts, per tracked layer, the usable token positions of the calls
whose output received a gradient in the update steps' passes, the calls and the update steps,
and writes them into every snapshot's manifest (``layers[<layer>]["row_count"]``). In a
Trainer run of the empirical Fisher at ``token_fraction=1`` every micro-batch of every step is
captured, so the counts must equal those of the recorded batches counted by hand."""

import json
from pathlib import Path

import pytest
import torch

from kfac_stream import Snapshot
from kfac_stream.extensions import (
    ExtensionExport,
    TrackerExtension,
    extensions_for,
    register_extension,
    unregister_extension,
)

from harness import hf_like_loss, run
from models import text_examples, tiny_gpt2

LENGTHS = [12, 9, 12, 7, 10, 12]  # padding in most batches


class RowCount(TrackerExtension):
    """Per layer: usable positions of its captured calls, the calls, the update steps."""

    name = "row_count"
    begun = 0

    @classmethod
    def applies(cls, config) -> bool:
        return True

    def __init__(self, tracker) -> None:
        super().__init__(tracker)
        self.rows: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self.updates = 0

    def begin_step(self) -> None:
        type(self).begun += 1

    def keep_call(self, layer: str):
        return layer

    def add_call(self, rec, layer, x, grad, usable, token) -> None:
        assert token == layer and x.shape[:-1] == grad.shape[:-1]
        counts = rec.extensions.setdefault(self.name, {})
        counts.setdefault(layer, []).append(usable.sum())

    def collect_pass(self, rec, c, acc):
        acc = {} if acc is None else acc
        for layer, found in rec.extensions.get(self.name, {}).items():
            acc.setdefault(layer, []).extend(found)
        return acc

    def add_update(self, step, acc, ok) -> None:
        assert bool(ok)
        for layer, found in acc.items():
            total = torch.stack(found).sum()
            self.rows[layer] = self.rows[layer] + total if layer in self.rows else total
            self.calls[layer] = self.calls.get(layer, 0) + len(found)
        self.updates += 1

    def export(self, step: int) -> ExtensionExport:
        return ExtensionExport(entries={
            layer: {"rows": int(rows), "calls": self.calls[layer], "updates": self.updates}
            for layer, rows in self.rows.items()})


@pytest.fixture
def toy_extension():
    register_extension(RowCount)
    RowCount.begun = 0
    yield RowCount
    unregister_extension(RowCount)


def _usable(labels: torch.Tensor) -> int:
    """Usable positions of one sequence (``labels [T]``): up to the last scored logit row
    (``labels[t+1] != -100``), by hand; the last real token scores nothing."""
    scored = (labels[1:] != -100).nonzero()
    return int(scored.max() + 1) if scored.numel() else 0


def _labels(batch: dict) -> torch.Tensor:
    """The batch's labels ``[B, T]``; a compute_loss_func's forward gets none: text_examples'
    are the ids, -100 at padding."""
    return batch.get("labels", torch.where(batch["attention_mask"] == 1, batch["input_ids"],
                                           -100))


def test_registered_extension_is_enabled_by_the_config(toy_extension):
    from kfac_stream import KFACConfig

    assert [c.name for c in extensions_for(KFACConfig())] == ["row_count"]
    assert [c.name for c in extensions_for(KFACConfig(ekfac=True))] == ["ekfac", "row_count"]
    unregister_extension(toy_extension)
    assert extensions_for(KFACConfig()) == []
    register_extension(toy_extension)


def test_registered_extension_runs_end_to_end(tmp_path, toy_extension):
    steps = 4
    examples = text_examples(2 * steps, 12, lengths=LENGTHS + LENGTHS[:2])
    cb, recs, _ = run(tiny_gpt2(), examples, {"snapshot_every": 2}, batch=2, lr=0.0,
                      loss=hf_like_loss, tmp_path=tmp_path, record=True)
    ext = cb.tracker.extension("row_count")
    assert type(ext) is toy_extension and toy_extension.begun == steps
    batches = [r["kwargs"] for r in recs]
    assert len(batches) == steps  # one forward per step: every pass is an update's
    want = sum(_usable(row) for b in batches for row in _labels(b))
    assert want < sum(LENGTHS + LENGTHS[:2])  # the padding and each last token count nothing
    snaps = [Snapshot.load(p) for p in cb.snapshots]
    assert [s.step for s in snaps] == [2, 4]
    for snap, done in zip(snaps, (2, 4)):
        manifest = json.loads((Path(snap.path) / "manifest.json").read_text())
        for name in snap.layer_names:  # every tracked layer is called once per forward
            entry = manifest["layers"][name]["row_count"]
            part = sum(_usable(row) for b in batches[:done] for row in _labels(b))
            assert entry == {"rows": part, "calls": done, "updates": done}, (name, entry)
            assert snap[name].meta["row_count"] == entry
    assert part == want
