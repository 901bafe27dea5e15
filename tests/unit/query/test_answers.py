"""Answers under the posterior: `answer_distribution` against a brute-force loop over
``sampled_weights`` (plain forwards, argmax, counts by `collections.Counter`), for a
classification head and a language-model head with shared and per-example options, right- and
left-padded batches; a posterior concentrated on the MAP; `generated_answers` against a loop of
``model.generate`` under each sample; the argument checks."""

from collections import Counter

import pytest
import torch

import kfac_stream
from kfac_stream import (
    AnswerDistribution,
    QueryInputError,
    answer_distribution,
    generated_answers,
)
from kfac_stream.query import answers as answers_mod
from kfac_stream.query.answers import GeneratedAnswers, abstain
from kfac_stream.query.laplace import LaplacePosterior
from kfac_stream.query.sampled import sampled_predictive

from harness import classifier_posterior, lm_posterior
from models import padded_batch
from reference import rel_err

#: float64 model: the batched samples (bmm) against F.linear / addmm on the same weights sum the
#: same numbers in another order (measured ~1e-15 relative); the renormalised option
#: probabilities inherit that.
ROUNDOFF_TOL = 1e-10
#: The brute-force answers are compared EXACTLY (argmax over option logits): that is sound only
#: where the best option logit beats the runner-up by far more than the round-off above; every
#: reference below asserts this margin (in absolute logit units), so a near tie would make the
#: test say so instead of flip an answer.
MARGIN = 1e-8
#: A prior precision so large that the posterior samples are the MAP up to |ΔW| ~ 1e-6.
HUGE_TAU = 1e12
N_DATA, TAU = 50.0, 0.7  # a wide posterior: the samples disagree (the tests mean something)
OPTIONS = [3, 101, 32, 200]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return lm_posterior(tmp_path_factory.mktemp("answers_lm"), TAU, N_DATA)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return classifier_posterior(tmp_path_factory.mktemp("answers_cls"), TAU, N_DATA)


def left_padded(lengths, seed=4):
    """As `padded_batch`, the padding moved to the left of every row."""
    batch = padded_batch(lengths, seed)
    t = batch["input_ids"].shape[1]
    return {k: torch.stack([row.roll(t - n) for row, n in zip(v, lengths)])
            for k, v in batch.items()}


def option_logits(post, batch, options, columns):
    """``[B, K]`` option logits of one plain forward (at ``columns [B]`` for an LM head)."""
    with torch.no_grad():
        logits = post.model(**batch).logits
    rows = logits if logits.dim() == 2 else logits[torch.arange(len(columns)), columns]
    ids = torch.as_tensor(options)
    return rows[:, ids] if ids.dim() == 1 else rows.gather(1, ids)


def brute_force(post, batch, options, columns, n, seed):
    """``(answers [S, B], option logits [S, B, K], MAP answer [B])``: one plain forward inside
    ``sampled_weights(seed + s)`` per sample, argmax over the options."""
    per_sample = []
    for s in range(n):
        with post.sampled_weights(seed=seed + s):
            per_sample.append(option_logits(post, batch, options, columns))
    f = torch.stack(per_sample)
    f_map = option_logits(post, batch, options, columns)
    for x in (f, f_map):
        top2 = x.topk(2, dim=-1).values
        assert float((top2[..., 0] - top2[..., 1]).min()) > MARGIN, "near tie: pick other data"
    return f.argmax(-1), f, f_map.argmax(-1)


def expected_summary(answers, map_answer, k):
    """Counts, majority and agreement by hand: `Counter` per example; of the answers tied at
    the top count the MAP answer if it is one, else the lowest index."""
    n, size = answers.shape
    counts, majority, agreement, ties = [], [], [], 0
    for b in range(size):
        c = Counter(answers[:, b].tolist())
        counts.append([c.get(i, 0) for i in range(k)])
        top = max(c.values())
        tied = sorted(i for i, v in c.items() if v == top)
        ties += len(tied) > 1
        m = int(map_answer[b])
        majority.append(m if m in tied else tied[0])
        agreement.append(top / n)
    return (torch.tensor(counts), torch.tensor(majority), torch.tensor(agreement,
                                                                       dtype=torch.float64),
            ties)


