"""Influence scores from a snapshot's factors, against a dense float64 computation.

The reference here shares nothing with `kfac_stream.query.influence` but the snapshot's factor
matrices: per-example gradients by autograd on the layers' PARAMETERS (one backward per
example, Conv1D weights transposed into ``W̄ = [W b]``), the Kronecker product expanded into a
dense ``G ⊗ A + λI`` (row-major ``vec(W̄)``) and solved with ``torch.linalg.solve``.
"""

import pytest
import torch
import torch.nn.functional as F

from kfac_stream import (
    Influence,
    LaplacePosterior,
    QueryInputError,
    Snapshot,
    influence_memory,
    influence_scores,
    self_influence,
)
from kfac_stream.query.influence import HEURISTIC_FACTOR

from harness import run, sum_nll_loss
from models import lora_gpt2, text_examples, tiny_classifier_run, tiny_gpt2

EXACT_TOL = 1e-6  # float64 end to end; the eigendecomposition's roundoff relative to λ


def _dense_grads(model, layers, example, loss_fn):
    """``{layer: [d_out * d_A]}`` float64: the gradient of the example's summed loss w.r.t.
    each layer's ``W̄ = [W b]`` (row-major), by autograd on the parameters."""
    modules = dict(model.named_modules())
    params = []
    for n in layers:
        m = modules[n]
        params.append(m.weight)
        if getattr(m, "bias", None) is not None:
            params.append(m.bias)
    for p in params:
        p.requires_grad_(True)
    batch = {k: v[None] for k, v in example.items()}
    loss = loss_fn(model, batch)
    grads = iter(torch.autograd.grad(loss, params))
    out = {}
    for n in layers:
        m = modules[n]
        w = next(grads)
        w = w.T if type(m).__name__ == "Conv1D" else w
        if getattr(m, "bias", None) is not None:
            w = torch.cat([w, next(grads)[:, None]], dim=1)
        out[n] = w.double().reshape(-1)
    return out


def _lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           batch["labels"][:, 1:].reshape(-1), ignore_index=-100,
                           reduction="sum")


def _clf_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits, batch["labels"].reshape(-1), reduction="sum")


def _dense_scores(post, damping, queries, train, loss_fn):
    """``[Q, N]`` by the dense Kronecker-expanded solve."""
    model, snap = post.model, post.snapshot
    scores = torch.zeros(len(queries), len(train), dtype=torch.float64)
    gq = [_dense_grads(model, post.layer_names, q, loss_fn) for q in queries]
    gt = [_dense_grads(model, post.layer_names, t, loss_fn) for t in train]
    for n in post.layer_names:
        a, g = snap[n].A.double(), snap[n].G.double()
        a = torch.diag(a) if a.dim() == 1 else a
        g = torch.diag(g) if g.dim() == 1 else g
        h = torch.kron(g, a) + damping[n] * torch.eye(a.shape[0] * g.shape[0],
                                                      dtype=torch.float64)
        sol = torch.linalg.solve(h, torch.stack([x[n] for x in gt]).T)  # [P, N]
        scores += torch.stack([x[n] for x in gq]) @ sol
    return scores


def _stack(examples):
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm")
    model = tiny_gpt2()
    run(model, text_examples(8, 12), {"snapshot_every": 10**6}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp, record=False)
    model.eval()
    return LaplacePosterior(model, Snapshot.latest(tmp / "kfac"), 2.0)


def _rel(got, want):
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("n_queries", [1, 3], ids=["factored", "dense"])
def test_lm_scores_equal_the_dense_kronecker_solve(lm, n_queries):
    """One query row takes the factored path (no per-example gradient), three the dense one;
    both equal the dense solve; two training batches fill the columns in order."""
    queries = text_examples(n_queries, 10, seed=5, lengths=[10, 7, 9][:n_queries])
    train = text_examples(6, 12, seed=7, lengths=[12, 8, 11, 12, 5, 9])
    inf = Influence(lm)
    got = inf.scores(_stack(queries), [_stack(train[:3]), _stack(train[3:])])
    want = _dense_scores(lm, inf.damping, queries, train, _lm_loss)
    print(f"{n_queries} queries: rel err {_rel(got.scores, want):.2e}")
    assert got.scores.shape == (n_queries, 6)
    assert _rel(got.scores, want) <= EXACT_TOL
    assert got.scores.abs().min() > 0  # nothing trivially zero


