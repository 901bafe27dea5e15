"""A model trained with the tracker is the model trained without it, bit for bit.

Every pair trains the same model from the same seed on the same data with the same
`TrainingArguments`, once without and once with a `KFACStreamCallback`, with dropout ON
(dropout masks and the Trainer's epoch shuffles come from the global generators the tracker
must leave alone), for several epochs (the sampler draws each epoch's order from the global
generator), and compares every weight with ``torch.equal``.

The matrix covers each way the tracker draws or runs a forward of its own: the MC Fisher as a
share of sequences on a run long enough to keep it (``min_window_sequences=0``, what a long
run keeps; the replay's forward runs dropout), the share raised to every sequence (a short
run), an integer count on padded batches (``DataCollatorWithPadding``), ``"all"`` under
gradient checkpointing (replayed after the step), the empirical Fisher with
``token_fraction``, ``include``, EK-FAC, gradient accumulation, an eval set (evaluations
during training and the held-out fit at the end).

`test_a_consumed_draw_is_seen` is the control: a callback that draws one number from the
global generator at every step end changes the weights, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from kfac_stream import KFACConfig, KFACStreamCallback

from models import ListDataset, real_text, save_bpe_tokenizer, text_examples, tiny_gpt2

STEPS = 24  # 6 epochs of 16 sequences at batch 4: 6 shuffles from the global generator
LONG_RUN = dict(min_window_sequences=0, snapshot_every=10_000)  # the share a long run keeps


def _lm(gc: bool = False):
    model = tiny_gpt2(torch.float32, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    if gc:
        model.config.use_cache = False
    return model


def _lm_data(padded: bool | str) -> list[dict]:
    """16 byte-level windows: 12 tokens each (``padded`` False), or 14, 9, 12 and 5 tokens
    padded to 14 on the right (True: attention_mask 0, labels -100 on the pads) or on the left
    (``"left"``: the same rows rolled so the pads come first)."""
    if not padded:
        return text_examples(16, 12)
    ex = text_examples(16, 14, lengths=[14, 9, 12, 5] * 4)
    if padded == "left":
        ex = [{k: v.roll(14 - int(e["attention_mask"].sum())) for k, v in e.items()} for e in ex]
    return ex


@pytest.fixture(scope="module")
def classifier_data(tmp_path_factory):
    """(tokenizer, train, eval): byte-level BPE texts of 5-40 tokens cut by the tokenizer at
    24 (special tokens kept), labels from a seeded draw; unpadded (the collator pads)."""
    text = real_text().decode("utf-8", "replace")
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 20][:400]
    tok = save_bpe_tokenizer(tmp_path_factory.mktemp("tok"), lines)
    tok.pad_token = tok.eos_token
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 3, (24,), generator=gen).tolist()

    def record(i: int) -> dict:
        enc = tok(" ".join(lines[7 * i: 7 * i + 1 + i % 4]), truncation=True, max_length=24)
        return {**enc, "labels": labels[i]}

    return tok, [record(i) for i in range(16)], [record(i) for i in range(16, 24)]


def _classifier():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(
            vocab_size=400, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=32, num_labels=3, pad_token_id=0,
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    return model.train()


def _train(model, train, tmp_path, cfg: dict | None, *, callbacks=(), accum=1, gc=False,
           eval_data=None, collator=None) -> dict[str, torch.Tensor]:
    """Train ``model`` for `STEPS` optimizer steps (batch 4 // ``accum`` × ``accum``), with a
    `KFACStreamCallback` of ``cfg`` (None: without one); returns ``{name: weight}``."""
    cbs = list(callbacks)
    if cfg is not None:
        cbs.append(KFACStreamCallback(KFACConfig(**cfg), report_spectra=False))
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4 // accum, gradient_accumulation_steps=accum,
        max_steps=STEPS, learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0,
        report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0,
        use_cpu=True, gradient_checkpointing=gc,
        gradient_checkpointing_kwargs={"use_reentrant": False} if gc else None,
        eval_strategy="steps" if eval_data else "no", eval_steps=10,
        per_device_eval_batch_size=4)
    Trainer(model=model, args=args, train_dataset=ListDataset(train),
            eval_dataset=ListDataset(eval_data) if eval_data else None,
            data_collator=collator, callbacks=cbs).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(plain: dict, tracked: dict) -> None:
    assert plain.keys() == tracked.keys()
    apart = {n: float((tracked[n] - plain[n]).norm() / plain[n].norm().clamp_min(1e-30))
             for n in plain if not torch.equal(plain[n], tracked[n])}
    assert not apart, f"{len(apart)} weights differ, largest relative: {max(apart.values()):.3g}"


LM_CASES = {  # name: (KFACConfig kwargs, padded data, accumulation, gradient checkpointing)
    "mc-share-long-run": (dict(LONG_RUN), False, 1, False),
    "mc-share-raised-short-run": (dict(snapshot_every=10_000), False, 1, False),
    "mc-int-padded": (dict(LONG_RUN, mc_sequences=2), True, 1, False),
    "mc-int-left-padded": (dict(LONG_RUN, mc_sequences=1), "left", 1, False),
    "mc-share-padded-accumulation": (dict(LONG_RUN, mc_sequences=0.3), True, 2, False),
    "mc-all-checkpointing-replay": (dict(LONG_RUN, mc_sequences="all"), False, 1, True),
    "mc-share-checkpointing": (dict(LONG_RUN), True, 1, True),
    "empirical-token-fraction": (dict(LONG_RUN, fisher="empirical", token_fraction=0.3),
                                 True, 1, False),
    "include-ekfac-share": (dict(LONG_RUN, include=[r"mlp\."], ekfac=True, snapshot_every=8,
                                 mc_sequences=0.5), False, 1, False),
    # no longer than snapshot_every: EK-FAC's extra snapshot midway (waited for)
    "ekfac-short-run": (dict(LONG_RUN, include=[r"mlp\."], ekfac=True), False, 1, False),
}


@pytest.fixture(scope="module")
def lm_plain(tmp_path_factory):
    """Weights of the plain runs, one per (padding, accumulation, checkpointing)."""
    cache: dict[tuple, dict] = {}

    def get(padded: bool | str, accum: int, gc: bool) -> dict:
        key = (padded, accum, gc)
        if key not in cache:
            cache[key] = _train(_lm(gc), _lm_data(padded), tmp_path_factory.mktemp("plain"),
                                None, accum=accum, gc=gc)
        return cache[key]

    return get


@pytest.mark.parametrize("case", list(LM_CASES))
def test_language_model_weights_are_untouched(case, lm_plain, tmp_path):
    cfg, padded, accum, gc = LM_CASES[case]
    tracked = _train(_lm(gc), _lm_data(padded), tmp_path, cfg, accum=accum, gc=gc)
    _assert_same(lm_plain(padded, accum, gc), tracked)


CLASSIFIER_CASES = {  # the classification walkthrough's config, MC share and empirical
    "walkthrough-mc-int": dict(include=[r"encoder\.layer\.", r"pooler\.dense$", r"^classifier$"],
                               token_fraction=0.25, update_every=2, mc_sequences=3,
                               snapshot_every=10_000, min_window_sequences=0),
    "mc-share-long-run": dict(LONG_RUN, mc_sequences=0.25),
    "empirical": dict(LONG_RUN, fisher="empirical"),
}


@pytest.fixture(scope="module")
def classifier_plain(classifier_data, tmp_path_factory):
    tok, train, ev = classifier_data
    return _train(_classifier(), train, tmp_path_factory.mktemp("plain"), None, eval_data=ev,
                  collator=DataCollatorWithPadding(tok))


@pytest.mark.parametrize("case", list(CLASSIFIER_CASES))
def test_padded_classifier_with_eval_set_is_untouched(case, classifier_data, classifier_plain,
                                                      tmp_path):
    tok, train, ev = classifier_data
    tracked = _train(_classifier(), train, tmp_path, CLASSIFIER_CASES[case], eval_data=ev,
                     collator=DataCollatorWithPadding(tok))
    _assert_same(classifier_plain, tracked)


class _Draw(TrainerCallback):
    """Draws one number from torch's global generator at every step end."""

    def on_step_end(self, args, state, control, **kwargs):
        torch.rand(1)


def test_a_consumed_draw_is_seen(lm_plain, tmp_path):
    """The control: one global draw per step (what an unguarded replay's dropout does) moves
    the weights, so the comparisons above can fail."""
    moved = _train(_lm(), _lm_data(False), tmp_path, None, callbacks=[_Draw()])
    with pytest.raises(AssertionError, match="weights differ"):
        _assert_same(lm_plain(False, 1, False), moved)


def test_tracker_generators_are_restored_around_its_events():
    """`kept_generators` restores torch's, Python's and NumPy's global states whatever ran
    inside; `own_draws` runs the block on the given seed (the same draws twice)."""
    import random

    import numpy as np

    from kfac_stream.utils.own_rng import kept_generators, own_draws

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    with kept_generators(["cpu", None]):
        torch.rand(7), random.random(), np.random.rand(2)
    assert torch.equal(torch.rand(3), expect[0])
    assert random.random() == expect[1] and np.random.rand() == expect[2]
    with own_draws(11):
        a = torch.rand(4)
    with own_draws(11):
        b = torch.rand(4)
    assert torch.equal(a, b) and not torch.equal(a, torch.rand(4))
