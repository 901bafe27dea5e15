r"""EK-FAC from the stream against kronfluence 1.0.1's EK-FAC at fixed weights.

Both sides see the same quantities:

* ours: a real ``Trainer`` at learning rate 0 (the weights checked unchanged) over the same
  training sequences for two identical epochs, ``KFACConfig(ekfac=True, fisher="empirical",
  token_fraction=1, ema_decay=1, storage_dtype="float64", update_every=1)`` with
  ``snapshot_every`` = one epoch's steps and the snapshots finished on the training thread
  (``background_snapshots=False``, so snapshot ``S``'s eigenbasis is in use from step ``S``):
  the final snapshot's ``λ`` is measured over every training sequence (epoch 2) in the
  eigenbasis of the one-epoch mean factors, and its own factors are the two-epoch mean, the same
  matrices (to rounding) whose eigenbasis the influence scores rotate into;
* kronfluence: ``fit_all_factors`` with ``FactorArguments(strategy="ekfac",
  use_empirical_fisher=True)`` and every dtype float64 on a copy of the same float64 model,
  tracking the same layers, over the same sequences, its loss the summed NLL of the labelled
  tokens (ours: the Trainer's ``compute_loss_func`` `harness.sum_nll_loss`, the same sum); its
  ``get_attention_mask`` gives our usable positions (a causal LM's real tokens up to each
  sequence's last scored logit row, `kfac_stream.stats.rows.gradient_positions`; here computed
  by hand from the lengths), so its covariances count the positions our factors count and the
  two eigenbases agree.

The normalisation (docs/computed.md, "EK-FAC from the stream"): both sum the same squared
rotated per-sequence gradients; we divide by ``N`` (the usable positions), kronfluence by the
number of sequences ``n``, so ``λ_kf = m·λ_ours`` with ``m = N / n``. At damping ``d_kf =
m·d_ours`` the preconditioners satisfy ``(λ_kf + d_kf)⁻¹ = (λ_ours + d_ours)⁻¹ / m`` and the
scores ``I_ours = m·I_kf``; each side's heuristic (``0.1·mean(λ)``) is such a pair.

Tolerance `KF_TOL`: the two pipelines share no code; both are float64 end to end, and what
separates them is rounding (different summation orders, two eigendecompositions of the same
factors): the measured differences are ~1e-13 relative (printed), as our K-FAC against
kronfluence (benchmarks/influence_peers.py); 1e-10 leaves room for other BLAS/LAPACK builds
while any convention or window mismatch (a stale basis, a partial window, a shifted count) is
at least 1e-3 (see `test_the_default_attention_mask_is_a_different_basis`).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from kfac_stream import Influence, LaplacePosterior, Snapshot

from harness import run, sum_nll_loss
from models import ListDataset, text_examples, tiny_llama

kronfluence = pytest.importorskip(
    "kronfluence", reason="kronfluence is not importable (a test peer: `make .venv/.peers` "
                          "installs kronfluence==1.0.1)")

KF_TOL = 1e-10  # float64 on both sides, rounding only (module docstring)
BATCH = 4
LENGTHS = [16, 11, 16, 9, 16, 13, 16, 16, 7, 16, 12, 16]  # padding in most batches
STEPS_PER_EPOCH = len(LENGTHS) // BATCH
QUERY_LENGTHS = [14, 10, 16]
INCLUDE = [r"layers\.0\.self_attn\.(q|v)_proj$", r"layers\.0\.self_attn\.o_proj$",
           r"layers\.1\.mlp\.(up|down)_proj$"]
LAYERS = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
          "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.up_proj",
          "model.layers.1.mlp.down_proj"]
EXPLICIT_DAMPING = 1e-3  # ours; kronfluence gets m times it


def _queries() -> dict[str, torch.Tensor]:
    """Three query sequences labelled on their second half only (a prompt, a completion)."""
    ex = text_examples(len(QUERY_LENGTHS), 16, seed=11, lengths=QUERY_LENGTHS)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ex[0]}
    half = torch.arange(batch["labels"].shape[1])[None] >= 8
    batch["labels"] = torch.where(half, batch["labels"], -100)
    return batch


def _usable_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` int64, 1 at the positions that carry a gradient of the next-token loss of an
    unprompted sequence of each length: ``0 .. length − 2`` (the last token scores nothing)."""
    return (torch.arange(width)[None] < (lengths[:, None] - 1)).long()


def _kf_task(layers: list[str]):
    from kronfluence.task import Task

    class SumNllTask(Task):
        """The summed NLL of the labelled tokens (the observed labels: the empirical Fisher);
        the covariances over our usable positions (module docstring)."""

        def compute_train_loss(self, batch, model, sample=False):
            assert not sample  # use_empirical_fisher=True
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return list(layers)

        def get_attention_mask(self, batch):
            scored = batch["labels"] != -100  # train sequences: labelled at every real token
            lengths = scored.sum(1)
            return _usable_mask(lengths, scored.shape[1]).to(batch["input_ids"].device)

    return SumNllTask()


