"""The Laplace-LoRA recipe end to end: a tiny Llama built from a config
with a BPE tokenizer trained offline, a 4-way multiple-choice task on real text (which license
an excerpt is from: answers " A" … " D", one token each, labels -100 except the answer), PEFT
LoRA r=8, a real ``transformers.Trainer`` with the callback (``preset="lora"``), then
``kfac_stream.gather_model``. The saved directory loads back: ``kfac-stream query --options``
on it and `LaplacePosterior` on a ``PeftModel.from_pretrained`` reload give the in-process
posterior's answers; a merged model and an adapter loaded by transformers are refused with
the way to load it (docs/lora.md)."""

from __future__ import annotations

import json
import os
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
from test_cli_query import cli_error

from kfac_stream import (
    HeldoutConfig,
    KFACConfig,
    KFACStreamCallback,
    LaplacePosterior,
    Snapshot,
    gather_model,
)
from kfac_stream.cli import main as cli_main
from kfac_stream.exceptions import SnapshotMismatchError
from kfac_stream.integrations.peft_adapter import SIDECAR, base_state_dict
from kfac_stream.query.answers import answer_distribution

from models import ListDataset, lora_gpt2, tiny_gpt2

peft = pytest.importorskip("peft")

LICENSES = ("Apache-2.0", "GPL-3", "BSD", "MPL-2.0")
OPTIONS = (" A", " B", " C", " D")
#: Tokens of an excerpt (the prompt is the excerpt, then "\nAnswer:", then the answer token).
EXCERPT = 20
TAU = 3.0
SAMPLES = 6
#: Agreement of two computations of the same numbers (float32 models, float64 algebra).
TOL = 1e-6


def _texts() -> list[str]:
    return [open(f"/usr/share/common-licenses/{name}", encoding="utf-8").read()
            for name in LICENSES]


def _tokenizer(directory):
    """A byte-level BPE (512 tokens) trained offline on the four licenses and the answer
    lines, so that each of " A" … " D" is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    answers = "".join(f"\nAnswer:{o}" for o in OPTIONS)
    bpe.train_from_iterator(_texts() + [answers] * 50, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.save_pretrained(directory)
    return tok


def _examples(tok, n: int, seed: int) -> tuple[list[dict], list[str], list[int]]:
    """``n`` questions (license ``i % 4``, a random excerpt of `EXCERPT` tokens): the training
    rows (prompt + answer; labels -100 but at the answer), the prompts' texts, the answers."""
    suffix = tok("\nAnswer:", add_special_tokens=False)["input_ids"]
    option_ids = [tok(o, add_special_tokens=False)["input_ids"][0] for o in OPTIONS]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in _texts()]
    rng = random.Random(seed)
    rows, prompts, answers = [], [], []
    for i in range(n):
        k = i % len(LICENSES)
        off = rng.randrange(0, len(ids[k]) - EXCERPT)
        x = ids[k][off:off + EXCERPT] + suffix + [option_ids[k]]
        rows.append({"input_ids": torch.tensor(x), "attention_mask": torch.ones(len(x), dtype=int),
                     "labels": torch.tensor([-100] * (len(x) - 1) + [option_ids[k]])})
        prompts.append(tok.decode(ids[k][off:off + EXCERPT]) + "\nAnswer:")
        answers.append(k)
    return rows, prompts, answers


