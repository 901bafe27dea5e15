"""``kfac-stream query``: the per-token whole-vocabulary table and ``--json`` print
what the Python API returns for the same text, seed and samples (`sampled_predictive`, a MAP
forward, `topk_predictive`); the mode's default; bad arguments exit 2 with one line."""

from __future__ import annotations

import ast
import json
import math
import re
import time

import pytest
import torch

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.cli import main as cli_main
from kfac_stream.query import token_table as tt
from kfac_stream.query.answers import answer_distribution
from kfac_stream.query.sampled import sampled_predictive
from kfac_stream.query.topk import topk_predictive

from harness import run
from models import text_examples, tiny_gpt2

TEXT = "def f(x):"
TAU = 2.0
TOKEN_FIELDS = ("position", "token_id", "token", "next_id", "next_token", "next_prob",
                "next_logprob_mean", "next_logprob_std", "next_map_prob", "entropy",
                "expected_entropy", "mutual_information", "top_id", "top_token", "top_prob")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny byte-level GPT-2 trained with the callback, saved next to its snapshot; the
    posterior at τ = 2 and the text's batch."""
    tmp = tmp_path_factory.mktemp("cli_query")
    model = tiny_gpt2(torch.float32)
    run(model, text_examples(8, 12), {"storage_dtype": "float32"}, batch=2, tmp_path=tmp,
        record=False)
    model.save_pretrained(tmp / "model")
    model.eval()
    post = LaplacePosterior(model, Snapshot.latest(tmp / "kfac"), prior_precision=TAU)
    ids = torch.tensor([list(TEXT.encode())])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return tmp, post, batch


def argv(tmp, *extra: str) -> list[str]:
    return ["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"), "--text",
            TEXT, "--byte-level", "--prior-precision", str(TAU), *extra]


def expected(post, batch, samples: int, seed: int, linearized: bool = True):
    """``(SampledPredictive, MAP probabilities [T, V])`` of the API."""
    pred = sampled_predictive(post, batch, n_samples=samples, seed=seed, labels="next",
                              linearized=linearized)
    with torch.no_grad():
        map_probs = torch.softmax(post.model(**batch).logits[0].double(), -1)
    return pred, map_probs


def decode(i: int) -> str:
    return bytes([i]).decode("utf-8", "backslashreplace")


REPR = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|–"
ROW = re.compile(rf"^\s*(\d+)\s+({REPR})\s+({REPR})\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)"
                 rf"\s+(\S+)\s+({REPR})\s+(\S+)$")


def parse_table(out: str) -> list[tuple]:
    """The rows of the per-token table in ``out`` (the lines that look like one)."""
    lines = out.splitlines()
    assert lines[0] == tt.TOKENS_EXPLAINED
    assert lines[1].split() == ["t", "input", "next", "p̄(next)", "log", "p(next)", "MAP", "p",
                                "H", "E[H]", "MI", "top", "p̄(top)"]
    rows = [ROW.match(line) for line in lines[2:-1]]
    assert all(rows), lines
    return [m.groups() for m in rows]


def close(printed: str, value: float, decimals: int) -> bool:
    """``printed`` is ``value`` to ``decimals`` places (a float's rounding either way)."""
    return abs(float(printed) - value) <= 0.5 * 10 ** -decimals + 1e-9


def test_token_table_prints_what_the_python_api_returns(trained, capsys):
    tmp, post, batch = trained
    assert cli_main(argv(tmp, "--samples", "6", "--seed", "3")) == 0
    out = capsys.readouterr().out
    pred, map_probs = expected(post, batch, 6, 3)
    ids = batch["input_ids"][0].tolist()
    rows = parse_table(out)
    assert len(rows) == len(TEXT)
    sd = pred.label_logprob_var[0].sqrt()
    for t, (pos, tok, nxt, p, lp, mp, h, eh, mi, top, ptop) in enumerate(rows):
        assert int(pos) == t and ast.literal_eval(tok) == TEXT[t]
        probs = pred.probs[0, t]
        assert close(h, float(pred.entropy[0, t]), 4)
        assert close(eh, float(pred.expected_entropy[0, t]), 4)
        assert close(mi, float(pred.mutual_information[0, t]), 4)
        assert ast.literal_eval(top) == decode(int(probs.argmax()))
        assert close(ptop, float(probs.max()), 4)
        if t == len(TEXT) - 1:  # no next token
            assert nxt == p == lp == mp == "–"
            continue
        assert ast.literal_eval(nxt) == TEXT[t + 1]
        assert close(p, float(probs[ids[t + 1]]), 4)
        assert close(mp, float(map_probs[t, ids[t + 1]]), 4)
        mean, std = lp.split("±")
        assert close(mean, float(pred.label_logprob_mean[0, t]), 3)
        assert close(std, float(sd[t]), 3)
    assert any(float(r[8]) > 0 for r in rows)  # some epistemic uncertainty
    footer = out.splitlines()[-1]
    assert footer.startswith(f"snapshot {post.snapshot.path} (step {post.snapshot.step}); "
                             f"N = {post.num_data:.0f}, prior precision τ = 2, S = 6 "
                             "posterior samples, linearised (seed 3); ")
    assert re.search(r"; \d+\.\d s$", footer)


