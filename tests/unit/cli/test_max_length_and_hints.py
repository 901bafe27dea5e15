"""Long inputs cut as training cut them, "did you mean" hints, a snapshot of another
architecture named, and the sampling error in ``kfac-stream inspect``, on real runs, files and
CLI calls:

- ``kfac-stream query --max-length N`` cuts a longer input as training did (a causal LM keeps
  the end of its text, a classifier the start) instead of refusing it, and the refusal names
  the flag;
- "did you mean" for a misspelt ``KFACConfig(preset=...)`` and the CLI's ``--label``;
- a snapshot of another architecture is named as such, both architectures, before any
  ``merge_and_unload()`` hint (which stays where it applies: a merged LoRA model);
- ``kfac-stream inspect`` prints the relative standard error with its threshold and verdict.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from kfac_stream import KFACConfig, LaplacePosterior, Snapshot
from kfac_stream.capture.presets import preset_layers
from kfac_stream.cli import main as cli_main
from kfac_stream.exceptions import KFACConfigError, SnapshotMismatchError
from kfac_stream.snapshot.adequacy import REL_SE_WARN, sampling_summary
from kfac_stream.snapshot.manifest_types import to_json

from harness import run
from models import lora_gpt2, save_bpe_tokenizer, text_examples, tiny_gpt2

POSITIONS = 16
#: Longer than the models' 16 positions, in bytes and in the BPE's tokens.
LONG = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n"
SHORT = "import os"
LABELS = {0: "negative", 1: "positive"}
#: A final window (the EMA below 1 turns it on), so `inspect` judges the sampling error.
WINDOW = {"final_window": 0.5, "ema_decay": 0.95, "min_window_sequences": 0,
          "storage_dtype": "float32"}


def _error(capsys, args: list[str], *needles: str) -> str:
    """``kfac-stream <cmd>`` exits 2 with one error line naming every needle; returns it."""
    capsys.readouterr()
    assert cli_main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    line = captured.err.strip().splitlines()[-1]
    assert line.startswith(f"kfac-stream {args[0]}: error: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def _json(capsys, args: list[str]) -> tuple[dict, str]:
    capsys.readouterr()
    assert cli_main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny GPT-2 of 16 positions (vocabulary 512: room for the BPE's 400 tokens) trained on
    byte windows with a final window, saved with a BPE tokenizer beside it (``tok/``)."""
    tmp = tmp_path_factory.mktemp("frictions_lm")
    model = tiny_gpt2(torch.float32, n_positions=POSITIONS, vocab_size=512)
    run(model, text_examples(16, 12), WINDOW, batch=2, tmp_path=tmp, record=False)
    model.save_pretrained(tmp / "model")
    save_bpe_tokenizer(tmp / "tok", [LONG, SHORT] * 20)
    return tmp, model.eval(), Snapshot.latest(tmp / "kfac")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT classifier of 16 positions with named labels, saved without tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    tmp = tmp_path_factory.mktemp("frictions_bert")
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=POSITIONS, num_labels=2, id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()}, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    ex = text_examples(8, 12)
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % 2)
    run(model, ex, {"snapshot_every": 2}, batch=2, tmp_path=tmp, record=False)
    model.save_pretrained(tmp / "model")
    return tmp, model.eval(), Snapshot.latest(tmp / "kfac")


def _lm_query(tmp, *extra: str) -> list[str]:
    return ["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--prior-precision", "2.0", "--samples", "4", *extra]


# -- 1. query --max-length ---------------------------------------------------------------


def test_query_max_length_keeps_the_end_of_a_causal_lm_text(lm, capsys):
    tmp, _, _ = lm
    long_bytes = LONG.encode()
    assert len(long_bytes) > POSITIONS
    # refused without the flag, and the refusal says how to truncate
    _error(capsys, _lm_query(tmp, "--byte-level", "--text", LONG),
           f"is {len(long_bytes)} tokens long", f"at most {POSITIONS}", "--max-length N",
           "keep its last N tokens")
    # --max-length 12: the last 12 bytes, exactly what a query of those bytes alone prints
    doc, err = _json(capsys, _lm_query(tmp, "--byte-level", "--text", LONG, "--max-length",
                                       "12"))
    assert [p["token_id"] for p in doc["positions"]] == list(long_bytes[-12:])
    assert doc["max_length"] == 12
    assert f"{len(long_bytes)} tokens, truncated to its last 12 (--max-length 12)" in err
    tail, _ = _json(capsys, _lm_query(tmp, "--byte-level", "--text",
                                      long_bytes[-12:].decode()))
    assert doc["positions"] == tail["positions"]
    # an input that fits is left alone
    short, err = _json(capsys, _lm_query(tmp, "--byte-level", "--text", SHORT,
                                         "--max-length", "12"))
    assert [p["token_id"] for p in short["positions"]] == list(SHORT.encode())
    assert "truncated" not in err
    # a tokenizer cuts from the left too (its truncation, truncation_side="left")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp / "tok")
    ids = tok(LONG)["input_ids"]
    assert len(ids) > 6
    doc, _ = _json(capsys, _lm_query(tmp, "--tokenizer", str(tmp / "tok"), "--text", LONG,
                                     "--max-length", "6"))
    assert [p["token_id"] for p in doc["positions"]] == ids[-6:]
    assert tok.truncation_side == "right"  # the loaded tokenizer is put back as it was
    # bad values: one line each
    _error(capsys, _lm_query(tmp, "--byte-level", "--text", LONG, "--max-length", "0"),
           "--max-length=0 is not allowed")
    _error(capsys, _lm_query(tmp, "--byte-level", "--text", LONG, "--max-length",
                             str(POSITIONS + 1)),
           f"--max-length={POSITIONS + 1} is more than the model's {POSITIONS} positions")