def check_against(got, answers, f, map_answer, n, seed):
    """Every field of `AnswerDistribution` ``got`` against the brute-force reference."""
    k = f.shape[-1]
    counts, majority, agreement, ties = expected_summary(answers, map_answer, k)
    assert isinstance(got, AnswerDistribution)
    assert got.sample_answers.dtype == torch.int64 and torch.equal(got.sample_answers, answers)
    assert got.counts.dtype == torch.int64 and torch.equal(got.counts, counts)
    assert got.frequencies.dtype == torch.float64
    assert torch.equal(got.frequencies, counts.double() / n)
    probs = torch.softmax(f.double(), -1).mean(0)
    assert got.probs.dtype == torch.float64 and got.probs.shape == probs.shape
    assert rel_err(got.probs, probs) <= ROUNDOFF_TOL
    assert torch.equal(got.map_answer, map_answer)
    assert torch.equal(got.majority, majority)
    assert got.agreement.dtype == torch.float64 and torch.equal(got.agreement, agreement)
    assert torch.equal(got.map_agrees, majority == map_answer)
    assert (got.n_samples, got.seed) == (n, seed)
    return ties


def last_tokens(batch):
    return batch["attention_mask"].sum(1) - 1  # right padding


# -- 1. answer_distribution == a brute-force loop over sampled_weights ---------------------------


@pytest.mark.parametrize("kind", ["shared", "per_example"])
def test_lm_answers_equal_a_loop_over_sampled_weights(lm, kind):
    batch = padded_batch([12, 9, 6, 11])  # right-padded; positions=-1: each last token
    options = OPTIONS if kind == "shared" else torch.tensor(
        [[3, 101, 32], [200, 32, 101], [10, 32, 105], [101, 3, 46]])
    n, seed = 9, 5
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    got = answer_distribution(lm, batch, options, n_samples=n, seed=seed, chunk=4,
                              linearized=False)
    answers, f, map_answer = brute_force(lm, batch, options, last_tokens(batch), n, seed)
    ties = check_against(got, answers, f, map_answer, n, seed)
    k = 4 if kind == "shared" else 3
    assert got.options.shape == (4, k) and torch.equal(
        got.options, torch.as_tensor(options).expand(4, -1))
    print(f"{kind}: agreement {got.agreement.tolist()}, {ties} tied majorities")
    assert float(got.agreement.min()) < 1  # the samples disagree: the test means something
    for k, v in lm.model.state_dict().items():  # nothing of the model changed
        assert torch.equal(v, before[k]), k
    assert all("forward" not in m.__dict__ for m in lm.modules.values())


@pytest.mark.parametrize("options", [None, [[3, 1], [0, 2]]], ids=["all_classes", "per_example"])
def test_classifier_answers_equal_a_loop_over_sampled_weights(classifier, options):
    batch = padded_batch([12, 7])
    n, seed = 12, 3
    got = answer_distribution(classifier, batch, options, n_samples=n, seed=seed,
                              linearized=False)
    ids = [list(range(4))] * 2 if options is None else options
    answers, f, map_answer = brute_force(classifier, batch, torch.tensor(ids), None, n, seed)
    ties = check_against(got, answers, f, map_answer, n, seed)
    print(f"classifier {options}: agreement {got.agreement.tolist()}, {ties} tied majorities")
    assert float(got.agreement.min()) < 1