@pytest.mark.parametrize("linearized", [False, True])
def test_json_holds_every_field_as_the_api_returns_it(trained, capsys, linearized):
    tmp, post, batch = trained
    extra = ["--samples", "4", "--json"] + ([] if linearized else ["--weight-samples"])
    assert cli_main(argv(tmp, *extra)) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout is the document alone
    assert {k: doc[k] for k in ("snapshot", "step", "mode", "samples", "seed", "linearized",
                                "text", "prior_precision")} == {
        "snapshot": str(post.snapshot.path), "step": post.snapshot.step, "mode": "tokens",
        "samples": 4, "seed": 0, "linearized": linearized, "text": TEXT, "prior_precision": TAU}
    assert doc["num_data"] == pytest.approx(post.num_data) and doc["seconds"] > 0
    pred, map_probs = expected(post, batch, 4, 0, linearized)
    ids = batch["input_ids"][0].tolist()
    assert [r["position"] for r in doc["positions"]] == list(range(len(TEXT)))

    def same(a, b):
        return math.isclose(a, float(b), rel_tol=1e-9, abs_tol=1e-12)

    for t, r in enumerate(doc["positions"]):
        assert tuple(r) == TOKEN_FIELDS
        assert r["token_id"] == ids[t] and r["token"] == TEXT[t]
        probs = pred.probs[0, t]
        assert same(r["entropy"], pred.entropy[0, t])
        assert same(r["expected_entropy"], pred.expected_entropy[0, t])
        assert same(r["mutual_information"], pred.mutual_information[0, t])
        assert r["top_id"] == int(probs.argmax()) and r["top_token"] == decode(r["top_id"])
        assert same(r["top_prob"], probs.max())
        if t == len(TEXT) - 1:
            assert all(r[k] is None for k in TOKEN_FIELDS if k.startswith("next_"))
            continue
        assert r["next_id"] == ids[t + 1] and r["next_token"] == TEXT[t + 1]
        assert same(r["next_prob"], probs[ids[t + 1]])
        assert same(r["next_map_prob"], map_probs[t, ids[t + 1]])
        assert same(r["next_logprob_mean"], pred.label_logprob_mean[0, t])
        assert same(r["next_logprob_std"], pred.label_logprob_var[0, t].sqrt())


def test_options_print_the_answer_agreement_of_the_api(trained, capsys):
    """--options: the votes of the posterior samples at the last position, as
    `answer_distribution` gives them for the same samples, in the table and in the JSON."""
    tmp, post, batch = trained
    options = ["\n", " ", "r", "e"]
    assert cli_main(argv(tmp, "--samples", "5", "--seed", "2", "--options", *options)) == 0
    out = capsys.readouterr().out
    d = answer_distribution(post, batch, options=[ord(o) for o in options], n_samples=5,
                            seed=2, linearized=True)
    lines = out.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("answers at the last position")))
    assert lines[start].startswith(f"answers at the last position (t = {len(TEXT) - 1}): each "
                                   "of the S = 5 posterior samples votes")
    for k, (o, line) in enumerate(zip(options, lines[start + 2:start + 2 + len(options)])):
        shown = re.match(REPR, line).group(0)
        cells = [shown, *line[len(shown):].split()]
        assert ast.literal_eval(cells[0]) == o
        assert close(cells[1], float(d.probs[0, k]), 4)
        assert cells[2] == f"{int(d.counts[0, k])}/5"
        assert close(cells[3], float(d.frequencies[0, k]), 4)
        assert (cells[4:] == ["*"]) == (k == int(d.map_answer[0]))
    majority, map_answer = options[int(d.majority[0])], options[int(d.map_answer[0])]
    assert lines[start + 2 + len(options)] == (
        f"majority {majority!r} (agreement {float(d.agreement[0]):.4f}); MAP answer "
        f"{map_answer!r} ({'agrees' if bool(d.map_agrees[0]) else 'differs'})")
    assert lines[-1].startswith("snapshot ")

    assert cli_main(argv(tmp, "--samples", "5", "--seed", "2", "--json", "--options",
                         *options)) == 0
    doc = json.loads(capsys.readouterr().out)
    a = doc["answers"]
    assert doc["options"] == options and a["samples"] == 5
    assert [o["option"] for o in a["options"]] == options
    assert [o["token_id"] for o in a["options"]] == [ord(o) for o in options]
    assert [o["count"] for o in a["options"]] == d.counts[0].tolist()
    assert [o["prob"] for o in a["options"]] == pytest.approx(d.probs[0].tolist(), rel=1e-9)
    assert [o["frequency"] for o in a["options"]] == d.frequencies[0].tolist()
    assert [o["map"] for o in a["options"]] == [k == int(d.map_answer[0])
                                                for k in range(len(options))]
    assert (a["majority"], a["map_answer"]) == (majority, map_answer)
    assert a["agreement"] == float(d.agreement[0]) and a["map_agrees"] == bool(d.map_agrees[0])