def test_query_max_length_keeps_the_start_of_a_classifier_input(bert, capsys, tmp_path):
    tmp, _, _ = bert
    inputs = tmp_path / "inputs.txt"
    inputs.write_text(f"{LONG.replace(chr(10), ' ')}\n{SHORT}\n")
    long_line = LONG.replace("\n", " ")
    argv = ["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--byte-level", "--prior-precision", "2.0"]
    _error(capsys, [*argv, "--file", str(inputs)], "line 1 is", "--max-length N",
           "keep its first N tokens")
    doc, err = _json(capsys, [*argv, "--file", str(inputs), "--max-length", str(POSITIONS)])
    assert doc["max_length"] == POSITIONS
    assert [r["tokens"] for r in doc["inputs"]] == [POSITIONS, len(SHORT)]
    assert f"truncated to its first {POSITIONS}" in err
    # the same probabilities as the first 16 bytes queried alone (and the short line as is)
    head = tmp_path / "head.txt"
    head.write_text(f"{long_line[:POSITIONS]}\n{SHORT}\n")
    want, _ = _json(capsys, [*argv, "--file", str(head)])
    for got, ref in zip(doc["inputs"], want["inputs"]):
        assert got["probs"] == pytest.approx(ref["probs"], rel=1e-9)
        assert got["map_probs"] == pytest.approx(ref["map_probs"], rel=1e-9)


# -- 2. did you mean ---------------------------------------------------------------------


def test_preset_typo_says_did_you_mean(lm):
    _, model, _ = lm
    for typo, meant in (("last-layer", "'last_layer'"), ("attn", "'attention'"),
                        ("all_linears", "'all_linear'")):
        with pytest.raises(KFACConfigError, match=f"did you mean {meant}\\?") as e:
            KFACConfig(preset=typo)
        assert f"KFACConfig.preset={typo!r} is not allowed: must be None or one of" in str(e.value)
        with pytest.raises(KFACConfigError, match=f"did you mean {meant}\\?"):
            preset_layers(model, typo)
    with pytest.raises(KFACConfigError) as e:  # nothing close: no guess
        KFACConfig(preset="heads")
    assert "did you mean" not in str(e.value)


