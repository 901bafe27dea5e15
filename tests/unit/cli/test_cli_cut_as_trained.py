"""One cut everywhere: a BERT classifier trained by the Trainer on texts preprocessed as a user
does (``tokenizer(text, truncation=True, max_length=N)``, ``DataCollatorWithPadding``), some
texts longer than ``N`` tokens; the JSON-lines file of its ``{"text", "label"}`` records given
to ``kfac-stream influence --train`` and ``kfac-stream query --file --max-length N``: the
printed scores and probabilities equal, bit for bit, `influence_scores`, `self_influence` and
`LaplacePosterior.predictive_probs` on batches tokenised and collated as the Trainer's were.
``influence --cut windows`` (the old first ``N`` tokens of the whole tokenisation: a longer
text's ``[SEP]`` dropped) is taken only when asked, and said on stderr and in the output.

Exact equality holds because the commands and the references run the same float32 model on
the same tensors (same rows, padding and batch grouping: ``--batch-size`` here, the query's
16 inputs per forward) and print each float with ``json``'s round-trip ``repr``.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kfac_stream import (
    KFACConfig,
    KFACStreamCallback,
    LaplacePosterior,
    Snapshot,
    influence_scores,
    self_influence,
)
from kfac_stream.cli import main as cli_main

from harness import EXACT
from models import ListDataset

#: The tokenizer's ``max_length`` in training, and the commands' ``--seq-len``/``--max-length``.
N = 10
WORDS = ("the a cat dog sat on mat ran fast slow big small red blue good bad movie film was is "
         "very not").split()
LABELS = {0: "neg", 1: "pos"}
#: ``influence --batch-size``: the reference batches are grouped the same way.
BATCH = 4
#: Influence queries (tokenised whole, as ``query`` without ``--max-length``): short and long.
QUERIES = [("the movie was very good", "pos"),
           ("the big red dog ran on the mat and the film was not good at all but bad", "neg")]


def _texts() -> list[tuple[str, int]]:
    """24 ``(text, label)``: 2 to 16 words, the label whether "good" outnumbers "bad"."""
    rng = random.Random(0)
    out = []
    for _ in range(24):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 16))]
        out.append((" ".join(words), int(words.count("good") > words.count("bad"))))
    return out


ROWS = _texts()


def _tokenizer():
    """A BERT WordPiece tokenizer over `WORDS` (``[CLS] ... [SEP]``, pad id 0), offline."""
    from transformers import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})


def _encoded(tokenizer, rows, cut: str = "tokenizer") -> list[dict]:
    """A Trainer user's preprocessing of ``rows`` (``cut="tokenizer"``), or the first ``N``
    ids of each whole tokenisation (``"windows"``), with ``labels``."""
    out = []
    for text, label in rows:
        if cut == "tokenizer":
            enc = dict(tokenizer(text, truncation=True, max_length=N))
        else:
            enc = {k: v[:N] for k, v in tokenizer(text).items()}
        out.append({**enc, "labels": label})
    return out


def _batches(tokenizer, encoded: list[dict], size: int) -> list[dict]:
    """``DataCollatorWithPadding``'s batches of ``size`` in order (right-padded ``[B, T]``)."""
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer)
    return [collate(encoded[i:i + size]) for i in range(0, len(encoded), size)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The classifier trained with the callback on `ROWS` cut to ``N`` tokens by the tokenizer
    (``DataCollatorWithPadding``, 6 steps), saved with its tokenizer; its JSON-lines file.
    ``(tmp, model as the commands load it, tokenizer, snapshot, train.jsonl)``."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    tmp = tmp_path_factory.mktemp("one_cut")
    tokenizer = _tokenizer()
    assert sum(len(tokenizer(t)["input_ids"]) > N for t, _ in ROWS) >= 8  # cut by training
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64, num_labels=2, id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()}, pad_token_id=tokenizer.pad_token_id))
    args = TrainingArguments(str(tmp), per_device_train_batch_size=BATCH, num_train_epochs=1,
                             learning_rate=1e-2, report_to=[], logging_strategy="no",
                             save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(_encoded(tokenizer, ROWS)),
                      data_collator=DataCollatorWithPadding(tokenizer),
                      callbacks=[KFACStreamCallback(KFACConfig(**{**EXACT,
                                                                  "snapshot_every": 3}))])
    trainer.train()
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    loaded = BertForSequenceClassification.from_pretrained(tmp / "model", dtype=torch.float32)
    train = tmp / "train.jsonl"
    train.write_text("".join(json.dumps({"text": t, "label": LABELS[y]}) + "\n"
                             for t, y in ROWS))
    return tmp, loaded.eval(), tokenizer, Snapshot.latest(tmp / "kfac"), train