def test_positions_per_example_and_left_padding(lm):
    """Explicit positions (one per example, negative counted back from the last token) on a
    right-padded batch, and ``-1`` on a left-padded one (the last column of every row)."""
    batch = padded_batch([12, 9, 6])
    n, seed = 6, 1
    got = answer_distribution(lm, batch, OPTIONS, n_samples=n, seed=seed,
                              positions=[3, -2, 0], linearized=False)
    answers, f, map_answer = brute_force(lm, batch, OPTIONS, torch.tensor([3, 7, 0]), n, seed)
    check_against(got, answers, f, map_answer, n, seed)

    left = left_padded([12, 9, 6])
    got = answer_distribution(lm, left, OPTIONS, n_samples=n, seed=seed, linearized=False)
    answers, f, map_answer = brute_force(lm, left, OPTIONS, torch.tensor([11, 11, 11]), n, seed)
    check_against(got, answers, f, map_answer, n, seed)


def test_chunking_and_linearized_samples(lm):
    """The chunk size changes nothing; ``linearized=True`` answers are the argmax of the
    linearised sample logits `sampled_predictive` returns."""
    batch = padded_batch([10, 8])
    runs = [answer_distribution(lm, batch, OPTIONS, n_samples=7, seed=2, chunk=c,
                                linearized=False)
            for c in (1, 3, None)]
    for r in runs[1:]:
        assert torch.equal(r.sample_answers, runs[0].sample_answers)
        assert rel_err(r.probs, runs[0].probs) <= ROUNDOFF_TOL
    lin = answer_distribution(lm, batch, OPTIONS, n_samples=7, seed=2, linearized=True)
    ref = sampled_predictive(lm, batch, n_samples=7, seed=2, linearized=True,
                             return_logits=True).sample_logits
    f = ref[:, torch.arange(2), last_tokens(batch)][..., OPTIONS]  # [S, B, K]
    assert lin.linearized and torch.equal(lin.sample_answers, f.argmax(-1))
    assert rel_err(lin.probs, torch.softmax(f, -1).mean(0)) <= ROUNDOFF_TOL


@pytest.mark.parametrize("head", ["lm", "classifier"])
def test_a_concentrated_posterior_agrees_with_the_map(request, head):
    post = request.getfixturevalue(head)
    tight = LaplacePosterior(post.model, post.snapshot, HUGE_TAU, N_DATA)
    batch = padded_batch([12, 9, 6])
    options = OPTIONS if head == "lm" else None
    for linearized in (False, True):
        got = answer_distribution(tight, batch, options, n_samples=8, linearized=linearized)
        assert torch.equal(got.agreement, torch.ones(3, dtype=torch.float64))
        assert torch.equal(got.majority, got.map_answer) and bool(got.map_agrees.all())
        assert torch.equal(got.counts.max(-1).values, torch.full((3,), 8))


def test_majority_ties_go_to_the_map_answer_then_the_lowest_index():
    counts = torch.tensor([[3, 3, 0], [3, 3, 0], [1, 2, 2], [0, 1, 5]])
    map_answer = torch.tensor([1, 2, 0, 0])
    majority, top = answers_mod._majority(counts, map_answer)
    assert majority.tolist() == [1, 0, 1, 2] and top.tolist() == [3, 3, 2, 5]


# -- 2. generated_answers == a loop of model.generate under each sample --------------------------


def generate_loop(post, ids, mask, n, seed, new, eos, **kw):
    """Continuations ``[S][B]`` and the MAP's ``[B]``: ``model.generate`` (greedy) inside
    ``sampled_weights(seed + s)`` per sample, cut by hand before the first ``eos``."""
    def cont(out):
        rows = []
        for row in out[:, ids.shape[1]:].tolist():
            rows.append(tuple(row[:row.index(eos)] if eos in row else row))
        return rows

    def gen():
        return post.model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                   do_sample=False, pad_token_id=0, eos_token_id=eos, **kw)
    per_sample = []
    for s in range(n):
        with post.sampled_weights(seed=seed + s), torch.no_grad():
            per_sample.append(cont(gen()))
    with torch.no_grad():
        return per_sample, cont(gen())


