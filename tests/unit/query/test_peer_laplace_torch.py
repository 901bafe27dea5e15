r"""Peer agreement with laplace-torch's ``KronLaplace``.

Same tiny model, same data, same weights: a float64 ``tiny_llama`` (every tracked layer a plain
``nn.Linear`` without bias, plus ``lm_head``) is "trained" with ``learning_rate=0`` by the
callback (``fisher="empirical"``, ``token_fraction=1``, ``ema_decay=1``, float64 storage,
``update_every=1``, SUM-of-token-NLL loss), so the factors are collected on exactly the weights
that laplace-torch then fits at. laplace-torch gets the same ``N_seq`` sequences of ``T``
tokens (one full batch, and again in batches of 2 sequences), through `SeqLM`, a wrapper
that maps ``input_ids [B, T]`` to the logits in ``CrossEntropyLoss``'s layout ``[B, V, T]``
with targets ``y [B, T]`` (``y[:, t]`` is token ``t+1``, the Hugging Face shift). The
callback trains on the same sequences one token longer (``T + 1``): its rows are the
positions that carry the loss, ``0..T-1`` (the last token scores nothing), laplace-torch's are
every position of its ``T``, each with a target (the next token): the same rows. Backend
``CurvlinopsEF`` (empirical Fisher, K-FAC *expand*: every position of a sequence is a row of
the factors), restricted to the tracked layers by ``requires_grad=False`` everywhere else.

Normalisation mapping (derived from laplace-torch 0.3 / curvlinops 3.0.1 source)
-----------------------------------------------------------------------------------
Write ``S_A = Σ_{n,t} a aᵀ`` and ``S_G = Σ_{n,t} g gᵀ`` over the ``N_seq·T`` positions, with
``g = ∂(Σ_t NLL_t)/∂z`` (SUM loss over the ``T`` next-token targets).

* laplace-torch: curvlinops' ``KFACLinearOperator`` (loss ``CrossEntropyLoss(reduction="sum")``)
  gives ``A_cl = S_A / (N_data · T)`` — ``N_data`` = the *sequences* in the batch, ``T`` the
  weight-sharing (sequence) length of the expand approximation — and ``B_cl = S_G`` (summed
  over tokens, correction 1 for ``"sum"``); laplace-torch rescales ``A`` by ``len(y)/N`` with
  ``N = len(train_loader.dataset)`` (sequences; 1 for one full batch) and sums ``A`` and ``B``
  over batches separately (``Kron.__add__``), so for any loader batch size
  ``H_lt = S_A/(N_seq·T) ⊗ S_G`` and the posterior precision is ``H_lt + τ_lt·I``
  (``_H_factor = 1/σ²/temperature = 1`` for classification).
* kfac_stream: ``A = S_A / n_tok``, ``G = S_G / n_tok`` (token-weighted means over the
  ``n_tok`` positions that carry the loss), posterior precision ``N·(A⊗G) + τ·I``.

Equal precisions need ``τ = τ_lt`` and ``N / n_tok² = 1 / (N_seq·T)``, i.e.
``N = n_tok² / (N_seq·T)``; without padding ``n_tok = N_seq·T``, so ``N = n_tok``: the number
of *training tokens*, not laplace-torch's ``N`` (sequences). That is exactly kfac_stream's
default ``num_data`` (``tokens_seen / epochs``), which the test uses and checks. (With padding
laplace-torch would also sum the padding positions' inputs into ``A`` while kfac_stream drops
them, so the factors themselves differ; the test uses unpadded sequences.)

Both sides then give the linearised (GLM) covariance ``J P⁻¹ Jᵀ`` of the same ``K`` logits at
the last position of held-out sequences: kfac_stream's `LaplacePosterior.predictive` and
laplace-torch's ``functional_variance(backend.jacobians(x))`` (full ``[B, K, K]``). They agree
to float64 round-off; the bound is 1e-5 relative (Frobenius). The test also checks that
laplace-torch's ``N`` (sequences) used as kfac_stream's ``num_data`` gives a clearly different
covariance, so the agreement is not blind to the mapping.

laplace-torch is an optional, test-only peer, skipped (with the reason) when it does not import.
It declares ``torchvision`` (and backpack-for-pytorch does too) but imports it nowhere it is used
here, so install it without dependency resolution, which can never touch torch::

    python -m pip install --no-deps laplace-torch==0.3 asdfghjkl==0.1a4 \
        backpack-for-pytorch==1.7.1 curvlinops-for-pytorch==3.0.1 einops unfoldNd einconv \
        linear_operator opt-einsum torchmetrics lightning-utilities scipy

(``asdfghjkl==0.1a4`` provides the ``asdl`` module laplace-torch imports unconditionally; tqdm
and numpy come with transformers.) ``pip check`` then reports only the missing torchvision.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_stream import Snapshot
from kfac_stream.query.laplace import LaplacePosterior

from harness import run, sum_nll_loss
from models import text_examples, tiny_llama
from reference import rel_err

INSTALL_HINT = ("install it with `pip install --no-deps laplace-torch==0.3` plus the deps listed "
                "in this module's docstring, never torch/torchvision")
laplace = pytest.importorskip(
    "laplace", reason=f"laplace-torch is not installed or a dependency is missing; {INSTALL_HINT}")
curvature = pytest.importorskip("laplace.curvature", reason="laplace.curvature did not import")
if not (hasattr(laplace, "KronLaplace") and hasattr(curvature, "CurvlinopsEF")):
    pytest.skip("the importable `laplace` is not laplace-torch >= 0.2 with the Curvlinops backend "
                f"(curvlinops-for-pytorch); {INSTALL_HINT}", allow_module_level=True)

PEER_TOL = 1e-5
N_SEQ, SEQ_LEN = 8, 12
TAU = 0.3
TOKENS = [32, 101, 116, 3]
INCLUDE = [r"^model\.layers\.", r"^lm_head$"]


class SeqLM(nn.Module):
    """laplace-torch view of a causal LM: ``input_ids [B, T] -> logits [B, V, T]``.

    ``predict_ids`` set: ``input_ids -> logits[:, -1, predict_ids]`` (``[B, K]``), the outputs
    whose GLM covariance is compared.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.predict_ids: list[int] | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids,
                         attention_mask=torch.ones_like(input_ids)).logits  # [B, T, V]
        if self.predict_ids is None:
            return logits.permute(0, 2, 1)
        return logits[:, -1, self.predict_ids]


