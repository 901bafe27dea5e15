"""Bad query inputs fail at the call with one line naming the argument, the value and what is
allowed: `LaplacePosterior` and its methods, `topk_predictive`, `probs_from_gaussian`,
and the ``kfac-stream query`` / ``inspect`` command line (exit code 2, no traceback).

One tiny byte-level GPT-2 is trained once for the module (float32, saved with
``save_pretrained`` for the CLI); every check is cheap, so the file runs in seconds.
"""

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from kfac_stream import (
    KFACStreamError,
    LaplacePosterior,
    PartitionedModelError,
    QueryInputError,
    Snapshot,
)
from kfac_stream.cli import main as cli_main
from kfac_stream.query.calibration import fit_confidence_beta, probs_from_gaussian
from kfac_stream.query.topk import topk_predictive

from harness import run
from models import save_bpe_tokenizer, text_examples, tiny_gpt2

TAU, N_DATA = 0.7, 50.0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(model, snapshot, directory)``: the trained model is also saved in ``dir/model``."""
    tmp = tmp_path_factory.mktemp("query_validation")
    model = tiny_gpt2(torch.float32)
    run(model, text_examples(8, 12), {"storage_dtype": "float32"}, batch=2, tmp_path=tmp,
        record=False)
    model.eval()
    model.save_pretrained(tmp / "model")
    return model, Snapshot.latest(tmp / "kfac"), tmp


@pytest.fixture(scope="module")
def post(trained):
    model, snap, _ = trained
    return LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_DATA)


@pytest.fixture
def forwards(post):
    """How many times the model ran (a list of one count): checks before the forward keep 0."""
    calls = [0]

    def count(module, args, kwargs):
        calls[0] += 1

    handle = post.model.register_forward_pre_hook(count, with_kwargs=True)
    yield calls
    handle.remove()


def batch_of(lengths, seed=3):
    """``{"input_ids", "attention_mask"}`` ``[B, T]``, right-padded to ``max(lengths)``."""
    ex = text_examples(len(lengths), max(lengths), seed=seed, lengths=lengths)
    return {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}


def raises(fn, *needles, cls=QueryInputError) -> str:
    """Call ``fn``; it must raise ``cls`` (a `KFACStreamError`) with a one-line message that
    contains every needle. Returns the message."""
    with pytest.raises(cls) as e:
        fn()
    msg = str(e.value)
    assert isinstance(e.value, KFACStreamError)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def prior_allowed(snap, marglik=True):
    n = len(snap.layer_names)
    return (f"must be a positive finite float, a dict {{layer: positive finite float}} with "
            f"exactly the posterior's {n} layers"
            + (", or one of 'auto', 'heldout', 'marglik'" if marglik else ""))


# -- LaplacePosterior(...) -----------------------------------------------------------------------

@pytest.mark.parametrize("value,shown", [
    ("marlik", "'marlik'"), (-1.0, "-1.0"), (0, "0"), (0.0, "0.0"), (float("nan"), "nan"),
    (float("inf"), "inf"), (-math.inf, "-inf"), ("1.0", "'1.0'"),
])
def test_prior_precision_values(trained, value, shown):
    model, snap, _ = trained
    raises(lambda: LaplacePosterior(model, snap, prior_precision=value),
           f"LaplacePosterior: prior_precision={shown} is not allowed: " + prior_allowed(snap))


@pytest.mark.parametrize("value,shown", [(True, "True (a bool)"), (None, "None (a NoneType)"),
                                          ([1.0], "[1.0] (a list)")])
def test_prior_precision_types(trained, value, shown):
    model, snap, _ = trained
    raises(lambda: LaplacePosterior(model, snap, prior_precision=value),
           f"LaplacePosterior: prior_precision={shown} is not allowed: " + prior_allowed(snap))


def test_prior_precision_dict_must_cover_exactly_the_snapshots_layers(trained):
    model, snap, _ = trained
    names = snap.layer_names
    full = dict.fromkeys(names, TAU)
    missing = {n: TAU for n in names if n != names[1]}
    raises(lambda: LaplacePosterior(model, snap, missing), "LaplacePosterior: prior_precision={",
           f"lacks 1 of the posterior's layers ({names[1]!r}): " + prior_allowed(snap))
    raises(lambda: LaplacePosterior(model, snap, {names[0]: 1.0}),
           f"lacks {len(names) - 1} of the posterior's layers ({names[1]!r}, {names[2]!r}, "
           f"{names[3]!r} and {len(names) - 4} more)")
    extra = dict(full, **{"transformer.h.9.mlp.c_fc": TAU})
    raises(lambda: LaplacePosterior(model, snap, extra),
           "has 1 key(s) that are no layer of the snapshot ('transformer.h.9.mlp.c_fc'): "
           + prior_allowed(snap))
    for bad, shown in [(-2.0, "-2.0"), (0, "0"), (float("nan"), "nan"), ("big", "'big'")]:
        raises(lambda bad=bad: LaplacePosterior(model, snap, dict(full, **{names[2]: bad})),
               f"LaplacePosterior: prior_precision[{names[2]!r}]={shown}",
               "must be a positive finite float")
    assert LaplacePosterior(model, snap, full, N_DATA).prior_precision == full


@pytest.mark.parametrize("value,shown", [
    (0, "0"), (-5, "-5"), (float("nan"), "nan"), (float("inf"), "inf"), ("100", "'100' (a str)"),
    (True, "True (a bool)"), ([100], "[100] (a list)"),
])
def test_num_data(trained, value, shown):
    model, snap, _ = trained
    raises(lambda: LaplacePosterior(model, snap, TAU, num_data=value),
           f"LaplacePosterior: num_data={shown} is not allowed: must be None (N from the "
           "snapshot's counts) or a positive finite number")


def test_num_data_from_unusable_snapshot_counts(trained):
    model, snap, _ = trained
    bad = copy.copy(snap)
    bad.manifest = dataclasses.replace(
        snap.manifest, counts=dataclasses.replace(snap.manifest.counts, tokens_seen=-1000))
    raises(lambda: LaplacePosterior(model, bad, TAU),
           "LaplacePosterior: num_data=None takes N from the snapshot's counts, which give "
           "N=-1000.0 (counts.tokens_seen=-1000", "pass num_data, a positive finite number")


@pytest.mark.parametrize("make,shown", [
    (lambda d: str(d / "kfac"), "(a str)"), (lambda d: d / "kfac", "(a PosixPath)"),
    (lambda d: None, "None (a NoneType)"),
])
def test_snapshot_must_be_a_snapshot(trained, make, shown):
    model, _, tmp = trained
    value = make(tmp)
    msg = raises(lambda: LaplacePosterior(model, value, TAU),
                 f"LaplacePosterior: snapshot={shown if value is None else ''}",
                 shown, "is not allowed: must be a kfac_stream.Snapshot (load one with "
                 "Snapshot.load(path), or Snapshot.latest(dir) for the newest in a directory)")
    if isinstance(value, str):
        assert f"snapshot={value!r} (a str)" in msg


def test_model_must_be_a_module(trained):
    model, snap, tmp = trained
    raises(lambda: LaplacePosterior(str(tmp / "model"), snap, TAU),
           f"LaplacePosterior: model={str(tmp / 'model')!r} (a str) is not allowed: must be a "
           "torch.nn.Module (the trained model)")
    raises(lambda: LaplacePosterior(model.state_dict(), snap, TAU), "model={", "(a OrderedDict)",
           "must be a torch.nn.Module")


def test_zero3_partitioned_weights_fail_at_construction_saying_what_to_do(trained):
    """A model whose parameters DeepSpeed ZeRO-3 manages (``ds_numel`` set) fails at
    construction, also for "marglik": as a placeholder (numel 0, between forwards) and gathered
    whole (right after ``trainer.train()``: the engine partitions them again after the next
    forward, so the first query would pass and a later one fail on a shape error)."""
    model, snap, _ = trained
    name = snap.layer_names[0]
    for gathered in (False, True):
        part = copy.deepcopy(model)
        m = dict(part.named_modules())[name]
        full = m.weight.shape
        if not gathered:
            m.weight = nn.Parameter(torch.empty(0))
        m.weight.ds_numel, m.weight.ds_shape = full.numel(), full
        held = full.numel() if gathered else 0
        for prior in (TAU, "marglik"):
            with pytest.raises(PartitionedModelError) as info:
                LaplacePosterior(part, snap, prior)
            assert isinstance(info.value, QueryInputError)
            assert str(info.value) == (
                "LaplacePosterior: the model's weights are partitioned across ranks by DeepSpeed "
                f"ZeRO-3 ({name + '.weight'!r} holds {held} of its {full.numel()} values in this "
                "process, and the engine gathers them only inside its own forward): query a "
                "whole copy: model = kfac_stream.gather_model(trainer, save_dir) on every rank "
                "(it saves the model and loads it on the main process), or save it with "
                "trainer.save_model(dir) and load it with from_pretrained(dir) in a process "
                "without DeepSpeed")


def test_prior_precision_assignment_is_checked(post):
    raises(lambda: setattr(post, "prior_precision", -1),
           "LaplacePosterior: prior_precision=-1 is not allowed: "
           + prior_allowed(post.snapshot, marglik=False))
    raises(lambda: setattr(post, "prior_precision", "marglik"), "prior_precision='marglik'")
    assert post.prior_precision == TAU


# -- batch, positions, token_ids ----------------------------------------------------------------

BATCH_ALLOWED = ("must be a dict of model inputs with 'input_ids' [B, T] (an integer tensor) or "
                 "'inputs_embeds' [B, T, d], optionally 'attention_mask' [B, T]")


def query_calls(post):
    """Every public query taking ``(batch, positions, token_ids)``, as ``(name, call)``."""
    return [
        ("predictive", lambda b, p, t: post.predictive(b, p, t)),
        ("predictive_probs", lambda b, p, t: post.predictive_probs(b, p, t)),
        ("jacobian_features", lambda b, p, t: post.jacobian_features(b, p, t)),
        ("predictive_covariances",
         lambda b, p, t: post.predictive_covariances(b, p, t, prior_precisions=[TAU])),
        ("fit_beta",
         lambda b, p, t: post.fit_beta([{"batch": b, "positions": p, "token_ids": t,
                                         "labels": [0] * 2}])),
    ]


ARG = {"fit_beta": "heldout[0]['{}']"}


def arg_name(method, arg):
    return ARG.get(method, "{}").format(arg)


def test_batch_must_be_a_dict_with_input_ids(post, forwards):
    ids = batch_of([10, 10])["input_ids"]
    for method, call in query_calls(post):
        where = f"LaplacePosterior.{method}: "
        b = arg_name(method, "batch")
        raises(lambda call=call: call(ids, -1, [1, 2]),
               f"{where}{b}=<tensor [2, 10] int64> (a Tensor) is not allowed: " + BATCH_ALLOWED)
        raises(lambda call=call: call([ids], -1, [1, 2]), f"{where}{b}=[tensor(", "(a list)",
               BATCH_ALLOWED)
        raises(lambda call=call: call({"attention_mask": torch.ones(2, 10)}, -1, [1, 2]),
               f"{where}{b}={{'attention_mask': <tensor [2, 10] float32>}} has neither "
               "'input_ids' nor 'inputs_embeds': " + BATCH_ALLOWED)
        raises(lambda call=call: call({"input_ids": ids.double()}, -1, [1, 2]),
               f"{where}{b}['input_ids']=<tensor [2, 10] float64> is not allowed: must be a "
               "[B, T] integer tensor of token ids with B, T >= 1")
        raises(lambda call=call: call({"input_ids": ids[0]}, -1, [1, 2]),
               f"{where}{b}['input_ids']=<tensor [10] int64> is not allowed")
        raises(lambda call=call: call({"input_ids": ids.tolist()}, -1, [1, 2]),
               f"{where}{b}['input_ids']=[[", "(a list) is not allowed")
        raises(lambda call=call: call({"input_ids": ids, "attention_mask": ids[:, :5]}, -1,
                                      [1, 2]),
               f"{where}{b}['attention_mask']=<tensor [2, 5] int64> is not allowed: must be a "
               "[B, T] = [2, 10] tensor (1: token, 0: padding)")
        raises(lambda call=call: call({"input_ids": ids + 300}, -1, [1, 2]),
               f"{where}{b}['input_ids']=<tensor [2, 10] int64> holds ",
               "outside the model's 256 input embeddings: must be ids in [0, 256)")
    assert forwards[0] == 0  # every check ran before the model


def test_positions(post, forwards):
    batch = batch_of([10, 3])
    for method, call in query_calls(post):
        where, p = f"LaplacePosterior.{method}: ", arg_name(method, "positions")
        allowed = ("must be an int in [-10, 10) for every example, or 2 such ints (one per "
                   "example); negative counts back from the last non-padding token")
        raises(lambda call=call: call(batch, 10, [1, 2]),
               f"{where}{p}=10 is outside the 10 positions: {allowed}")
        raises(lambda call=call: call(batch, -11, [1, 2]),
               f"{where}{p}=-11 is outside the 10 positions")
        raises(lambda call=call: call(batch, [1, 2, 3], [1, 2]),
               f"{where}{p}=[1, 2, 3] gives 3 positions for 2 examples: {allowed}")
        raises(lambda call=call: call(batch, "last", [1, 2]),
               f"{where}{p}='last' (a str) is not allowed: {allowed}")
        raises(lambda call=call: call(batch, 2.5, [1, 2]), f"{where}{p}=2.5 (a float)")
        raises(lambda call=call: call(batch, True, [1, 2]), f"{where}{p}=True (a bool)")
        raises(lambda call=call: call(batch, [0, 1.5], [1, 2]),
               f"{where}{p}=[0, 1.5] is not allowed")
        raises(lambda call=call: call(batch, [0, 12], [1, 2]),
               f"{where}{p}=[0, 12] holds 12, outside the 10 positions: {allowed}")
    assert forwards[0] == 0
    # a negative position before the start of a short (padded) example: after the forward,
    # from the lengths the query reads anyway
    raises(lambda: post.predictive(batch, -5, [1, 2]),
           "LaplacePosterior.predictive: positions=-5 counts back past the start of example 1, "
           "which has 3 non-padding tokens: must be in [-n, T) for an example of n non-padding "
           "tokens")
    raises(lambda: post.predictive(batch, [-1, -4], [1, 2]), "positions=[-1, -4] counts back")


#: The queries that give probabilities over the ids: they need K >= 2.
OPTION_QUERIES = ("predictive_probs", "fit_beta")


def test_token_ids(post, forwards):
    batch = batch_of([10, 10])
    for method, call in query_calls(post):
        least = 2 if method in OPTION_QUERIES else 1
        allowed = (f"must be K >= {least} ids: one sequence of K ints for every example, or per "
                   "example a row of K ints ([B, K] with B = 2, the batch; every row the same "
                   "length K)")
        where, t = f"LaplacePosterior.{method}: ", arg_name(method, "token_ids")
        raises(lambda call=call: call(batch, -1, []), f"{where}{t}=[] is empty: {allowed}")
        raises(lambda call=call: call(batch, -1, "ab"), f"{where}{t}='ab' (a str) is not "
               f"allowed: {allowed}")
        raises(lambda call=call: call(batch, -1, [1.5, 2]), f"{where}{t}=[1.5, 2] is not allowed")
        raises(lambda call=call: call(batch, -1, [[1, 2], [3]]),
               f"{where}{t}=[[1, 2], [3]] has rows of lengths [1, 2]: {allowed}")
        raises(lambda call=call: call(batch, -1, [[1, 2]] * 3),
               f"{where}{t}=[[1, 2], [1, 2], [1, 2]] has 3 rows for 2 examples: {allowed}")
        raises(lambda call=call: call(batch, -1, torch.tensor([[1, 2]] * 3)),
               f"{where}{t}=<tensor [3, 2] int64> has 3 rows for 2 examples: {allowed}")
        raises(lambda call=call: call(batch, -1, torch.tensor([1.0, 2.0])),
               f"{where}{t}=<tensor [2] float32> is not allowed: {allowed}")
        raises(lambda call=call: call(batch, -1, torch.ones(2, 2, 2, dtype=torch.long)),
               f"{where}{t}=<tensor [2, 2, 2] int64> is not allowed")
    assert forwards[0] == 0
    vocab = "must be ids in [0, 256)"
    for method, call in query_calls(post):
        where, t = f"LaplacePosterior.{method}: ", arg_name(method, "token_ids")
        raises(lambda call=call: call(batch, -1, [1, 300]),
               f"{where}{t}=[1, 300] holds 300, outside the model's 256 vocabulary logits: "
               + vocab)
        raises(lambda call=call: call(batch, -1, [-1, 3]), f"{where}{t}=[-1, 3] holds -1")
        raises(lambda call=call: call(batch, -1, torch.tensor([[1, 2], [3, 256]])),
               f"{where}{t}=<tensor [2, 2] int64> holds 256, outside")
        raises(lambda call=call: call(batch, -1, None),
               f"{where}{t}=None is not allowed: token_ids is required for a language-model "
               "head (logits [B, T, V]): must be the K vocabulary ids to query")


def test_method_samples_and_seed_of_predictive_probs(post, forwards):
    batch = batch_of([10, 10])
    where = "LaplacePosterior.predictive_probs: "
    raises(lambda: post.predictive_probs(batch, -1, [1, 2], method="exact"),
           f"{where}method='exact' is not allowed: must be one of ('probit', "
           "'meanfield', 'mc', 'map')")
    raises(lambda: post.predictive_probs(batch, -1, [1, 2], method=7),
           f"{where}method=7 (a int) is not allowed: must be one of ('probit', "
           "'meanfield', 'mc', 'map')")
    raises(lambda: post.predictive_probs(batch, -1, [1, 2], method="mc", n_samples=0),
           f"{where}n_samples=0 is not allowed: must be an int >= 1")
    raises(lambda: post.predictive_probs(batch, -1, [1, 2], method="mc", seed="7"),
           f"{where}seed='7' (a str) is not allowed: must be an int (the random seed)")
    assert forwards[0] == 0
    # None: the posterior's own link (the stored held-out fit's, else probit)
    assert torch.equal(post.predictive_probs(batch, -1, [1, 2], method=None),
                       post.predictive_probs(batch, -1, [1, 2], method=post.link))


def test_probs_from_gaussian():
    mean = torch.zeros(2, 3, dtype=torch.float64)
    cov = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)
    raises(lambda: probs_from_gaussian(mean, cov, "sampling"),
           "probs_from_gaussian: method='sampling' is not allowed: must be one of ('probit', "
           "'meanfield', 'mc', 'map')")
    raises(lambda: probs_from_gaussian(mean, cov[0]),
           "probs_from_gaussian: cov=<tensor [3, 3] float64> is not allowed: must be a "
           "[B, K, K] = [2, 3, 3] floating tensor (mean is [B, K])")
    raises(lambda: probs_from_gaussian([0.0, 1.0], cov),
           "probs_from_gaussian: mean=[0.0, 1.0] (a list) is not allowed: must be a [B, K] "
           "floating tensor")
    raises(lambda: probs_from_gaussian(mean, cov, "mc", n_samples=-3),
           "probs_from_gaussian: n_samples=-3 is not allowed: must be an int >= 1")


def test_prior_precisions(post, forwards):
    batch = batch_of([10, 10])
    snap = post.snapshot
    where = "LaplacePosterior.predictive_covariances: "

    def call(priors):
        return post.predictive_covariances(batch, -1, [1, 2], prior_precisions=priors)

    allowed = ("must be a non-empty list of prior precisions, each "
               + prior_allowed(snap, marglik=False).removeprefix("must be ") + " (one: [tau])")
    raises(lambda: call([]), f"{where}prior_precisions=[] is empty: {allowed}")
    raises(lambda: call(TAU), f"{where}prior_precisions=0.7 (a float) is not allowed: {allowed}")
    raises(lambda: call(dict.fromkeys(snap.layer_names, 1.0)),
           f"{where}prior_precisions={{", "(a dict) is not allowed")
    raises(lambda: call("marglik"), f"{where}prior_precisions='marglik' (a str)")
    raises(lambda: call([1.0, -2.0]), f"{where}prior_precisions[1]=-2.0 is not allowed: "
           + prior_allowed(snap, marglik=False))
    raises(lambda: call([1.0, "marglik"]), f"{where}prior_precisions[1]='marglik' is not allowed")
    raises(lambda: call([{snap.layer_names[0]: 1.0}]), f"{where}prior_precisions[0]={{",
           f"lacks {len(snap.layer_names) - 1} of the posterior's layers")
    assert forwards[0] == 0


def test_sampled_weights_seed_fails_at_the_call(post):
    before = {k: v.clone() for k, v in post.model.state_dict().items()}
    raises(lambda: post.sampled_weights(seed="1"),
           "LaplacePosterior.sampled_weights: seed='1' (a str) is not allowed: must be an int "
           "(the random seed)")
    raises(lambda: post.sampled_weights(seed=1.5), "seed=1.5 (a float)")
    raises(lambda: post.sampled_weights(seed=None), "seed=None (a NoneType)")
    for k, v in post.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_optimize_prior_precision_bounds(post):
    where = "LaplacePosterior.optimize_prior_precision: "
    allowed = "must be a finite float with 0 < lower < upper"
    raises(lambda: post.optimize_prior_precision(lower=0), f"{where}lower=0 is not allowed: "
           + allowed)
    raises(lambda: post.optimize_prior_precision(lower=-1.0), f"{where}lower=-1.0 is not allowed")
    raises(lambda: post.optimize_prior_precision(upper=float("inf")),
           f"{where}upper=inf is not allowed: " + allowed)
    raises(lambda: post.optimize_prior_precision(lower=10.0, upper=1.0),
           f"{where}upper=1.0 is not above lower=10.0: " + allowed)
    raises(lambda: post.optimize_prior_precision(lower="1e-6"), f"{where}lower='1e-6' (a str)")
    raises(lambda: post.optimize_prior_precision(grid=0),
           f"{where}grid=0 is not allowed: must be an int >= 1")
    raises(lambda: post.optimize_prior_precision(iters=0),
           f"{where}iters=0 is not allowed: must be an int >= 1")
    raises(lambda: post.optimize_prior_precision(grid=10.0), f"{where}grid=10.0 (a float)")
    assert post.prior_precision == TAU


def test_log_marginal_likelihood_arguments(post):
    where = "LaplacePosterior.log_marginal_likelihood: "
    snap = post.snapshot
    for bad, shown in [(-1.0, "-1.0"), ("marglik", "'marglik'"), (0, "0"), ({}, "{}")]:
        raises(lambda bad=bad: post.log_marginal_likelihood(bad),
               f"{where}prior_precision={shown}", prior_allowed(snap, marglik=False))
    raises(lambda: post.log_marginal_likelihood(1.0, log_likelihood=float("nan")),
           f"{where}log_likelihood=nan is not allowed: must be a finite float")
    assert math.isfinite(post.log_marginal_likelihood(1.0))


def test_layer_names_of_tau_and_weights(post):
    first = post.snapshot.layer_names[0]
    raises(lambda: post.tau("nope"),
           "LaplacePosterior.tau: name='nope' is not allowed: must be one of the posterior's "
           f"{len(post.layer_names)} layers (its layer_names, e.g. {first!r})")
    raises(lambda: post.weights(3), "LaplacePosterior.weights: name=3 is not allowed")
    raises(lambda: post.tau(first, -3.0), "LaplacePosterior.tau: prior_precision=-3.0")
    assert post.tau(first) == TAU


def test_fit_beta_heldout(post, forwards):
    batch = batch_of([10, 10])
    where = "LaplacePosterior.fit_beta: "
    allowed = ("must be an iterable of dicts {'batch', 'token_ids', 'labels' [B], optionally "
               "'positions'} (a list of one dict for one batch)")
    item = {"batch": batch, "token_ids": [1, 2], "labels": [0, 1]}
    raises(lambda: post.fit_beta(item), f"{where}heldout={{'batch': {{'input_ids': <tensor "
           "[2, 10] int64>", "(a dict) is not allowed: " + allowed)
    raises(lambda: post.fit_beta([]), f"{where}heldout=[] is empty: " + allowed)
    raises(lambda: post.fit_beta([{"batch": batch, "token_ids": [1, 2]}]),
           f"{where}heldout[0]={{", "is not allowed: must be a dict {'batch', 'token_ids', "
           "'labels', optionally 'positions'}")
    raises(lambda: post.fit_beta([batch["input_ids"]]),
           f"{where}heldout[0]=<tensor [2, 10] int64> (a Tensor) is not allowed")
    raises(lambda: post.fit_beta([dict(item, labels=[0, 1, 1])]),
           f"{where}heldout[0]['labels']=[0, 1, 1] has 3 labels for 2 examples: must be 2 ints "
           "(per example, the index into its token_ids of the right answer)")
    raises(lambda: post.fit_beta([dict(item, labels="01")]),
           f"{where}heldout[0]['labels']='01' (a str) is not allowed")
    assert forwards[0] == 0
    raises(lambda: post.fit_beta([dict(item, labels=torch.tensor([0, 2]))]),
           f"{where}heldout[0]['labels']=<tensor [2] int64> holds 2, outside the 2 token_ids of "
           "a row: must be ids in [0, 2)")
    assert post.fit_beta([item]) > 0


def test_confidence_and_fit_confidence_beta():
    post_free = "fit_confidence_beta: "
    raises(lambda: fit_confidence_beta([0.1, 0.2], torch.tensor([True, False])),
           f"{post_free}variances=[0.1, 0.2] (a list) is not allowed: must be a [n] tensor")
    raises(lambda: fit_confidence_beta(torch.ones(3), torch.ones(2, dtype=torch.bool)),
           f"{post_free}correct=<tensor [2] bool> is not allowed: must be a [n] = [3] bool "
           "tensor like variances")
    raises(lambda: fit_confidence_beta(torch.ones(2), torch.ones(2).bool(), lower=1.0, upper=1.0),
           f"{post_free}upper=1.0 is not above lower=1.0")


def test_confidence_variance(post):
    raises(lambda: post.confidence("0.3"), "LaplacePosterior.confidence: variance='0.3' (a str) "
           "is not allowed: must be a tensor or a float")
    assert post.confidence(0.0) == 1.0


# -- topk_predictive -----------------------------------------------------------------------------

def test_topk_predictive_arguments(post, forwards):
    ids = torch.tensor(list(b"def f(x):"))
    where = "topk_predictive: "
    allowed = "must be a [T] integer tensor of token ids with T >= 1 (one sequence)"
    raises(lambda: topk_predictive(post, {"input_ids": ids[None]}),
           f"{where}input_ids={{'input_ids': <tensor [1, 9] int64>}} (a dict) is not allowed: "
           + allowed)
    raises(lambda: topk_predictive(post, ids[None]),
           f"{where}input_ids=<tensor [1, 9] int64> is not allowed: " + allowed)
    raises(lambda: topk_predictive(post, ids[:0]), f"{where}input_ids=<tensor [0] int64>")
    raises(lambda: topk_predictive(post, "def f(x):"), f"{where}input_ids='def f(x):' (a str)")
    raises(lambda: topk_predictive(post, ids + 250),
           f"{where}input_ids=<tensor [9] int64> holds 370, outside the model's 256 input "
           "embeddings: must be ids in [0, 256)")
    raises(lambda: topk_predictive(post, ids, k=0), f"{where}k=0 is not allowed: must be an int "
           ">= 1")
    raises(lambda: topk_predictive(post, ids, k=2.0), f"{where}k=2.0 (a float)")
    raises(lambda: topk_predictive(post, ids, n_samples=1),
           f"{where}n_samples=1 is not allowed: must be an int >= 2")
    raises(lambda: topk_predictive(post, ids, seed=None), f"{where}seed=None (a NoneType)")
    raises(lambda: topk_predictive("out/kfac", ids),
           f"{where}post='out/kfac' (a str) is not allowed: must be a kfac_stream.LaplacePosterior")
    assert forwards[0] == 0
    raises(lambda: topk_predictive(post, ids, k=257),
           f"{where}k=257 is not allowed: must be an int in [1, 256] (the vocabulary)")


def test_valid_queries_still_run(post):
    """The checks pass every form the API documents (and leave the values alone)."""
    batch = batch_of([10, 7])
    mean, cov = post.predictive(batch, -1, [1, 2, 3])
    for positions in ([9, 6], torch.tensor([-1, -1]), (-1, -1)):
        for ids in (torch.tensor([1, 2, 3]), (1, 2, 3), [torch.tensor([1, 2, 3])] * 2,
                    torch.tensor([[1, 2, 3]] * 2), [[1, 2, 3], [1, 2, 3]]):
            m, c = post.predictive(batch, positions, ids)
            assert torch.equal(m, mean) and torch.equal(c, cov)
    priors = [TAU, dict.fromkeys(post.snapshot.layer_names, TAU)]
    _, covs = post.predictive_covariances(batch, -1, [1, 2, 3], prior_precisions=tuple(priors))
    assert torch.equal(covs[0], cov)
    with post.sampled_weights(seed=3):
        pass


# -- the command line ----------------------------------------------------------------------------

def cli_error(capsys, argv, *needles, cmd="query") -> str:
    """``kfac-stream argv`` exits 2 with one line ``kfac-stream query: error: ...`` holding
    every needle as the last line of stderr (before it at most transformers' progress bars),
    and no traceback."""
    capsys.readouterr()
    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line or "error" in line.lower() for line in lines[:-1]), lines
    err = lines[-1]
    assert err.startswith(f"kfac-stream {cmd}: error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def query_argv(tmp, **over):
    args = {"--snapshot": str(tmp / "kfac"), "--model": str(tmp / "model"), "--text": "def f",
            "--top-k": "2", "--samples": "50", "--prior-precision": "2.0", **over}
    flags = ["--byte-level"] if args.pop("byte_level", True) else []
    return ["query", *[x for kv in args.items() for x in kv], *flags]


def test_cli_query_bad_paths_and_models(trained, tmp_path, capsys):
    _, _, tmp = trained
    allowed = ("must be a model directory written by save_pretrained (e.g. out/demo/model) or a "
               "hub model name")
    nowhere = str(tmp / "no" / "model")
    cli_error(capsys, query_argv(tmp, **{"--model": nowhere}),
              f"kfac-stream query: error: --model={nowhere!r} is a local path that does not "
              f"exist: {allowed}")
    empty = tmp_path / "empty"
    empty.mkdir()
    cli_error(capsys, query_argv(tmp, **{"--model": str(empty)}),
              f"--model={str(empty)!r} could not be loaded as a causal LM (", allowed)
    cli_error(capsys, query_argv(tmp, **{"--model": str(tmp / "model" / "config.json")}),
              "config.json' is a file: " + allowed)
    snap_allowed = ("must be a snapshot directory (with manifest.json) or a directory of them "
                    "(e.g. out/demo/kfac)")
    cli_error(capsys, query_argv(tmp, **{"--snapshot": str(tmp / "nowhere")}),
              f"--snapshot={str(tmp / 'nowhere')!r} does not exist: {snap_allowed}")
    cli_error(capsys, query_argv(tmp, **{"--snapshot": str(tmp / "model" / "config.json")}),
              "config.json' is a file: " + snap_allowed)
    cli_error(capsys, query_argv(tmp, **{"--snapshot": str(tmp / "model")}),
              "no complete snapshot found")
    other = tmp_path / "other"
    tiny_gpt2(torch.float32, n_embd=32).save_pretrained(other)
    cli_error(capsys, query_argv(tmp, **{"--model": str(other)}),
              "layer 'transformer.h.0.attn.c_attn' has (d_in, d_out, bias)")
    cli_error(capsys, ["inspect", str(tmp / "nowhere")],
              f"kfac-stream inspect: error: path={str(tmp / 'nowhere')!r} does not exist: "
              + snap_allowed, cmd="inspect")


def test_cli_query_bad_values(trained, capsys):
    _, _, tmp = trained
    cli_error(capsys, query_argv(tmp, **{"--text": ""}),
              "kfac-stream query: error: --text='' is not allowed: must be a non-empty text")
    for k in ("0", "-3"):
        cli_error(capsys, query_argv(tmp, **{"--top-k": k}),
                  f"--top-k={k} is not allowed: must be an int >= 1")
    cli_error(capsys, query_argv(tmp, **{"--samples": "1"}),
              "--samples=1 is not allowed: must be an int >= 2")
    for tau in ("marlik", "-1", "0", "nan", "inf", ""):
        cli_error(capsys, query_argv(tmp, **{"--prior-precision": tau}),
                  f"--prior-precision={tau!r} is not allowed: must be a positive finite number "
                  "or 'auto' or 'heldout' or 'marglik'")
    cli_error(capsys, query_argv(tmp, **{"--text": "x" * 65}),
              "--text is 65 tokens long: must be at most 64 tokens (the model's positions)")
    with pytest.raises(SystemExit) as e:  # argparse's own check of the type, also exit code 2
        cli_main(query_argv(tmp, **{"--top-k": "two"}))
    assert e.value.code == 2
    assert "kfac-stream query: error: argument --top-k: invalid int value: 'two'" in (
        capsys.readouterr().err)


def test_cli_query_tokenizers(trained, tmp_path, capsys):
    """The demo's byte-level model has no tokenizer files: without --byte-level the message
    says to pass it; a tokenizer whose ids exceed the model's vocabulary is named."""
    _, _, tmp = trained
    cli_error(capsys, query_argv(tmp, byte_level=False),
              f"--model={str(tmp / 'model')!r}", "pass --byte-level for a byte-level model such "
              "as the demo's, or --tokenizer DIR for the model's tokenizer")
    cli_error(capsys, query_argv(tmp, byte_level=False, **{"--tokenizer": str(tmp / "nowhere")}),
              f"--tokenizer={str(tmp / 'nowhere')!r}", "pass --byte-level")
    save_bpe_tokenizer(tmp_path / "bpe", ["def f(x): return x + 1\n" * 50])
    text = "def f(x): return x + 1"
    cli_error(capsys, query_argv(tmp, byte_level=False,
                                 **{"--tokenizer": str(tmp_path / "bpe"), "--text": text}),
              f"--text={text!r}: the tokenizer of {str(tmp_path / 'bpe')!r} give token id ",
              "but the model's vocabulary has 256 tokens: pass the model's own tokenizer")
    assert cli_main(query_argv(tmp)) == 0  # the same arguments with --byte-level run
    assert "top-2 next tokens" in capsys.readouterr().out


def test_negative_positions_count_back_from_the_last_token_with_either_padding():
    """`inputs.position_index`: ``-1`` is the last 1 of the attention mask (right padding:
    ``n − 1``; left padding: ``T − 1``), ``-n`` the first token; past the start is an error."""
    from kfac_stream.query.inputs import position_index

    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    batch = {"input_ids": torch.zeros(3, 5, dtype=torch.long), "attention_mask": mask}
    assert position_index("q", "positions", -1, batch, 3, 5, -1) == [2, 4, 4]
    assert position_index("q", "positions", -3, batch, 3, 5, -3) == [0, 2, 2]
    assert position_index("q", "positions", [1, -2, 0], batch, 3, 5, [1, -2, 0]) == [1, 3, 0]
    assert position_index("q", "positions", -2, {"input_ids": batch["input_ids"]}, 3, 5,
                          -2) == [3, 3, 3]
    with pytest.raises(QueryInputError, match=r"^q: positions=-4 counts back past the start of "
                       r"example 0, which has 3 non-padding tokens: must be in \[-n, T\)"):
        position_index("q", "positions", -4, batch, 3, 5, -4)
