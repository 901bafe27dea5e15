r"""The tracked layers under posterior weight samples ``W̄_s = W̄* + ΔW̄_s``.

One sample written into the model (`weights_sampled`, the block of
``LaplacePosterior.sampled_weights``), or ``S_c`` samples at once without changing the model
(`SampledLayers`: the draws, and forwards in which every tracked layer computes the rows of
sample ``s`` with its own weights, exact, or with its own tangent, linearised). The batched
draws consume the same generators in the same order as the in-place one, so sample ``s`` is the
same draw either way. Used by `kfac_stream.query.sampled`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn

from ..capture.hooks import logits_of
from ..capture.selection import layer_spec
from . import kron_eigen as ke


class SampledPosterior(Protocol):
    """What a posterior gives the samples here (`kfac_stream.query.laplace.LaplacePosterior`).

    Attributes:
        model: The model whose tracked layers are sampled.
        modules: ``{layer: module}`` of the tracked layers.
        eig: ``eig[layer]``: ``(Q_A [d_A, d_A], α [d_A], Q_G [d_out, d_out], γ [d_out])``
            (``d_A = d_in + 1`` with a bias; float64 on the CPU, ``Q`` None for a diagonal
            factor).
        layer_num_data: ``{layer: N}`` each layer's data count.
        snapshot: ``snapshot[layer].has_bias``: whether the layer's ``A`` holds a bias row.
        feature_dtype: The dtype the batched draws compute in.
    """

    model: nn.Module
    modules: Mapping[str, nn.Module]
    eig: Any
    layer_num_data: Mapping[str, float]
    snapshot: Any
    feature_dtype: torch.dtype

    def tau(self, name: str) -> float:
        """The prior precision of layer ``name``."""

    def eigenbases(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """``(Q_A [d_A, d_A], Q_G [d_out, d_out])`` of layer ``name`` in ``feature_dtype``
        on the model's device (None for a diagonal factor)."""

#: ``{layer: (W_s [S_c, d_out, d_in], b_s [S_c, d_out] or None)}``: sampled weights of a chunk.
Samples = dict[str, tuple[Tensor, "Tensor | None"]]


@contextlib.contextmanager
def weights_sampled(post: SampledPosterior, seed: int) -> Iterator[None]:
    """Inside the block, ``post``'s tracked weights are one posterior sample (drawn with a
    generator seeded ``seed``, layer by layer); restored bit-identically on exit, also when the
    body raises (`LaplacePosterior.sampled_weights`, with the seed checked)."""
    gen = torch.Generator().manual_seed(seed)
    saved = {}
    with torch.no_grad():
        for name, m in post.modules.items():
            saved[name] = [p.detach().clone() for p in (m.weight, getattr(m, "bias", None))
                           if p is not None]
        try:
            for name, m in post.modules.items():
                qa, aval, qg, gval = post.eig[name]
                dw = ke.sample_block(qg, gval, qa, aval, num_data=post.layer_num_data[name],
                                     prior_precision=post.tau(name), generator=gen)
                if post.snapshot[name].has_bias:
                    m.bias.add_(dw[:, -1].to(m.bias.device, m.bias.dtype))
                    dw = dw[:, :-1]
                kind = layer_spec(name, m).kind
                m.weight.add_((dw.T if kind == "conv1d" else dw).to(m.weight.device,
                                                                    m.weight.dtype))
            yield
        finally:
            for name, m in post.modules.items():
                for p, old in zip([p for p in (m.weight, getattr(m, "bias", None))
                                   if p is not None], saved[name]):
                    p.copy_(old)


