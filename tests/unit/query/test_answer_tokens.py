"""Answer tokens as a setting, and one convention for where an answer is read.

* ``HeldoutConfig(answer_tokens=...)``: resolved at train begin (strings through the Trainer's
  tokenizer, one token each), recorded in every snapshot, the default ``token_ids`` of the
  queries; every misconfiguration fails at train begin in one line, before the first step.
* ``HeldoutConfig.prior_precision`` with answer tokens stores the ``τ`` of a brute-force grid
  search on the eval set's answer positions.
* The answer position: a batch with ``labels [B, T]`` is answered at each row's first labelled
  position (as training scores it) by `predictive`, `predictive_probs`, `answer_distribution`
  and `fit_prior_precision` alike; positions with labels are refused.
* ``token_ids`` of shape ``[B, 1]`` as nested lists (a tokenizer's ``input_ids`` of one-token
  answers) is refused with both readings named; as a tensor it is one id per example.
"""

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from kfac_stream import (
    HeldoutConfig,
    KFACConfig,
    KFACConfigError,
    KFACStreamCallback,
    LaplacePosterior,
    QueryInputError,
    Snapshot,
    answer_distribution,
    fit_prior_precision,
)

from harness import brute_heldout_choice
from models import ListDataset, real_text, tiny_gpt2

ANSWERS = [65, 66, 67, 68]  # the bytes "A" .. "D" of the byte-level model
PAD_TO = 14


def _questions(n: int, seed: int) -> list[dict]:
    """``n`` answer-token examples of real text: a byte window of 6..12 tokens whose answer
    (one of `ANSWERS`, decided by its first byte) follows it; labels -100 except at the
    answer; right-padded to `PAD_TO`."""
    text = real_text()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        n_prompt = int(torch.randint(6, 13, (1,), generator=g))
        off = int(torch.randint(0, len(text) - n_prompt, (1,), generator=g))
        prompt = torch.tensor(list(text[off:off + n_prompt]))
        answer = ANSWERS[int(prompt[0]) % 4]
        ids = torch.zeros(PAD_TO, dtype=torch.long)
        ids[:n_prompt], ids[n_prompt] = prompt, answer
        mask = (torch.arange(PAD_TO) <= n_prompt).long()
        labels = torch.full((PAD_TO,), -100)
        labels[n_prompt] = answer
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _stack(examples: list[dict]) -> dict:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def _trainer(tmp_path, model, cfg: KFACConfig, train, held=None, steps=6, tokenizer=None,
             heldout: HeldoutConfig | None = None):
    cb = KFACStreamCallback(cfg, heldout=heldout)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4,
                             per_device_eval_batch_size=5, max_steps=steps, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(train),
                      eval_dataset=None if held is None else ListDataset(held), callbacks=[cb],
                      processing_class=tokenizer)
    return trainer, cb


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    """A byte-level GPT-2 fine-tuned on answer-token questions with ``answer_tokens`` and
    ``prior_precision=True`` (`HeldoutConfig`): ``(model, snapshot, held-out examples)``."""
    tmp = tmp_path_factory.mktemp("answered")
    model = tiny_gpt2()
    train, held = _questions(24, seed=0), _questions(10, seed=1)
    trainer, cb = _trainer(tmp, model, KFACConfig(
        output_dir=str(tmp / "kfac"), update_every=1, token_fraction=1.0, fisher="empirical"),
        train, held, heldout=HeldoutConfig(answer_tokens=ANSWERS, prior_precision=True))
    trainer.train()
    model.eval()
    return model, Snapshot.load(cb.snapshots[-1]), held


def _prompt_batch(examples: list[dict]) -> tuple[dict, list[int]]:
    """The prompts alone (no labels, the answer token masked out) and each one's last prompt
    position (where the logit predicting the answer is)."""
    batch = _stack(examples)
    answer_at = (batch["labels"] != -100).int().argmax(1)  # [B]
    mask = (torch.arange(PAD_TO)[None] < answer_at[:, None]).long()
    return {"input_ids": batch["input_ids"] * mask, "attention_mask": mask}, (
        answer_at - 1).tolist()