def _kronfluence(model, layers, train, queries, tmp_path, dampings):
    """kronfluence's EK-FAC on a copy of ``model``: ``({layer: λ_kf [d_out, d_A]}, {damping:
    scores [Q, N]})``, ``dampings`` its ``damping_factor`` values (None: its heuristic)."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments

    task = _kf_task(layers)
    kf_model = prepare_model(copy.deepcopy(model).eval(), task)
    analyzer = Analyzer("ekfac_peer", kf_model, task, cpu=True, log_level=logging.WARNING,
                        disable_tqdm=True, output_dir=str(tmp_path))
    f64 = torch.float64
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True,
                                  activation_covariance_dtype=f64, gradient_covariance_dtype=f64,
                                  per_sample_gradient_dtype=f64, lambda_dtype=f64,
                                  eigendecomposition_dtype=f64)
    analyzer.fit_all_factors("ekfac", ListDataset(train), per_device_batch_size=BATCH,
                             factor_args=factor_args, overwrite_output_dir=True)
    lam = analyzer.load_lambda_matrices("ekfac")
    lam_kf = {n: lam["lambda_matrix"][n].double() / lam["num_lambda_processed"][n].double()
              for n in layers}
    q = [{k: v[i] for k, v in queries.items()} for i in range(len(queries["input_ids"]))]
    scores = {}
    for i, damping in enumerate(dampings):
        args = ScoreArguments(damping_factor=damping, per_sample_gradient_dtype=f64,
                              precondition_dtype=f64, score_dtype=f64)
        analyzer.compute_pairwise_scores(f"scores{i}", "ekfac", ListDataset(q),
                                         ListDataset(train), per_device_query_batch_size=len(q),
                                         per_device_train_batch_size=BATCH, score_args=args,
                                         overwrite_output_dir=True)
        scores[damping] = analyzer.load_pairwise_scores(f"scores{i}")["all_modules"].double()
    return lam_kf, scores


def _rel(got, want) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """Our side (module docstring): ``(model, final snapshot, first snapshot, train)``."""
    tmp = tmp_path_factory.mktemp("ekfac_kf")
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    train = text_examples(len(LENGTHS), 16, seed=2, lengths=LENGTHS)
    cb, _, _ = run(model, train, {"snapshot_every": STEPS_PER_EPOCH, "ekfac": True,
                                  "eigendecompose": "always", "include": INCLUDE},
                   batch=BATCH, epochs=2, lr=0.0, loss=sum_nll_loss, tmp_path=tmp,
                   record=False, callback_kwargs={"background_snapshots": False})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.eval()
    first, final = (Snapshot.load(p) for p in cb.snapshots)
    return model, final, first, train


def test_streamed_ekfac_equals_kronfluence(streamed, tmp_path):
    """``λ_ours·m = λ_kf`` per layer and ``I_ours = m·I_kf`` at equal damping (explicit, and each
    side's heuristic), ``m = N / n`` the mean usable positions per sequence."""
    model, final, first, train = streamed
    assert sorted(final.layer_names) == sorted(LAYERS)
    n_seq = len(LENGTHS)
    usable = sum(n - 1 for n in LENGTHS)  # N, by hand: each sequence's last token scores nothing
    m = usable / n_seq
    for n in LAYERS:  # the window: epoch 2, every sequence, in snapshot 1's (one epoch's) basis
        entry = final[n].entry.ekfac
        assert (entry.basis_step, entry.updates) == (first.step, STEPS_PER_EPOCH)
        assert (entry.first_step, entry.last_step) == (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH - 1)
        assert entry.weight == usable
    queries = _queries()
    lam_kf, kf = _kronfluence(model, LAYERS, train, queries, tmp_path,
                              [None, m * EXPLICIT_DAMPING])
    lam_err = {n: _rel(final[n].ekfac_eigvals.double() * m, lam_kf[n]) for n in LAYERS}
    post = LaplacePosterior(model, final, 1.0)
    heuristic = Influence(post, "heuristic", eigenvalues="ekfac")
    damp_err = {n: abs(heuristic.damping[n] * m / (0.1 * float(lam_kf[n].mean())) - 1)
                for n in LAYERS}
    train_batches = [{k: torch.stack([e[k] for e in train[i:i + BATCH]]) for k in train[0]}
                     for i in range(0, len(train), BATCH)]
    ours = {None: heuristic.scores(queries, train_batches).scores,
            m * EXPLICIT_DAMPING: Influence(post, EXPLICIT_DAMPING, eigenvalues="ekfac")
            .scores(queries, train_batches).scores}
    score_err = {d: _rel(ours[d], m * kf[d]) for d in kf}
    print(f"\nm = N/n = {usable}/{n_seq} = {m:.6g}; λ_ours·m vs λ_kf, rel Frobenius per layer: "
          + ", ".join(f"{e:.1e}" for e in lam_err.values())
          + f"; heuristic damping·m vs kronfluence's: max rel {max(damp_err.values()):.1e}"
          + f"; scores ours vs m·kronfluence: heuristic {score_err[None]:.1e}, explicit "
          f"{score_err[m * EXPLICIT_DAMPING]:.1e}")
    assert max(lam_err.values()) <= KF_TOL
    assert max(damp_err.values()) <= KF_TOL
    assert max(score_err.values()) <= KF_TOL
