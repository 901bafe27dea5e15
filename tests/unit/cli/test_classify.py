"""``kfac-stream query`` with a sequence classifier: the task comes from the model's
config; per input the printed MAP probabilities are the model's softmax, the Laplace ones
`LaplacePosterior.predictive_probs` (and ``--json`` holds the same); other tasks, a causal
LM's flags and a missing tokenizer are refused in one line (exit 2)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from test_cli_query import cli_error

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.cli import main as cli_main
from kfac_stream.query import token_table as tt

from harness import run
from models import save_bpe_tokenizer, text_examples

TAU = 2.0
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
#: --file's lines (a blank one is skipped): different lengths, so the batch is padded.
LINES = ["def f(x):", "", "return x + 1", "import os"]
TEXTS = [line for line in LINES if line]


def _labelled(n: int) -> list[dict]:
    """``n`` byte-token windows of 12, labelled ``i % 3``."""
    ex = text_examples(n, 12)
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % 3)
    return ex


def _trained(tmp, model, batch: int):
    """``model`` trained with the callback (a snapshot every 2 steps), saved without tokenizer
    files under ``tmp/model``, its snapshots under ``tmp/kfac``; ``(model in eval mode,
    newest snapshot)``."""
    run(model, _labelled(4 * batch), {"snapshot_every": 2}, batch=batch, tmp_path=tmp,
        record=False)
    model.save_pretrained(tmp / "model")
    return model.eval(), Snapshot.latest(tmp / "kfac")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT classifier (3 named labels, pad id 0: inputs batched with padding)."""
    from transformers import BertConfig, BertForSequenceClassification

    tmp = tmp_path_factory.mktemp("cli_bert")
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=3, id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()}, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    return (tmp, *_trained(tmp, model, batch=2))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 classifier (default LABEL_i names, no pad id: one input per batch)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    tmp = tmp_path_factory.mktemp("cli_gpt2")
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=3,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return (tmp, *_trained(tmp, model, batch=1))


def argv(tmp, *extra: str, byte_level: bool = True) -> list[str]:
    return ["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--prior-precision", str(TAU), *(["--byte-level"] if byte_level else []), *extra]


def write_file(tmp, lines=LINES) -> str:
    path = tmp / "inputs.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def padded(ids: list[list[int]], pad: int = 0) -> dict[str, torch.Tensor]:
    """``{"input_ids", "attention_mask"}`` ``[B, T]``, right-padded with ``pad``."""
    T = max(map(len, ids))
    return {"input_ids": torch.tensor([x + [pad] * (T - len(x)) for x in ids]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids])}


def expected(model, snap, batches, tau=TAU):
    """``(MAP probs [B, C], Laplace probs [B, C], logit std [B, C], posterior)`` from the API,
    over ``batches`` in order."""
    post = LaplacePosterior(model, snap, prior_precision=tau)
    with torch.no_grad():
        map_probs = torch.cat([torch.softmax(model(**b).logits.double(), -1) for b in batches])
    probs = torch.cat([post.predictive_probs(b) for b in batches])
    std = torch.cat([torch.diagonal(post.predictive(b)[1], dim1=-2, dim2=-1).sqrt()
                     for b in batches])
    return map_probs, probs, std, post


def close(printed: str, value: float, decimals: int) -> bool:
    """``printed`` is ``value`` to ``decimals`` places."""
    return abs(float(printed) - value) <= 0.5 * 10 ** -decimals + 1e-9


def parse_table(out: str, names: list[str]) -> list[dict]:
    """Per input of the printed table: its text line, class rows and summary line."""
    lines = out.splitlines()
    assert lines[0].startswith("per input: MAP p = softmax of the trained model's logits")
    blocks, i = [], 1
    while lines[i].startswith("input "):
        assert lines[i + 1].split() == ["class", "MAP", "p", "Laplace", "p", "logit"]
        rows = [ln.split() for ln in lines[i + 2:i + 2 + len(names)]]
        blocks.append({"head": lines[i], "rows": rows, "summary": lines[i + 2 + len(names)]})
        i += 3 + len(names)
    assert i == len(lines) - 1  # the footer
    return blocks


def no_lm_output(out: str) -> None:
    """Nothing of a causal LM's tables."""
    assert tt.TOKENS_EXPLAINED not in out and "next token" not in out and "p̄" not in out