def test_the_snapshot_records_the_answer_tokens_and_queries_default_to_them(answered):
    model, snap, held = answered
    assert snap.answer_tokens == tuple(ANSWERS)
    assert snap.manifest.answer_tokens.ids == ANSWERS
    post = LaplacePosterior(model, snap, prior_precision=3.0)
    prompts, last = _prompt_batch(held)
    m0, c0 = post.predictive(prompts, positions=last, token_ids=ANSWERS)
    m1, c1 = post.predictive(prompts, positions=last)  # token_ids: the snapshot's
    assert torch.equal(m0, m1) and torch.equal(c0, c1)
    assert m0.shape == (10, 4)


def test_labels_decide_where_every_query_reads_the_answer(answered):
    """The training rows (prompt + answer, labels at the answer) give the same figures as
    the prompts with explicit positions: predictive, predictive_probs, answer_distribution."""
    model, snap, held = answered
    post = LaplacePosterior(model, snap, prior_precision=3.0)
    rows = _stack(held)
    prompts, last = _prompt_batch(held)
    assert len(set(last)) > 1  # the rows' answers sit at different positions
    m_rows, c_rows = post.predictive(rows)
    m_ref, c_ref = post.predictive(prompts, positions=last, token_ids=ANSWERS)
    # the same forward up to the answer position (causal attention): equal to roundoff
    assert torch.allclose(m_rows, m_ref, rtol=0, atol=1e-12)
    assert torch.allclose(c_rows, c_ref, rtol=1e-9, atol=1e-14)
    # the old silent read: position -1 of the training rows is the answer token itself
    m_wrong, _ = post.predictive({k: rows[k] for k in ("input_ids", "attention_mask")},
                                 positions=-1, token_ids=ANSWERS)
    assert (m_wrong - m_ref).abs().max() > 1e-3
    p_rows = post.predictive_probs(rows)
    assert torch.allclose(p_rows, post.predictive_probs(prompts, last, ANSWERS), atol=1e-12)
    d_rows = answer_distribution(post, rows, n_samples=4, seed=3)
    d_ref = answer_distribution(post, prompts, ANSWERS, n_samples=4, seed=3, positions=last)
    assert torch.equal(d_rows.sample_answers, d_ref.sample_answers)
    assert torch.allclose(d_rows.probs, d_ref.probs, atol=1e-12)


def test_positions_given_with_labels_are_refused(answered):
    model, snap, held = answered
    post = LaplacePosterior(model, snap, prior_precision=3.0)
    rows = _stack(held[:2])
    for call in (lambda: post.predictive(rows, positions=-1),
                 lambda: post.predictive_probs(rows, -1),
                 lambda: answer_distribution(post, rows, positions=-1, n_samples=2)):
        with pytest.raises(QueryInputError, match=r"positions=-1 is given with the batch's "
                                                  r"labels: must be None when the batch holds "
                                                  r"labels \[B, T\]") as e:
            call()
        assert "\n" not in str(e.value)
    bad = dict(rows, labels=torch.full_like(rows["labels"], -100))
    with pytest.raises(QueryInputError, match=r"has none in row 0"):
        post.predictive(bad)


def test_prior_precision_equals_a_grid_search_on_the_answer_positions(answered):
    """The stored tau is the candidate with the lowest held-out NLL, recomputed here by brute
    force: the prompts, each at its own last position, every candidate tau and link."""
    model, snap, held = answered
    prior = snap.heldout_prior
    assert prior is not None and prior.examples == 10
    post = LaplacePosterior(model, snap)
    prompts, last = _prompt_batch(held)
    y = torch.tensor([ANSWERS.index(int(e["labels"][e["labels"] != -100])) for e in held])
    (tau, link), brute, kept = brute_heldout_choice(
        post, prior.grid, lambda: post.predictive(prompts, positions=last, token_ids=ANSWERS),
        y)
    assert (prior.tau, prior.link) == (tau, link) and prior.map_kept == kept
    assert prior.nll == pytest.approx(brute[(tau, link)], rel=1e-9)
    assert len(set(brute.values())) > 1  # the candidates differ: the choice is not trivial
    # and by hand, with the snapshot's answer tokens by default
    again = fit_prior_precision(post, [_stack(held)])
    assert again.tau == prior.tau and again.nll == pytest.approx(prior.nll, rel=1e-12)


