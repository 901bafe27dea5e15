"""Exact curvature of tracked layers, float64, the reference of ``influence_peers.py``'s
part 2: per-example gradients of the tracked weights, the exact block-diagonal GGN (and
empirical Fisher) over a training set, each checked against a second form, and influence
scores through a dense curvature block per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sum_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[B]``: each example's summed NLL over its labelled tokens (HF shift), in the logits'
    dtype (float64 stays float64)."""
    logits, labels = logits[:, :-1], labels[:, 1:].to(logits.device)
    nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (nll * (labels != -100)).sum(1)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(torch.linalg.norm(x - y) / torch.linalg.norm(y))


class Hooks:
    """Forward hooks: each tracked layer's input (detached) and output (in the graph), and the
    LM head's input ``h`` (in the graph)."""

    def __init__(self, model: nn.Module, layers: list[str]):
        self.acts, self.outs, self.h = {}, {}, None
        mods = dict(model.named_modules())
        self.bias = {n: mods[n].bias is not None for n in layers}
        self.handles = [mods[n].register_forward_hook(self._hook(n)) for n in layers]
        self.handles.append(model.lm_head.register_forward_hook(self._head))

    def _hook(self, name):
        def fn(module, args, out):
            self.acts[name] = args[0].detach()
            self.outs[name] = out
        return fn

    def _head(self, module, args, out):
        self.h = args[0]

    def abar(self, name: str) -> torch.Tensor:
        a = self.acts[name]
        return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1) if self.bias[name] else a

    def close(self):
        for h in self.handles:
            h.remove()


def per_example_grads(model, layers, batch_list) -> dict[str, torch.Tensor]:
    """``{layer: [N, d_out·d_A]}``: each example's gradient of its summed NLL with respect to
    ``[W b]`` (row-major ``[d_out, d_A]``, bias column last), ``Σ_t δ_t ā_tᵀ``."""
    hooks = Hooks(model, layers)
    out = {n: [] for n in layers}
    try:
        for b in batch_list:
            with torch.enable_grad():
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                losses = sum_nll(logits, b["labels"])
                deltas = torch.autograd.grad(losses.sum(), [hooks.outs[n] for n in layers])
            for n, d in zip(layers, deltas):
                out[n].append(torch.einsum("bti,btj->bij", d, hooks.abar(n)).flatten(1))
    finally:
        hooks.close()
    return {n: torch.cat(v) for n, v in out.items()}


def check_per_example_grad(model, layers, ex: dict) -> float:
    """Max relative difference of `per_example_grads` against autograd's parameter gradients
    (Conv1D weight ``[d_in, d_out]``, transposed, bias appended) on one example."""
    mine = per_example_grads(model, layers, [{k: v[None] for k, v in ex.items()}])
    mods = dict(model.named_modules())
    params = [p for n in layers for p in (mods[n].weight, mods[n].bias)]
    with torch.enable_grad():
        logits = model(input_ids=ex["input_ids"][None]).logits
        grads = torch.autograd.grad(sum_nll(logits, ex["labels"][None]).sum(), params)
    worst = 0.0
    for i, n in enumerate(layers):
        ref = torch.cat([grads[2 * i].T, grads[2 * i + 1][:, None]], 1).flatten()
        worst = max(worst, rel(mine[n][0], ref))
    return worst


def exact_ggn(model, layers, exs: list[dict], chunk: int = 4) -> dict[str, torch.Tensor]:
    """``{layer: Σ_{n,t} J_tᵀ H_t J_t}`` (dense ``[P, P]``, float64; not yet divided by the
    positions), by ``d`` backward rows per position at the LM head's input (module
    docstring)."""
    w_e = model.lm_head.weight.detach()  # [V, d]
    d = w_e.shape[1]
    hooks = Hooks(model, layers)
    ggn = {}
    try:
        for i in range(0, len(exs), chunk):
            ids = torch.stack([e["input_ids"] for e in exs[i:i + chunk]])  # [b, T]
            b, seq = ids.shape
            rows = (seq - 1) * d  # per sequence: positions with a target × d
            with torch.enable_grad():
                logits = model(input_ids=ids.repeat_interleave(rows, 0)).logits  # [b·rows, T, V]
                p = torch.softmax(logits.detach()[::rows, :-1], -1)  # [b, T-1, V]
                wp = p @ w_e  # [b, T-1, d]
                m = (torch.einsum("vi,btv,vj->btij", w_e, p, w_e)
                     - wp[..., :, None] * wp[..., None, :])
                val, vec = torch.linalg.eigh(m)
                k = vec * val.clamp(min=0).sqrt()[..., None, :]  # [b, T-1, d, d]: M = K Kᵀ
                cot = torch.zeros_like(hooks.h)  # [b·rows, T, d]
                r = torch.arange(b * rows)
                t = (r % rows) // d
                cot[r, t] = k[r // rows, t, :, r % d]
                deltas = torch.autograd.grad(hooks.h, [hooks.outs[n] for n in layers],
                                             grad_outputs=cot)
            for n, dl in zip(layers, deltas):
                a = hooks.abar(n)
                jac = torch.einsum("rsi,rsj->rij", dl, a).flatten(1)
                ggn[n] = ggn.get(n, 0) + jac.T @ jac
    finally:
        hooks.close()
    return ggn


def ggn_direct_check(model, layers, ex: dict) -> float:
    """Max relative difference of `exact_ggn` against the direct ``V``-row form on one
    sequence: backward rows ``√p_c (e_c − p_t)`` at the logits, one per (position, class)."""
    fast = exact_ggn(model, layers, [ex], chunk=1)
    hooks = Hooks(model, layers)
    try:
        ids = ex["input_ids"][None]
        seq = ids.shape[1]
        with torch.enable_grad():
            logits = model(input_ids=ids).logits
            v = logits.shape[-1]
            p = torch.softmax(logits.detach()[0, :-1], -1)  # [T-1, V]
            t_all = torch.arange(seq - 1).repeat_interleave(v)
            c_all = torch.arange(v).repeat(seq - 1)
            direct = {}
            for i in range(0, len(t_all), 512):  # rows (position, class) in chunks
                t, c = t_all[i:i + 512], c_all[i:i + 512]
                sq = p[t, c].sqrt()
                cot = torch.zeros(len(t), 1, seq, v, dtype=logits.dtype)
                cot[torch.arange(len(t)), 0, t] = -sq[:, None] * p[t]
                cot[torch.arange(len(t)), 0, t, c] += sq
                deltas = torch.autograd.grad(logits, [hooks.outs[n] for n in layers],
                                             grad_outputs=cot, is_grads_batched=True,
                                             retain_graph=True)
                for n, dl in zip(layers, deltas):
                    jac = torch.einsum("rsi,sj->rij", dl[:, 0], hooks.abar(n)[0]).flatten(1)
                    direct[n] = direct.get(n, 0) + jac.T @ jac
        worst = max(rel(fast[n], direct[n]) for n in layers)
    finally:
        hooks.close()
    return worst


def exact_scores(curv: dict[str, torch.Tensor], damping: dict[str, float],
                 gq: dict[str, torch.Tensor], gt: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[Q, N]``: ``Σ_l g_qᵀ (F_l + λ_l I)⁻¹ g_n`` by Cholesky solves."""
    total = 0
    for n, f in curv.items():
        chol = torch.linalg.cholesky(f + damping[n] * torch.eye(len(f), dtype=f.dtype))
        x = torch.cholesky_solve(gq[n].T, chol)  # [P, Q]
        total = total + x.T @ gt[n].T
    return total