def _json(capsys, args: list[str]) -> tuple[dict, str]:
    capsys.readouterr()
    assert cli_main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def _influence(tmp, train, *extra: str) -> list[str]:
    return ["influence", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--train", str(train), "--seq-len", str(N), "--batch-size", str(BATCH), *extra]


def _query_args() -> list[str]:
    return [a for text, label in QUERIES for a in ("--query", text, "--label", label)]


def test_influence_equals_the_api_on_the_trainers_tokenisation(trained, capsys):
    tmp, model, tokenizer, snap, train = trained
    post = LaplacePosterior(model, snap, 1.0)
    batches = _batches(tokenizer, _encoded(tokenizer, ROWS), BATCH)
    queries = [_batches(tokenizer, [{**tokenizer(t), "labels": 1 if y == "pos" else 0}], 1)[0]
               for t, y in QUERIES]
    want = influence_scores(post, queries, batches)  # [Q, 24]
    doc, err = _json(capsys, _influence(tmp, train, *_query_args(), "--top-k", str(len(ROWS))))
    assert (doc["cut"], doc["seq_len"], doc["train_examples"]) == ("tokenizer", N, len(ROWS))
    assert "cut by the tokenizer" in doc["train_described"]
    longer = sum(len(tokenizer(t)["input_ids"]) > N for t, _ in ROWS)
    assert f"{longer} of {len(ROWS)} texts longer than {N} tokens (--seq-len): cut as " \
           f"tokenizer(text, truncation=True, max_length={N}) cuts them" in err
    for q, rec in enumerate(doc["queries"]):
        assert rec["tokens"] == len(tokenizer(QUERIES[q][0])["input_ids"])  # a query: whole
        got = {r["index"]: r["score"] for r in rec["helpful"]}
        assert got == {j: float(want.scores[q, j]) for j in range(len(ROWS))}
    # every shown example ends in [SEP], as each training row did
    assert all(r["text"].endswith("[SEP]") for r in doc["queries"][0]["helpful"])
    doc, _ = _json(capsys, _influence(tmp, train, "--self"))
    assert doc["scores"] == self_influence(post, batches).tolist()


def test_influence_cut_windows_only_when_asked_and_said(trained, capsys):
    """``--cut windows``: the first ``N`` ids of each whole tokenisation (a longer text
    without its ``[SEP]``): equal to the API on those rows, said on stderr and in the
    output, and not the training's scores."""
    tmp, model, tokenizer, snap, train = trained
    post = LaplacePosterior(model, snap, 1.0)
    windows = _batches(tokenizer, _encoded(tokenizer, ROWS, "windows"), BATCH)
    doc, err = _json(capsys, _influence(tmp, train, "--self", "--cut", "windows"))
    assert doc["cut"] == "windows" and "(--cut windows)" in doc["train_described"]
    assert doc["train_rule"].startswith("--cut windows: ")
    assert "--cut windows: " in err and "not as tokenizer(text, truncation=True" in err
    assert doc["scores"] == self_influence(post, windows).tolist()
    trained_on = self_influence(post, _batches(tokenizer, _encoded(tokenizer, ROWS), BATCH))
    longer = [j for j, (t, _) in enumerate(ROWS) if len(tokenizer(t)["input_ids"]) > N]
    assert all(doc["scores"][j] != float(trained_on[j]) for j in longer)
    capsys.readouterr()
    assert cli_main(_influence(tmp, train, "--self", "--cut", "windows")) == 0
    assert "(--cut windows)" in capsys.readouterr().out.splitlines()[-1]  # the footer


def test_query_equals_the_api_on_the_trainers_tokenisation(trained, capsys):
    """``query --file train.jsonl --max-length N``: each input cut as training cut it; the
    Laplace and MAP probabilities equal the API's on the Trainer's batches (16 per forward,
    as the command's)."""
    tmp, model, tokenizer, snap, train = trained
    post = LaplacePosterior(model, snap, prior_precision=2.0)
    batches = _batches(tokenizer, [{k: v for k, v in e.items() if k != "labels"}
                                   for e in _encoded(tokenizer, ROWS)], 16)
    probs = torch.cat([post.predictive_probs(b) for b in batches]).double()
    with torch.no_grad():
        map_probs = torch.cat([torch.softmax(model(**b).logits.double(), -1) for b in batches])
    doc, err = _json(capsys, ["query", "--snapshot", str(tmp / "kfac"), "--model",
                              str(tmp / "model"), "--file", str(train), "--max-length", str(N),
                              "--prior-precision", "2.0"])
    assert [r["text"] for r in doc["inputs"]] == [t for t, _ in ROWS]
    assert [r["tokens"] for r in doc["inputs"]] == [
        len(e["input_ids"]) for e in _encoded(tokenizer, ROWS)]
    assert [r["probs"] for r in doc["inputs"]] == probs.tolist()
    assert [r["map_probs"] for r in doc["inputs"]] == map_probs.tolist()
    assert f"truncated to its first {N} (--max-length {N})" in err
    bad = tmp / "bad.jsonl"
    bad.write_text(json.dumps({"text": "the cat"}) + "\n" + json.dumps({"body": "a"}) + "\n")
    capsys.readouterr()
    assert cli_main(["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
                     "--file", str(bad), "--prior-precision", "2.0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"kfac-stream query: error: --file={str(bad)!r} line 2: must be a JSON object with a "
        "non-empty 'text' (a *.jsonl --file holds one {\"text\": ...} per line)")
