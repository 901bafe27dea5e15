r"""`LaplacePosterior`: linearised-Laplace queries of a trained model and a snapshot.

Posterior over the tracked layers' weights ``W̄ = [W b]``: a Gaussian around the trained
weights with block-diagonal precision ``N·(A⊗G) + τI`` per layer (``kron_eigen``), exact in the
snapshot's eigenbases for any prior precision ``τ`` chosen after training. Everything else in
the model is held at its trained value.

Predictive of chosen logits ``f`` (``[B, K]``), linearised: ``f ~ N(f_MAP, J Σ Jᵀ)`` with, per
layer and logit ``c``, ``J_c = Σ_s g_s^{(c)} ā_sᵀ`` (``g^{(c)} = ∂f_c/∂z``, one backward per
logit) and ``Cov[f_c, f_c'] = Σ_layers Σ_ij M_c[i,j] M_c'[i,j] / D_ij``,
``M_c = Q_Gᵀ J_c Q_A``. Computed in float64.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..capture.hooks import logits_of
from ..capture.selection import layer_spec
from ..exceptions import SnapshotMismatchError
from ..snapshot.snapshot import Snapshot
from . import kron_eigen as ke

#: Which logits to select: ``K`` indices for every row (a sequence of ints), or one row of ``K``
#: indices per example (a ``[B, K]`` integer tensor or ``B`` sequences of ``K`` ints).
TokenIds = Sequence[int] | Sequence[Sequence[int]] | Tensor


def default_num_data(meta: dict) -> float:
    """``N``: non-padding positions in the data set, from the snapshot's counts.

    ``tokens_seen`` counts every training position; divided by the epochs run (when known and
    positive) it is the data set's size, also after a partial epoch.
    """
    seen = float(meta["counts"]["tokens_seen"])
    epoch = meta.get("epoch")
    return seen / epoch if epoch and epoch > 0 else seen


class LaplacePosterior:
    """Laplace posterior over the tracked layers of ``model`` from ``snapshot``.

    Args:
        model: The trained model (the one the snapshot was tracked on, or a copy).
        snapshot: A loaded `Snapshot`.
        prior_precision: ``τ``: a float, ``{layer: float}``, or ``"marglik"`` (maximise the
            Laplace marginal likelihood over one shared ``τ``).
        num_data: ``N``; default `default_num_data`.
    """

    def __init__(self, model: nn.Module, snapshot: Snapshot,
                 prior_precision: float | dict[str, float] | str = 1.0,
                 num_data: float | None = None) -> None:
        self.model, self.snapshot = model, snapshot
        self.modules = _match_layers(model, snapshot)
        self.num_data = float(num_data) if num_data is not None else default_num_data(snapshot.meta)
        # Eigenvalue algebra (D, log-determinants, samples) runs in float64; the per-token
        # Jacobian features run in the model's precision (float64 models: float64, else
        # float32 — a float32 model's gradients carry no more digits than that).
        wdtypes = {m.weight.dtype for m in self.modules.values()}
        self.feature_dtype = torch.float64 if torch.float64 in wdtypes else torch.float32
        self.device = next(iter(self.modules.values())).weight.device
        self.eig, self._qf = {}, {}
        for name in snapshot.layer_names:
            lf = snapshot[name]
            self.eig[name] = tuple(None if t is None else t.double() for t in (
                lf.A_eigvecs, lf.A_eigvals, lf.G_eigvecs, lf.G_eigvals))
            self._qf[name] = tuple(None if t is None else t.to(self.device, self.feature_dtype)
                                   for t in (lf.A_eigvecs, lf.G_eigvecs))
        self.prior_precision: float | dict[str, float] = 1.0
        if prior_precision == "marglik":
            self.optimize_prior_precision()
        else:
            self.prior_precision = prior_precision  # type: ignore[assignment]

    # -- helpers ---------------------------------------------------------------------------------

    def tau(self, name: str, prior_precision=None) -> float:
        """Prior precision of one layer."""
        p = self.prior_precision if prior_precision is None else prior_precision
        return float(p[name]) if isinstance(p, dict) else float(p)

    def weights(self, name: str) -> Tensor:
        """Trained ``W̄ = [W b]`` of a layer, ``[d_out, d_A]`` float64 (Conv1D transposed)."""
        m = self.modules[name]
        w = m.weight.detach().double()
        w = w.T if layer_spec(name, m).kind == "conv1d" else w
        if getattr(m, "bias", None) is not None:
            w = torch.cat([w, m.bias.detach().double()[:, None]], dim=1)
        return w

    # -- predictive ------------------------------------------------------------------------------

    def jacobian_features(self, batch: dict[str, Tensor], positions: int | Sequence[int] = -1,
                          token_ids: TokenIds | None = None
                          ) -> tuple[Tensor, Iterator[tuple[str, Tensor]]]:
        """MAP logits and, layer by layer, ``M = Q_Gᵀ J Q_A`` for the chosen logits.

        Args:
            batch: Model inputs (``input_ids``, ``attention_mask``, ...), batch size ``B``.
            positions: Sequence position(s) of the logits, one int for all or one per example;
                negative counts back from the last non-padding token (``-1``: the last one).
                Ignored for classification heads (``logits [B, C]``).
            token_ids: The ``K`` vocabulary (or class) indices: one sequence of ``K`` ints for
                every example, or per example a row of ``K`` (a ``[B, K]`` integer tensor or
                ``B`` sequences of ``K`` ints; row ``b`` selects ``f[b, k] = logits[b, ids[b,
                k]]``). Default: all classes of a classification head.

        Returns:
            ``(f [B, K] float64, iterator of (layer, M [B, K, d_out, d_A]))``; the features
            of one layer at a time (in ``feature_dtype``), so memory stays at one layer's
            ``B·K·d_out·d_A``.
        """
        acts: dict[str, Tensor] = {}
        outs: dict[str, Tensor] = {}

        def hook(name):
            def fn(module, args, out):
                acts[name] = args[0].detach()
                if not out.requires_grad:  # frozen weights: make the output differentiable
                    out = out.detach().requires_grad_()
                outs[name] = out
                return out
            return fn

        handles = [m.register_forward_hook(hook(n)) for n, m in self.modules.items()]
        try:
            with torch.enable_grad():
                logits = logits_of(self.model(**_model_inputs(batch)))
                f = _select_logits(logits, batch, positions, token_ids)  # [B, K]
                names = list(outs)
                grads: dict[str, list[Tensor]] = {n: [] for n in names}
                for k in range(f.shape[1]):  # one backward per chosen logit
                    gs = torch.autograd.grad(f[:, k].sum(), [outs[n] for n in names],
                                             retain_graph=k + 1 < f.shape[1], allow_unused=True)
                    for n, g in zip(names, gs):
                        grads[n].append(torch.zeros_like(outs[n]) if g is None else g.detach())
        finally:
            for h in handles:
                h.remove()
        outs.clear()
        return f.detach().double(), (
            (n, self._features(n, acts.pop(n), torch.stack(grads.pop(n)))) for n in names)

    def _features(self, name: str, a: Tensor, g: Tensor) -> Tensor:
        """``M[b, k] = Σ_t (Q_Gᵀ g_{k,b,t}) (Q_Aᵀ ā_{b,t})ᵀ`` from ``a [B, T, d_in]`` and
        ``g [K, B, T, d_out]``; the input side is rotated once for all K logits."""
        qa, qg = self._qf[name]
        fd = self.feature_dtype
        a = a.to(fd).reshape(a.shape[0], -1, a.shape[-1])  # [B, T, d_in]
        if self.snapshot[name].has_bias:
            a = torch.cat([a, a.new_ones(a.shape[0], a.shape[1], 1)], dim=-1)  # [B, T, d_A]
        g = g.to(fd).reshape(g.shape[0], g.shape[1], -1, g.shape[-1])  # [K, B, T, d_out]
        return torch.einsum("kbti,btj->bkij", ke.rotate(g, qg), ke.rotate(a, qa))

    def predictive(self, batch: dict[str, Tensor], positions: int | Sequence[int] = -1,
                   token_ids: TokenIds | None = None) -> tuple[Tensor, Tensor]:
        """Linearised predictive of chosen logits under ``self.prior_precision``.

        Arguments as in `jacobian_features`.

        Returns:
            ``(mean [B, K], cov [B, K, K])``, float64.
        """
        mean, covs = self.predictive_covariances(batch, positions, token_ids,
                                                 prior_precisions=[self.prior_precision])
        return mean, covs[0]

    def predictive_covariances(self, batch: dict[str, Tensor],
                               positions: int | Sequence[int] = -1,
                               token_ids: TokenIds | None = None, *,
                               prior_precisions: Sequence[float | dict[str, float]]
                               ) -> tuple[Tensor, Tensor]:
        """The linearised predictive for several prior precisions from ONE Jacobian pass.

        The Jacobian features (`jacobian_features`: the model's forward and one backward per
        chosen logit) do not depend on ``τ``; only the eigenvalues they are divided by do. So
        choosing ``τ`` on held-out data costs one pass, not one per candidate. Entry ``p``
        equals `predictive` with ``prior_precision = prior_precisions[p]`` bit for bit (the
        same float64 operations in the same order).

        Args:
            batch, positions, token_ids: As in `jacobian_features`.
            prior_precisions: ``P`` candidates, each a float ``τ`` or ``{layer: τ}``.

        Returns:
            ``(mean [B, K], covs [P, B, K, K])``, float64; ``covs[p]`` is the covariance
            under ``prior_precisions[p]``.
        """
        f, feats = self.jacobian_features(batch, positions, token_ids)
        B, K = f.shape
        covs = f.new_zeros(len(prior_precisions), B, K, K)  # on the model's device
        for name, m in feats:
            _, aval, _, gval = self.eig[name]
            for p, prior in enumerate(prior_precisions):
                d = ke.precision_eigenvalues(gval, aval, self.num_data, self.tau(name, prior))
                covs[p] += torch.einsum("bkij,blij->bkl", m / d.to(m.device, m.dtype), m).double()
        return f, covs

    def predictive_probs(self, batch: dict[str, Tensor], positions: int | Sequence[int] = -1,
                         token_ids: TokenIds | None = None, method: str = "probit",
                         n_samples: int = 1000, seed: int = 0) -> Tensor:
        """Predictive probabilities over the ``K`` chosen logits (a K-way softmax).

        ``method="probit"``: ``softmax(μ / sqrt(1 + π/8 · diag Σ))``; ``"mc"``: the mean of
        ``softmax(f)`` over ``n_samples`` draws ``f ~ N(μ, Σ)``.

        Returns:
            ``[B, K]``.
        """
        mean, cov = self.predictive(batch, positions, token_ids)
        return probs_from_gaussian(mean, cov, method, n_samples, seed)

    # -- posterior samples -----------------------------------------------------------------------

    @contextlib.contextmanager
    def sampled_weights(self, seed: int = 0) -> Iterator[None]:
        """Replace the tracked weights by one posterior sample inside the block.

        The trained values are restored bit-identically on exit, also when the body raises.
        """
        gen = torch.Generator().manual_seed(seed)
        saved = {}
        with torch.no_grad():
            for name, m in self.modules.items():
                saved[name] = [p.detach().clone() for p in (m.weight, getattr(m, "bias", None))
                               if p is not None]
            try:
                for name, m in self.modules.items():
                    qa, aval, qg, gval = self.eig[name]
                    dw = ke.sample_block(qg, gval, qa, aval, self.num_data, self.tau(name), gen)
                    if self.snapshot[name].has_bias:
                        m.bias.add_(dw[:, -1].to(m.bias.device, m.bias.dtype))
                        dw = dw[:, :-1]
                    kind = layer_spec(name, m).kind
                    m.weight.add_((dw.T if kind == "conv1d" else dw).to(m.weight.device,
                                                                        m.weight.dtype))
                yield
            finally:
                for name, m in self.modules.items():
                    for p, old in zip([p for p in (m.weight, getattr(m, "bias", None))
                                       if p is not None], saved[name]):
                        p.copy_(old)

    # -- confidence score ------------------------------------------------------------------------

    def confidence(self, variance: Tensor) -> Tensor:
        """The seed report's score ``1 / (1 + β·var)`` (``β`` from `fit_beta`, default 1)."""
        return 1.0 / (1.0 + getattr(self, "beta", 1.0) * variance)

    def fit_beta(self, heldout) -> float:
        """Fit ``β`` of `confidence` on held-out data; sets and returns it.

        Args:
            heldout: Iterable of dicts ``{"batch", "token_ids", "labels" [B] (index into
                token_ids of the right answer), "positions" (optional, default -1)}``. The
                score uses the predictive variance of the MAP-predicted logit and is fitted to
                whether that prediction is right (`fit_confidence_beta`).
        """
        variances, correct = [], []
        for item in heldout:
            mean, cov = self.predictive(item["batch"], item.get("positions", -1),
                                        item["token_ids"])
            pred = mean.argmax(-1)  # [B]
            variance = torch.diagonal(cov, dim1=-2, dim2=-1)  # [B, K]
            variances.append(variance.gather(1, pred[:, None])[:, 0].cpu())
            correct.append(pred.cpu() == torch.as_tensor(item["labels"]).cpu())
        self.beta = fit_confidence_beta(torch.cat(variances), torch.cat(correct))
        return self.beta

    # -- evidence --------------------------------------------------------------------------------

    def log_marginal_likelihood(self, prior_precision=None, log_likelihood: float = 0.0) -> float:
        r"""Laplace log marginal likelihood over the tracked weights.

        :math:`\log p(D|\theta^*) + \log p(\theta^*) + \frac P2\log 2\pi - \frac12\log\det H`
        with ``H`` the posterior precision. ``log_likelihood`` is :math:`\log p(D|\theta^*)`
        (minus the training loss summed over the data); it does not depend on ``τ``, so the
        default 0 gives the evidence up to that constant, enough to choose ``τ``.
        """
        total = float(log_likelihood)
        for name in self.modules:
            _, aval, _, gval = self.eig[name]
            tau = self.tau(name, prior_precision)
            w = self.weights(name)
            logdet = ke.log_det_precision(gval, aval, self.num_data, tau)
            total += float(ke.marglik_terms(w.numel(), float((w * w).sum()), logdet, tau))
        return total

    def optimize_prior_precision(self, lower: float = 1e-6, upper: float = 1e6,
                                 grid: int = 61, iters: int = 60) -> float:
        """Maximise `log_marginal_likelihood` over one shared ``τ``; sets and returns it.

        A log-spaced grid over ``[lower, upper]`` brackets the maximum, golden-section search
        on ``log τ`` refines it.
        """
        def negative_evidence(log_tau: float) -> float:
            return -self.log_marginal_likelihood(math.exp(log_tau))

        self.prior_precision = _minimise_over_log_range(negative_evidence, lower, upper,
                                                        grid, iters)
        return self.prior_precision