def test_bert_file_prints_what_the_api_returns(bert, capsys):
    """--file: three inputs (a blank line skipped) in one padded batch; per class the MAP
    probability (the model's softmax), the Laplace one (`predictive_probs`) and the logit's
    mean ± std, ``*`` on the label; the summary line and footer; the JSON holds the same."""
    tmp, model, snap = bert
    path = write_file(tmp)
    assert cli_main(argv(tmp, "--file", path)) == 0
    out = capsys.readouterr().out
    no_lm_output(out)
    ids = [list(t.encode()) for t in TEXTS]
    map_probs, probs, std, post = expected(model, snap, [padded(ids)])
    assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=probs.dtype), atol=1e-12)
    names = list(LABELS.values())
    blocks = parse_table(out, names)
    assert [b["head"] for b in blocks] == [f"input {i}: {t!r}" for i, t in enumerate(TEXTS)]
    for b, block in enumerate(blocks):
        k = int(probs[b].argmax())
        for c, row in enumerate(block["rows"]):
            assert row[0] == names[c]
            assert close(row[1], float(map_probs[b, c]), 4)
            assert close(row[2], float(probs[b, c]), 4)
            mean, sd = row[3].split("±")
            assert close(sd, float(std[b, c]), 3)
            assert (row[4:] == ["*"]) == (c == k)
        assert block["summary"].strip().startswith(
            f"label {names[k]!r} (Laplace p {float(probs[b, k]):.4f}, MAP p "
            f"{float(map_probs[b, k]):.4f}")
        assert f"; sd = {float(std[b, k]):.4f}" in block["summary"]
    footer = out.splitlines()[-1]
    assert footer.startswith(f"snapshot {snap.path} (step {snap.step}); "
                             "BertForSequenceClassification, 3 classes; N = "
                             f"{post.num_data:.0f}, prior precision τ = 2 (given), probit "
                             "link (the default link); 3 inputs; ")

    assert cli_main(argv(tmp, "--file", path, "--json")) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout is the document alone
    assert {k: doc[k] for k in ("snapshot", "step", "task", "architecture", "file", "link",
                                "labels", "prior_precision")} == {
        "snapshot": str(snap.path), "step": snap.step, "task": "sequence_classification",
        "architecture": "BertForSequenceClassification", "file": path, "link": "probit",
        "labels": names, "prior_precision": TAU}
    assert doc["num_data"] == pytest.approx(post.num_data)
    assert [r["text"] for r in doc["inputs"]] == TEXTS
    for b, r in enumerate(doc["inputs"]):
        k = int(probs[b].argmax())
        assert r["tokens"] == len(ids[b])
        assert r["map_probs"] == pytest.approx(map_probs[b].tolist(), abs=1e-5)
        assert r["probs"] == pytest.approx(probs[b].tolist(), abs=1e-9)
        assert math.isclose(sum(r["probs"]), 1.0, abs_tol=1e-9)
        assert math.isclose(sum(r["map_probs"]), 1.0, abs_tol=1e-9)
        assert (r["label_id"], r["label"]) == (k, names[k])
        m = int(map_probs[b].argmax())
        assert (r["map_label_id"], r["map_label"]) == (m, names[m])
        assert r["logit_std"] == pytest.approx(std[b].tolist(), rel=1e-9)
        assert r["label_logit_std"] == pytest.approx(float(std[b, k]), rel=1e-9)
        entropy = -sum(p * math.log(p) for p in probs[b].tolist())
        assert r["entropy"] == pytest.approx(entropy, rel=1e-9)
    assert any(s > 0 for r in doc["inputs"] for s in r["logit_std"])  # some uncertainty


