r"""Pure algebra of one Kronecker-factored posterior block in its eigenbasis.

A tracked layer's weights ``W̄ = [W b]`` (``[d_out, d_A]``, ``d_A = d_in + 1`` with a bias) have
posterior precision :math:`N (A \otimes G) + \tau I` — in the vec convention where ``A`` acts on
the input side and ``G`` on the output side. With :math:`A = Q_A \mathrm{diag}(\alpha) Q_A^\top`,
:math:`G = Q_G \mathrm{diag}(\gamma) Q_G^\top` its eigenvalues are
:math:`D_{ij} = N \gamma_i \alpha_j + \tau` (``[d_out, d_A]``) with eigenvectors
:math:`Q_G e_i (Q_A e_j)^\top`. So for a Jacobian ``J`` (``[d_out, d_A]``) of an output w.r.t.
``W̄``, ``M = Q_Gᵀ J Q_A`` and ``J Σ J'ᵀ = Σ_ij M_ij M'_ij / D_ij``. A diagonal factor has
``Q = I``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def precision_eigenvalues(g_eigvals: Tensor, a_eigvals: Tensor, num_data: float,
                          prior_precision: float) -> Tensor:
    """``D = N γ αᵀ + τ``: ``[d_out, d_A]``."""
    return num_data * torch.outer(g_eigvals, a_eigvals) + prior_precision


def rotate(x: Tensor, q: Tensor | None) -> Tensor:
    """``x @ q`` (rows into the eigenbasis); identity when ``q`` is None (diagonal factor)."""
    return x if q is None else x @ q


def log_det_precision(g_eigvals: Tensor, a_eigvals: Tensor, num_data: float,
                      prior_precision: float) -> Tensor:
    """``log det(N (A⊗G) + τI) = Σ_ij log(N γ_i α_j + τ)`` (float64 scalar)."""
    d = precision_eigenvalues(g_eigvals.double(), a_eigvals.double(), num_data, prior_precision)
    return d.log().sum()


def eigenbasis_draw(root_d: Tensor, generator: torch.Generator,
                    out: Tensor | None = None) -> Tensor:
    """``Z ⊘ sqrt(D)`` with ``Z ~ N(0, I)`` from ``generator``: one draw of the block in its
    eigenbasis, ``[d_out, d_A]`` like ``root_d = sqrt(D)`` (written into ``out`` if given). The
    one place the normals are taken, so every sampler consuming the same generator draws the
    same weights bit for bit."""
    z = torch.randn(root_d.shape, generator=generator, dtype=root_d.dtype, out=out)
    return z.div_(root_d)


def sample_block(g_eigvecs: Tensor | None, g_eigvals: Tensor, a_eigvecs: Tensor | None,
                 a_eigvals: Tensor, num_data: float, prior_precision: float,
                 generator: torch.Generator) -> Tensor:
    """One draw ``ΔW̄ ~ N(0, (N (A⊗G) + τI)^{-1})``: ``Q_G (Z ⊘ sqrt(D)) Q_Aᵀ``, ``[d_out, d_A]``."""
    d = precision_eigenvalues(g_eigvals, a_eigvals, num_data, prior_precision)
    z = eigenbasis_draw(d.sqrt(), generator)
    if g_eigvecs is not None:
        z = g_eigvecs @ z
    if a_eigvecs is not None:
        z = z @ a_eigvecs.T
    return z


def marglik_terms(num_params: int, weight_sq_norm: float, log_det: Tensor,
                  prior_precision: float) -> Tensor:
    r"""The τ-dependent part of the Laplace log marginal likelihood of one block:
    :math:`\frac P2 \log\tau - \frac\tau2\lVert\theta\rVert^2 - \frac12\log\det(\cdot)`
    (the prior's :math:`-\frac P2\log 2\pi` cancels the Laplace :math:`+\frac P2\log 2\pi`)."""
    return (0.5 * num_params * math.log(prior_precision) - 0.5 * prior_precision * weight_sq_norm
            - 0.5 * log_det)


def damped_solve(v: Tensor, q_g: Tensor | None, q_a: Tensor | None, denominator: Tensor
                 ) -> Tensor:
    """``(Q diag(λ) Qᵀ + δI)⁻¹`` applied to each ``V`` of ``v [..., d_out, d_A]`` in the basis
    ``Q = Q_A ⊗ Q_G``: ``Q_G [(Q_Gᵀ V Q_A) ⊘ D] Q_Aᵀ`` with ``D = λ + δ`` (``denominator``,
    ``[d_out, d_A]``, in ``v``'s dtype and device): K-FAC's ``λ = γ αᵀ`` (`kfac_denominator`)
    or EK-FAC's corrected eigenvalues (`kfac_stream.ekfac.ekfac_denominator`). A None basis is
    the identity of a diagonal factor."""
    x = v if q_g is None else q_g.T @ v
    x = (x if q_a is None else x @ q_a) / denominator
    x = x if q_g is None else q_g @ x
    return x if q_a is None else x @ q_a.T


def kfac_denominator(g_eigvals: Tensor, a_eigvals: Tensor, damping: float, like: Tensor
                     ) -> Tensor:
    """``γ αᵀ`` clamped at 0, plus ``damping``, in ``like``'s dtype and device: `damped_solve`'s
    denominator for the K-FAC eigenvalues."""
    return (torch.outer(g_eigvals, a_eigvals).clamp(min=0) + damping).to(like.device, like.dtype)
