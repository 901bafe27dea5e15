"""``kfac-stream influence``: the printed top-k and ``--json`` equal
`influence_scores` computed here on batches built here from the same training examples (the
app's windows rebuilt from `kfac_stream.app.data` directly; JSON lines and a ``datasets``
directory windowed by the documented rule; a classifier's labelled texts); bad arguments exit 2
with one line.

The app run is the training app's own `run` in-process on a tiny config (1 layer, 32 wide,
windows of 32 bytes, 6 steps), with its composed config saved where Hydra saves it
(``<run dir>/.hydra/config.yaml``), so ``--train app`` finds it as it does on ``make demo``'s
output (tests/docs/test_readme.py runs the README's command on a real ``make demo``).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from kfac_stream import Influence, LaplacePosterior, Snapshot, influence_scores, self_influence
from kfac_stream.app import data as appdata
from kfac_stream.cli import INFLUENCE_EXPLAINED, SELF_INFLUENCE_EXPLAINED, TEXT_WIDTH
from kfac_stream.cli import main as cli_main
from kfac_stream.query.token_table import show_token

from harness import run
from models import text_examples

SEQ = 32
APP_TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", f"model.seq_len={SEQ}",
            "trainer.max_steps=6", "trainer.per_device_train_batch_size=4",
            "trainer.use_cpu=true", "trainer.report_to=[]", "trainer.disable_tqdm=true",
            "kfac.update_every=1", "kfac.snapshot_every=3", "kfac.token_fraction=0.5",
            "data.max_documents=12", "report.enabled=false"]
QUERIES = [("for x in", " range(3):"), ("The ", "class")]
#: the table prints 5 significant digits; the API here runs other batch sizes (float32 sums)
PRINTED_RTOL = 1e-4
#: JSON scores against the API's: the same float32 model and factors, other batch sizes
JSON_RTOL = 1e-5


def cli_error(capsys, args, *needles) -> str:
    """`test_cli_query.cli_error` for ``influence``: exit 2, one line, the needles in it."""
    capsys.readouterr()
    assert cli_main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == [lines[-1]], lines
    assert lines[-1].startswith("kfac-stream influence: error: "), lines[-1]
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return captured.err


@pytest.fixture(scope="module")
def app_run(tmp_path_factory):
    """The training app in-process on `APP_TINY` (its config saved as Hydra does); ``(run
    dir, model loaded as the CLI loads it, newest snapshot)``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import GPT2LMHeadModel

    from kfac_stream.app.main import CONF_DIR
    from kfac_stream.app.main import run as app
    from kfac_stream.app.schema import register

    out = tmp_path_factory.mktemp("influence_app") / "run"
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=APP_TINY)
    app(cfg, str(out))
    (out / ".hydra").mkdir()
    OmegaConf.save(cfg, out / ".hydra" / "config.yaml")
    model = GPT2LMHeadModel.from_pretrained(out / "model", dtype=torch.float32).eval()
    return out, model, Snapshot.latest(out / "kfac")


def app_windows(n: int | None = None) -> list[dict[str, torch.Tensor]]:
    """The app's training windows of `APP_TINY`, rebuilt from the data functions."""
    docs = appdata.pydoc_documents()[:12]
    train, _ = appdata.split_documents(docs, 0.1, seed=0)
    ids = appdata.encode_documents(train, appdata.ByteTokenizer())
    return appdata.lm_examples(ids, SEQ, n)


def lm_query(prompt: str, completion: str) -> dict[str, torch.Tensor]:
    p, c = list(prompt.encode()), list(completion.encode())
    ids = torch.tensor([p + c])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.tensor([[-100] * len(p) + c])}


def stack(examples, size: int) -> list[dict[str, torch.Tensor]]:
    """Batches of ``size`` examples of one length each (no padding)."""
    return [{k: torch.stack([e[k] for e in examples[i:i + size]]) for k in examples[0]}
            for i in range(0, len(examples), size)]