def _llama(vocab: int, pad_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=pad_id,
            bos_token_id=pad_id, eos_token_id=pad_id))


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The recipe as docs/lora.md shows it: fine-tune, ``gather_model``, the newest snapshot,
    the in-process posterior at ``τ = TAU``; four held-out prompts (one per license)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    tmp = tmp_path_factory.mktemp("lora_recipe")
    tok = _tokenizer(tmp / "tokenizer")
    option_ids = [tok(o, add_special_tokens=False)["input_ids"] for o in OPTIONS]
    assert all(len(i) == 1 for i in option_ids), option_ids  # one token each
    option_ids = [i[0] for i in option_ids]
    train, _, _ = _examples(tok, 96, seed=0)
    _, prompts, answers = _examples(tok, 4, seed=1)
    base = _llama(len(tok), tok.pad_token_id)
    initial = {k: v.clone() for k, v in base.state_dict().items()}  # the frozen base
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
            lora_dropout=0.0, task_type="CAUSAL_LM"))
    cb = KFACStreamCallback(KFACConfig(preset="lora", token_fraction=0.5, update_every=4,
                                       min_window_sequences=0),
                            heldout=HeldoutConfig(answer_tokens=list(OPTIONS)))
    args = TrainingArguments(
        str(tmp / "run"), per_device_train_batch_size=8, max_steps=24, learning_rate=1e-2,
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(train), callbacks=[cb],
                      processing_class=tok)
    trainer.train()
    saved = gather_model(trainer, str(tmp / "model"))
    assert saved is model  # without ZeRO-3: the trained model itself
    model.eval()
    snap = Snapshot.latest(tmp / "run" / "kfac")
    post = LaplacePosterior(model, snap, prior_precision=TAU)
    return SimpleNamespace(tmp=tmp, tok=tok, model=model, snap=snap, post=post, initial=initial,
                           option_ids=option_ids, prompts=prompts, answers=answers,
                           dir=tmp / "model")


