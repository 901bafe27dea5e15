"""An encoder-decoder's default layers are its decoder stack whatever the
depths (named in the train-begin line), and the end-of-train line gives the callback's own
seconds and their share of training. Real ``transformers.Trainer`` runs of tiny models built
from configs, on CPU."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.capture.presets import block_prefix
from kfac_stream.tracking.tracker import Tracker

from harness import run
from models import ListDataset, text_examples, tiny_gpt2

VOCAB, SEQ = 64, 8


def _t5(num_layers: int, num_decoder_layers: int | None):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=num_layers,
        num_decoder_layers=num_decoder_layers, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _bart(encoder_layers: int, decoder_layers: int):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=encoder_layers,
        decoder_layers=decoder_layers, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))


def _seq2seq_examples(n: int) -> list[dict[str, torch.Tensor]]:
    """Targets as long as the inputs (what the tracker trains on), ids >= 3 (no special)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": ((ids * 3 + 1) % VOCAB).clamp(min=3)})
    return out


def _train(model, tmp_path, caplog, steps: int = 2) -> KFACStreamCallback:
    cb = KFACStreamCallback(KFACConfig(update_every=1, snapshot_every=10_000,
                                       output_dir=str(tmp_path / "kfac")))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=steps,
                             learning_rate=1e-3, report_to=[], logging_strategy="no",
                             save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    with caplog.at_level("INFO", logger="kfac_stream"):
        Trainer(model=model, args=args, train_dataset=ListDataset(_seq2seq_examples(4 * steps)),
                callbacks=[cb]).train()
    return cb


def _summary(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("kfac_stream: tracking ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("family,encoder,decoder", [
    ("t5", 2, None),  # was: decoder.block.0 only (its 3-long ``layer`` list beat both stacks)
    ("t5", 4, None),  # was: the encoder (encoder.block, first of two 4-long stacks)
    ("t5", 4, 2),     # the encoder deeper than the decoder
    ("t5", 1, 3),
    ("bart", 3, 2),   # was: model.encoder.layers
    ("bart", 2, 2),
])
def test_seq2seq_default_layers_are_the_decoder_stack(family, encoder, decoder, tmp_path,
                                                       caplog):
    """The default selection is every Linear of every decoder block and nothing else, for any
    depths; the train-begin line names that stack and its length."""
    model = _t5(encoder, decoder) if family == "t5" else _bart(encoder, decoder)
    depth = decoder if decoder is not None else encoder  # T5: num_decoder_layers or num_layers
    stack = "decoder.block" if family == "t5" else "model.decoder.layers"
    blocks = re.compile(rf"^{re.escape(stack)}\.(\d+)\.")
    want = [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and blocks.match(n)]
    cb = _train(model, tmp_path, caplog)
    assert list(cb.tracker.specs) == want, sorted(set(cb.tracker.specs) ^ set(want))
    assert {int(blocks.match(n)[1]) for n in want} == set(range(depth))
    assert len(want) == 10 * depth  # self- and cross-attention's 4 each; T5 wi, wo; BART fc1, fc2
    assert f" in stack {stack} ({depth} blocks), " in _summary(caplog), _summary(caplog)


def test_a_list_nested_in_a_block_is_never_the_stack():
    """Why T5 with 2 layers tracked one block: the longest ``nn.ModuleList`` was a block's own
    sub-layer list. A list inside another list's element (sub-layers, MoE experts) never wins,
    however long."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(4, 4)

    assert block_prefix(Model()) == "blocks"


def test_decoder_only_summary_names_its_stack(tmp_path, caplog):
    """A decoder-only model: the stack is its blocks, as before; ``include`` names no stack."""
    with caplog.at_level("INFO", logger="kfac_stream"):
        run(tiny_gpt2(torch.float32), text_examples(4, 12), batch=2, tmp_path=tmp_path,
            record=False)
    assert " in stack transformer.h (2 blocks), " in _summary(caplog)
    caplog.clear()
    with caplog.at_level("INFO", logger="kfac_stream"):
        run(tiny_gpt2(torch.float32), text_examples(4, 12), {"include": [r"\.mlp\."]}, batch=2,
            tmp_path=tmp_path / "inc", record=False)
    assert " in stack " not in _summary(caplog)


NUM = r"([\d.e+-]+)"
COST = re.compile(rf"^kfac_stream: {NUM} s in the callback \(([\d.]+)% of {NUM} s training, from "
                  rf"train begin to this line; {NUM} s set-up; {NUM} s steps; {NUM} s end\); "
                  r"counted: ")
SLEEP = 0.05


def test_end_of_train_line_gives_the_callbacks_seconds_and_share(tmp_path, caplog,
                                                                 monkeypatch):
    """The callback's own seconds (its Trainer events, timed on the training thread) and their
    share of the time from train begin to that line. Each factor update is made 50 ms slower:
    that time must be counted, and the share is the ratio of the two printed figures."""
    end_step = Tracker.end_step

    def slow_end_step(self, model):
        time.sleep(SLEEP)
        return end_step(self, model)

    monkeypatch.setattr(Tracker, "end_step", slow_end_step)
    steps = 4
    started = time.perf_counter()
    with caplog.at_level("INFO", logger="kfac_stream"):
        cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(8, 12), batch=2, steps=steps,
                       tmp_path=tmp_path, record=False)
    wall = time.perf_counter() - started
    lines = [r.getMessage() for r in caplog.records if " s in the callback (" in r.getMessage()]
    assert len(lines) == 1, lines
    m = COST.match(lines[0])
    assert m, lines[0]
    seconds, share, training = float(m[1]), float(m[2]), float(m[3])
    assert 0 < seconds <= training <= wall
    # the printed figures are the callback's own (3 significant digits, share to 0.1 points)
    assert seconds == pytest.approx(cb.callback_seconds, rel=5e-3)
    assert training == pytest.approx(cb.train_end_seconds, rel=5e-3)
    assert share == pytest.approx(100 * cb.callback_seconds / cb.train_end_seconds, abs=0.051)
    # and the share is the ratio of the printed seconds, to their rounding
    assert share == pytest.approx(100 * seconds / training, rel=1e-2, abs=0.051)
    parts = dict(zip(("set-up", "steps", "end"), map(float, m.groups()[3:])))
    assert parts == pytest.approx(cb.callback_parts, rel=5e-3)
    assert sum(cb.callback_parts.values()) == pytest.approx(cb.callback_seconds, rel=1e-9)
    assert cb.callback_parts["steps"] >= steps * SLEEP  # the slowed updates: in the steps
    # what the handlers did is in it: the slowed calls, the tracker's own update time and the
    # snapshots' hold on the training thread (all inside on_step_end / on_train_end)
    counted = cb.tracker.counters.tracker_seconds + sum(cb.snapshot_hold_seconds)
    assert cb.callback_seconds >= steps * SLEEP + counted
    assert cb.train_seconds <= cb.train_end_seconds
    # and it is the callback's, not the training's: below the whole run's time
    assert cb.callback_seconds < cb.train_end_seconds
