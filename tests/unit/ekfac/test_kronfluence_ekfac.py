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

Without the matched setting (`test_what_separates_the_two_without_the_matched_setting`):
kronfluence's covariances over its default mask (the attention mask: each sequence's last
token counted too) are other factors, so another eigenbasis; our one-epoch lr-0 run (no longer
than ``snapshot_every``) takes an extra snapshot midway and measures ``λ`` over the second
half's sequences in the eigenbasis of the first half's factors (`kfac_stream.ekfac.schedule`).

Tolerance `KF_TOL`: the two pipelines share no code; both are float64 end to end, and what
separates them is rounding (other summation orders, two eigendecompositions of the same
factors): the factors, ``λ`` and the scores agree to ~1e-14 relative (printed); 1e-10 leaves
room for other BLAS/LAPACK builds, while each departure from the matched setting moves them by
more than 1e-3 (`test_what_separates_the_two_without_the_matched_setting`).
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


def _usable_mask(labels: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64, 1 at the positions that carry a gradient of the next-token loss of
    training sequences labelled at every real token (``labels [B, T]``, -100 at padding):
    ``0 .. length − 2`` (the last token scores nothing)."""
    lengths = (labels != -100).sum(1)
    return (torch.arange(labels.shape[1])[None] < (lengths[:, None] - 1)).long()


def _real_tokens(labels: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64, 1 at every real token: the attention mask, what kronfluence counts
    when ``get_attention_mask`` returns the batch's own (the last token included)."""
    return (labels != -100).long()


def _kf_task(layers: list[str], mask):
    from kronfluence.task import Task

    class SumNllTask(Task):
        """The summed NLL of the labelled tokens (the observed labels: the empirical Fisher);
        the covariances over the positions ``mask(labels)`` marks."""

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
            return mask(batch["labels"])

    return SumNllTask()


def _kronfluence(model, train, queries, tmp_path, dampings, mask=_usable_mask):
    """kronfluence's EK-FAC on a copy of ``model`` tracking `LAYERS`, its covariances over the
    positions ``mask`` marks: ``({layer: λ_kf [d_out, d_A]}, {damping: scores [Q, N]}, {layer:
    (A [d_A, d_A], G [d_out, d_out])})``, ``dampings`` its ``damping_factor`` values (None: its
    heuristic), the factors its covariances divided by their counts."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments

    task = _kf_task(LAYERS, mask)
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
              for n in LAYERS}
    cov = analyzer.load_covariance_matrices("ekfac")
    factors = {n: (cov["activation_covariance"][n] / cov["num_activation_covariance_processed"][n],
                   cov["gradient_covariance"][n] / cov["num_gradient_covariance_processed"][n])
               for n in LAYERS}
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
    return lam_kf, scores, factors


def _rel(got, want) -> float:
    return float((got - want).norm() / want.norm())


def _ours(model, train, tmp_path, cfg: dict, epochs: int) -> list[Snapshot]:
    """A real Trainer at learning rate 0 over ``train`` for ``epochs`` epochs with EK-FAC
    (`harness.run`'s exact setting plus ``cfg``), the snapshots finished on the training
    thread; the weights checked unchanged. Returns the run's snapshots."""
    before = [p.detach().clone() for p in model.parameters()]
    cb, _, _ = run(model, train, {"ekfac": True, "eigendecompose": "always", "include": INCLUDE,
                                  **cfg},
                   batch=BATCH, epochs=epochs, lr=0.0, loss=sum_nll_loss, tmp_path=tmp_path,
                   record=False, callback_kwargs={"background_snapshots": False})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.eval()
    return [Snapshot.load(p) for p in cb.snapshots]


def _batches(examples: list[dict]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.stack([e[k] for e in examples[i:i + BATCH]]) for k in examples[0]}
            for i in range(0, len(examples), BATCH)]


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """Both sides (module docstring): ``{"model", "train", "queries", "m", "snapshots",
    "lam_kf", "kf", "factors"}``, ``snapshots`` ours (one per epoch), ``lam_kf``, ``kf``
    (scores at its heuristic, key None, and at ``m·EXPLICIT_DAMPING``) and ``factors``
    kronfluence's (`_kronfluence`)."""
    tmp = tmp_path_factory.mktemp("ekfac_kf")
    model = tiny_llama()
    train = text_examples(len(LENGTHS), 16, seed=2, lengths=LENGTHS)
    snaps = _ours(model, train, tmp / "ours", {"snapshot_every": STEPS_PER_EPOCH}, epochs=2)
    m = sum(n - 1 for n in LENGTHS) / len(LENGTHS)  # N / n, N by hand
    queries = _queries()
    lam_kf, kf, factors = _kronfluence(model, train, queries, tmp / "kf",
                                       [None, m * EXPLICIT_DAMPING])
    return {"model": model, "train": train, "queries": queries, "m": m, "snapshots": snaps,
            "lam_kf": lam_kf, "kf": kf, "factors": factors}


def test_streamed_ekfac_equals_kronfluence(sides):
    """``λ_ours·m = λ_kf`` per layer and ``I_ours = m·I_kf`` at equal damping (explicit, and each
    side's heuristic), ``m = N / n`` the mean usable positions per sequence."""
    first, final = sides["snapshots"]
    m, lam_kf, kf = sides["m"], sides["lam_kf"], sides["kf"]
    assert sorted(final.layer_names) == sorted(LAYERS)
    usable = sum(n - 1 for n in LENGTHS)  # N, by hand: each sequence's last token scores nothing
    for n in LAYERS:  # the window: epoch 2, every sequence, in snapshot 1's (one epoch's) basis
        entry = final[n].entry.ekfac
        assert (entry.basis_step, entry.updates) == (first.step, STEPS_PER_EPOCH)
        assert (entry.first_step, entry.last_step) == (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH - 1)
        assert entry.weight == usable
    factor_err = {n: max(_rel(final[n].A, sides["factors"][n][0]),
                         _rel(final[n].G, sides["factors"][n][1])) for n in LAYERS}
    lam_err = {n: _rel(final[n].ekfac_eigvals.double() * m, lam_kf[n]) for n in LAYERS}
    post = LaplacePosterior(sides["model"], final, 1.0)
    heuristic = Influence(post, "heuristic", eigenvalues="ekfac")
    damp_err = {n: abs(heuristic.damping[n] * m / (0.1 * float(lam_kf[n].mean())) - 1)
                for n in LAYERS}
    queries, train = sides["queries"], _batches(sides["train"])
    ours = {None: heuristic.scores(queries, train).scores,
            m * EXPLICIT_DAMPING: Influence(post, EXPLICIT_DAMPING, eigenvalues="ekfac")
            .scores(queries, train).scores}
    score_err = {d: _rel(ours[d], m * kf[d]) for d in kf}
    print(f"\nfactors A, G vs kronfluence's: max rel Frobenius {max(factor_err.values()):.1e}; "
          f"m = N/n = {usable}/{len(LENGTHS)} = {m:.6g}; λ_ours·m vs λ_kf, rel Frobenius per "
          "layer: " + ", ".join(f"{e:.1e}" for e in lam_err.values())
          + f"; heuristic damping·m vs kronfluence's: max rel {max(damp_err.values()):.1e}"
          + f"; scores ours vs m·kronfluence: heuristic {score_err[None]:.1e}, explicit "
          f"{score_err[m * EXPLICIT_DAMPING]:.1e}")
    assert max(factor_err.values()) <= KF_TOL  # the same factors: the same eigenbasis
    assert max(lam_err.values()) <= KF_TOL
    assert max(damp_err.values()) <= KF_TOL
    assert max(score_err.values()) <= KF_TOL


def _spearman_worst(x: torch.Tensor, y: torch.Tensor) -> float:
    """The lowest per-query Spearman rank correlation of two ``[Q, N]`` score matrices (no
    ties in float64 scores)."""
    def ranks(v):
        return v.argsort(1).argsort(1).double()

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(1, keepdim=True), ry - ry.mean(1, keepdim=True)
    return float(((rx * ry).sum(1) / (rx.norm(dim=1) * ry.norm(dim=1))).min())


def test_what_separates_the_two_without_the_matched_setting(sides, tmp_path):
    """The two departures from the matched setting a comparison meets, each alone, at each
    side's heuristic damping (scores rescaled by ``m``): kronfluence's covariances over its
    attention mask (every real token, the last one included: another eigenbasis), and our
    one-epoch lr-0 run (no longer than ``snapshot_every``: its extra midway snapshot's basis,
    fitted on the first half of the sequences, and its correction measured on the second half
    only). Each moves ``λ`` and the scores by far more than `KF_TOL` (the figures: printed,
    and in docs/computed.md)."""
    m, kf, queries = sides["m"], sides["kf"][None], sides["queries"]
    model, train = sides["model"], sides["train"]
    final = sides["snapshots"][1]
    post = LaplacePosterior(model, final, 1.0)
    matched = Influence(post, "heuristic", eigenvalues="ekfac").scores(queries,
                                                                        _batches(train)).scores
    lam_mask, kf_mask, _ = _kronfluence(model, train, queries, tmp_path / "kf", [None],
                                     mask=_real_tokens)
    one = _ours(model, train, tmp_path / "ours", {"snapshot_every": 10**6}, epochs=1)[-1]
    assert one[LAYERS[0]].entry.ekfac.basis_step == STEPS_PER_EPOCH // 2  # the extra snapshot
    one_scores = Influence(LaplacePosterior(model, one, 1.0), "heuristic", eigenvalues="ekfac"
                           ).scores(queries, _batches(train)).scores
    figures = {
        "kronfluence's attention mask": (
            max(_rel(final[n].ekfac_eigvals * m, lam_mask[n]) for n in LAYERS),
            _rel(matched, m * kf_mask[None]), _spearman_worst(matched, kf_mask[None])),
        "our one-epoch run": (
            max(_rel(one[n].ekfac_eigvals * m, sides["lam_kf"][n]) for n in LAYERS),
            _rel(one_scores, m * kf), _spearman_worst(one_scores, kf))}
    for what, (lam, scores, rho) in figures.items():
        print(f"\n{what}: λ max rel Frobenius over layers {lam:.3g}, scores rel Frobenius "
              f"{scores:.3g}, worst Spearman {rho:.5f}")
        assert lam > 1e-3 and scores > 1e-3