def test_gpt2_without_pad_id_runs_one_input_per_batch(gpt2, capsys):
    """GPT-2's classifier has no pad id: each input runs alone (as the model requires); the
    default LABEL_i names print as class indices; --text gives one input."""
    tmp, model, snap = gpt2
    assert model.config.pad_token_id is None
    assert cli_main(argv(tmp, "--file", write_file(tmp), "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    ids = [list(t.encode()) for t in TEXTS]
    map_probs, probs, _, _ = expected(model, snap, [padded([x]) for x in ids])
    assert doc["labels"] == ["0", "1", "2"]
    for b, r in enumerate(doc["inputs"]):
        assert r["map_probs"] == pytest.approx(map_probs[b].tolist(), abs=1e-5)
        assert r["probs"] == pytest.approx(probs[b].tolist(), abs=1e-9)
        assert r["label"] == str(int(probs[b].argmax()))
    assert cli_main(argv(tmp, "--text", TEXTS[1])) == 0
    out = capsys.readouterr().out
    no_lm_output(out)
    [block] = parse_table(out, ["0", "1", "2"])
    assert block["head"] == f"input 0: {TEXTS[1]!r}"
    assert [close(row[2], float(probs[1, c]), 4) for c, row in enumerate(block["rows"])] == [
        True] * 3
    assert out.splitlines()[-1].endswith(" s") and "; 1 input; " in out.splitlines()[-1]


def test_marglik_and_a_tokenizer(bert, capsys, tmp_path):
    """--prior-precision marglik: the posterior's own marginal-likelihood τ; --tokenizer DIR
    (a BPE) encodes the inputs with it."""
    tmp, model, snap = bert
    assert cli_main(argv(tmp, "--text", TEXTS[0], "--json", "--prior-precision",
                         "marglik")) == 0
    doc = json.loads(capsys.readouterr().out)
    batch = padded([list(TEXTS[0].encode())])
    post = LaplacePosterior(model, snap, prior_precision="marglik")
    assert doc["prior_precision"] == pytest.approx(post.prior_precision, rel=1e-12)
    # τ ≈ 0.05 here: the wide posterior scales the float32 round-off between the model in
    # memory and the one read back (~1e-9); the float τ = 2 above agrees to 1e-9 and better
    assert doc["inputs"][0]["probs"] == pytest.approx(post.predictive_probs(batch)[0].tolist(),
                                                      abs=1e-7)
    tok = save_bpe_tokenizer(tmp_path / "bpe", [" ".join(TEXTS) * 20])
    assert cli_main(argv(tmp, "--file", write_file(tmp), "--tokenizer", str(tmp_path / "bpe"),
                         "--json", byte_level=False)) == 0
    doc = json.loads(capsys.readouterr().out)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert ids != [list(t.encode()) for t in TEXTS]
    map_probs, probs, _, _ = expected(model, snap, [padded(ids)])
    for b, r in enumerate(doc["inputs"]):
        assert r["tokens"] == len(ids[b])
        assert r["map_probs"] == pytest.approx(map_probs[b].tolist(), abs=1e-5)
        assert r["probs"] == pytest.approx(probs[b].tolist(), abs=1e-9)


SUPPORTED = ("kfac-stream query answers causal LMs (*ForCausalLM, *LMHeadModel) and "
             "single-label sequence classifiers (*ForSequenceClassification, num_labels >= 2) "
             "only")


def test_other_tasks_are_refused_before_any_weight_loads(bert, capsys, tmp_path):
    """A token classifier (saved whole) and, from their configs alone (no weights: a load
    would fail otherwise), multiple choice, question answering, seq2seq, a regression and a
    multi-label sequence classifier: one line naming the architecture and what is answered."""
    from transformers import BertConfig, BertForTokenClassification, T5Config

    tmp, _, _ = bert
    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32)
    token = tmp_path / "token"
    BertForTokenClassification(BertConfig(**small, num_labels=3)).save_pretrained(token)
    cases = [(token, "is a BertForTokenClassification: ")]
    for name, config, needle in [
            ("mc", BertConfig(**small, architectures=["BertForMultipleChoice"]),
             "is a BertForMultipleChoice: "),
            ("qa", BertConfig(**small, architectures=["BertForQuestionAnswering"]),
             "is a BertForQuestionAnswering: "),
            ("t5", T5Config(d_model=16, architectures=["T5ForConditionalGeneration"]),
             "is a T5ForConditionalGeneration: "),
            ("regression", BertConfig(**small, num_labels=1,
                                      architectures=["BertForSequenceClassification"]),
             "is a BertForSequenceClassification with problem_type='regression' (num_labels=1)"
             ", not a single-label classifier: "),
            ("multilabel", BertConfig(**small, num_labels=4,
                                      problem_type="multi_label_classification",
                                      architectures=["BertForSequenceClassification"]),
             "is a BertForSequenceClassification with problem_type="
             "'multi_label_classification' (num_labels=4)")]:
        config.save_pretrained(tmp_path / name)
        cases.append((tmp_path / name, needle))
    for path, needle in cases:
        args = argv(tmp, "--text", "x")
        args[args.index("--model") + 1] = str(path)
        err = cli_error(capsys, args, f"--model={str(path)!r} {needle}", SUPPORTED)
        assert err.count("\n") == 1  # the error line alone: nothing loaded before it


def test_a_classifier_checkpoint_without_its_head_is_refused(bert, capsys, tmp_path):
    """The missing-weights refusal of the causal LM's loader holds for the classifier's: a
    head the checkpoint lacks would be random."""
    from safetensors.torch import load_file, save_file

    tmp, _, _ = bert
    headless = tmp_path / "headless"
    shutil.copytree(tmp / "model", headless)
    weights = load_file(headless / "model.safetensors")
    del weights["classifier.weight"], weights["classifier.bias"]
    save_file(weights, headless / "model.safetensors", metadata={"format": "pt"})
    args = argv(tmp, "--text", "x")
    args[args.index("--model") + 1] = str(headless)
    cli_error(capsys, args, f"--model={str(headless)!r}: its checkpoint has no weights for 2 "
              "parameter(s) of the sequence classifier (classifier.bias, classifier.weight): "
              "they would be random")


@pytest.mark.parametrize("flag", [["--mode", "tokens"], ["--top-k", "3"], ["--options", "A", "B"],
                                  ["--samples", "4"], ["--weight-samples"], ["--seed", "1"]])
def test_a_causal_lms_flags_are_refused_with_a_classifier(bert, capsys, flag):
    tmp, _, _ = bert
    cli_error(capsys, argv(tmp, "--text", "x", *flag), f"kfac-stream query: error: {flag[0]} is "
              "not allowed with a sequence classifier (BertForSequenceClassification): it is a "
              "flag of a causal LM's query")


def test_missing_tokenizer_and_bad_inputs(bert, capsys, tmp_path):
    """No tokenizer files (or a tokenizer with no vocabulary) without --byte-level: one line
    suggesting --tokenizer DIR or --byte-level, never words mapped to [UNK]; --text and
    --file: exactly one; --file must be a file with an input, each within the model's
    positions; a causal LM takes no --file."""
    tmp, _, _ = bert
    model = str(tmp / "model")
    cli_error(capsys, argv(tmp, "--text", "x", byte_level=False),
              f"--model={model!r} has no tokenizer files (none of tokenizer.json, "
              "tokenizer_config.json, vocab.txt, ...): pass --byte-level", "--tokenizer DIR")
    novocab = tmp_path / "novocab"
    shutil.copytree(tmp / "model", novocab)
    (novocab / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}')
    cli_error(capsys, argv(tmp, "--text", "x", "--tokenizer", str(novocab), byte_level=False),
              f"--tokenizer={str(novocab)!r}: its tokenizer knows only its 5 special token(s), "
              "no vocabulary", "pass --byte-level", "--tokenizer DIR")
    cli_error(capsys, argv(tmp), "one of --text TEXT or --file PATH is required")
    cli_error(capsys, argv(tmp, "--text", "x", "--file", write_file(tmp)),
              "--text and --file are not allowed together")
    cli_error(capsys, argv(tmp, "--file", str(tmp / "none.txt")),
              f"--file={str(tmp / 'none.txt')!r} does not exist: must be a text file")
    blank = write_file(tmp_path, ["", "  "])
    cli_error(capsys, argv(tmp, "--file", blank), f"--file={blank!r} holds no input")
    long = write_file(tmp_path, ["ok", "y" * 65])
    cli_error(capsys, argv(tmp, "--file", long),
              f"--file={long!r} line 2 is 65 tokens long: must be at most 64 tokens")
    cli_error(capsys, argv(tmp, "--text", "é" * 40),
              "--text is 80 tokens long: must be at most 64 tokens")
    from transformers import GPT2Config

    lm = tmp_path / "lm"  # its config alone: refused before anything loads
    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]
               ).save_pretrained(lm)
    args = argv(tmp, "--file", write_file(tmp))
    args[args.index("--model") + 1] = str(lm)
    cli_error(capsys, args, "--file=", "is not allowed with a causal LM: it takes one --text")