def probs_from_gaussian(mean: Tensor, cov: Tensor, method: str = "probit",
                        n_samples: int = 1000, seed: int = 0) -> Tensor:
    """K-way softmax probabilities under ``f ~ N(mean, cov)`` (``[B, K]``, ``[B, K, K]``)."""
    if method == "probit":
        kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * torch.diagonal(cov, dim1=-2, dim2=-1))
        return torch.softmax(mean * kappa, dim=-1)
    if method == "mc":
        gen = torch.Generator().manual_seed(seed)
        k = mean.shape[-1]
        jitter = 1e-10 * torch.diagonal(cov, dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30)
        chol = torch.linalg.cholesky(cov + jitter[:, None, None] * torch.eye(k, dtype=cov.dtype))
        z = torch.randn(n_samples, *mean.shape, generator=gen, dtype=mean.dtype)  # [S, B, K]
        f = mean + torch.einsum("bkl,sbl->sbk", chol, z)
        return torch.softmax(f, dim=-1).mean(0)
    raise ValueError(f"method={method!r} is not supported: use 'probit' or 'mc'")


def fit_confidence_beta(variances: Tensor, correct: Tensor, lower: float = 1e-8,
                        upper: float = 1e8) -> float:
    """``β ≥ 0`` minimising the binary cross-entropy of ``1/(1+β·var)`` against correctness.

    Args:
        variances: ``[n]`` predictive variances (≥ 0).
        correct: ``[n]`` bool, whether each prediction was right.

    Returns:
        The minimiser over a log-spaced grid on ``[lower, upper]`` refined by golden section.
    """
    v = variances.double().clamp(min=0.0)
    y = correct.double()

    def nll(log_beta: float) -> float:
        conf = (1.0 / (1.0 + math.exp(log_beta) * v)).clamp(1e-12, 1 - 1e-12)
        return -float((y * conf.log() + (1 - y) * (1 - conf).log()).mean())

    return _minimise_over_log_range(nll, lower, upper, grid=161, iters=80)


