r"""Influence scores from a snapshot's Kronecker factors: which training examples made the model
say this, with no factor-fitting pass.

For a query example ``z_q`` (a prompt and its completion, the completion labelled; or a
labelled classifier example) and a training example ``z``, the score over the tracked layers
``l`` is

    I(z_q, z) = Σ_l ∇_l L(z_q)ᵀ (F_l + λ_l I)⁻¹ ∇_l L(z)

with ``F_l = A_l ⊗ G_l`` the snapshot's Kronecker factors (the streamed, token-weighted mean
factors: eigendecomposed already, so ``(F_l + λ_l I)⁻¹ vec(V) = Q_G [(Q_Gᵀ V Q_A) ⊘ (γ αᵀ +
λ_l)] Q_Aᵀ`` costs two rotations) and ``L(z)`` the example's loss summed over its labelled
tokens (a classifier's: its cross-entropy; the same sum training takes the mean of). The sign is
kronfluence's: a positive score says that a gradient step on ``z`` lowers the query's loss (the
example is helpful), a negative one that it raises it (harmful).

Damping ``λ_l`` (`DAMPINGS`):

* ``"heuristic"`` (default): ``λ_l = 0.1 · mean(γ αᵀ)`` of the layer, kronfluence's heuristic, so
  scores from the stream and from kronfluence's post-hoc factors are compared at equal damping;
  a layer whose factor is zero (no sampled position carried a gradient there: an encoder
  classifier's last block, a decoder classifier's head under token sampling) has no scale to
  take a tenth of and takes the ``"prior"`` value instead, with a warning naming it;
* ``"prior"``: the Laplace posterior's, ``λ_l = τ_l / N_l`` (the posterior precision is
  ``N·A⊗G + τ``, so ``(A⊗G + τ/N)⁻¹ = N·Σ_posterior``: the scores are then ``N`` times the
  posterior covariance's inner products; ``τ`` and ``N`` as the `LaplacePosterior` holds them);
* a positive float, the same ``λ`` for every layer.

Eigenvalues (`EIGENVALUES`): ``"auto"`` (default) uses, for each layer whose snapshot carries an
EK-FAC correction (``KFACConfig(ekfac=True)``, `kfac_stream.ekfac`; ``snap[name].ekfac_eigvals``),
the corrected eigenvalues ``λ_ij`` in place of ``γ_i α_j`` (and ``"heuristic"`` damping is then
``0.1 · mean(λ)``, as kronfluence's EK-FAC), else K-FAC's; ``"kfac"``: always ``γ αᵀ``;
``"ekfac"``: the corrected ones, an error if a layer has none. A run that asked for the
correction gets it; one that did not is unchanged. A snapshot of a run that asked for it but
carries none (the run's first snapshot: a run no longer than ``snapshot_every`` ends with it,
`kfac_stream.ekfac.schedule`) gets K-FAC's under ``"auto"``, with a warning (once per snapshot)
that names the reason and the schedule that gives one.

Self-influence (`Influence.self_scores`, `self_influence`): ``I(z, z) = Σ_l ∇_l L(z)ᵀ
(F_l + λ_l I)⁻¹ ∇_l L(z)``, each training example against itself, one forward and backward per
batch and no queries: the score that ranks mislabelled or atypical examples first (its value is
large where the model needed a large, poorly explained step for that example alone).

Cost and memory. Each training example is read once, whatever the number of queries: the
query gradients are preconditioned once, before the training set is read (``R`` rows: the
queries, or their completion tokens for the per-token split), and every training batch runs one
forward and one backward of its summed loss (its examples are independent, so each row's output
gradients are its own) and is scored against every row (`InfluenceScores.examples_read` counts
what was read). Per layer the hooks' factors give the per-example gradient ``Σ_t g_t ā_tᵀ``
either as a dense ``[B, d_out, d_A]`` (cost ``B·T·d_out·d_A``, then ``R·B·d_out·d_A`` for the
inner products) or, when cheaper (``R·T < T + R``: one query row), never formed:
``Σ_t g_tᵀ P ā_t`` directly. Peak memory beyond the model's own forward and backward, with
``W = Σ_l d_out·d_A`` the tracked weights (bias columns included) and ``s`` the feature dtype's
bytes (`influence_memory`):

* the preconditioned query rows, ``R·W·s`` (``s``: the feature dtype's bytes, float32 for a
  16-bit model: 64 queries on a 1.1B Llama's ~0.97e9 tracked weights take 248 GB), kept in
  blocks of one query batch each, never concatenated; ``query_device_bytes`` caps their share
  on the model's device: a block past it moves to host memory (pinned on CUDA) as soon as it is
  preconditioned, and is copied back a layer at a time for each training batch (each training
  gradient is still formed once, and scored against every block; the copies are the host
  share of ``R·W·s`` bytes per training batch, so larger training batches amortise them);
* one training batch's hooks (``B·T·Σ_l (d_A + d_out)·s``) and one layer's per-example
  gradients (``B·max_l d_out·d_A·s``);
* the ``[R, N]`` float64 scores on the host: nothing else grows with the training set.

Everything runs on the model's device, in the model's precision (float64 models: float64),
scores accumulated in float64.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..capture.hooks import logits_of
from ..ekfac import ekfac_denominator, missing_correction_reason
from ..exceptions import QueryInputError
from ..utils.progress import progress
from . import inputs
from . import kron_eigen as ke
from .laplace import LaplacePosterior
from .per_example import layer_calls, per_example_inputs

logger = logging.getLogger("kfac_stream")

#: The damping rules (module docstring), besides a positive float.
DAMPINGS = ("heuristic", "prior")

#: ``"heuristic"`` damping: this factor times the mean eigenvalue ``mean(γ αᵀ)`` of the layer.
HEURISTIC_FACTOR = 0.1

#: The snapshots whose missing EK-FAC correction ``"auto"`` has warned of (their paths).
_TOLD_UNCORRECTED: set[str] = set()

#: Which eigenvalues precondition (module docstring).
EIGENVALUES = ("auto", "kfac", "ekfac")


@dataclass(frozen=True)
class InfluenceScores:
    """Influence scores of ``N`` training examples on ``Q`` queries (module docstring).

    Attributes:
        scores: ``[Q, N]`` float64 (CPU): ``I(z_q, z_n)``; positive: ``z_n`` helps the query.
        token_scores: ``[Q, S, N]`` float64 (CPU), the split of each query's score over its
            ``S`` labelled tokens (the loss of token ``s`` alone in place of the query's loss;
            they sum to ``scores``), NaN past a query's own tokens; None unless asked for.
        token_positions: ``[Q, S]`` int64: the position of each split token in the query's
            ``labels`` (``-1`` past its tokens); None with ``token_scores``.
        damping: ``{layer: λ_l}``.
        layers: The layers summed over.
        examples_read: Training examples read (each once: one forward and backward per
            batch, scored against every query row).
        query_bytes: Bytes of the preconditioned query rows (``R·W·s``, module docstring).
        query_bytes_on_host: The part of them held in host memory (``query_device_bytes``).
    """

    scores: Tensor
    token_scores: Tensor | None
    token_positions: Tensor | None
    damping: dict[str, float]
    layers: tuple[str, ...]
    examples_read: int = 0
    query_bytes: int = 0
    query_bytes_on_host: int = 0

    def top_k(self, k: int = 10) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """``((helpful indices [Q, k], scores [Q, k]), (harmful indices, scores))``: the
        training examples with the highest scores, highest first, and with the lowest,
        lowest first (``k`` at most ``N``)."""
        k = min(inputs.check_int("InfluenceScores.top_k", "k", k, 1), self.scores.shape[1])
        top = torch.topk(self.scores, k, dim=1)
        low = torch.topk(self.scores, k, dim=1, largest=False)
        return (top.indices, top.values), (low.indices, low.values)


def example_losses(logits: Tensor, labels: Tensor, shift: bool) -> Tensor:
    """Per-token losses ``[B, T]`` (0 where there is no label) of logits ``[B, T, V]`` and
    labels ``[B, T]`` (``-100``: none; ``shift``: a causal LM, whose logit at ``t`` predicts
    the label at ``t + 1``), or per-example losses ``[B, 1]`` of a classifier's logits
    ``[B, C]`` and labels ``[B]`` (cross-entropy; float labels ``[B]`` of a one-output head:
    squared error ``½(f − y)²``)."""
    if logits.dim() == 2:
        if labels.is_floating_point() and logits.shape[1] == 1:
            return 0.5 * (logits[:, 0] - labels.to(logits.dtype)).square()[:, None]
        return F.cross_entropy(logits, labels.to(logits.device).long(), reduction="none")[:, None]
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
        pad = torch.zeros(logits.shape[0], 1, dtype=logits.dtype, device=logits.device)
    labels = labels.to(logits.device)
    nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    nll = torch.where(labels == inputs.IGNORE_INDEX, torch.zeros_like(nll), nll)
    return torch.cat([pad, nll], 1) if shift else nll  # [B, T]: the loss at label t


class _QueryRows:
    """The preconditioned query rows, by layer, in blocks (one per query batch): a block that
    would take the device's share past ``device_bytes`` is moved to host memory (pinned when
    it comes from CUDA) as soon as it is made, so the rows never sit on the device whole."""

    def __init__(self, device_bytes: int | None) -> None:
        self.device_bytes = device_bytes
        #: {layer: [block [R_k, d_out, d_A], ...]}, the blocks in query order
        self.blocks: dict[str, list[Tensor]] = {}
        self.bytes = self.host_bytes = self.device_used = 0

    @property
    def rows(self) -> int:
        """``R``: the rows of every block of one layer."""
        return sum(len(p) for p in next(iter(self.blocks.values()), ()))

    def add(self, layer: str, block: Tensor) -> None:
        """Keep one block of ``layer``'s rows (``[R_k, d_out, d_A]``)."""
        size = block.numel() * block.element_size()
        self.bytes += size
        over = self.device_bytes is not None and self.device_used + size > self.device_bytes
        if over and block.device.type != "cpu":
            block = block.to("cpu").pin_memory() if block.is_cuda else block.to("cpu")
            self.host_bytes += size
        else:
            self.device_used += size
        self.blocks.setdefault(layer, []).append(block)


