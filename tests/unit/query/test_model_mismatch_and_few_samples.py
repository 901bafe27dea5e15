"""A model that does not match its snapshot, too long inputs, few samples and an empty eval
set, each at its exact behaviour:

- a model with layers the run's selection picks but the snapshot lacks: named (first few and
  their count) in a warning when the tracked weights are the snapshot's (layers left out of
  the run, here frozen in training), refused when they are not (another, deeper network:
  the snapshot's curvature is not its); a model lacking several of the snapshot's layers: the
  refusal counts and names them;
- an input longer than the model's positions: the Python queries raise `QueryInputError` with
  the CLI's words, before the model's forward (which would raise "size 122 vs 64");
- the few-samples warning once per snapshot per process (also for a snapshot without a run id),
  never from influence (the CLI's, `trajectory_posteriors`, `influence_scores`); the raised MC
  share's line says why in words;
- an empty eval set: the train-begin line says it is empty, and the fit's own error too.

One short training run (module fixture, ~2 s): a 2-layer byte-level GPT-2 with block 1's MLP
frozen, 4 steps, a final window of 8 sequences (fewer than min_window_sequences=256: a snapshot
resting on few samples).
"""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from torch import nn

from kfac_stream import (
    HeldoutConfig,
    KFACConfig,
    LaplacePosterior,
    QueryInputError,
    Snapshot,
    SnapshotMismatchError,
    influence_scores,
)
from kfac_stream.cli import main as cli_main
from kfac_stream.query.heldout_tau import fit_prior_precision
from kfac_stream.query.topk import topk_predictive
from kfac_stream.query.trajectory import trajectory_posteriors
from kfac_stream.snapshot import adequacy
from kfac_stream.tracking.lines import raised_share_line
from kfac_stream.tracking.plan import RunPlan, RunShape

from harness import run
from models import ListDataset, text_examples, tiny_gpt2