def _freeze_untracked(model: nn.Module, names: list[str]) -> None:
    keep = {n + ".weight" for n in names} | {n + ".bias" for n in names}
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)


def _fit_peer(model: nn.Module, ids: torch.Tensor, loader_batch: int):
    """laplace-torch ``KronLaplace`` (empirical Fisher, K-FAC expand) on the training sequences
    (``ids [N_seq, T + 1]``: the first ``T`` tokens in, every next token a target)."""
    ids, y = ids[:, :-1], ids[:, 1:]  # y[:, t] = token t+1 for every t < T
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, y),
                                         batch_size=loader_batch, shuffle=False)
    wrapped = SeqLM(model)
    la = laplace.KronLaplace(wrapped, "classification", prior_precision=TAU,
                             backend=curvature.CurvlinopsEF)  # kfac_approx="expand" by default
    la.fit(loader)
    return la, wrapped


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peer_laplace")
    model = tiny_llama()
    tracked = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and (n.startswith("model.layers.") or n == "lm_head")]
    _freeze_untracked(model, tracked)  # laplace-torch's subset of weights = the tracked layers
    # equal lengths, no padding; one token more than laplace-torch's T (its last scores nothing)
    examples = text_examples(N_SEQ, SEQ_LEN + 1, seed=3)
    cfg = {"fisher": "empirical", "token_fraction": 1.0, "ema_decay": 1.0,
           "storage_dtype": "float64", "update_every": 1, "include": INCLUDE}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run(model, examples, cfg, batch=2, lr=0.0, loss=sum_nll_loss, tmp_path=tmp, record=False)
    snap = Snapshot.latest(tmp / "kfac")
    assert sorted(snap.layer_names) == sorted(tracked)
    for k, v in model.state_dict().items():  # lr=0: the factors were taken at these weights
        assert torch.equal(v, before[k]), k
    model.eval()
    ids = torch.stack([e["input_ids"] for e in examples])  # [N_SEQ, SEQ_LEN + 1]
    peers = {b: _fit_peer(model, ids, b) for b in (N_SEQ, 2)}
    test = text_examples(3, 10, seed=11)
    batch = {k: torch.stack([e[k] for e in test]) for k in ("input_ids", "attention_mask")}
    return model, snap, tracked, peers, batch