def pad(examples: list[tuple[list[int], list[int] | int]]) -> dict[str, torch.Tensor]:
    """One right-padded batch of ``(ids, labels)`` (labels per token, or a class index)."""
    T = max(len(i) for i, _ in examples)
    per_token = isinstance(examples[0][1], list)
    return {"input_ids": torch.tensor([i + [0] * (T - len(i)) for i, _ in examples]),
            "attention_mask": torch.tensor([[1] * len(i) + [0] * (T - len(i))
                                            for i, _ in examples]),
            "labels": torch.tensor([lab + [-100] * (T - len(lab)) for _, lab in examples]
                                   if per_token else [lab for _, lab in examples])}


def argv(run_dir, *extra, queries=QUERIES) -> list[str]:
    q = [a for p, c in queries for a in ("--query", p, "--completion", c)]
    return ["influence", "--snapshot", str(run_dir / "kfac"), "--model",
            str(run_dir / "model"), *q, *extra]


ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+([+-]\d\.\d{4}e[+-]\d+)\s+(.*)$")


def parse(out: str) -> list[dict[str, list[tuple]]]:
    """Per query ``{"helpful": [(rank, index, score, text)], "harmful": [...]}``."""
    lines = out.splitlines()
    assert lines[0] == INFLUENCE_EXPLAINED
    queries: list[dict] = []
    side = None
    for line in lines[1:-1]:
        if line.startswith("query "):
            queries.append({"helpful": [], "harmful": [], "line": line})
        elif line.strip() in ("most helpful", "most harmful"):
            side = line.split()[-1]
        elif line.split() == ["rank", "example", "score", "text"]:
            continue
        else:
            m = ROW.match(line)
            assert m, line
            queries[-1][side].append((int(m[1]), int(m[2]), float(m[3]), m[4]))
    return queries


def test_table_equals_the_api_on_the_apps_windows(app_run, capsys):
    """``--train app``: the top-3 of each query equal `influence_scores` on the app's windows
    (rebuilt here, batched 50 at a time); the byte-level tokens implied by the run's config."""
    run_dir, model, snap = app_run
    n = 120
    assert cli_main(argv(run_dir, "--train", "app", "--max-train", str(n), "--top-k", "3")) == 0
    captured = capsys.readouterr()
    assert "--byte-level" in captured.err and "scored" in captured.err  # status, progress
    windows = app_windows(n)
    assert len(windows) == n
    want = influence_scores(LaplacePosterior(model, snap, 1.0),
                            [lm_query(p, c) for p, c in QUERIES], stack(windows, 50))
    (hi, hv), (lo, lv) = want.top_k(3)
    got = parse(captured.out)
    assert len(got) == len(QUERIES)
    for q, (prompt, completion) in enumerate(QUERIES):
        assert got[q]["line"] == (f"query {q}: {prompt!r} -> {completion!r} "
                                  f"({len(completion)} completion tokens)")
        for side, idx, val in (("helpful", hi, hv), ("harmful", lo, lv)):
            rows = got[q][side]
            assert [r[0] for r in rows] == [1, 2, 3]
            assert [r[1] for r in rows] == idx[q].tolist(), (side, q)
            for (_, j, score, text), v in zip(rows, val[q].tolist()):
                assert score == pytest.approx(v, rel=PRINTED_RTOL)
                window = bytes(windows[j]["input_ids"].tolist()).decode("utf-8", "replace")
                assert text == show_token(window, TEXT_WIDTH)
    footer = captured.out.splitlines()[-1]
    assert footer.startswith(f"snapshot {snap.path} (step 6); {n} training examples (windows "
                             f"of {SEQ} tokens of the app's training data, ")
    assert "damping heuristic" in footer and "ms per training example" in footer