@pytest.mark.parametrize("padding", ["equal", "left"])
def test_generated_answers_equal_a_loop_of_generate(lm, padding):
    """Token-exact: greedy decoding of S samples in one generate call (sample_rows) against a
    generate call per sample. ``eos_token_id=32`` (the byte of a space, frequent in the text)
    makes rows stop early, so the cut at the end token and the padding after it are tested."""
    if padding == "equal":
        batch = padded_batch([7, 7, 7])
    else:
        batch = left_padded([7, 5, 3])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n, seed, new, eos = 8, 4, 6, 32
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    got = generated_answers(lm, ids, n_samples=n, seed=seed, max_new_tokens=new,
                            attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    per_sample, map_rows = generate_loop(lm, ids, mask, n, seed, new, eos)
    assert isinstance(got, GeneratedAnswers)
    assert got.map_answer == tuple(map_rows)
    stopped = 0
    for b in range(ids.shape[0]):
        mine = [per_sample[s][b] for s in range(n)]
        stopped += sum(len(a) < new for a in mine)
        assert got.samples[b] == tuple(mine)
        c = Counter(mine)
        top = max(c.values())
        tied = [a for a in dict.fromkeys(mine) if c[a] == top]  # in order of first appearance
        majority = map_rows[b] if map_rows[b] in tied else tied[0]
        assert got.majority[b] == majority
        assert float(got.agreement[b]) == top / n
        assert bool(got.map_agrees[b]) == (majority == map_rows[b])
        assert dict(got.answers[b]) == dict(c) and got.answers[b][0] == (majority, top)
        assert [v for _, v in got.answers[b]] == sorted(c.values(), reverse=True)
        assert [got.answers[b][i][0] for i in got.sample_answers[:, b].tolist()] == mine
    distinct = [len(a) for a in got.answers]
    print(f"{padding}: distinct answers {distinct}, agreement {got.agreement.tolist()}, "
          f"{stopped} continuations cut at eos")
    assert max(distinct) > 1 and stopped > 0  # the samples differ; the eos cut is exercised
    assert (got.n_samples, got.seed, got.max_new_tokens) == (n, seed, new)
    assert got.agreement.dtype == torch.float64 and got.map_agrees.dtype == torch.bool
    for k, v in lm.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all("forward" not in m.__dict__ for m in lm.modules.values())


def test_generated_answers_of_a_concentrated_posterior_are_the_map(lm):
    tight = LaplacePosterior(lm.model, lm.snapshot, HUGE_TAU, N_DATA)
    ids = padded_batch([6, 6])["input_ids"]
    got = generated_answers(tight, ids, n_samples=4, max_new_tokens=5)
    _, map_rows = generate_loop(lm, ids, None, 0, 0, 5, 0)  # the config's eos is 0
    assert got.map_answer == tuple(map_rows)
    assert got.majority == got.map_answer and bool(got.map_agrees.all())
    assert torch.equal(got.agreement, torch.ones(2, dtype=torch.float64))
    assert all(len(a) == 1 for a in got.answers)


# -- 3. selective answering -------------------------------------------------------------------


def test_abstain_below_an_agreement_threshold():
    agreement = torch.tensor([1.0, 0.5, 0.75, 0.25], dtype=torch.float64)
    assert abstain(agreement, 0.75).tolist() == [False, True, False, True]
    assert not bool(abstain(agreement, 0.0).any()) and abstain(agreement, 1.0).sum() == 3
    with pytest.raises(QueryInputError, match=r"^abstain: threshold=1.5 is not allowed"):
        abstain(agreement, 1.5)
    with pytest.raises(QueryInputError, match=r"^abstain: agreement=\[1.0\] \(a list\)"):
        abstain([1.0], 0.5)


def test_public_names():
    assert kfac_stream.answer_distribution is answer_distribution
    assert kfac_stream.generated_answers is generated_answers
    assert {"answer_distribution", "generated_answers", "AnswerDistribution"} <= set(
        kfac_stream.__all__)


# -- 4. argument checks ------------------------------------------------------------------------


BAD = [
    ({"post": "posterior"}, r"post='posterior' \(a str\) is not allowed: must be a kfac_stream"),
    ({"batch": {"attention_mask": torch.ones(1, 4)}}, r"batch=.* has neither 'input_ids'"),
    ({"options": None}, r"options=None is not allowed for a language-model head"),
    ({"options": [3]}, r"options=\[3\] has 1 option: must be K >= 2"),
    ({"options": [3, 101, 3]}, r"options=\[3, 101, 3\] repeats an id in example 0"),
    ({"options": [3, 256]}, r"options=\[3, 256\] holds 256, outside the model's 256 vocabulary"),
    ({"options": "AB"}, r"options='AB' \(a str\)"),
    ({"options": torch.tensor([[1, 2], [3, 4]])}, r"options=.* has 2 rows for 1 examples"),
    ({"positions": 6}, r"positions=6 is outside the 6 positions"),
    ({"positions": [0, 1]}, r"positions=\[0, 1\] gives 2 positions for 1 examples"),
    ({"positions": -5}, r"positions=-5 counts back past the start of example 0, which has 4 "),
    ({"n_samples": 1}, r"n_samples=1 is not allowed: must be an int >= 2"),
    ({"seed": 0.5}, r"seed=0.5 \(a float\)"),
    ({"chunk": 0}, r"chunk=0 is not allowed: must be an int >= 1"),
    ({"linearized": 1}, r"linearized=1 \(a int\) is not allowed: must be True or False"),
    ({"show_progress": "yes"}, r"show_progress='yes' \(a str\)"),
]


@pytest.mark.parametrize("bad,match", BAD, ids=[f"{next(iter(b))}-{i}" for i, (b, _) in
                                                 enumerate(BAD)])
def test_answer_distribution_bad_arguments(lm, bad, match):
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}
    kw = {"post": lm, "batch": batch, "options": [3, 101], "n_samples": 2, **bad}
    with pytest.raises(QueryInputError, match=match) as info:
        answer_distribution(**kw)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("answer_distribution: ")