FROZEN = ("transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj")
FEW = "rests on few samples"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(dir, model, snapshot)``: the run of the module docstring, the model saved (all
    weights trainable again once loaded) in ``dir/model``, its snapshot in ``dir/kfac``."""
    tmp = tmp_path_factory.mktemp("frictions57")
    model = tiny_gpt2(torch.float32)
    for name in FROZEN:
        model.get_submodule(name).requires_grad_(False)
    run(model, text_examples(8, 12), {"final_window": 0.5, "ema_decay": 0.95,
                                      "min_window_sequences": 256, "storage_dtype": "float32"},
        batch=2, steps=4, tmp_path=tmp, record=False)
    model.save_pretrained(tmp / "model")
    model.eval()
    snap = Snapshot.latest(tmp / "kfac")
    assert len(snap.layer_names) == 6 and not set(FROZEN) & set(snap.layer_names)
    assert adequacy.sampling_problems(snap.manifest)  # the few-samples warning applies
    return tmp, model, snap


def _posterior(model, snap, **kw) -> LaplacePosterior:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return LaplacePosterior(model, snap, 1.0, **kw)


# -- 7: layers the snapshot lacks -----------------------------------------------------------------

def test_layers_left_out_of_the_run_are_named_in_a_warning(trained):
    _, model, snap = trained
    unfrozen = copy.deepcopy(model).requires_grad_(True)  # as from_pretrained loads it
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        post = LaplacePosterior(unfrozen, snap, 1.0)
    extra = [str(w.message) for w in said if "does not hold" in str(w.message)]
    assert len(extra) == 1, [str(w.message) for w in said]
    assert (f"LaplacePosterior: the model has 2 layer(s) that the run's layer selection (the "
            f"default: the trainable Linear/Conv1D layers in the blocks) picks but snapshot "
            f"{snap.path} does not hold (6 layers): 'transformer.h.1.mlp.c_fc', "
            "'transformer.h.1.mlp.c_proj'. The posterior is over the snapshot's layers only"
            ) in extra[0]
    assert "the tracked layers' weights are those the snapshot was taken at" in extra[0]
    assert post.layer_names == snap.layer_names
    # no other weights warning: the tracked weights are the snapshot's
    assert not [w for w in said if "are not those snapshot" in str(w.message)]
    # the frozen model as trained: the selection skips its frozen layers, nothing to say
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        LaplacePosterior(model, snap, 1.0)
    assert not [w for w in said if "does not hold" in str(w.message)]


def test_a_deeper_model_is_refused_naming_its_extra_layers(trained):
    _, _, snap = trained
    deeper = tiny_gpt2(torch.float32, n_layer=3).eval()  # untrained: other weights
    with pytest.raises(SnapshotMismatchError) as e:
        LaplacePosterior(deeper, snap, 1.0)
    msg = str(e.value)
    assert msg.startswith("LaplacePosterior: the model has 6 layer(s) that the run's layer "
                          "selection"), msg
    assert ("does not hold (6 layers): 'transformer.h.1.mlp.c_fc', "
            "'transformer.h.1.mlp.c_proj', 'transformer.h.2.attn.c_attn' and 3 more; and its "
            "tracked weights are not those the snapshot was taken at (6 of 6 layers differ"
            ) in msg
    assert "every query would be wrong" in msg


def test_a_model_lacking_snapshot_layers_is_refused_with_their_count(trained):
    _, model, snap = trained
    lacking = copy.deepcopy(model)
    lacking.transformer.h[0].mlp = nn.Identity()
    with pytest.raises(SnapshotMismatchError) as e:
        LaplacePosterior(lacking, snap, 1.0)
    assert str(e.value).endswith(
        "(2 of the 6 layers asked for are not modules of the model: "
        "'transformer.h.0.mlp.c_fc', 'transformer.h.0.mlp.c_proj')"), str(e.value)


# -- 8: inputs longer than the model's positions ----------------------------------------------

#: The words the CLI and the Python queries share for a 122-token input to a 64-position model.
TOO_LONG = "is 122 tokens long: must be at most 64 tokens (the model's positions)"


def test_too_long_inputs_raise_the_clis_message_in_python(trained, capsys):
    tmp, model, snap = trained
    post = _posterior(model, snap)
    long = {"input_ids": torch.randint(1, 256, (2, 122), generator=torch.Generator()
                                       .manual_seed(0))}
    labelled = {**long, "labels": long["input_ids"].clone()}
    calls = {
        "LaplacePosterior.predictive_probs": lambda: post.predictive_probs(long, token_ids=[1, 2]),
        "LaplacePosterior.predictive": lambda: post.predictive(long, token_ids=[1, 2]),
        "LaplacePosterior.jacobian_features": lambda: post.jacobian_features(long,
                                                                             token_ids=[1, 2]),
        "influence_scores": lambda: influence_scores(post, labelled, [labelled]),
    }
    for where, call in calls.items():
        with pytest.raises(QueryInputError) as e:
            call()
        assert str(e.value) == (f"{where}: batch['input_ids'] {TOO_LONG}; cut it as training "
                                "did, e.g. tokenizer(texts, truncation=True, max_length=64)")
    with pytest.raises(QueryInputError) as e:
        topk_predictive(post, long["input_ids"][0], k=2, n_samples=2)
    assert str(e.value).startswith(f"topk_predictive: input_ids {TOO_LONG}; cut it"), e.value
    # the longest allowed input runs (the check is not off by one)
    probs = post.predictive_probs({"input_ids": long["input_ids"][:, :64]}, token_ids=[1, 2])
    assert probs.shape == (2, 2)
    # the CLI says the same of its --text
    capsys.readouterr()
    code = cli_main(["query", "--snapshot", str(tmp / "kfac"), "--model", str(tmp / "model"),
                     "--byte-level", "--prior-precision", "1", "--text", "a" * 122])
    err = capsys.readouterr().err
    assert code == 2 and f"--text {TOO_LONG}" in err.strip().splitlines()[-1], err


# -- 9: the few-samples warning ----------------------------------------------------------------

def _few(said) -> list[str]:
    return [str(w.message) for w in said if FEW in str(w.message)]


def test_few_samples_said_once_per_snapshot_also_without_a_run_id(trained):
    _, model, snap = trained
    adequacy._SAID.clear()  # as in a fresh process
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        LaplacePosterior(model, snap, 1.0)
        LaplacePosterior(model, snap, 1.0)
    assert len(_few(said)) == 1, _few(said)
    # a manifest without a run id (written without one): once per snapshot path, not each time
    adequacy._SAID.clear()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            again = Snapshot.load(snap.path)
            again.manifest.run_id = None
            LaplacePosterior(model, again, 1.0)
    assert len(_few(said)) == 1, _few(said)


def test_influence_does_not_warn_of_few_samples(trained, tmp_path, capsys):
    tmp, model, snap = trained
    adequacy._SAID.clear()
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"text": t}) for t in ("def f(x):", "x = 2")))
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert cli_main(["influence", "--snapshot", str(tmp / "kfac"), "--model",
                         str(tmp / "model"), "--byte-level", "--train", str(train), "--query",
                         "def f", "--completion", "(x):", "--json"]) == 0
        posts = list(trajectory_posteriors([(4, str(tmp / "model"), snap.path)],
                                           lambda _: model, prior_precision=1.0))
        batch = {"input_ids": torch.tensor([list(b"def f(x):")])}
        batch["labels"] = batch["input_ids"].clone()
        influence_scores(posts[0], batch, [batch])
    assert not _few(said) and FEW not in capsys.readouterr().err
    # nothing was marked said: the first posterior built for a predictive still says it
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        LaplacePosterior(model, snap, 1.0)
    assert len(_few(said)) == 1


def test_the_raised_mc_share_says_why():
    """132 steps at update_every=5 (27 updates, 8 sequences a step): at the default share 0.05
    about 0.05·27·8 = 10.8 sequences, fewer than 256, so every sequence of an update step; the
    line says so in words."""
    plan = RunPlan.resolve(KFACConfig(update_every=5), shape=RunShape(8, 1, 1, 132))
    assert (plan.mc_share_raised, plan.config.mc_sequences) == (0.05, 1.0)
    line = raised_share_line(plan)
    assert line.startswith(
        "kfac_stream: mc_sequences 0.05 -> 1 for this run (every sequence of each update step), "
        "so that the final snapshot's posterior rests on enough samples: its 132 steps at "
        "update_every=5 make 27 factor updates, which at mc_sequences=0.05 would replay about "
        "10.8 sequences in all, fewer than the 256 its final window is to hold "
        "(min_window_sequences; factors from fewer are noisy"), line
    assert line.endswith("set min_window_sequences=0 to keep 0.05 here too")
    # a share raised below 1: how many of each update step's sequences
    plan = RunPlan.resolve(KFACConfig(update_every=5), shape=RunShape(16, 2, 1, 400))
    assert "mc_sequences 0.05 -> 0.125 for this run (4 of the 32 sequences of each update step)" \
        in raised_share_line(plan)


# -- 10: an empty eval set ---------------------------------------------------------------------

@pytest.mark.parametrize("mode,level", [("auto", logging.INFO), (True, logging.WARNING)])
def test_an_empty_eval_set_is_named(tmp_path, caplog, mode, level):
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

    from kfac_stream import KFACStreamCallback

    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, num_labels=3,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(1, 64, (8, 10), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": i, "labels": torch.tensor(int(i[0]) % 3)} for i in ids]
    cb = KFACStreamCallback(KFACConfig(output_dir=str(tmp_path / "kfac")),
                            heldout=HeldoutConfig(prior_precision=mode))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0)
    with caplog.at_level(logging.INFO, logger="kfac_stream"):
        Trainer(model=model, args=args, train_dataset=ListDataset(data),
                eval_dataset=ListDataset([]), callbacks=[cb]).train()
    said = [r for r in caplog.records if "eval_dataset is empty" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == level, [r.getMessage() for r in caplog.records]
    assert said[0].getMessage().startswith(
        "kfac_stream: the eval_dataset is empty (0 examples): no tau is fitted on held-out data")
    assert not [r for r in caplog.records if "held-out fit:" in r.getMessage()]  # not tried
    snap = Snapshot.load(cb.snapshots[-1])
    assert snap.heldout_prior is None
    if mode is True:  # the fit itself, given no batch, says so too
        with pytest.raises(QueryInputError, match="no held-out examples: the eval set is empty"):
            fit_prior_precision(_posterior(model.eval(), snap), [])
