"""Independent brute-force K-FAC oracle for the tests (imports nothing from kfac_stream).

Conventions
----------------------
A tracked layer maps a_s in R^{d_in} at token position s to z_s = W a_s + b.
ā_s = [a_s; 1] when the layer has a bias (ones column appended LAST), else a_s.
The micro-batch loss is the SUM of per-token NLLs, L = Σ_t −log p(y_t | x_<t), over every
loss-bearing position with the Hugging Face shift (``logits[:, t]`` predicts
``labels[:, t+1]``; ``labels == -100`` are ignored).  g_s = ∂L/∂z_s at every non-padding
position s (``attention_mask == 1``; positions without a label are still used) that can
carry a gradient: at or before its row's last loss-bearing position (a later one has
g_s = 0 in a causal model).
Over a set S of positions: A = (1/|S|) Σ ā_s ā_sᵀ and G = (1/|S|) Σ g_s g_sᵀ.

Everything is computed in float64 on a private deep copy of the model (all forward /
backward hooks of the copy are dropped, all its parameters require grad, it runs in
``eval()`` mode so that gradient checkpointing and dropout are off), so the caller's model
and any hooks attached to it are never touched or triggered.

Supported layers: ``nn.Linear`` (weight [d_out, d_in]), ``transformers`` ``Conv1D``
(weight [d_in, d_out], forward x @ W + b) and the ``nn.Linear`` modules inside peft LoRA
layers (``...lora_A.default``, ``...lora_B.default``).  A tracked layer must be called
exactly once per forward with an input whose leading dims flatten to B*T.

Public API
----------
* ``ForwardRecorder(model)`` — context manager recording training micro-batch forwards.
* ``float64_copy(model) -> nn.Module``
* ``reference_rows(model, kwargs, layer_names, state=None) -> (rows, mask)``
* ``reference_factors(model, records, layer_names, positions=None) -> (factors, count)``
* ``expected_fisher_G(model, kwargs, layer_names, state=None) -> dict[str, Tensor]``
* ``summed_nll(logits, labels) -> Tensor``;  ``labels_of(kwargs) -> Tensor``
* ``rel_err(x, ref) -> float``
* ``moved_into_basis(eigvals, old, new) -> Tensor`` — an EK-FAC correction moved into another
  eigenbasis
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ForwardRecorder",
    "float64_copy",
    "labels_of",
    "summed_nll",
    "reference_rows",
    "reference_factors",
    "expected_fisher_G",
    "rel_err",
    "moved_into_basis",
]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


# --------------------------------------------------------------------------- recording


class ForwardRecorder:
    """Record every training micro-batch forward of ``model``.

    ``with ForwardRecorder(model) as rec: trainer.train()`` registers a forward pre-hook
    (``with_kwargs=True``) on ``model`` itself.  Each call made while ``model.training`` and
    ``torch.is_grad_enabled()`` appends to ``rec.records`` a dict::

        {"kwargs": {name: tensor.detach().clone()  for tensor keyword args},
         "args":   (tensor.detach().clone() for tensor positional args, ...),
         "state":  {k: v.detach().clone() for k, v in model.state_dict().items()}}

    e.g. kwargs ``input_ids`` [B, T], ``attention_mask`` [B, T], ``labels`` [B, T]
    (and maybe ``num_items_in_batch`` [] — harmless, ignored downstream).  The state is
    taken *before* the forward, i.e. it holds the weights that forward used.  The hook is
    removed on exit.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.records: list[dict[str, Any]] = []
        self._handle = None

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if not (module.training and torch.is_grad_enabled()):
            return None
        rec = {
            "kwargs": {
                k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, Tensor)
            },
            "args": tuple(a.detach().clone() for a in args if isinstance(a, Tensor)),
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        }
        self.records.append(rec)
        return None

    def __enter__(self) -> ForwardRecorder:
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