def test_json_holds_scores_damping_layers_timing_and_the_per_token_split(app_run, capsys):
    run_dir, model, snap = app_run
    n = 40
    assert cli_main(argv(run_dir, "--train", "app", "--max-train", str(n), "--top-k", "2",
                         "--per-token", "--json", "--batch-size", "7")) == 0
    doc = json.loads(capsys.readouterr().out)
    post = LaplacePosterior(model, snap, 1.0)
    inf = Influence(post)
    windows = app_windows(n)
    want = inf.scores([lm_query(p, c) for p, c in QUERIES], stack(windows, 8), per_token=True)
    assert set(doc) == {
        "snapshot", "step", "model", "task", "architecture", "train", "train_rule",
        "train_described", "app_config", "seq_len", "train_examples", "damping",
        "damping_per_layer", "layers", "eigenvalues", "ekfac_layers", "top_k", "per_token",
        "device", "batch_size", "seconds", "scoring_seconds", "seconds_per_train_example",
        "queries"}
    assert (doc["train"], doc["train_examples"], doc["seq_len"], doc["top_k"], doc["damping"],
            doc["batch_size"], doc["task"]) == ("app", n, SEQ, 2, "heuristic", 7, "causal_lm")
    assert doc["app_config"] == str(run_dir / ".hydra" / "config.yaml")
    assert doc["layers"] == list(post.layer_names)
    assert (doc["eigenvalues"], doc["ekfac_layers"]) == ("auto", [])  # a run without EK-FAC
    assert doc["damping_per_layer"] == pytest.approx(inf.damping, rel=1e-12)
    assert 0 < doc["scoring_seconds"] <= doc["seconds"]
    # scoring_seconds is rounded to 1 ms in the JSON: its share per example to 0.5 ms / n
    assert doc["seconds_per_train_example"] == pytest.approx(doc["scoring_seconds"] / n,
                                                             rel=0, abs=0.5e-3 / n + 1e-12)
    for q, rec in enumerate(doc["queries"]):
        prompt, completion = QUERIES[q]
        assert (rec["index"], rec["prompt"], rec["completion"]) == (q, prompt, completion)
        assert rec["tokens"] == len(prompt) + len(completion)
        assert [t["token"] for t in rec["completion_tokens"]] == list(completion)
        assert [t["position"] for t in rec["completion_tokens"]] == \
            want.token_positions[q, :len(completion)].tolist()
        for side, desc in (("helpful", True), ("harmful", False)):
            order = want.scores[q].sort(descending=desc).indices[:2].tolist()
            assert [r["index"] for r in rec[side]] == order
            for r in rec[side]:
                j = r["index"]
                assert set(r) == {"rank", "index", "score", "text", "source", "token_scores"}
                assert r["source"] == {"window": j, "first_token": j * SEQ}
                assert r["score"] == pytest.approx(float(want.scores[q, j]), rel=JSON_RTOL)
                split = want.token_scores[q, :len(completion), j]
                assert r["token_scores"] == pytest.approx(split.tolist(), rel=JSON_RTOL,
                                                          abs=JSON_RTOL * float(split.abs().max()))
                assert sum(r["token_scores"]) == pytest.approx(r["score"], rel=1e-9)