def _minimise_over_log_range(f: Callable[[float], float], lower: float, upper: float,
                             grid: int, iters: int) -> float:
    """``x`` in ``[lower, upper]`` minimising ``f(log x)`` (``f`` takes the logarithm).

    ``grid`` log-spaced points bracket the minimum (the best point and its two neighbours),
    ``iters`` golden-section steps on ``log x`` refine it, one evaluation of ``f`` per step;
    ties keep the left part. Returns ``x`` at the centre of the final bracket.
    """
    xs = torch.linspace(math.log(lower), math.log(upper), grid).tolist()
    values = [f(x) for x in xs]
    best = min(range(grid), key=values.__getitem__)
    lo, hi = xs[max(best - 1, 0)], xs[min(best + 1, grid - 1)]
    r = (math.sqrt(5) - 1) / 2  # 1/φ: each step keeps this fraction of the bracket
    c, d = hi - r * (hi - lo), lo + r * (hi - lo)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:  # the minimum lies in [lo, d]; the old c becomes the new d
            hi, d, fd = d, c, fc
            c = hi - r * (hi - lo)
            fc = f(c)
        else:  # in [c, hi]; the old d becomes the new c
            lo, c, fc = c, d, fd
            d = lo + r * (hi - lo)
            fd = f(d)
    return math.exp((lo + hi) / 2)