def test_damping_rules(lm):
    heuristic = Influence(lm).damping
    for n in lm.layer_names:
        aval, gval = lm.eig.eigvals(n)
        assert heuristic[n] == pytest.approx(
            HEURISTIC_FACTOR * float(gval.mean() * aval.mean()), rel=1e-12)
    prior = Influence(lm, "prior").damping
    assert all(prior[n] == pytest.approx(2.0 / lm.layer_num_data[n]) for n in lm.layer_names)
    assert set(Influence(lm, 0.5).damping.values()) == {0.5}
    for bad in ("none", 0.0, -1.0, float("nan")):
        with pytest.raises(QueryInputError, match="damping"):
            Influence(lm, bad)


def test_per_token_split_sums_to_the_query_score_and_equals_token_losses(lm):
    """Each labelled token's share: the dense solve with that token's loss alone."""
    queries = text_examples(2, 9, seed=3, lengths=[9, 6])
    for q in queries:  # a completion: only the last 3 tokens labelled
        n = int(q["attention_mask"].sum())
        q["labels"][: n - 3] = -100
    train = text_examples(4, 12, seed=8)
    got = influence_scores(lm, _stack(queries), [_stack(train)], per_token=True)
    assert got.token_scores.shape == (2, 3, 4)
    assert torch.allclose(got.token_scores.sum(1), got.scores, rtol=1e-10, atol=0)
    assert got.token_positions.tolist() == [[6, 7, 8], [3, 4, 5]]
    inf = Influence(lm)
    for qi, q in enumerate(queries):
        for si, t in enumerate(got.token_positions[qi].tolist()):
            alone = {k: v.clone() for k, v in q.items()}
            alone["labels"][:] = -100
            alone["labels"][t] = q["labels"][t]
            want = _dense_scores(lm, inf.damping, [alone], train, _lm_loss)[0]
            assert _rel(got.token_scores[qi, si], want) <= EXACT_TOL


def test_top_k(lm):
    got = influence_scores(lm, _stack(text_examples(2, 8, seed=1)),
                           [_stack(text_examples(5, 8, seed=2))])
    (hi, hv), (lo, lv) = got.top_k(3)
    assert hi.shape == (2, 3) and torch.equal(hv, got.scores.gather(1, hi))
    assert torch.equal(hv, got.scores.sort(1, descending=True).values[:, :3])
    assert torch.equal(lv, got.scores.sort(1).values[:, :3])
    assert got.top_k(10)[0][0].shape == (2, 5)  # k capped at N


def test_classifier_scores_equal_the_dense_solve(tmp_path):
    model, snap, ex = tiny_classifier_run(tmp_path)
    model.eval()
    post = LaplacePosterior(model, snap, 1.0)
    inf = Influence(post)
    got = inf.scores(_stack(ex[:2]), [_stack(ex)])
    want = _dense_scores(post, inf.damping, ex[:2], ex, _clf_loss)
    assert _rel(got.scores, want) <= EXACT_TOL


def test_lora_scores_equal_the_dense_solve(tmp_path):
    """Adapter layers only (the base frozen): the adapters' gradients."""
    model = lora_gpt2()
    run(model, text_examples(8, 12), {"snapshot_every": 10**6}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp_path, record=False)
    model.eval()
    post = LaplacePosterior(model, Snapshot.latest(tmp_path / "kfac"), 1.0)
    assert all("lora_" in n for n in post.layer_names)
    inf = Influence(post)
    queries, train = text_examples(2, 10, seed=4), text_examples(4, 10, seed=6)
    got = inf.scores(_stack(queries), [_stack(train)])
    want = _dense_scores(post, inf.damping, queries, train, _lm_loss)
    assert _rel(got.scores, want) <= EXACT_TOL


def test_batches_without_labels_are_refused(lm):
    batch = _stack(text_examples(2, 8))
    bare = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with pytest.raises(QueryInputError, match="without labels"):
        influence_scores(lm, bare, [batch])
    with pytest.raises(QueryInputError, match="no training examples"):
        influence_scores(lm, batch, [])


# -- self-influence and many queries in one pass ------------------------------------------------

SELF_TOL = 1e-10  # float64 end to end (factors stored in float64, float64 eigh): roundoff only


def test_self_influence_equals_the_dense_solve(lm):
    """``I(z, z)`` of every training example: the diagonal of the dense ``[N, N]`` solve, in
    the order of the batches, through the method and the package function."""
    train = text_examples(6, 12, seed=7, lengths=[12, 8, 11, 12, 5, 9])
    inf = Influence(lm)
    got = inf.self_scores([_stack(train[:4]), _stack(train[4:])])
    want = _dense_scores(lm, inf.damping, train, train, _lm_loss).diagonal()
    print(f"self-influence: rel err {_rel(got, want):.2e}")
    assert got.shape == (6,) and got.dtype == torch.float64
    assert _rel(got, want) <= SELF_TOL
    assert (got > 0).all()  # ⟨g, (F + λ)⁻¹ g⟩ of a non-zero gradient
    same = self_influence(lm, [_stack(train)], damping=inf.damping[lm.layer_names[0]])
    want = _dense_scores(lm, dict.fromkeys(lm.layer_names, inf.damping[lm.layer_names[0]]),
                         train, train, _lm_loss).diagonal()
    assert _rel(same, want) <= SELF_TOL