def test_topk_mode_and_its_json(trained, capsys):
    """--top-k (or --mode topk) keeps the top-k table; its JSON holds topk_predictive's rows."""
    tmp, post, batch = trained
    assert cli_main(argv(tmp, "--top-k", "2", "--samples", "50", "--seed", "1")) == 0
    out = capsys.readouterr().out
    assert "top-2 next tokens" in out and f"tau {TAU:.4g} (given), probit link" in out
    assert "S = 50 draws per position (seed 1)" in out.splitlines()[-1]
    assert cli_main(argv(tmp, "--mode", "topk", "--samples", "50", "--seed", "1",
                         "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "topk" and doc["top_k"] == 5 and doc["samples"] == 50
    rows = topk_predictive(post, batch["input_ids"][0], k=5, n_samples=50, seed=1)
    assert len(doc["positions"]) == len(rows) == len(TEXT)
    for r, row in zip(doc["positions"], rows):
        assert r["position"] == row["position"] and r["token"] == TEXT[r["position"]]
        assert [c["token_id"] for c in r["top"]] == row["token_ids"]
        assert [c["token"] for c in r["top"]] == [decode(i) for i in row["token_ids"]]
        for key in ("map_prob", "mean_prob", "std_prob"):
            assert [c[key] for c in r["top"]] == pytest.approx(row[key], rel=1e-12)


def test_default_mode_is_the_token_table(trained, capsys):
    tmp, _, _ = trained
    assert cli_main(argv(tmp, "--samples", "2")) == 0
    out = capsys.readouterr().out
    assert out.startswith(tt.TOKENS_EXPLAINED) and "S = 2 posterior samples" in out


def cli_error(capsys, args, *needles) -> str:
    """``kfac-stream query`` exits 2 with one line on stderr (after the status lines), holding
    every needle, and prints nothing on stdout; returns stderr (also used by
    tests/unit/cli/test_classify.py)."""
    capsys.readouterr()
    assert cli_main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == [lines[-1]], lines
    assert lines[-1].startswith("kfac-stream query: error: "), lines[-1]
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return captured.err


def test_bad_arguments_exit_2_with_one_line(trained, capsys):
    tmp, _, _ = trained
    cli_error(capsys, argv(tmp, "--samples", "1"),
              "--samples=1 is not allowed: must be an int >= 2 (posterior samples")
    cli_error(capsys, argv(tmp, "--mode", "topk", "--samples", "1"),
              "--samples=1 is not allowed: must be an int >= 2 (draws per position")
    cli_error(capsys, argv(tmp, "--mode", "tokens", "--top-k", "3"),
              "--top-k=3 is not allowed with --mode tokens", "must come with --mode topk")
    cli_error(capsys, argv(tmp, "--top-k", "3", "--weight-samples"),
              "--weight-samples is not allowed with --mode topk")
    cli_error(capsys, argv(tmp, "--options", "A"),
              "must be two or more distinct non-empty answer strings")
    cli_error(capsys, argv(tmp, "--options", "A", "A"), "two or more distinct")
    cli_error(capsys, argv(tmp, "--options", "A", " B"),
              "--options: ' B' is 2 UTF-8 bytes (--byte-level) (' ' 'B'): each option "
              "must encode to exactly one token (one ASCII character, e.g. A)")
    cli_error(capsys, argv(tmp, "--top-k", "2", "--options", "A", "B"),
              "is not allowed with --mode topk")


def test_token_table_text():
    """The table from records alone: aligned columns, '–' where there is no next token, long
    tokens cut to the column's width."""
    long = "x" * 30
    records = [
        {"position": 0, "token_id": 1, "token": "a", "next_id": 2, "next_token": long,
         "next_prob": 0.25, "next_logprob_mean": -1.5, "next_logprob_std": 0.25,
         "next_map_prob": 0.3, "entropy": 1.0, "expected_entropy": 0.75,
         "mutual_information": 0.25, "top_id": 3, "top_token": "\n", "top_prob": 0.5},
        {"position": 1, "token_id": 2, "token": long, "next_id": None, "next_token": None,
         "next_prob": None, "next_logprob_mean": None, "next_logprob_std": None,
         "next_map_prob": None, "entropy": 2.0, "expected_entropy": 1.5,
         "mutual_information": 0.5, "top_id": 1, "top_token": "a", "top_prob": 0.125},
    ]
    lines = tt.token_table(records).splitlines()
    cut = repr(long)[:tt.TOKEN_WIDTH - 1] + "…"
    assert lines[2].split() == ["0", "'a'", cut, "0.2500", "-1.500±0.250", "0.3000", "1.0000",
                                "0.7500", "0.2500", "'\\n'", "0.5000"]
    assert lines[3].split() == ["1", cut, "–", "–", "–", "–", "2.0000", "1.5000", "0.5000",
                                "'a'", "0.1250"]
    assert len({tt.width(line) for line in lines[1:]}) == 1  # aligned (no cell ends short)
    doc = json.loads(tt.document({"mode": "tokens"}, records))
    assert doc["positions"][1]["next_prob"] is None


def test_bytes_over_127_print_with_one_backslash(trained, capsys):
    """A byte-level token that is no character by itself (here the two UTF-8 bytes of "é")
    prints as Python writes that byte, ``'\\xc3'``, in the table: one backslash, not the
    doubled one of ``repr("\\\\xc3")``; ``--json`` holds the same text."""
    tmp, _, _ = trained
    args = argv(tmp, "--samples", "2")
    args[args.index("--text") + 1] = "é!"
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    rows = parse_table(out)
    assert [r[1] for r in rows] == ["'\\xc3'", "'\\xa9'", "'!'"]  # the printed cells
    assert "\\\\x" not in out
    assert cli_main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["token"] for p in doc["positions"]] == ["\\xc3", "\\xa9", "!"]


def test_another_task_or_a_headless_checkpoint_is_refused_in_one_line(trained, capsys,
                                                                       tmp_path):
    """Never an LM table from a head the checkpoint lacks. A token classifier's
    config names its task (neither a causal LM nor a sequence classifier, which
    tests/unit/cli/test_classify.py answers): refused before any weight loads; a causal LM whose
    checkpoint lacks its (untied) head: refused naming the missing weights."""
    from safetensors.torch import load_file, save_file
    from transformers import (
        BertConfig,
        BertForTokenClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tmp, _, _ = trained
    bert = tmp_path / "bert"
    BertForTokenClassification(BertConfig(
        vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3)).save_pretrained(bert)
    args = argv(tmp, "--samples", "2")
    args[args.index("--model") + 1] = str(bert)
    cli_error(capsys, args, f"--model={str(bert)!r} is a BertForTokenClassification: "
              "kfac-stream query answers causal LMs")
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, tie_word_embeddings=False)
                     ).save_pretrained(llama)
    weights = load_file(llama / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, llama / "model.safetensors", metadata={"format": "pt"})
    args[args.index("--model") + 1] = str(llama)
    cli_error(capsys, args, "its checkpoint has no weights for 1 parameter(s) of the causal LM "
              "(lm_head.weight): they would be random")