def _model_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if k not in ("labels", "num_items_in_batch")}


def _select_logits(logits: Tensor, batch: dict[str, Tensor], positions,
                   token_ids: TokenIds | None) -> Tensor:
    """``f [B, K]``: the chosen logits of each example.

    ``logits`` is ``[B, C]`` (classification head: ``positions`` ignored, ``token_ids``
    default all ``C`` classes) or ``[B, T, V]`` (language-model head: the row at each
    example's position, then ``token_ids``, required).
    """
    if logits.dim() == 2:  # classification head: [B, C]
        rows = logits
        if token_ids is None:
            token_ids = list(range(logits.shape[1]))
    else:
        if token_ids is None:
            raise ValueError("token_ids is required for a language-model head")
        rows = _rows_at_positions(logits, batch, positions)  # [B, V]
    per_row = _per_row_ids(token_ids, rows.shape[0])
    if per_row is None:
        return rows[:, list(token_ids)]
    return rows.gather(1, per_row.to(rows.device))


def _rows_at_positions(logits: Tensor, batch: dict[str, Tensor], positions) -> Tensor:
    """``[B, V]`` rows of ``logits [B, T, V]`` at one position per example (negative: counted
    back from the example's last non-padding token)."""
    B, T = logits.shape[:2]
    mask = batch.get("attention_mask")
    lengths = mask.sum(1).tolist() if mask is not None else [T] * B
    pos = [positions] * B if isinstance(positions, int) else list(positions)
    idx = [p if p >= 0 else int(lengths[b]) + p for b, p in enumerate(pos)]
    return logits[torch.arange(B, device=logits.device), torch.tensor(idx, device=logits.device)]