def test_one_token_per_example_lists_are_refused_as_ambiguous(answered):
    """``tok([" A", " B", " C", " D"]).input_ids`` = ``[[383], [657], [370], [468]]``
    on a batch of 4 used to be read as one option per example (probabilities all 1)."""
    model, snap, held = answered
    post = LaplacePosterior(model, snap, prior_precision=3.0)
    prompts, last = _prompt_batch(held[:4])
    nested = [[a] for a in ANSWERS]
    both = (r"it reads as K = 1 id per example, or as K = 4 options for every example")
    for call in (lambda: post.predictive_probs(prompts, last, nested),
                 lambda: post.predictive(prompts, last, nested),
                 lambda: answer_distribution(post, prompts, nested, positions=last,
                                             n_samples=2)):
        with pytest.raises(QueryInputError, match=both):
            call()
    # the explicit forms: flat for K options everywhere, a [B, 1] tensor for one id each
    flat = post.predictive_probs(prompts, last, ANSWERS)
    assert flat.shape == (4, 4)
    mean, cov = post.predictive(prompts, last, torch.tensor(nested))
    full_mean, full_cov = post.predictive(prompts, last, ANSWERS)
    assert torch.allclose(mean[:, 0], full_mean.diagonal(), atol=1e-12)
    assert torch.allclose(cov[:, 0, 0], full_cov.diagonal(dim1=1, dim2=2).diagonal(),
                          rtol=1e-9)
    with pytest.raises(QueryInputError, match=r"gives one option per example \(its "
                                              r"probability is 1\): " + both):
        post.predictive_probs(prompts, last, torch.tensor(nested))


# -- misconfiguration fails at train begin, in one line --------------------------------------


def _word_tokenizer():
    """A real (tokenizers) word-level tokenizer whose words "A" .. "D" are the byte ids of the
    byte-level model (65 .. 68), split on whitespace: " A" and "A" are the same one token,
    "A B" two tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, **{c: ord(c) for c in "ABCD"}},
                                       unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]")


class _Steps(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_begin(self, *args, **kwargs):
        self.steps += 1


def test_strings_are_tokenised_once_with_the_trainers_tokenizer(tmp_path):
    options = [" A", " B", " C", " D"]
    trainer, cb = _trainer(tmp_path, tiny_gpt2(), KFACConfig(
        output_dir=str(tmp_path / "kfac")), _questions(8, 0), steps=2,
        tokenizer=_word_tokenizer(), heldout=HeldoutConfig(answer_tokens=options))
    trainer.train()
    snap = Snapshot.load(cb.snapshots[-1])
    assert snap.answer_tokens == tuple(ANSWERS)
    assert snap.answer_texts == tuple(options)


CASES = {
    "no_tokenizer": ([" A", " B"], r"the option ' A' is a string, but the Trainer has no "
                                   r"tokenizer"),
    "two_tokens": ([" A", "B C"], r"'B C' is 2 tokens \[66, 67\] with the Trainer's "
                                  r"tokenizer: each answer must be exactly one token"),
    "same_token": ([" A", "A"], r"' A' and 'A' are the same token \(65\)"),
    "out_of_vocab": ([65, 300], r"token id 300 is outside the model's 256 vocabulary"),
    "classifier": ([65, 66], r"needs a language-model head .*GPT2ForSequenceClassification "
                             r"has none"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_misconfigured_answer_tokens_fail_at_train_begin(tmp_path, case):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    answers, match = CASES[case]
    data, model = _questions(8, 0), tiny_gpt2()
    if case == "classifier":
        model = GPT2ForSequenceClassification(GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=4,
            pad_token_id=0))
        data = [dict(e, labels=torch.tensor(i % 4)) for i, e in enumerate(data)]
    held = None
    tok = _word_tokenizer() if case in ("two_tokens", "same_token") else None
    trainer, _ = _trainer(tmp_path, model, KFACConfig(output_dir=str(tmp_path / "kfac")), data,
                          held, tokenizer=tok, heldout=HeldoutConfig(
                              answer_tokens=answers, prior_precision=held is not None))
    steps = _Steps()
    trainer.add_callback(steps)
    with pytest.raises(KFACConfigError, match=match) as e:
        trainer.train()
    assert "\n" not in str(e.value) and steps.steps == 0  # before the first step


def test_answer_tokens_checked_in_the_config():
    for bad in ([65], [65, 65], [" A", ""], [True, 2], "AB"):
        with pytest.raises(KFACConfigError,
                           match=r"HeldoutConfig.answer_tokens=.* is not allowed"):
            HeldoutConfig(answer_tokens=bad)
    assert HeldoutConfig(answer_tokens=[" A", 66]).answer_tokens == [" A", 66]