def test_missing_local_model_fails_at_once(trained, capsys, monkeypatch):
    """``--model out/nomodel`` beside a directory ``out/`` is a local path, not a hub name: one
    line at once, before the snapshot loads and before any hub request (``from_pretrained``
    spent 49 s on hub retries offline). A name that may be a hub id is not refused here."""
    from kfac_stream.utils.files import local_path_problem

    tmp, _, _ = trained
    monkeypatch.chdir(tmp)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the check must not rely on it
    for model, needle in [("kfac/nomodel", "does not exist (kfac/ is a directory here, so it "
                                           "is a local path, not a hub name)"),
                          ("./nomodel", "is a local path that does not exist"),
                          (str(tmp / "nomodel"), "is a local path that does not exist")]:
        args = argv(tmp, "--samples", "2")
        args[args.index("--model") + 1] = model
        t0 = time.perf_counter()
        cli_error(capsys, args, f"--model={model!r} {needle}: must be a model directory")
        assert time.perf_counter() - t0 < 2.0
    cli_error(capsys, [*argv(tmp), "--tokenizer", "kfac/notok"], "--tokenizer='kfac/notok' "
              "does not exist (kfac/ is a directory here")
    assert local_path_problem("gpt2") is None and local_path_problem("org/name") is None
    assert local_path_problem("model") is None  # exists here: from_pretrained reads it
