"""What a query captures per example: the checked query arguments (`QueryArgs`), the chosen
logits ``f [B, K]`` of each example (`select_logits`), every call of the tracked layers
(`layer_calls`), a layer's input as ``[B, T, d]`` (`per_example_inputs`) and the output
gradients of each chosen logit (`logit_gradients`). Shared by `LaplacePosterior` and
`kfac_stream.query.influence`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..capture.hooks import logits_of
from ..exceptions import QueryInputError, UnsupportedLayoutError
from . import inputs


@dataclass
class QueryArgs:
    """Checked arguments of one predictive query (names as the caller knows them)."""

    where: str
    names: tuple[str, str, str]  # the batch, positions and token_ids arguments
    batch: Mapping[str, Tensor]
    size: int  # B
    positions: int | list[int]
    positions_given: object
    ids: Tensor | None  # [K] (CPU) or [B, K] int64
    ids_given: object


@contextlib.contextmanager
def layer_calls(modules: Mapping[str, nn.Module]
                ) -> Iterator[dict[str, list[tuple[Tensor, Tensor]]]]:
    """Within the block, every call of each of ``modules`` (``{name: module}``) records
    ``(input, output)`` in the yielded ``{name: [(input, output), ...]}`` (a layer run several
    times per forward, ALBERT's shared layers, once per call); an output that does not require
    grad (frozen weights) is replaced by a differentiable copy, so the queries' backward reaches
    it. The hooks are removed on exit."""
    calls: dict[str, list[tuple[Tensor, Tensor]]] = {}

    def hook(name):
        def fn(module, args, out):
            if not out.requires_grad:  # frozen weights: make the output differentiable
                out = out.detach().requires_grad_()
            calls.setdefault(name, []).append((args[0].detach(), out))
            return out
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def per_example_inputs(where: str, name: str, x: Tensor, size: int) -> Tensor:
    """A tracked layer's input ``x`` as ``[B, T, d]`` for a batch of ``size`` = B examples:
    ``[B, ..., d]`` (the positions of each example flattened) or batch-major rows ``[B*T, d]``
    (a 2-D input whose rows are the examples' positions, example by example: OPT's fc1/fc2,
    a pooled ``[B, d]`` head with T = 1).

    Raises:
        UnsupportedLayoutError: any other layout (e.g. sequence-first ``[T, B, d]``), whose
            rows cannot be told apart by example.
    """
    if x.dim() >= 2 and x.numel() > 0 and (
            (x.dim() >= 3 and x.shape[0] == size) or (x.dim() == 2 and x.shape[0] % size == 0)):
        return x.reshape(size, -1, x.shape[-1])
    raise UnsupportedLayoutError(
        f"{where}: layer {name!r} receives its input as {list(x.shape)} for a batch of {size} "
        f"examples: queries need [B, ..., d] ([{size}, T, d]) or batch-major rows [B*T, d]; "
        "leave this layer out of the posterior (layers=[...])")


def logit_gradients(f: Tensor, outs: list[Tensor], batched: bool | None = None
                    ) -> list[tuple[Tensor, ...]]:
    """``K`` tensors of ``out.shape`` per tensor of ``outs``: ``∂f[:, k].sum() / ∂out`` for
    every chosen logit ``k`` of ``f [B, K]`` (rows are independent examples, so the sum over
    rows gives each row's own gradient).

    ``batched`` (None: on an accelerator, not on the CPU) runs the ``K`` backward passes as one
    batched backward (``is_grads_batched``: vmap over the cotangents ``e_k``, the graph walked
    once with ``K``-wide kernels; where an operation of the graph has no batching rule, the
    loop instead), else as a loop of ``K`` backward passes; the same numbers either way. On
    the CPU the loop was measured faster (the 2-layer BERT classifier of
    ``benchmarks/heldout_cost.py``, ``K = 10``: the forward and the loop took 13 forwards'
    time, the forward and the batched backward 15); on an accelerator the single ``K``-wide
    walk is expected to save kernel launches (not measured here). Either way no gradient is
    copied: the loop's are returned as the backward made them, the batched one's as views.
    """
    k_count = f.shape[1]
    if (f.device.type != "cpu" if batched is None else batched) and k_count > 1:
        eye = torch.eye(k_count, dtype=f.dtype, device=f.device)[:, None, :].expand(
            k_count, *f.shape)
        try:
            gs = torch.autograd.grad(f, outs, grad_outputs=eye, retain_graph=True,
                                     allow_unused=True, is_grads_batched=True)
            return [tuple(torch.zeros_like(o) for _ in range(k_count)) if g is None
                    else g.detach().unbind(0) for g, o in zip(gs, outs)]
        except RuntimeError:  # an operation without a vmap rule: fall back to the loop
            pass
    per_k: list[list[Tensor]] = [[] for _ in outs]
    for k in range(k_count):  # one backward per chosen logit
        gs = torch.autograd.grad(f[:, k].sum(), outs, retain_graph=k + 1 < k_count,
                                 allow_unused=True)
        for i, (g, o) in enumerate(zip(gs, outs)):
            per_k[i].append(torch.zeros_like(o) if g is None else g.detach())
    return [tuple(g) for g in per_k]


def layer_gradients(model: nn.Module, modules: Mapping[str, nn.Module], q: QueryArgs
                    ) -> tuple[Tensor, dict[str, list[tuple[Tensor, Tensor]]]]:
    """``(f [B, K], {layer: [(input [B, T, d_in], the K output gradients, each of the output's
    shape) per call]})``: one forward of ``model`` and the ``K`` chosen logits' backwards
    (`logit_gradients`) to the outputs of ``modules`` (``{name: module}``); every call's input
    is laid out per example (`per_example_inputs`) before the caller makes any feature."""
    with layer_calls(modules) as calls, torch.enable_grad():
        logits = logits_of(model(**inputs.forward_inputs(q.batch)))
        f = select_logits(logits, q)  # [B, K]
        names = list(calls)
        flat = [out for n in names for _, out in calls[n]]
        grads = iter(logit_gradients(f, flat))
        per_call = {n: [(a, next(grads)) for a, _ in calls[n]] for n in names}
    calls.clear()
    size = f.shape[0]
    return f, {n: [(per_example_inputs(q.where, n, a, size), g) for a, g in per_call[n]]
               for n in names}


def select_logits(logits: Tensor | None, q: QueryArgs) -> Tensor:
    """``f [B, K]``: the chosen logits of each example.

    ``logits`` is ``[B, C]`` (classification head: ``positions`` ignored, ``token_ids``
    default all ``C`` classes) or ``[B, T, V]`` (language-model head: the row at each
    example's position, then ``token_ids``, required).
    """
    if logits is None or logits.dim() not in (2, 3):
        raise QueryInputError(f"{q.where}: the model's output holds no logits [B, C] or "
                              f"[B, T, V] (got {inputs.show(logits)}): the model must return "
                              "logits (a tensor, or an output with .logits)")
    if logits.dim() == 2:  # classification head: [B, C]
        rows = logits
        ids = q.ids if q.ids is not None else torch.arange(logits.shape[1])
        what = f"the head's {logits.shape[1]} classes"
    else:
        if q.ids is None:
            raise inputs.error(q.where, q.names[2], None,
                               "the K vocabulary ids to query (only a classification head "
                               "defaults to all classes)",
                               problem="is not allowed: token_ids is required for a "
                                       "language-model head (logits [B, T, V])")
        rows = _rows_at_positions(logits, q)  # [B, V]
        ids = q.ids
        what = f"the model's {logits.shape[-1]} vocabulary logits"
    inputs.check_id_range(q.where, q.names[2], q.ids_given, ids, rows.shape[1], what)
    if ids.dim() == 1:
        return rows[:, ids.to(rows.device)]
    return rows.gather(1, ids.to(rows.device))


def _rows_at_positions(logits: Tensor, q: QueryArgs) -> Tensor:
    """``[B, V]`` rows of ``logits [B, T, V]`` at one position per example (negative: counted
    back from the example's last non-padding token, with right or left padding)."""
    B, T = logits.shape[:2]
    idx = inputs.position_index(q.where, q.names[1], q.positions_given,
                                inputs.output_positions(q.batch, T)[1], size=B, length=T,
                                positions=q.positions)
    return logits[torch.arange(B, device=logits.device), torch.tensor(idx, device=logits.device)]