def test_prior_and_fixed_damping(app_run, capsys):
    run_dir, model, snap = app_run
    base = argv(run_dir, "--train", "app", "--max-train", "8", "--json")
    assert cli_main([*base, "--damping", "prior", "--prior-precision", "2.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    post = LaplacePosterior(model, snap, 2.5)
    assert doc["damping"] == "prior" and doc["prior_precision"] == 2.5
    assert doc["damping_per_layer"] == pytest.approx(
        {n: 2.5 / post.layer_num_data[n] for n in post.layer_names}, rel=1e-12)
    assert cli_main([*base, "--damping", "0.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["damping"] == 0.5 and set(doc["damping_per_layer"].values()) == {0.5}
    want = influence_scores(post, [lm_query(p, c) for p, c in QUERIES], stack(app_windows(8), 8),
                            damping=0.5)
    for q, rec in enumerate(doc["queries"]):
        for r in rec["helpful"]:
            assert r["score"] == pytest.approx(float(want.scores[q, r["index"]]), rel=JSON_RTOL)


#: 69 bytes (windows of 32, 32, 5), a blank text (skipped), 28 bytes, 5 bytes
TEXTS = ["def add(a, b):\n    return a + b\n" * 2 + "# end", "", "import os\nprint(os.getcwd())",
         "x = 1"]


def text_windows(seq_len: int, cut: str = "windows") -> list[tuple[list[int], list[int], dict]]:
    """The documented rules for texts: ``--cut windows``: each text's bytes in consecutive
    windows of ``seq_len``, a shorter last window kept when it has 2 tokens or more; the
    default (``tokenizer``): each text's first ``seq_len`` bytes (a tokenizer's
    ``truncation=True, max_length=seq_len`` on bytes); blank texts skipped."""
    out = []
    for i, text in enumerate(TEXTS):
        ids = list(text.encode())
        if cut == "tokenizer" and ids:
            out.append((ids[:seq_len], ids[:seq_len], {"record": i}))
            continue
        for s in range(0, len(ids), seq_len):
            w = ids[s:s + seq_len]
            if len(w) >= 2:
                out.append((w, list(w), {"record": i, "first_token": s}))
    return out


@pytest.mark.parametrize("kind,cut", [("jsonl", "windows"), ("datasets", "windows"),
                                      ("jsonl", "tokenizer")])
def test_texts_from_json_lines_or_a_datasets_directory(app_run, capsys, tmp_path, kind, cut):
    """``--train`` a JSON-lines file or a ``save_to_disk`` directory of texts, and a
    ``--query-file``: every example (top-k = N) equals the API on the documented windows
    (``--cut windows``) or texts cut to ``--seq-len`` (the default)."""
    run_dir, model, snap = app_run
    if kind == "jsonl":
        train = tmp_path / "train.jsonl"
        train.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n\n")
    else:
        datasets = pytest.importorskip("datasets")
        train = tmp_path / "train_ds"
        datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(train))
    qfile = tmp_path / "queries.jsonl"
    qfile.write_text("\n".join(json.dumps({"prompt": p, "completion": c}) for p, c in QUERIES))
    extra = ["--text-field", "body"] if kind == "datasets" else []
    extra += ["--cut", "windows"] if cut == "windows" else []
    windows = text_windows(SEQ, cut)
    args = ["influence", "--snapshot", str(run_dir / "kfac"), "--model", str(run_dir / "model"),
            "--byte-level", "--train", str(train), "--query-file", str(qfile), "--json",
            "--top-k", str(len(windows)), "--batch-size", "2", *extra]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [len(w) for w, _, _ in windows] == (
        [32, 32, 5, 28, 5] if cut == "windows" else [32, 28, 5])
    assert doc["train_examples"] == len(windows) and doc["seq_len"] == SEQ
    assert doc["cut"] == cut and "1 of 3 texts longer than 32 tokens" in captured.err
    assert ("--cut windows" in doc["train_described"]) == (cut == "windows")
    want = influence_scores(LaplacePosterior(model, snap, 1.0),
                            [lm_query(p, c) for p, c in QUERIES],
                            [pad([(i, lab) for i, lab, _ in windows])])
    for q, rec in enumerate(doc["queries"]):
        got = {r["index"]: r for r in rec["helpful"]}
        assert sorted(got) == list(range(len(windows)))
        for j, r in got.items():
            assert r["score"] == pytest.approx(float(want.scores[q, j]), rel=JSON_RTOL)
            assert r["source"] == windows[j][2]
            assert r["text"] == bytes(windows[j][0]).decode()


def test_prompt_completion_training_records(app_run, capsys, tmp_path):
    """A training record ``{"prompt", "completion"}``: the loss on the completion only."""
    run_dir, model, snap = app_run
    records = [("a = ", "1"), ("def f", "(x):"), ("import ", "sys")]
    train = tmp_path / "pairs.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": p, "completion": c}) for p, c in records))
    assert cli_main(argv(run_dir, "--byte-level", "--train", str(train), "--json",
                         "--top-k", "3")) == 0
    doc = json.loads(capsys.readouterr().out)
    examples = [(list(p.encode()) + list(c.encode()),
                 [-100] * len(p.encode()) + list(c.encode())) for p, c in records]
    want = influence_scores(LaplacePosterior(model, snap, 1.0),
                            [lm_query(p, c) for p, c in QUERIES], [pad(examples)])
    for q, rec in enumerate(doc["queries"]):
        for r in rec["helpful"]:
            assert r["score"] == pytest.approx(float(want.scores[q, r["index"]]), rel=JSON_RTOL)
            assert r["text"] == "".join(records[r["index"]])