def _per_row_ids(token_ids: TokenIds, batch_size: int) -> Tensor | None:
    """``token_ids`` as a ``[B, K]`` int64 tensor when given per row, ``None`` when one
    sequence of ``K`` ints serves every row."""
    if isinstance(token_ids, Tensor):
        if token_ids.dim() <= 1:
            return None
        ids = token_ids.long()
    elif len(token_ids) and _is_row(token_ids[0]):
        if len({len(row) for row in token_ids}) != 1:
            raise ValueError("per-row token_ids must all have the same length K, got lengths "
                             f"{sorted({len(row) for row in token_ids})}")
        ids = torch.tensor([[int(i) for i in row] for row in token_ids], dtype=torch.long)
    else:
        return None
    if ids.dim() != 2 or ids.shape[0] != batch_size:
        raise ValueError(f"per-row token_ids must be [B, K] with B = {batch_size} (the batch), "
                         f"got shape {tuple(ids.shape)}")
    return ids


def _is_row(x) -> bool:
    """Whether ``x`` is a row of ids (a sequence or 1-D tensor), not one id."""
    return isinstance(x, Tensor) and x.dim() == 1 or isinstance(x, Sequence)


def _match_layers(model: nn.Module, snapshot: Snapshot) -> dict[str, nn.Module]:
    modules = dict(model.named_modules())
    out = {}
    for name in snapshot.layer_names:
        info = snapshot[name].meta
        if name not in modules:
            raise SnapshotMismatchError(
                f"snapshot {snapshot.path}: tracked layer {name!r} is not a module of the model")
        spec = layer_spec(name, modules[name])
        want = (info["d_in"], info["d_out"], bool(info["has_bias"]))
        have = (spec.d_in, spec.d_out, spec.has_bias)
        if want != have:
            raise SnapshotMismatchError(
                f"snapshot {snapshot.path}: layer {name!r} has (d_in, d_out, bias) = {have} in "
                f"the model but {want} in the snapshot")
        out[name] = modules[name]
    return out