class Influence:
    """Influence scores over the layers of a `LaplacePosterior` (module docstring).

    Args:
        post: The posterior: its model (whole weights, in eval mode for deterministic scores),
            its snapshot's eigendecomposed factors and, for ``damping="prior"``, its ``τ`` and
            ``N`` per layer.
        damping: ``"heuristic"`` (default), ``"prior"`` or a positive float (module docstring).
        eigenvalues: ``"auto"`` (default), ``"kfac"`` or ``"ekfac"`` (module docstring).
    """

    def __init__(self, post: LaplacePosterior, damping: float | str = "heuristic",
                 eigenvalues: str = "auto") -> None:
        where = "Influence"
        if not isinstance(post, LaplacePosterior):
            raise inputs.error(where, "post", post, "a kfac_stream.LaplacePosterior", typed=True)
        allowed = f"one of {DAMPINGS} or a positive finite float"
        if isinstance(damping, str):
            inputs.check_choice(where, "damping", damping, DAMPINGS)
        else:
            inputs.check_positive(where, "damping", damping, allowed)
        self.post, self.model = post, post.model
        self.layers = tuple(post.layer_names)
        self.shift = not inputs.seq2seq_lm(self.model)
        inputs.check_choice(where, "eigenvalues", eigenvalues, EIGENVALUES)
        #: {layer: EK-FAC eigenvalues [d_out, d_A] or None (K-FAC's)}
        self.corrected = {n: None if eigenvalues == "kfac" else post.snapshot[n].ekfac_eigvals
                          for n in self.layers}
        missing = [n for n, v in self.corrected.items() if v is None]
        if eigenvalues == "ekfac" and missing:
            raise QueryInputError(f"{where}: eigenvalues='ekfac', but snapshot "
                                  f"{post.snapshot.path} has no EK-FAC correction for "
                                  f"{missing[0]!r} (it needs KFACConfig(ekfac=True), and the "
                                  "run's first snapshot has none); use 'auto' or 'kfac'")
        if eigenvalues == "auto" and missing and len(missing) == len(self.layers):
            _say_uncorrected(post.snapshot)
        self.damping = {n: self._damping(n, damping) for n in self.layers}

    def _damping(self, name: str, rule: float | str) -> float:
        if rule == "prior":
            return self.post.tau(name) / self.post.layer_num_data[name]
        if rule == "heuristic":
            if self.corrected[name] is not None:
                mean = float(self.corrected[name].clamp(min=0).mean())
            else:
                aval, gval = self.post.eig.eigvals(name)
                mean = float(gval.clamp(min=0).mean() * aval.clamp(min=0).mean())
            if mean > 0:
                return HEURISTIC_FACTOR * mean
            # a zero factor (no sampled position carried a gradient there: an encoder
            # classifier's last block, a decoder classifier's head under token sampling): no
            # scale to take 0.1 of; the posterior's damping τ/N instead (said once per layer)
            lam = self.post.tau(name) / self.post.layer_num_data[name]
            logger.warning("kfac_stream: Influence: layer %s has a zero factor (no sampled "
                           "position carried a gradient there), so the heuristic damping would "
                           "be 0; it takes the posterior's tau/N = %.4g instead (pass damping="
                           "'prior' or a float to choose for every layer)", name, lam)
            return lam
        return float(rule)

    # -- per-example factors -------------------------------------------------------------------

    def _io(self, where: str, batch: Mapping[str, Tensor], per_token: bool
            ) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor | None, Tensor]:
        """One forward and backward of ``batch`` (with ``labels``): per layer the inputs
        ``ā [B, T, d_A]`` and the output gradients ``g`` (``[B, T, d_out]`` of each example's
        summed loss; ``per_token``: ``[R, B, T, d_out]``, one row per labelled token, only its
        own example's row non-zero), the ``[B, S]`` positions of the labelled tokens
        (``per_token``, -1 padded) and the number of rows ``R`` per example ``[B]``."""
        if "labels" not in batch:
            raise QueryInputError(f"{where}: a batch without labels: influence needs the loss "
                                  "of each example (labels [B, T], -100 where there is none, or a "
                                  "classifier's labels [B])")
        size, _ = inputs.check_model_batch(where, "batch", batch, self.model)
        batch = inputs.query_batch(where, "batch", batch, self.model)
        modules = {n: self.post.modules[n] for n in self.layers}
        with layer_calls(modules) as calls:  # every call of a layer (ALBERT's: several)
            with torch.enable_grad():
                logits = logits_of(self.model(**inputs.forward_inputs(batch, self.model)))
                losses = example_losses(logits, batch["labels"], self.shift)  # [B, T] / [B, 1]
                names = [n for n in self.layers if n in calls]
                flat = [out for n in names for _, out in calls[n]]
                if per_token:
                    keep = losses.detach() != 0 if losses.shape[1] > 1 else torch.ones_like(
                        losses, dtype=torch.bool)
                    if logits.dim() == 3:
                        keep = batch["labels"].to(keep.device) != inputs.IGNORE_INDEX
                        if self.shift:
                            keep = torch.cat([torch.zeros_like(keep[:, :1]), keep[:, 1:]], 1)
                    rows = keep.nonzero()  # [R, 2]: (example, position)
                    cot = torch.zeros(len(rows), *losses.shape, dtype=losses.dtype,
                                      device=losses.device)
                    cot[torch.arange(len(rows)), rows[:, 0], rows[:, 1]] = 1
                    grads = torch.autograd.grad(losses, flat, grad_outputs=cot,
                                                is_grads_batched=True, allow_unused=True)
                    counts = keep.sum(1).cpu()
                    pos = torch.full((size, int(counts.max()) if size else 0), -1,
                                     dtype=torch.long)
                    for b in range(size):
                        at = keep[b].nonzero()[:, 0].cpu()
                        pos[b, :len(at)] = at
                else:
                    grads = torch.autograd.grad(losses.sum(), flat, allow_unused=True)
                    counts, pos = torch.ones(size, dtype=torch.long), None
        a_out, g_out = {}, {}
        fd = self.post.feature_dtype
        grads = iter(grads)
        for n in names:  # several calls: their positions side by side (the gradient sums them)
            a_parts, g_parts = [], []
            for act, out in calls.pop(n):
                g = next(grads)
                a = per_example_inputs(where, n, act.to(fd), size)  # [B, T, d_in]
                if self.post.snapshot[n].has_bias:
                    a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
                if g is None:
                    g = torch.zeros((*([len(rows)] if per_token else []), *out.shape),
                                    dtype=fd, device=a.device)
                lead = g.shape[:-len(out.shape)] if per_token else ()
                a_parts.append(a)
                g_parts.append(g.to(fd).reshape(*lead, size, a.shape[1], g.shape[-1]))
            a_out[n] = torch.cat(a_parts, dim=1) if len(a_parts) > 1 else a_parts[0]
            g_out[n] = torch.cat(g_parts, dim=-2) if len(g_parts) > 1 else g_parts[0]
        return a_out, g_out, pos, counts

    def gradients(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{layer: [B, d_out, d_A]}``: each example's gradient of its summed loss with
        respect to the layer's ``W̄ = [W b]`` (``Σ_t g_t ā_tᵀ``), in the feature dtype."""
        a, g, _, _ = self._io("Influence.gradients", batch, per_token=False)
        return {n: torch.einsum("bti,btj->bij", g[n], a[n]) for n in a}

    def precondition(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``(F_l + λ_l I)⁻¹`` applied to each row of ``{layer: [R, d_out, d_A]}``."""
        out = {}
        for n, v in grads.items():
            qa, qg = self.post.eigenbases(n)
            out[n] = ke.damped_solve(v, qg, qa, self._denominator(n, v))
        return out

    def _denominator(self, name: str, like: Tensor) -> Tensor:
        """``[d_out, d_A]``: the layer's eigenvalues (EK-FAC's ``λ_ij`` when corrected, else
        ``γ_i α_j``), clamped at 0, plus its damping, in ``like``'s dtype and device."""
        if self.corrected[name] is not None:  # EK-FAC: λ_ij in place of γ_i α_j
            return ekfac_denominator(self.corrected[name], self.damping[name], like=like)
        aval, gval = self.post.eig.eigvals(name, device=like.device)
        return ke.kfac_denominator(gval, aval, self.damping[name], like=like)

    def _self_products(self, name: str, v: Tensor) -> Tensor:
        """``[B]``: ``vec(V)ᵀ (F + λI)⁻¹ vec(V)`` of each ``V`` of ``v [B, d_out, d_A]``, one
        rotation into the eigenbasis: ``Σ_ij (Q_Gᵀ V Q_A)_ij² / D_ij``."""
        qa, qg = self.post.eigenbases(name)
        x = ke.rotate(v if qg is None else qg.T @ v, qa)
        return (x.square() / self._denominator(name, v)).sum((1, 2))

    # -- scores --------------------------------------------------------------------------------

    def _query_rows(self, queries: Iterable[Mapping[str, Tensor]], per_token: bool,
                    device_bytes: int | None) -> tuple[_QueryRows, list[int], Tensor | None]:
        """The preconditioned query rows (`_QueryRows`: ``{layer: [[R_k, d_out, d_A], ...]}``,
        one block per query batch, never concatenated; a block past ``device_bytes`` goes to
        host memory as soon as it is made), the rows of each query (1, or its labelled
        tokens) and the token positions ``[Q, S]`` (``per_token``)."""
        rows = _QueryRows(device_bytes)
        rows_per_query: list[int] = []
        positions: list[Tensor] = []
        for batch in queries:
            a, g, pos, counts = self._io("influence_scores", batch, per_token)
            for n in a:
                if per_token:  # [R, B, T, d_out] -> [R, d_out, d_A], each row its own example
                    v = torch.einsum("rbti,btj->rij", g[n], a[n])
                else:
                    v = torch.einsum("bti,btj->bij", g[n], a[n])
                rows.add(n, self.precondition({n: v})[n])
            rows_per_query += counts.tolist()
            if pos is not None:
                positions.append(pos)
        if not rows_per_query:
            raise QueryInputError("influence_scores: no queries")
        pos = None
        if per_token:
            width = max(p.shape[1] for p in positions)
            pos = torch.cat([F.pad(p, (0, width - p.shape[1]), value=-1) for p in positions])
        return rows, rows_per_query, pos

    def _train_scores(self, q: _QueryRows, batch: Mapping[str, Tensor]) -> tuple[Tensor, int]:
        """``([R, B] float64, B)``: the query rows' inner products with the batch's
        per-example gradients, layer by layer in the cheaper of the dense and the factored
        form; each layer's per-example gradients formed once and scored against every block
        (blocks held on the host are copied to the batch's device first)."""
        a, g, _, _ = self._io("influence_scores", batch, per_token=False)
        total = None
        size = 0
        for n, blocks in q.blocks.items():
            steps, size = a[n].shape[1], a[n].shape[0]
            one = q.rows * steps < steps + q.rows  # one query row: Σ_t g_tᵀ P ā_t
            grad = None if one else torch.einsum("bti,btj->bij", g[n], a[n])
            parts = []
            for p in blocks:
                p = p.to(a[n].device, non_blocking=True)
                parts.append(torch.einsum("bti,rij,btj->rb", g[n], p, a[n]) if one else
                             torch.einsum("rij,bij->rb", p, grad))
            s = torch.cat(parts).double()
            total = s if total is None else total + s
        if total is None:  # no tracked layer ran: every score is 0
            size = inputs.check_batch("influence_scores", "batch", batch,
                                      inputs.input_vocab(self.model))[0]
            total = torch.zeros(q.rows, size, dtype=torch.float64)
        return total, size

    def self_scores(self, train: Iterable[Mapping[str, Tensor]], *,
                    show_progress: bool | None = None) -> Tensor:
        """Self-influence ``I(z_n, z_n)`` of every training example (module docstring):
        ``[N]`` float64 on the CPU, in the order of ``train`` (an iterable of batches with
        ``labels``, on the model's device; read once). Higher: the example is explained
        worse by the rest of the curvature (mislabelled or atypical examples rank first)."""
        out = []
        for batch in self._batches(train, "self-influence", show_progress):
            a, g, _, counts = self._io("self_influence", batch, per_token=False)
            total = torch.zeros(len(counts), dtype=torch.float64)
            for n in a:
                v = torch.einsum("bti,btj->bij", g[n], a[n])  # [B, d_out, d_A]
                total += self._self_products(n, v).double().cpu()
            out.append(total)
        if not out:
            raise QueryInputError("self_influence: no training examples")
        return torch.cat(out)

    @staticmethod
    def _batches(train: Iterable[Mapping[str, Tensor]], desc: str,
                 show_progress: bool | None):
        """``train``'s batches, with a progress bar over them."""
        total = None
        try:
            total = len(train)  # type: ignore[arg-type]
        except TypeError:
            pass
        bar = progress(total=total, desc=desc, unit="batch", show=show_progress)
        try:
            for batch in train:
                yield batch
                bar.update(1)
        finally:
            bar.close()

    def scores(self, queries: Mapping[str, Tensor] | Iterable[Mapping[str, Tensor]],
               train: Iterable[Mapping[str, Tensor]], *, per_token: bool = False,
               show_progress: bool | None = None,
               query_device_bytes: int | None = None) -> InfluenceScores:
        """The influence of every training example on every query.

        Args:
            queries: A batch (or an iterable of batches) of query examples with ``labels``
                (``[B, T]``, -100 but at the completion's tokens; a classifier's ``[B]``), on
                the model's device.
            train: An iterable of training batches with ``labels`` (a list, a DataLoader), on
                the model's device; read once, in order (the scores' columns).
            per_token: Also split each query's score over its labelled tokens
                (``token_scores``; costs one backward per token of the queries and ``S`` times
                the preconditioned rows' memory).
            show_progress: A progress bar over the training batches: None (on a terminal),
                True or False.
            query_device_bytes: At most this many bytes of preconditioned query rows stay on
                the model's device; the rest wait in host memory and are copied a layer at a
                time for each training batch (module docstring). None: all on the device.

        Returns:
            An `InfluenceScores`.
        """
        if isinstance(queries, Mapping):
            queries = [queries]
        inputs.check_flag("influence_scores", "per_token", per_token)
        if query_device_bytes is not None:
            inputs.check_int("influence_scores", "query_device_bytes", query_device_bytes, 0)
        q, rows_per_query, pos = self._query_rows(queries, per_token, query_device_bytes)
        cols = []
        read = 0
        for batch in self._batches(train, "influence", show_progress):
            col, size = self._train_scores(q, batch)
            cols.append(col.cpu())
            read += size
        if not cols:
            raise QueryInputError("influence_scores: no training examples")
        rows = torch.cat(cols, dim=1)  # [R, N]
        owner = torch.repeat_interleave(torch.arange(len(rows_per_query)),
                                        torch.tensor(rows_per_query))
        scores = torch.zeros(len(rows_per_query), rows.shape[1], dtype=torch.float64)
        scores.index_add_(0, owner, rows)
        token_scores = None
        if per_token:
            width = pos.shape[1]
            token_scores = torch.full((len(rows_per_query), width, rows.shape[1]), math.nan,
                                      dtype=torch.float64)
            start = 0
            for i, r in enumerate(rows_per_query):
                token_scores[i, :r] = rows[start:start + r]
                start += r
        return InfluenceScores(scores=scores, token_scores=token_scores,
                               token_positions=pos, damping=dict(self.damping),
                               layers=self.layers, examples_read=read,
                               query_bytes=q.bytes, query_bytes_on_host=q.host_bytes)


def influence_scores(post: LaplacePosterior,
                     queries: Mapping[str, Tensor] | Iterable[Mapping[str, Tensor]],
                     train: Iterable[Mapping[str, Tensor]], *, damping: float | str = "heuristic",
                     per_token: bool = False, show_progress: bool | None = None,
                     eigenvalues: str = "auto") -> InfluenceScores:
    """`Influence` ``(post, damping, eigenvalues).scores(queries, train, ...)``: the influence
    of every training example on every query (module docstring; arguments as there)."""
    return Influence(post, damping, eigenvalues).scores(queries, train, per_token=per_token,
                                           show_progress=show_progress)


def self_influence(post: LaplacePosterior, train: Iterable[Mapping[str, Tensor]], *,
                   damping: float | str = "heuristic", eigenvalues: str = "auto",
                   show_progress: bool | None = None) -> Tensor:
    """`Influence` ``(post, damping, eigenvalues).self_scores(train)``: ``[N]`` float64, each
    training example's influence on itself (module docstring), in the order of ``train``."""
    return Influence(post, damping, eigenvalues).self_scores(train, show_progress=show_progress)


def influence_memory(post: LaplacePosterior, rows: int, batch: int, tokens: int,
                     itemsize: int | None = None) -> dict[str, int]:
    """The bytes `Influence.scores` holds beyond the model's forward and backward (module
    docstring), for ``rows`` query rows and training batches of ``batch`` examples of
    ``tokens`` positions: ``{"query_rows": R·W·s, "batch_hooks": B·T·Σ(d_A + d_out)·s,
    "batch_gradients": B·max d_out·d_A·s, "tracked_weights": W}`` (``s``: ``itemsize``, by
    default the posterior's feature dtype's)."""
    s = itemsize or torch.empty((), dtype=post.feature_dtype).element_size()
    entries = [post.snapshot.manifest.layers[n] for n in post.layer_names]
    shapes = [(int(e.d_out), int(e.d_in) + bool(e.has_bias)) for e in entries]
    weights = sum(o * a for o, a in shapes)
    return {"query_rows": rows * weights * s,
            "batch_hooks": batch * tokens * sum(o + a for o, a in shapes) * s,
            "batch_gradients": batch * max((o * a for o, a in shapes), default=0) * s,
            "tracked_weights": weights}


def _say_uncorrected(snapshot) -> None:
    """Warn, once per snapshot, that ``eigenvalues="auto"`` falls back to K-FAC's eigenvalues
    on a snapshot of a ``KFACConfig(ekfac=True)`` run that carries no correction, naming why
    and what to change (`kfac_stream.ekfac.missing_correction_reason`); nothing for a run
    without ``ekfac``."""
    config = snapshot.manifest.config
    if not config.get("ekfac") or str(snapshot.path) in _TOLD_UNCORRECTED:
        return
    _TOLD_UNCORRECTED.add(str(snapshot.path))
    logger.warning("kfac_stream: Influence: snapshot %s of a KFACConfig(ekfac=True) run carries "
                   "no EK-FAC correction, so eigenvalues='auto' uses K-FAC's eigenvalues: %s "
                   "(eigenvalues='kfac' says this choice outright)", snapshot.path,
                   missing_correction_reason(snapshot.step, config))