def _batch(tok, text: str) -> dict:
    ids = torch.tensor([tok(text)["input_ids"]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _reload(directory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32)
    return PeftModel.from_pretrained(base, directory).eval()


def _argv(r, text: str, *extra: str, model=None) -> list[str]:
    return ["query", "--snapshot", str(r.tmp / "run" / "kfac"), "--model",
            str(model or r.dir), "--text", text, "--prior-precision", str(TAU), "--samples",
            str(SAMPLES), "--json", *extra]


def test_the_saved_directory_holds_the_adapter_and_the_frozen_base(recipe):
    """``gather_model`` of a PeftModel: the adapter at the directory, the base model's weights
    under its own names in base/ (equal to the base before LoRA wrapped it: frozen), the
    tokenizer in both, and where the base is (sidecar, adapter_config.json)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    d = recipe.dir
    for f in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", SIDECAR,
              "base/config.json", "base/model.safetensors", "base/tokenizer.json"):
        assert (d / f).is_file(), f
    assert json.loads((d / SIDECAR).read_text()) == {
        "format": 1, "base": "base", "adapter": ".", "adapter_name": "default",
        "base_class": "LlamaForCausalLM"}
    config = json.loads((d / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == os.path.abspath(d / "base")
    assert AutoConfig.from_pretrained(d / "base").architectures == ["LlamaForCausalLM"]
    weights = load_file(d / "base" / "model.safetensors")
    assert sorted(weights) == sorted(recipe.initial)
    for k, v in recipe.initial.items():
        assert torch.equal(weights[k], v), k
    adapter = load_file(d / "adapter_model.safetensors")
    lora = {k: v for k, v in recipe.model.state_dict().items() if ".lora_" in k}
    assert len(adapter) == len(lora) == len(recipe.snap.layer_names)  # lora_A/B weights
    assert any(v.abs().max() > 0 for k, v in lora.items() if ".lora_B." in k)  # it trained


def test_cli_options_on_the_saved_directory_equal_the_in_process_posterior(recipe, capsys):
    """``kfac-stream query --model DIR --options ' A' ' B' ' C' ' D'`` loads the adapter with
    its base and prints, per prompt, what `answer_distribution` gives on the trained model in
    the training process (same samples, seed, τ)."""
    r = recipe
    for text in r.prompts:
        capsys.readouterr()
        assert cli_main(_argv(r, text, "--options", *OPTIONS)) == 0
        captured = capsys.readouterr()
        doc = json.loads(captured.out)
        assert "PEFT adapter on base model" in captured.err
        assert doc["base"] == os.path.normpath(r.dir / "base")
        assert doc["options"] == list(OPTIONS) and doc["options_from"] == "--options"
        assert doc["num_data"] == pytest.approx(r.post.num_data, rel=1e-12)
        assert doc["prior_precision"] == TAU
        d = answer_distribution(r.post, _batch(r.tok, text), options=r.option_ids,
                                n_samples=SAMPLES, seed=0, linearized=True)
        a = doc["answers"]
        assert [o["token_id"] for o in a["options"]] == r.option_ids
        assert [o["prob"] for o in a["options"]] == pytest.approx(d.probs[0].tolist(), abs=TOL)
        assert [o["count"] for o in a["options"]] == d.counts[0].tolist()
        assert a["map_answer"] == OPTIONS[int(d.map_answer[0])]
    # the answers differ from the MAP softmax: the posterior has a say
    assert not torch.allclose(d.probs[0], torch.softmax(
        r.model(**_batch(r.tok, text)).logits[0, -1, r.option_ids].double(), -1), atol=1e-4)


def test_a_peft_reload_gives_the_in_process_posterior(recipe):
    """``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/base), DIR)``: its
    module names are the snapshot's, and `LaplacePosterior` on it gives the in-process
    posterior's Gaussian of the option logits, its probabilities and the samples' answers."""
    r = recipe
    reloaded = _reload(r.dir)
    names = dict(reloaded.named_modules())
    assert all(n in names for n in r.snap.layer_names)
    assert r.snap.layer_names[0].startswith("base_model.model.model.layers.0.")
    post = LaplacePosterior(reloaded, r.snap, prior_precision=TAU)
    assert post.num_data == r.post.num_data
    batch = {k: torch.cat([_batch(r.tok, t)[k] for t in r.prompts]) for k in ("input_ids",
                                                                            "attention_mask")}
    mean, cov = post.predictive(batch, token_ids=r.option_ids)
    want_mean, want_cov = r.post.predictive(batch, token_ids=r.option_ids)
    assert mean.shape == (4, 4) and cov.shape == (4, 4, 4)
    torch.testing.assert_close(mean, want_mean, atol=TOL, rtol=0)
    torch.testing.assert_close(cov, want_cov, atol=TOL, rtol=0)
    assert float(torch.diagonal(want_cov, dim1=-2, dim2=-1).min()) > 1e-4  # not a point mass
    probs = post.predictive_probs(batch, token_ids=r.option_ids)
    torch.testing.assert_close(probs, r.post.predictive_probs(batch, token_ids=r.option_ids),
                               atol=TOL, rtol=0)
    # docs/lora.md: without token_ids, the snapshot's answer tokens at the last position
    torch.testing.assert_close(post.predictive_probs(batch), probs, atol=0, rtol=0)
    got = answer_distribution(post, batch, options=r.option_ids, n_samples=SAMPLES, seed=0,
                              linearized=True)
    want = answer_distribution(r.post, batch, options=r.option_ids, n_samples=SAMPLES, seed=0,
                               linearized=True)
    torch.testing.assert_close(got.probs, want.probs, atol=TOL, rtol=0)
    assert torch.equal(got.counts, want.counts)


def test_a_merged_model_is_refused_with_the_way_to_load_the_adapter(recipe, capsys, tmp_path):
    """``merge_and_unload()`` folds the adapters into the base weights: the snapshot's layers
    are gone, and `LaplacePosterior` and the CLI say so, naming merging and the reload."""
    r = recipe
    reloaded = _reload(r.dir)
    batch = _batch(r.tok, r.prompts[0])
    with torch.no_grad():
        want = reloaded(**batch).logits
    merged = reloaded.merge_and_unload()
    with torch.no_grad():  # the same function, without the LoRA layers
        torch.testing.assert_close(merged(**batch).logits, want, atol=1e-5, rtol=1e-5)
    needles = ("has no LoRA layers", "merge_and_unload()", "folded into the base weights",
               "PeftModel.from_pretrained(base, adapter_dir)", "kfac_stream.gather_model")
    with pytest.raises(SnapshotMismatchError) as e:
        LaplacePosterior(merged, r.snap, prior_precision=TAU)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
    merged.save_pretrained(tmp_path / "merged")
    r.tok.save_pretrained(tmp_path / "merged")
    cli_error(capsys, _argv(r, r.prompts[0], "--options", *OPTIONS, model=tmp_path / "merged"),
              f"tracked layer {r.snap.layer_names[0]!r} is not a module of the model",
              *needles)


def test_an_adapter_loaded_by_transformers_is_refused_with_the_way_to_load_it(recipe):
    """``AutoModelForCausalLM.from_pretrained(DIR)`` loads the adapter onto the base through
    adapter_config.json's base_model_name_or_path, but under the base model's names: refused
    with the name it has and the reload that keeps the snapshot's."""
    from transformers import AutoModelForCausalLM

    r = recipe
    model = AutoModelForCausalLM.from_pretrained(r.dir, dtype=torch.float32)
    name = r.snap.layer_names[0]
    assert name.removeprefix("base_model.model.") in dict(model.named_modules())
    with pytest.raises(SnapshotMismatchError) as e:
        LaplacePosterior(model, r.snap, prior_precision=TAU)
    msg = str(e.value)
    assert f"the model holds it as {name.removeprefix('base_model.model.')!r}" in msg, msg
    assert "AutoModelFor*.from_pretrained(adapter_dir)" in msg
    assert "PeftModel.from_pretrained(base, adapter_dir)" in msg