def test_a_lora_adapter_directory(capsys, tmp_path):
    """A PEFT LoRA run saved by `gather_model` (adapter + base): the scores are over the
    adapter layers only and equal the API's on the trained model."""
    pytest.importorskip("peft")
    from kfac_stream import gather_model

    from models import lora_gpt2

    model = lora_gpt2(torch.float32)
    _, _, trainer = run(model, text_examples(8, 12), batch=2, tmp_path=tmp_path, record=False)
    gather_model(trainer, str(tmp_path / "model"))
    model.eval()
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    args = ["influence", "--snapshot", str(tmp_path / "kfac"), "--model", str(tmp_path / "model"),
            "--byte-level", "--train", str(train), "--query", "def f", "--completion", "(x):",
            "--json", "--top-k", "5", "--seq-len", "16", "--cut", "windows"]
    capsys.readouterr()  # the Trainer's own lines
    assert cli_main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["base"] and all(".lora_" in n for n in doc["layers"]) and len(doc["layers"]) == 8
    windows = []
    for text in TEXTS:
        ids = list(text.encode())
        windows += [(ids[s:s + 16], ids[s:s + 16]) for s in range(0, len(ids), 16)
                    if len(ids[s:s + 16]) >= 2]
    snap = Snapshot.latest(tmp_path / "kfac")
    want = influence_scores(LaplacePosterior(model, snap, 1.0), lm_query("def f", "(x):"),
                            [pad(windows)])
    assert doc["train_examples"] == len(windows)
    for r in doc["queries"][0]["helpful"] + doc["queries"][0]["harmful"]:
        assert r["score"] == pytest.approx(float(want.scores[0, r["index"]]), rel=JSON_RTOL)