def test_cli_label_typo_says_did_you_mean(bert, capsys, tmp_path):
    tmp, _, _ = bert
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"text": t, "label": lab})
                               for t, lab in (("def f(x):", "negative"), ("x = 2", "positive"))))
    argv = ["influence", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--byte-level", "--train", str(train), "--query", "def f(x):", "--label"]
    _error(capsys, [*argv, "negatve"], "label 'negatve' is not one of the model's labels",
           "did you mean 'negative'?")
    _error(capsys, [*argv, "Positive"], "did you mean 'positive'?")
    line = _error(capsys, [*argv, "maybe"], "label 'maybe' is not one of the model's labels")
    assert "did you mean" not in line
    # the training file's labels are checked the same way
    train.write_text(json.dumps({"text": "def f(x):", "label": "postive"}))
    _error(capsys, [*argv, "negative"], "did you mean 'positive'?")


# -- 3. a snapshot of another architecture ----------------------------------------------


def test_snapshot_of_another_architecture_is_named_before_any_merge_hint(lm, bert, capsys,
                                                                         tmp_path):
    lm_tmp, _, lm_snap = lm
    bert_tmp, bert_model, bert_snap = bert
    assert to_json(lm_snap.manifest.model) == {"class": "GPT2LMHeadModel", "model_type": "gpt2"}
    assert to_json(bert_snap.manifest.model) == {"class": "BertForSequenceClassification",
                                                 "model_type": "bert"}
    with pytest.raises(SnapshotMismatchError) as e:
        LaplacePosterior(bert_model, lm_snap, prior_precision=1.0)
    msg = str(e.value)
    assert msg.startswith(f"snapshot {lm_snap.path} is a snapshot of another architecture: it "
                          "was taken on a GPT2LMHeadModel (model_type 'gpt2'), the model is a "
                          "BertForSequenceClassification (model_type 'bert')"), msg
    assert "merge_and_unload" not in msg
    # the CLI: one line, the same words
    _error(capsys, ["query", "--snapshot", str(lm_tmp / "kfac"), "--model",
                    str(bert_tmp / "model"), "--byte-level", "--prior-precision", "1.0",
                    "--text", SHORT],
           "is a snapshot of another architecture", "GPT2LMHeadModel (model_type 'gpt2')",
           "BertForSequenceClassification (model_type 'bert')")

    # a LoRA run's snapshot records the base model's architecture; its merge gets the merge
    # hint (the same architecture, its adapter layers folded away), another model does not
    lora = lora_gpt2(torch.float32)
    run(lora, text_examples(8, 12), {"preset": "lora", "storage_dtype": "float32"}, batch=2,
        tmp_path=tmp_path / "lora", record=False)
    lora_snap = Snapshot.latest(tmp_path / "lora" / "kfac")
    assert to_json(lora_snap.manifest.model) == {"class": "GPT2LMHeadModel",
                                                 "model_type": "gpt2"}
    merged = lora.merge_and_unload().eval()
    with pytest.raises(SnapshotMismatchError, match="merge_and_unload") as e:
        LaplacePosterior(merged, lora_snap, prior_precision=1.0)
    assert "another architecture" not in str(e.value)
    with pytest.raises(SnapshotMismatchError) as e:
        LaplacePosterior(bert_model, lora_snap, prior_precision=1.0)
    assert "is a snapshot of another architecture: it was taken on a GPT2LMHeadModel" in str(
        e.value) and "merge_and_unload" not in str(e.value)

    # a snapshot written before the field: judged from its layer names
    old = tmp_path / "old"
    shutil.copytree(lora_snap.path, old)
    meta = json.loads((old / "manifest.json").read_text())
    del meta["model"]
    (old / "manifest.json").write_text(json.dumps(meta))
    old_snap = Snapshot.load(old)
    with pytest.raises(SnapshotMismatchError) as e:
        LaplacePosterior(bert_model, old_snap, prior_precision=1.0)
    msg = str(e.value)
    assert "is a snapshot of another architecture, it seems: none of its" in msg, msg
    assert "BertForSequenceClassification (model_type 'bert')" in msg
    assert "merge_and_unload" not in msg
    with pytest.raises(SnapshotMismatchError, match="merge_and_unload") as e:
        LaplacePosterior(merged, old_snap, prior_precision=1.0)
    assert "another architecture" not in str(e.value)


# -- 4. inspect: the standard error with its threshold and verdict ----------------------


def _inspect_line(capsys, path) -> str:
    capsys.readouterr()
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("sampling: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_inspect_gives_the_standard_error_with_threshold_and_verdict(lm, capsys, tmp_path):
    _, _, snap = lm
    s = sampling_summary(snap.manifest)
    assert s["in_window"] and s["max_rel_se"] <= REL_SE_WARN, s
    line = _inspect_line(capsys, snap.path)
    assert (f"largest relative standard error of a factor {s['max_rel_se']:.3g} "
            f"(≤ {REL_SE_WARN:g}: enough samples)") in line, line

    # a final window of one update (the last 25% of 4 steps, not widened): infinite error
    model = tiny_gpt2(torch.float32)
    run(model, text_examples(8, 12), {**WINDOW, "final_window": 0.25,
                                      "min_window_sequences": 0},
        batch=2, steps=4, tmp_path=tmp_path / "short", record=False)
    short = Snapshot.latest(tmp_path / "short" / "kfac")
    s = sampling_summary(short.manifest)
    assert s["in_window"] and s["max_rel_se"] > REL_SE_WARN, s
    line = _inspect_line(capsys, short.path)
    assert (f"factor {s['max_rel_se']:.3g} (> {REL_SE_WARN:g}: too few samples") in line, line

    # no final window (the EMA over the whole run): shown, not judged
    model = tiny_gpt2(torch.float32)
    run(model, text_examples(4, 12), {**WINDOW, "final_window": 0.0}, batch=2,
        tmp_path=tmp_path / "ema", record=False, steps=2)
    ema = Snapshot.latest(tmp_path / "ema" / "kfac")
    s = sampling_summary(ema.manifest)
    assert not s["in_window"] and not math.isnan(s["max_rel_se"]), s
    line = _inspect_line(capsys, ema.path)
    assert (f"factor {s['max_rel_se']:.3g} (not judged: the threshold {REL_SE_WARN:g} applies "
            "in the final window") in line, line