def test_an_adapter_without_a_base_needs_base(recipe, capsys, tmp_path):
    """An adapter directory alone (what ``trainer.save_model`` writes for a model built from a
    config: base_model_name_or_path empty): one line saying to pass --base; with --base the
    answers are those of the saved directory."""
    r = recipe
    bare = tmp_path / "adapter"
    bare.mkdir()
    shutil.copy(r.dir / "adapter_model.safetensors", bare)
    config = json.loads((r.dir / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (bare / "adapter_config.json").write_text(json.dumps(config))
    argv = _argv(r, r.prompts[1], "--options", *OPTIONS, model=bare)
    cli_error(capsys, argv, f"--model={str(bare)!r} is a PEFT adapter directory",
              "names no base model", "pass --base")
    cli_error(capsys, [*argv, "--base", str(tmp_path / "nobase")], "--base=",
              "is a local path that does not exist")
    assert cli_main([*argv, "--base", str(r.dir / "base")]) == 0  # tokenizer: the base's
    got = json.loads(capsys.readouterr().out)["answers"]
    assert cli_main(_argv(r, r.prompts[1], "--options", *OPTIONS)) == 0
    assert got == json.loads(capsys.readouterr().out)["answers"]
    cli_error(capsys, [*_argv(r, r.prompts[1], model=r.dir / "base"), "--base", str(bare)],
              "--base=", "is no PEFT adapter directory")


def test_the_snapshots_answer_tokens_are_the_default_options(recipe, capsys, monkeypatch):
    """Without --options, a snapshot that records answer tokens (HeldoutConfig.answer_tokens:
    ``Snapshot.answer_tokens`` ids, ``Snapshot.answer_texts``) gives the options: the status
    line and the JSON say so, and the answers are those of ``--options`` with the same
    strings."""
    r = recipe
    assert r.snap.answer_tokens == tuple(r.option_ids) and r.snap.answer_texts == OPTIONS
    assert cli_main(_argv(r, r.prompts[2])) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert "the snapshot's answer tokens" in captured.err
    assert doc["options"] == list(OPTIONS) and doc["options_from"] == "snapshot"
    assert cli_main(_argv(r, r.prompts[2], "--options", *OPTIONS)) == 0
    given = json.loads(capsys.readouterr().out)
    assert doc["answers"] == given["answers"] and given["options_from"] == "--options"
    # recorded ids without texts: the options are the ids decoded by the tokenizer
    monkeypatch.setattr(Snapshot, "answer_texts", property(lambda s: None), raising=False)
    assert cli_main(_argv(r, r.prompts[2])) == 0
    assert json.loads(capsys.readouterr().out)["options"] == list(OPTIONS)


@pytest.mark.parametrize("kind", ["llama_classifier", "gpt2"])
def test_base_state_dict_is_the_base_before_peft_wrapped_it(kind):
    """`base_state_dict` of a PeftModel's state dict: the base model's own state dict, names
    and values, for LoRA on Llama projections with a ``modules_to_save`` head (a classifier's
    ``score``: its original weights, not the trained copy) and on GPT-2's Conv1D layers."""
    from peft import LoraConfig, get_peft_model

    if kind == "gpt2":
        base = tiny_gpt2(torch.float32)
        want = {k: v.clone() for k, v in base.state_dict().items()}
        model = lora_gpt2(torch.float32)
    else:
        from transformers import LlamaConfig, LlamaForSequenceClassification

        torch.manual_seed(0)
        base = LlamaForSequenceClassification(LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_labels=3, pad_token_id=0))
        want = {k: v.clone() for k, v in base.state_dict().items()}
        model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "down_proj"],
                                                task_type="SEQ_CLS"))
        with torch.no_grad():  # the trained head copy differs from the original
            model.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
    got = base_state_dict(model, model.state_dict())
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_lora_classifier_from_whole_model_queries_from_the_cli(capsys, tmp_path):
    """A LoRA sequence classifier (``task_type="SEQ_CLS"``: the ``score`` head trained as a
    ``modules_to_save`` copy, so the base's own head stays untrained): ``gather_model`` saves
    adapter + base, and ``kfac-stream query --file`` on the directory prints the in-process
    posterior's class probabilities (the base's head is loaded, the adapter's trained copy
    replaces it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from harness import run
    from models import text_examples

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = LlamaForSequenceClassification(LlamaConfig(
            vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_labels=3, pad_token_id=0))
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                task_type="SEQ_CLS"))
    examples = text_examples(8, 12)
    for i, e in enumerate(examples):
        e["labels"] = torch.tensor(i % 3)
    _, _, trainer = run(model, examples, {"preset": "lora"}, batch=2, lr=5e-2,
                        tmp_path=tmp_path, record=False)
    assert gather_model(trainer, str(tmp_path / "model")) is model
    model.eval()
    snap = Snapshot.latest(tmp_path / "kfac")
    lines = ["def f(x):", "return x + 1", "import os"]
    (tmp_path / "inputs.txt").write_text("\n".join(lines) + "\n")
    capsys.readouterr()  # the training's output
    assert cli_main(["query", "--snapshot", str(tmp_path / "kfac"), "--model",
                     str(tmp_path / "model"), "--byte-level", "--file",
                     str(tmp_path / "inputs.txt"), "--prior-precision", str(TAU),
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ids = [list(t.encode()) for t in lines]
    T = max(map(len, ids))
    batch = {"input_ids": torch.tensor([x + [0] * (T - len(x)) for x in ids]),
             "attention_mask": torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids])}
    post = LaplacePosterior(model, snap, prior_precision=TAU)
    probs = post.predictive_probs(batch)
    with torch.no_grad():
        map_probs = torch.softmax(model(**batch).logits.double(), -1)
    assert doc["task"] == "sequence_classification" and len(doc["inputs"]) == 3
    for b, rec in enumerate(doc["inputs"]):
        assert rec["probs"] == pytest.approx(probs[b].tolist(), abs=TOL)
        assert rec["map_probs"] == pytest.approx(map_probs[b].tolist(), abs=TOL)
    # the trained head is the adapter's copy: the base's own head gives other logits
    with torch.no_grad(), model.disable_adapter():
        plain = torch.softmax(model(**batch).logits.double(), -1)
    assert (plain - map_probs).abs().max() > 1e-3