class SampledLayers:
    """The tracked layers of a posterior: posterior draws, and forwards of the model with
    per-sample weights (exact) or per-sample tangents (linearised)."""

    def __init__(self, post: SampledPosterior) -> None:
        self.post = post
        self.specs = {n: layer_spec(n, m) for n, m in post.modules.items()}
        self._bases: dict[str, Tensor] = {}

    def base_weight(self, name: str) -> Tensor:
        """The layer's ``W`` as a contiguous ``[d_out, d_in]`` (a Conv1D's transposed copy, made
        once per query: adding a transposed view to every sample's ``ΔW`` read it strided, 5–9×
        slower than the contiguous add on a CPU)."""
        if name not in self._bases:
            m = self.post.modules[name]
            w = m.weight.detach()
            self._bases[name] = (w.T if self.specs[name].kind == "conv1d" else w).contiguous()
        return self._bases[name]

    def draws(self, seeds: range) -> Samples:
        """The sampled weights ``W̄* + ΔW̄`` of every layer in its weight dtype on its device
        (`Samples`): sample ``i`` is ``sampled_weights(seeds[i])``'s draw (the same generator,
        consumed layer by layer in the same order; the rotation ``Q_G Z Q_Aᵀ`` on the device in
        the posterior's ``feature_dtype`` — float64 for float64 models, else float32, whose
        rounding is far below a draw's own spread — with the eigenbases the posterior converted
        once, `LaplacePosterior.eigenbases`), added to the weights as ``sampled_weights`` adds
        them (``W + ΔW`` in the weight's dtype: the very weights it writes)."""
        post = self.post
        # Z ⊘ sqrt(D) by `kron_eigen.eigenbasis_draw`, one generator per seed consumed layer by
        # layer as in sampled_weights (so the draws are bit-equal to its). sqrt(D), the same for
        # every sample, is computed once per layer (per sample it cost more than the rotations).
        root_d, zs = {}, {}
        for name in post.modules:
            _, aval, _, gval = post.eig[name]
            root_d[name] = ke.precision_eigenvalues(gval, aval, post.layer_num_data[name],
                                                    post.tau(name)).sqrt()
            zs[name] = root_d[name].new_empty((len(seeds), *root_d[name].shape))
        for i, s in enumerate(seeds):
            gen = torch.Generator().manual_seed(s)
            for name in post.modules:
                ke.eigenbasis_draw(root_d[name], gen, out=zs[name][i])
        out: Samples = {}
        for name, m in post.modules.items():
            qa, qg = post.eigenbases(name)  # feature dtype, converted once per posterior
            dev = m.weight.device
            z = zs.pop(name).to(dev, post.feature_dtype)
            if qg is not None:
                z = qg.to(dev) @ z
            if qa is not None:
                z = z @ qa.to(dev).T
            dw = z.to(m.weight.dtype)  # ΔW̄ [S_c, d_out, d_A]
            d_in = self.specs[name].d_in
            # one pass writing the contiguous [S_c, d_out, d_in] that bmm reads as its
            # transposed operand (a view of [S_c, d_out, d_A] would read with an odd stride)
            weight = torch.add(dw[:, :, :d_in], self.base_weight(name)[None])
            bias = (m.bias.detach()[None] + dw[:, :, d_in]) if self.specs[name].has_bias \
                else None
            out[name] = (weight, bias)
        return out

    def sampled_forward(self, rows: dict[str, Tensor], samples: Samples,
                        count: int) -> Tensor | None:
        """Logits of the model at ``W̄_s``, rows of sample ``s`` at ``[s·B, (s+1)·B)``."""
        with torch.no_grad(), forwards_replaced(self.post.modules,
                                                 self.sampled_forwards(samples, count)):
            return logits_of(self.post.model(**rows))

    def sampled_forwards(self, samples: Samples, count: int) -> dict[str, object]:
        """``{layer: forward}`` computing sample ``s``'s rows with ``W̄_s`` (the weights handed
        to bmm as their transposed view ``[S_c, d_in, d_out]``, for ``x_s @ W_sᵀ``: BLAS reads
        a transposed operand in place)."""
        return {name: _sampled_linear(w.transpose(1, 2), b, count)
                for name, (w, b) in samples.items()}

    def linearized_forward(self, rows: dict[str, Tensor], samples: Samples,
                           count: int) -> Tensor | None:
        """Logits of the linearised model ``f* + J (W̄_s − W̄*)`` (forward mode), rows as
        above."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        handles = []
        try:
            for name, m in self.post.modules.items():
                w, b = samples[name]
                dw = w - self.base_weight(name)  # see PosteriorDraws: θ_s − θ* as written
                db = None if b is None else b - m.bias.detach()
                handles.append(m.register_forward_hook(_tangent_hook(
                    dw.transpose(1, 2), db, count, self.specs[name].d_in)))
            with torch.no_grad(), fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH):
                logits = logits_of(self.post.model(**rows))
                if logits is None:
                    return None
                primal, tangent = fwAD.unpack_dual(logits)
                return primal if tangent is None else primal + tangent
        finally:
            for h in handles:
                h.remove()


def _sampled_linear(weight: Tensor, bias: Tensor | None, count: int):
    """A tracked layer's forward with ``count`` weights ``weight [S_c, d_in, d_out]`` (and
    ``bias [S_c, d_out]``): ``x [count·B, ..., d_in]`` → ``x_s W_sᵀ + b_s`` per sample group."""
    d_in = weight.shape[1]

    def forward(x: Tensor) -> Tensor:
        xs = x.reshape(count, -1, d_in)
        out = (torch.bmm(xs, weight) if bias is None
               else torch.baddbmm(bias[:, None, :], xs, weight))
        return out.reshape(*x.shape[:-1], weight.shape[-1])

    return forward


def _tangent_hook(w_delta_t: Tensor, b_delta: Tensor | None, count: int, d_in: int):
    """A forward hook adding ``x_s ΔW_sᵀ + Δb_s`` to the tangent of a tracked layer's output
    (the product rule's weight term; the module's own forward carries the input's tangent)."""

    def fn(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        x = fwAD.unpack_dual(args[0]).primal
        xs = x.reshape(count, -1, d_in)
        t = torch.bmm(xs, w_delta_t) if b_delta is None else torch.baddbmm(
            b_delta[:, None, :], xs, w_delta_t)
        primal, tangent = fwAD.unpack_dual(out)
        t = t.reshape(primal.shape)
        return fwAD.make_dual(primal, t if tangent is None else tangent + t)

    return fn


class forwards_replaced:
    """Context manager: ``module.forward = forwards[name]`` (an instance attribute; hooks still
    run), the previous attribute restored on exit, also when the body raises."""

    def __init__(self, modules: Mapping[str, nn.Module], forwards: Mapping[str, object]) -> None:
        self.modules, self.forwards = modules, forwards
        self.saved: list[tuple[nn.Module, object]] = []

    def __enter__(self) -> None:
        for name, fwd in self.forwards.items():
            m = self.modules[name]
            self.saved.append((m, m.__dict__.get("forward")))
            m.forward = fwd  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        for m, prev in reversed(self.saved):
            if prev is None:
                del m.forward
            else:
                m.forward = prev  # type: ignore[method-assign]
        self.saved.clear()