def _peer_predictive(la, wrapped, input_ids):
    wrapped.predict_ids = TOKENS
    try:
        Js, f = la.backend.jacobians(input_ids)  # [B, K, P], [B, K]
        return f.double(), la.functional_variance(Js).double()  # [B, K], [B, K, K]
    finally:
        wrapped.predict_ids = None


@pytest.mark.parametrize("loader_batch", [N_SEQ, 2], ids=["full-batch", "batch2"])
def test_kron_factors_map_onto_laplace_torch(peer, loader_batch):
    """Per layer: laplace-torch's ``[B, A] = [n_tok·G, n_tok·A/(N_seq·T)]``."""
    _, snap, tracked, peers, _ = peer
    la, wrapped = peers[loader_batch]
    n_tok = N_SEQ * SEQ_LEN
    names = [n[len("lm."):-len(".weight")] for n, p in wrapped.named_parameters()
             if p.requires_grad]
    assert names == tracked and len(la.H_facs.kfacs) == len(names)
    worst = 0.0
    for name, (B, A) in zip(names, la.H_facs.kfacs):
        lf = snap[name]
        worst = max(worst, rel_err(B, n_tok * lf.G), rel_err(A, n_tok / (N_SEQ * SEQ_LEN) * lf.A))
    print(f"\n[{loader_batch=}] Kron factors vs mapped kfac_stream factors: max rel err "
          f"{worst:.1e} over {len(names)} layers")
    assert worst <= PEER_TOL


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("loader_batch", [N_SEQ, 2], ids=["full-batch", "batch2"])
def test_predictive_covariance_agrees_with_laplace_torch_kron(peer, loader_batch):
    model, snap, _, peers, batch = peer
    la, wrapped = peers[loader_batch]
    n_tok = N_SEQ * SEQ_LEN
    post = LaplacePosterior(model, snap, prior_precision=TAU)  # default num_data
    assert post.num_data == n_tok**2 / (N_SEQ * SEQ_LEN)  # == n_tok: no padding
    mean, cov = post.predictive(batch, positions=-1, token_ids=TOKENS)
    f_lt, cov_lt = _peer_predictive(la, wrapped, batch["input_ids"])
    err_mean, err_cov = rel_err(mean, f_lt), rel_err(cov, cov_lt)
    var, var_lt = cov.diagonal(dim1=1, dim2=2), cov_lt.diagonal(dim1=1, dim2=2)
    err_var = float(((var - var_lt) / var_lt).abs().max())
    print(f"\n[{loader_batch=}] laplace-torch {_version()} KronLaplace(CurvlinopsEF, expand) vs "
          f"kfac_stream LaplacePosterior, {len(TOKENS)} logits x {cov.shape[0]} sequences: "
          f"covariance rel err {err_cov:.2e}, max variance rel err {err_var:.2e}, mean rel err "
          f"{err_mean:.2e} (N={post.num_data:g} tokens, tau={TAU})")
    assert err_mean <= 1e-10
    assert err_cov <= PEER_TOL and err_var <= PEER_TOL

    # laplace-torch's own N (sequences) as kfac_stream's num_data: the comparison sees it.
    wrong = LaplacePosterior(model, snap, prior_precision=TAU, num_data=N_SEQ)
    _, cov_wrong = wrong.predictive(batch, positions=-1, token_ids=TOKENS)
    print(f"  (num_data = N_seq = {N_SEQ} instead: rel err {rel_err(cov_wrong, cov_lt):.2e})")
    assert rel_err(cov_wrong, cov_lt) > 100 * PEER_TOL


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("laplace-torch")
    except PackageNotFoundError:
        return "?"