LABELS = {0: "neg", 1: "pos"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny BERT classifier with label names and pad id 0, saved without tokenizer files."""
    from transformers import BertConfig, BertForSequenceClassification

    tmp = tmp_path_factory.mktemp("influence_clf")
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64, num_labels=2, id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()}, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    ex = text_examples(8, 12)
    for i, e in enumerate(ex):
        e["labels"] = torch.tensor(i % 2)
    run(model, ex, {"snapshot_every": 2}, batch=2, tmp_path=tmp, record=False)
    model.save_pretrained(tmp / "model")
    loaded = BertForSequenceClassification.from_pretrained(tmp / "model", dtype=torch.float32)
    return tmp, loaded.eval(), Snapshot.latest(tmp / "kfac")


def test_classifier_queries_and_labelled_texts(classifier, capsys, tmp_path):
    tmp, model, snap = classifier
    rows = [("return x", "pos"), ("import os", 0), ("a longer line of text here", "1")]
    train = tmp_path / "labelled.jsonl"
    train.write_text("\n".join(json.dumps({"text": t, "label": lab}) for t, lab in rows))
    args = ["influence", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
            "--byte-level", "--train", str(train), "--query", "def f(x):", "--label", "neg",
            "--query", "x = 2", "--label", "1", "--top-k", "3", "--seq-len", "8"]
    assert cli_main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["task"] == "sequence_classification" and doc["train_examples"] == 3
    assert [(q["text"], q["label"], q["label_id"]) for q in doc["queries"]] == [
        ("def f(x):", "neg", 0), ("x = 2", "pos", 1)]
    examples = [(list(t.encode())[:8], [1, 0, 1][i]) for i, (t, _) in enumerate(rows)]
    queries = [pad([(list(b"def f(x):"), 0)]), pad([(list(b"x = 2"), 1)])]
    want = influence_scores(LaplacePosterior(model, snap, 1.0), queries, [pad(examples)])
    for q, rec in enumerate(doc["queries"]):
        assert [r["index"] for r in rec["helpful"]] == \
            want.scores[q].sort(descending=True).indices.tolist()
        for r in rec["helpful"]:
            assert r["score"] == pytest.approx(float(want.scores[q, r["index"]]), rel=JSON_RTOL)
            assert r["label"] == LABELS[examples[r["index"]][1]]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "query 0: 'def f(x):' label 'neg'" in out and "label 'pos'" in out
    own = ["influence", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
           "--byte-level", "--train", str(train), "--seq-len", "8", "--self"]
    assert cli_main([*own, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = self_influence(LaplacePosterior(model, snap, 1.0), [pad(examples)])
    assert doc["scores"] == pytest.approx(want.tolist(), rel=JSON_RTOL)
    assert [(r["index"], r["label"]) for r in doc["ranked"]] == [
        (j, LABELS[examples[j][1]]) for j in want.sort(descending=True).indices.tolist()]


def test_bad_arguments_exit_2_with_one_line(app_run, classifier, capsys, tmp_path):
    run_dir, _, _ = app_run
    app = ["--train", "app"]
    cli_error(capsys, argv(run_dir, *app, "--top-k", "0"), "--top-k=0 is not allowed: must "
              "be an int >= 1")
    cli_error(capsys, argv(run_dir, *app, "--batch-size", "0"), "--batch-size=0")
    cli_error(capsys, argv(run_dir, *app, "--damping", "none"), "--damping='none' is not "
              "allowed: must be 'heuristic', 'prior' or a positive finite number")
    cli_error(capsys, argv(run_dir, *app, "--eigenvalues", "ekfac"),
              "eigenvalues='ekfac', but snapshot", "has no EK-FAC correction")
    cli_error(capsys, argv(run_dir, *app, "--prior-precision", "2"),
              "--prior-precision is only used with --damping prior")
    cli_error(capsys, argv(run_dir, *app, "--cut", "windows"), "--cut windows is not allowed "
              "with --train app: its examples are the windows the run trained on")
    missing = str(tmp_path / "nope")
    cli_error(capsys, ["influence", "--snapshot", missing, "--model", str(run_dir / "model"),
                       "--query", "a", "--completion", "b", *app],
              f"--snapshot={missing!r} does not exist")
    cli_error(capsys, argv(run_dir, "--train", missing), f"--train={missing!r} does not "
              "exist: must be 'app', a datasets save_to_disk directory or a JSON-lines file")
    cli_error(capsys, ["influence", "--snapshot", str(run_dir / "kfac"), "--model", missing,
                       "--query", "a", "--completion", "b", *app], f"--model={missing!r}")
    cli_error(capsys, argv(run_dir, *app, queries=[]), "one of --query")
    no_completion = ["influence", "--snapshot", str(run_dir / "kfac"), "--model",
                     str(run_dir / "model"), "--query", "for x in", *app]
    cli_error(capsys, no_completion, "1 --query but 0 --completion: a causal LM's query is a "
              "prompt and the completion whose loss is scored")
    cli_error(capsys, argv(run_dir, *app, queries=[("for x", "")]), "has an empty completion")
    cli_error(capsys, [*no_completion, "--label", "1"], "--label is not allowed with a causal "
              "LM")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "x"}) + "\n")
    cli_error(capsys, argv(run_dir, "--byte-level", "--train", str(empty)),
              f"--train={str(empty)!r} yields no training example", "nothing to score")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "abc"}\nnot json\n')
    cli_error(capsys, argv(run_dir, "--byte-level", "--train", str(bad)),
              f"--train={str(bad)!r} line 2 is not JSON")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"body": "abc"}))
    cli_error(capsys, argv(run_dir, "--byte-level", "--train", str(other)),
              "record 0 has no 'text'", "--text-field")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"prompt": "a"}))
    cli_error(capsys, ["influence", "--snapshot", str(run_dir / "kfac"), "--model",
                       str(run_dir / "model"), "--query-file", str(qfile), *app],
              "line 1: must be a JSON object with 'prompt' and 'completion'")
    cli_error(capsys, argv(run_dir, "--byte-level", "--train", str(empty), "--app-config",
                           str(run_dir)), "--app-config is not allowed with --train=")
    tmp, _, _ = classifier
    clf = ["influence", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
           "--byte-level", "--query", "x"]
    cli_error(capsys, [*clf, "--train", "app", "--label", "neg"], "--train app is not allowed "
              "with a sequence classifier")
    cli_error(capsys, [*clf, "--train", str(empty)], "1 --query but 0 --label")
    cli_error(capsys, [*clf, "--train", str(empty), "--label", "maybe"],
              "label 'maybe' is not one of the model's labels: must be a class name (neg, pos)")
    cli_error(capsys, [*clf, "--train", str(empty), "--label", "neg", "--per-token"],
              "--per-token is not allowed with a sequence classifier")


def test_a_zero_heuristic_damping_is_refused(app_run, capsys, monkeypatch):
    """A layer whose factor is zero (no sampled position carried a gradient: an encoder
    classifier's last block under the defaults) gets heuristic damping 0 and NaN scores: the
    command refuses it in one line, naming the way out (tests/runs/test_families.py)."""
    from kfac_stream.query import influence

    real = influence.Influence._damping
    monkeypatch.setattr(influence.Influence, "_damping", lambda self, n, rule: 0.0 if (
        rule == "heuristic" and n.endswith("c_fc")) else real(self, n, rule))
    run_dir, _, _ = app_run
    cli_error(capsys, argv(run_dir, "--train", "app", "--max-train", "4"),
              "--damping heuristic is 0 on 1 layer(s) (transformer.h.0.mlp.c_fc)",
              "pass --damping prior or a positive --damping FLOAT")
    assert cli_main(argv(run_dir, "--train", "app", "--max-train", "4", "--damping",
                         "prior", "--prior-precision", "1")) == 0


def test_train_app_without_a_run_config(app_run, capsys, tmp_path):
    """A model and snapshot outside a run directory: --train app says where it looked."""
    import shutil

    run_dir, _, _ = app_run
    shutil.copytree(run_dir / "model", tmp_path / "m" / "model")
    shutil.copytree(run_dir / "kfac", tmp_path / "s" / "kfac")
    args = ["influence", "--snapshot", str(tmp_path / "s" / "kfac"), "--model",
            str(tmp_path / "m" / "model"), "--query", "a", "--completion", "b", "--train", "app"]
    cli_error(capsys, args, "--train app: no run config found", "pass --app-config")
    assert cli_main([*args, "--app-config", str(run_dir), "--max-train", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["train_examples"] == 4


def test_self_influence_ranks_the_training_examples(app_run, capsys):
    """``--self``: the table's top 4 and ``--json``'s every score equal `self_influence` on the
    app's windows (rebuilt here, batched otherwise); a query is refused beside it."""
    run_dir, model, snap = app_run
    n = 30
    base = ["influence", "--snapshot", str(run_dir / "kfac"), "--model", str(run_dir / "model"),
            "--train", "app", "--max-train", str(n), "--self"]
    assert cli_main([*base, "--json", "--batch-size", "7"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = self_influence(LaplacePosterior(model, snap, 1.0), stack(app_windows(n), 10))
    assert doc["self_influence"] is True and "queries" not in doc
    assert doc["scores"] == pytest.approx(want.tolist(), rel=JSON_RTOL)
    order = want.sort(descending=True).indices.tolist()
    assert [r["index"] for r in doc["ranked"]] == order[:5]  # --top-k 5 by default
    assert [r["rank"] for r in doc["ranked"]] == [1, 2, 3, 4, 5]
    assert cli_main([*base, "--top-k", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == SELF_INFLUENCE_EXPLAINED
    assert out[1].split() == ["rank", "example", "self-influence", "text"]
    rows = [line.split()[:3] for line in out[2:6]]
    assert [int(r[1]) for r in rows] == order[:4]
    for (_, j, score) in rows:
        assert float(score) == pytest.approx(float(want[int(j)]), rel=PRINTED_RTOL)
    assert "self-influence;" in out[-1]
    cli_error(capsys, [*base, "--query", "x", "--completion", "y"], "--query",
              "is not allowed with --self")