def test_classifier_options_are_class_indices(classifier):
    with pytest.raises(QueryInputError, match=r"^answer_distribution: options=\[0, 4\] holds 4, "
                                              r"outside the head's 4 classes"):
        answer_distribution(classifier, padded_batch([6]), [0, 4])


BAD_GEN = [
    ({"post": None}, r"post=None \(a NoneType\)"),
    ({"input_ids": torch.tensor([1, 2, 3])}, r"input_ids=<tensor \[3\] int64> is not allowed"),
    ({"input_ids": torch.zeros(1, 3)}, r"input_ids=<tensor \[1, 3\] float32>"),
    ({"input_ids": torch.tensor([[1, 256]])}, r"holds 256, outside the model's 256 input"),
    ({"attention_mask": torch.tensor([[1, 1, 0]])},
     r"attention_mask=.* is not left-padded \(row 0 has padding after a token"),
    ({"attention_mask": torch.tensor([[0, 2, 1]])}, r"holds values other than 0 and 1"),
    ({"attention_mask": torch.ones(2, 3)}, r"attention_mask=<tensor \[2, 3\] float32> is not "
                                           r"allowed: must be None or a \[B, T\] = \[1, 3\]"),
    ({"n_samples": 1}, r"n_samples=1 is not allowed: must be an int >= 2"),
    ({"max_new_tokens": 0}, r"max_new_tokens=0 is not allowed: must be an int >= 1"),
    ({"do_sample": True}, r"do_sample=True is not allowed: must be False \(the decoding is "
                          r"greedy"),
    ({"num_beams": 2}, r"num_beams=2 is not allowed: must be 1"),
    ({"num_return_sequences": 3}, r"num_return_sequences=3 is not allowed: must be 1"),
]


@pytest.mark.parametrize("bad,match", BAD_GEN, ids=[f"{next(iter(b))}-{i}" for i, (b, _) in
                                                     enumerate(BAD_GEN)])
def test_generated_answers_bad_arguments(lm, bad, match):
    kw = {"post": lm, "input_ids": torch.tensor([[5, 6, 7]]), "n_samples": 2,
          "max_new_tokens": 2, **bad}
    with pytest.raises(QueryInputError, match=match) as info:
        generated_answers(**kw)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("generated_answers: ")