def test_self_influence_of_a_classifier_equals_the_dense_solve(tmp_path):
    model, snap, ex = tiny_classifier_run(tmp_path)
    model.eval()
    post = LaplacePosterior(model, snap, 1.0)
    inf = Influence(post, "prior")
    got = inf.self_scores([_stack(ex)])
    want = _dense_scores(post, inf.damping, ex, ex, _clf_loss).diagonal()
    assert _rel(got, want) <= SELF_TOL


class _Counted:
    """Training batches that count how often each example is handed out."""

    def __init__(self, batches):
        self.batches, self.reads = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            self.reads += len(b["input_ids"])
            yield b


def test_many_queries_read_each_training_example_once_and_equal_one_query_at_a_time(lm):
    """Eight queries in one call: each training example read once (counted by the batches
    handed out and by the model's forwards on training inputs), the scores equal to eight
    one-query calls (each of which reads the whole set) and to the dense solve."""
    queries = text_examples(8, 10, seed=11)
    train = text_examples(7, 12, seed=13, lengths=[12, 9, 12, 7, 12, 10, 12])
    batches = _Counted([_stack(train[:3]), _stack(train[3:6]), _stack(train[6:])])
    seen = []
    hook = lm.model.register_forward_hook(lambda m, a, k, o: seen.append(len(k["input_ids"])),
                                          with_kwargs=True)
    try:
        inf = Influence(lm)
        got = inf.scores([_stack(queries[:5]), _stack(queries[5:])], batches)
    finally:
        hook.remove()
    assert batches.reads == 7 and got.examples_read == 7
    assert seen == [5, 3, 3, 3, 1]  # two query batches, then each training batch once
    one = torch.stack([inf.scores(_stack([q]), batches.batches).scores[0] for q in queries])
    print(f"8 queries at once vs one by one: max abs diff "
          f"{float((got.scores - one).abs().max()):.2e}")
    assert _rel(got.scores, one) <= SELF_TOL
    assert _rel(got.scores, _dense_scores(lm, inf.damping, queries, train, _lm_loss)) <= SELF_TOL
    assert got.query_bytes == 8 * influence_memory(lm, 1, 1, 1)["query_rows"]
    assert got.query_bytes_on_host == 0


def test_a_device_cap_on_the_query_rows_keeps_the_scores(lm):
    """On the CPU the model's device is the host: nothing moves, the scores are the same."""
    queries = _stack(text_examples(3, 10, seed=3))
    train = [_stack(text_examples(4, 12, seed=4))]
    inf = Influence(lm)
    full = inf.scores(queries, train)
    capped = inf.scores(queries, train, query_device_bytes=0)
    assert capped.query_bytes == full.query_bytes > 0 and capped.query_bytes_on_host == 0
    assert torch.equal(capped.scores, full.scores)
    with pytest.raises(QueryInputError, match="query_device_bytes"):
        inf.scores(queries, train, query_device_bytes=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: query rows past the "
                    "device cap wait in host memory only when the model is on a GPU")
def test_query_rows_past_the_device_cap_wait_on_the_host_with_the_same_scores(lm):
    post = LaplacePosterior(lm.model.cuda(), lm.snapshot, 2.0)
    try:
        queries = {k: v.cuda() for k, v in _stack(text_examples(3, 10, seed=3)).items()}
        train = [{k: v.cuda() for k, v in _stack(text_examples(4, 12, seed=4)).items()}]
        inf = Influence(post)
        full = inf.scores(queries, train)
        half = full.query_bytes // 2
        capped = inf.scores(queries, train, query_device_bytes=half)
        assert 0 < capped.query_bytes_on_host <= full.query_bytes
        assert full.query_bytes - capped.query_bytes_on_host <= half
        assert _rel(capped.scores, full.scores) <= SELF_TOL
    finally:
        lm.model.cpu()


def test_influence_memory_counts_the_tracked_weights(lm):
    """``W``: every tracked layer's weight and bias entries (the model's own parameters)."""
    modules = dict(lm.model.named_modules())
    want = sum(p.numel() for n in lm.layer_names for p in modules[n].parameters())
    mem = influence_memory(lm, rows=64, batch=8, tokens=12)
    assert mem["tracked_weights"] == want
    assert mem["query_rows"] == 64 * want * 8  # float64: 8 bytes