# --------------------------------------------------------------------------- helpers


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 deep copy of ``model`` without any module forward/backward hooks, with every
    parameter requiring grad, in ``eval()`` mode.  ``model`` itself is not modified."""
    memo: dict[int, Any] = {}
    for mod in model.modules():
        for attr in _HOOK_DICTS:
            d = mod.__dict__.get(attr)
            if d is not None:
                memo[id(d)] = OrderedDict()  # the copy gets an empty hook dict
    m = copy.deepcopy(model, memo)
    m = m.to(torch.float64)
    for p in m.parameters():
        p.requires_grad_(True)
    m.eval()
    return m


def labels_of(kwargs: Mapping[str, Tensor]) -> Tensor:
    """Unshifted labels [B, T] of a batch: ``kwargs["labels"]`` if present, else
    ``input_ids`` with -100 where ``attention_mask == 0``."""
    if kwargs.get("labels") is not None:
        return kwargs["labels"]
    labels = kwargs["input_ids"].clone()
    am = kwargs.get("attention_mask")
    if am is not None:
        labels[am == 0] = -100
    return labels


def _attention_mask(kwargs: Mapping[str, Tensor]) -> Tensor:
    am = kwargs.get("attention_mask")
    if am is None:
        am = torch.ones_like(kwargs["input_ids"])
    return am


def summed_nll(logits: Tensor, labels: Tensor) -> Tensor:
    """L = Σ_t −log softmax(logits[b, t])[labels[b, t+1]] over labels[b, t+1] != -100.

    logits: [B, T, V]; labels: [B, T] (unshifted, HF convention).  Returns a scalar."""
    lg = logits[:, :-1, :]
    lb = labels[:, 1:]
    valid = lb != -100
    logp = F.log_softmax(lg.to(torch.float64), dim=-1)
    tok = logp.gather(-1, lb.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    return -(tok * valid).sum()


def _has_bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def _capture(m: nn.Module, kwargs: Mapping[str, Tensor], layer_names: Sequence[str]):
    """Forward ``m`` on input_ids/attention_mask; return (logits [B,T,V], inputs, outputs)
    where inputs[name] is the detached layer input and outputs[name] the layer output
    (part of the autograd graph)."""
    modules = dict(m.named_modules())
    missing = [n for n in layer_names if n not in modules]
    if missing:
        raise KeyError(f"unknown layer names: {missing}")
    inputs: dict[str, list[Tensor]] = {n: [] for n in layer_names}
    outputs: dict[str, list[Tensor]] = {n: [] for n in layer_names}
    handles = []

    def make_hook(name):
        def hook(mod, args, out):
            inputs[name].append(args[0].detach())
            outputs[name].append(out)

        return hook

    for n in layer_names:
        handles.append(modules[n].register_forward_hook(make_hook(n)))
    try:
        input_ids = kwargs["input_ids"]
        am = _attention_mask(kwargs)
        with torch.enable_grad():
            out = m(input_ids=input_ids, attention_mask=am)
    finally:
        for h in handles:
            h.remove()
    for n in layer_names:
        if len(outputs[n]) != 1:
            raise RuntimeError(f"layer {n} was called {len(outputs[n])} times in one forward")
    logits = out.logits if hasattr(out, "logits") else out[0]
    return (
        logits,
        {n: v[0] for n, v in inputs.items()},
        {n: v[0] for n, v in outputs.items()},
    )


def _abar(module: nn.Module, a: Tensor, n_rows: int) -> Tensor:
    a = a.reshape(n_rows, -1).to(torch.float64)
    if _has_bias(module):
        a = torch.cat([a, a.new_ones(n_rows, 1)], dim=1)
    return a


def _rows(m: nn.Module, kwargs: Mapping[str, Tensor], layer_names: Sequence[str]):
    input_ids = kwargs["input_ids"]
    B, T = input_ids.shape
    N = B * T
    logits, ins, outs = _capture(m, kwargs, layer_names)
    L = summed_nll(logits, labels_of(kwargs))
    names = list(layer_names)
    grads = torch.autograd.grad(L, [outs[n] for n in names], allow_unused=True)
    modules = dict(m.named_modules())
    rows = {}
    for n, g in zip(names, grads):
        o = outs[n]
        if g is None:
            g = torch.zeros_like(o)
        if o.numel() // o.shape[-1] != N:
            raise RuntimeError(f"layer {n}: output {tuple(o.shape)} does not flatten to B*T={N}")
        rows[n] = (_abar(modules[n], ins[n], N), g.reshape(N, -1).to(torch.float64))
    return rows, _gradient_mask(kwargs), L.detach()


def _gradient_mask(kwargs: Mapping[str, Tensor]) -> Tensor:
    """[B*T] bool: ``attention_mask == 1`` and at or before the row's last position t with
    ``labels[b, t+1] != -100`` (`labels_of`: without labels, the next real token's), a loop
    by hand."""
    am = _attention_mask(kwargs).bool()
    labels = labels_of(kwargs)
    keep = torch.zeros_like(am)
    for b in range(am.shape[0]):
        bearing = [t for t in range(am.shape[1] - 1) if int(labels[b, t + 1]) != -100]
        if bearing:
            keep[b, : max(bearing) + 1] = True
    return (am & keep).reshape(-1)


# --------------------------------------------------------------------------- public oracle


def reference_rows(
    model: nn.Module,
    kwargs: Mapping[str, Tensor],
    layer_names: Sequence[str],
    state: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, tuple[Tensor, Tensor]], Tensor]:
    """Per-position rows for one batch (float64, on a private copy of ``model``).

    kwargs: ``input_ids`` [B, T], optional ``attention_mask`` [B, T], optional ``labels``
    [B, T]; ``state``: optional state dict to load into the copy first.

    Returns ``(rows, mask)``: ``rows[name] = (abar [B*T, d_in(+1)], g [B*T, d_out])`` for ALL
    B*T positions in row-major (b, t) order, padding included, where g = ∂L/∂z for the
    summed NLL L; ``mask`` [B*T] bool: the positions that can carry a gradient
    (``attention_mask == 1``, and none after the row's last loss-bearing one).
    """
    m = float64_copy(model)
    if state is not None:
        m.load_state_dict(state)
    rows, mask, _ = _rows(m, kwargs, layer_names)
    return rows, mask


def reference_factors(
    model: nn.Module,
    records: Sequence[Mapping[str, Any]],
    layer_names: Sequence[str],
    positions: Sequence[Tensor | None] | None = None,
) -> tuple[dict[str, tuple[Tensor, Tensor]], int]:
    """Token-weighted K-FAC factors over all records (as produced by ``ForwardRecorder``).

    For each record, ``record["state"]`` is loaded into a float64 copy of ``model`` and a
    forward on its ``input_ids`` [B, T] / ``attention_mask`` [B, T] is run; g comes from the
    summed NLL with the record's ``labels`` (or ``input_ids`` masked by attention_mask).
    The rows used are the positions that can carry a gradient (`reference_rows`' mask), further
    restricted to ``positions[i]`` (1-D LongTensor of flat indices into B*T) when given.

    Returns ``(factors, count)``: ``factors[name] = (A [d_in(+1), d_in(+1)],
    G [d_out, d_out])`` float64 = (Σ ā āᵀ / count, Σ g gᵀ / count) accumulated over all
    records, and ``count`` the total number of rows used.
    """
    if positions is not None and len(positions) != len(records):
        raise ValueError("positions needs one entry per record")
    m = float64_copy(model)
    sums: dict[str, list[Tensor | None]] = {n: [None, None] for n in layer_names}
    count = 0
    for i, rec in enumerate(records):
        if rec.get("state") is not None:
            m.load_state_dict(rec["state"])
        rows, mask, _ = _rows(m, rec["kwargs"], layer_names)
        keep = mask.clone()
        if positions is not None and positions[i] is not None:
            sel = torch.zeros_like(keep)
            sel[positions[i].reshape(-1).long()] = True
            keep &= sel
        idx = keep.nonzero().squeeze(1)
        count += int(idx.numel())
        for n, (a, g) in rows.items():
            a, g = a[idx], g[idx]
            aa, gg = a.T @ a, g.T @ g
            s = sums[n]
            s[0] = aa if s[0] is None else s[0] + aa
            s[1] = gg if s[1] is None else s[1] + gg
    if count == 0:
        raise ValueError("no positions selected")
    return {n: (s[0] / count, s[1] / count) for n, s in sums.items()}, count


def expected_fisher_G(
    model: nn.Module,
    kwargs: Mapping[str, Tensor],
    layer_names: Sequence[str],
    state: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Exact expected ("true", type-2) Fisher G factor for one batch.

    Labels are resampled from the model's own predictive at every loss-bearing logit
    position t (HF shift: t with ``labels[b, t+1] != -100``); with J_{s,t} = ∂logits_t/∂z_s
    [V, d_out] and p_t the softmax, g_s^{(t,y)} = J_{s,t}ᵀ (p_t − e_y) and

        E[g_s g_sᵀ] = Σ_t J_{s,t}ᵀ (diag p_t − p_t p_tᵀ) J_{s,t}

    (cross terms between different t vanish in expectation).  Returns
    ``G[name] = (1/n) Σ_s E[g_s g_sᵀ]`` [d_out, d_out] float64, the sum and n running over
    the positions s that can carry a gradient (`reference_rows`' mask).

    kwargs: ``input_ids`` [B, T], optional ``attention_mask`` [B, T] / ``labels`` [B, T].
    Cost: one batched (vmap) backward of V vectors per logit position t.
    """
    m = float64_copy(model)
    if state is not None:
        m.load_state_dict(state)
    input_ids = kwargs["input_ids"]
    B, T = input_ids.shape
    names = list(layer_names)
    logits, _, outs = _capture(m, kwargs, names)
    V = logits.shape[-1]
    valid = labels_of(kwargs)[:, 1:] != -100  # [B, T-1]
    probs = F.softmax(logits.detach().to(torch.float64), dim=-1)  # [B, T, V]
    smask = _gradient_mask(kwargs).reshape(B, T).to(torch.float64)  # [B, T]
    n_pos = int(smask.sum().item())
    out_list = [outs[n] for n in names]
    G = {n: torch.zeros(outs[n].shape[-1], outs[n].shape[-1], dtype=torch.float64) for n in names}
    eye = torch.arange(V)
    for t in range(T - 1):
        vb = valid[:, t]
        if not bool(vb.any()):
            continue
        go = torch.zeros(V, B, T, V, dtype=logits.dtype)
        go[eye, :, t, eye] = vb.to(logits.dtype)  # go[v, b, t, v] = 1 for loss-bearing b
        try:
            J = torch.autograd.grad(
                logits, out_list, grad_outputs=go, is_grads_batched=True,
                retain_graph=True, allow_unused=True,
            )
        except RuntimeError:  # vmap fallback: one backward per vocab entry
            per_v = [
                torch.autograd.grad(logits, out_list, grad_outputs=go[v],
                                    retain_graph=True, allow_unused=True)
                for v in range(V)
            ]
            J = tuple(
                None if per_v[0][k] is None else torch.stack([pv[k] for pv in per_v])
                for k in range(len(names))
            )
        p = probs[:, t, :] * vb.to(torch.float64).unsqueeze(-1)  # [B, V]; 0 if not loss-bearing
        for n, Jn in zip(names, J):
            if Jn is None:
                continue
            d = Jn.shape[-1]
            Jn = Jn.reshape(V, B, T, d).to(torch.float64) * smask[None, :, :, None]
            # Σ_{b,s} J_{bs}ᵀ diag(p_b) J_{bs} − (J_{bs}ᵀ p_b)(J_{bs}ᵀ p_b)ᵀ
            pw = p.T[:, :, None, None]  # [V, B, 1, 1]
            Jp = (Jn * pw).sum(0).reshape(B * T, d)  # [B*T, d]
            Jf = Jn.reshape(V * B * T, d)
            G[n] += Jf.T @ (Jn * pw).reshape(V * B * T, d) - Jp.T @ Jp
    return {n: g / n_pos for n, g in G.items()}


def rel_err(x: Tensor, ref: Tensor) -> float:
    """||x − ref||_F / ||ref||_F computed in float64."""
    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    return float(torch.linalg.norm(x - ref) / torch.linalg.norm(ref))


def moved_into_basis(eigvals: Tensor, old: tuple[Tensor | None, Tensor | None],
                     new: tuple[Tensor | None, Tensor | None]) -> Tensor:
    """A correction ``λ`` measured on the basis ``old = (Q_A, Q_G)`` (a snapshot's
    ``ekfac_eigvals``, on its ``basis_step`` snapshot's eigenvectors) moved into ``new`` (the
    snapshot's own): the diagonal in ``new`` of the EK-FAC Fisher it defines on ``old``,
    ``(R_G∘R_G) λ (R_A∘R_A)ᵀ`` with ``R = Q_newᵀ Q_old`` (None: the identity). It removes the
    basis' part of the staleness (measured in tests/unit/ekfac/test_ekfac.py, docs/computed.md); it
    needs the previous snapshot's eigenvectors, which a snapshot does not hold."""
    out = eigvals.double()
    (oa, og), (na, ng) = old, new
    if ng is not None or og is not None:
        rg = _rotation(ng, og, out.shape[0])
        out = rg.square() @ out
    if na is not None or oa is not None:
        ra = _rotation(na, oa, out.shape[1])
        out = out @ ra.square().T
    return out.to(eigvals.dtype)


def _rotation(new: Tensor | None, old: Tensor | None, d: int) -> Tensor:
    eye = torch.eye(d, dtype=torch.float64)
    n = eye if new is None else new.double()
    o = eye if old is None else old.double()
    return n.T @ o
