r"""EK-FAC from the stream: the eigenvalue correction accumulated during training
(``KFACConfig(ekfac=True)``).

K-FAC approximates a layer's Fisher by ``N·(A ⊗ G)``, whose eigenvalues in the basis
``Q_A ⊗ Q_G`` are ``N·γ_i α_j``. EK-FAC (George et al. 2018, "Fast Approximate Natural Gradient
Descent in a Kronecker-factored Eigenbasis"; kronfluence's ``EKFAC`` strategy) keeps the basis
and replaces the Kronecker eigenvalues by the Fisher's own diagonal in it:

    λ_ij = Σ_n (Q_Gᵀ ∇_W L_n Q_A)_ij² / N,     ∇_W L_n = Σ_t g_nt ā_ntᵀ   ([d_out, d_A])

with ``∇_W L_n`` the gradient of sequence ``n``'s loss ``L_n = Σ_t ℓ_t`` (the SUM over its
tokens, as everywhere in this project: `kfac_stream.capture`) with respect to the layer's
``W̄ = [W b]``, the sum over the sequences the statistic comes from and ``N`` the same
sequences' usable (non-padding) token positions, the ``N`` of the factors (a layer whose rows
are sequences, a pooler / head on ``[B, d]`` or ``factor_form="reduce"``: their sequences). So
``N·λ_ij`` is the empirical (or MC) Fisher ``Σ_n ∇L_n ∇L_nᵀ`` on the basis' diagonal, and
``λ`` is on the scale of ``γ αᵀ``: it replaces it one for one in every formula (the influence
scores' ``(F + λI)⁻¹``: `kfac_stream.query.influence`).

Convention against kronfluence (1.0.1, ``FactorStrategy.EKFAC``): its ``lambda_matrix`` sums
the same squared rotated per-sample gradients (``einsum("b...i,b...o->bio")`` of the output
gradient and the input, Q_Gᵀ·V·Q_A, squared, summed over the batch) and divides by
``num_lambda_processed``, the number of SEQUENCES, while its K-FAC eigenvalues come from
factors divided by the number of token positions. Ours divides by the token positions
``N``: ``λ_ours = λ_kronfluence · (sequences / positions)``, i.e. kronfluence's ``λ`` is the
mean sequence length times ours (exactly ``T`` for unpadded sequences of ``T`` tokens). Ratios
such as its heuristic damping ``0.1·mean(λ)`` are unchanged by that constant.

Which sequences, which weights. At an update step the correction comes from the same passes
as the factors, restricted to WHOLE sequences (a per-sequence gradient needs every token of it,
never the token-sampled rows): the MC replay's sequences with ``fisher="mc"`` (its sampled
labels: the correction of the MC Fisher, kronfluence's default), every sequence of every
micro-batch with ``fisher="empirical"`` (the observed labels, divided by the pass's recovered
loss scale ``c²``). A replayed sequence carries the replay's sequence weight (``1/f`` for a
share ``f``, ``B/b`` for an int), and the pass's ``N`` is what the factors use (the
micro-batch's usable positions for an int ``mc_sequences``, the replayed ones times ``1/f`` for
a share), so each update step's ``Σ w·(…)² / N`` is unbiased for the step's per-token mean.

Window and staleness. The correction of snapshot ``k`` is the weighted MEAN
``Σ num / Σ N`` over the update steps that ran on snapshot ``k − 1``'s eigenbasis: from the
first update step after that snapshot's eigenvectors reached the tracker to snapshot ``k``.
A mean, not the tracker's EMA: the basis is fixed for the window, so every step of it measures
the same quantity, the window is bounded by ``snapshot_every`` anyway, and with ``ema_decay=1``
the factors are the same kind of mean (the exact test). The first snapshot has no basis before
it and carries no correction; a snapshot whose basis never arrived (a failed one) neither.
With background snapshots (the default) the eigenvectors arrive when the snapshot's
eigendecompositions are done: the update steps in between add nothing (nothing is accumulated
on a basis that is about to be replaced). The staleness accepted: snapshot ``k`` stores
``λ`` measured on snapshot ``k − 1``'s basis (``basis_step`` in its manifest) with the
gradients of the weights of the window, next to its own eigenvectors; the two bases differ by
one ``snapshot_every`` of training. Measured in tests/test_ekfac.py and docs/computed.md.
Resume: the basis and the accumulator do not ride with checkpoints; a resumed run's first
snapshot carries no correction.

Cost (per layer and update, ``b`` sequences of ``T`` tokens, ``d_o = d_out``, ``d_A``): two
orders compute the same ``[b, d_o, d_A]`` rotated gradients, and `correction_order` takes the
cheaper one per layer (``rotate_first`` iff ``T·(d_o² + d_A²) ≤ d_o·d_A·(d_o + d_A)``):

* rotate first: ``ĝ = g Q_G``, ``â = ā Q_A`` (``2·b·T·(d_o² + d_A²)`` FLOPs), then
  ``M_n = ĝ_nᵀ â_n`` (``2·b·T·d_o·d_A``);
* gradient first: ``V_n = g_nᵀ ā_n`` (``2·b·T·d_o·d_A``), then ``Q_Gᵀ V_n Q_A``
  (``2·b·d_o·d_A·(d_o + d_A)``);

then ``Σ_n M_n²`` (``2·b·d_o·d_A``). A diagonal factor's basis is the identity (no rotation).
Bytes on the device per update (`correction_bytes`): the eigenvectors read once
(``2·(d_o² + d_A²)`` in a 16-bit run), the float32 accumulator read and written
(``8·d_o·d_A``), the rotated gradients written and read (``4·b·d_o·d_A``, in chunks of
`CHUNK_ENTRIES`). A training step is ``6·P·tokens``; at the
defaults (``mc_sequences=0.05``, ``update_every=10``) the correction is ``(0.05/10)·ρ`` of a
step, ``ρ`` the per-token ratio ``Σ_layers min-order FLOPs / (6·P·T·b)`` (each corrected token
is rotated through every factor's ``d²`` basis, about what the ``6·P`` of a training step
costs per token): with micro-batch 8 × 2048 tokens and ``P`` without the input embedding,
``ρ`` = 1.27 / 1.20 / 0.62 and the correction 0.63% / 0.60% / 0.31% of a step for
Llama-3.2-1B / TinyLlama-1.1B / Llama-2-7B layouts built on the ``meta`` device, plus
0.17% / 0.18% / 0.13% if its bytes did not overlap (H100 HBM against a 40%-MFU step);
``benchmarks/ekfac_cost.py`` prints them.
Precision and rate: when training runs in 16 bits (fp16/bf16 output gradients) the rotations
and products run in bfloat16 on tensor cores, the training step's own rate, so the FLOP ratio is
the time ratio (`EkfacState.compute_dtype`; bf16 so that sums over a sequence's tokens cannot
overflow), each rotated entry to ~3 digits, the squares summed in float32; a float32 or
float64 run computes in its own dtype.
Memory on the model's device: every factor's eigenvectors (``4·Σ d²`` bytes as they arrive,
``2·Σ d²`` once a 16-bit run has converted them; ``4·Σ d²`` is what the device path's pending
statistics hold) and a ``[d_out, d_A]`` float32 accumulator per layer (a float32 copy of the
tracked weights), plus each pass's ``[b, d_o, d_A]`` chunk. With gradient checkpointing each
tracked layer's input of the captured sequences is held until its backward.

Nothing here reads a device value on the host during training (tests/test_ekfac.py counts):
the decision whether an update counts (finite, loss scale known) is a ``torch.where`` on the
device, and the accumulator is read only when a snapshot takes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("kfac_stream")

#: Entries of the ``[b, d_out, d_A]`` rotated per-sequence gradients formed at once (float32:
#: 64 MiB); at least one sequence.
CHUNK_ENTRIES = 1 << 24


def correction_order(d_out: int, d_a: int, tokens: int, rotate_g: bool = True,
                     rotate_a: bool = True) -> str:
    """``"rotate_first"`` or ``"gradient_first"``: the cheaper order for sequences of
    ``tokens`` positions (module docstring); ``rotate_g`` / ``rotate_a`` False: that factor is
    diagonal (identity basis, no rotation)."""
    first = tokens * (d_out * d_out * rotate_g + d_a * d_a * rotate_a)
    after = d_out * d_a * (d_out * rotate_g + d_a * rotate_a)
    return "rotate_first" if first <= after else "gradient_first"


def correction_flops(d_out: int, d_a: int, tokens: int, sequences: int = 1,
                     rotate_g: bool = True, rotate_a: bool = True) -> int:
    """FLOPs of one layer's correction over ``sequences`` sequences of ``tokens`` positions, in
    the order `correction_order` picks (what `sequence_correction` runs)."""
    first = tokens * (d_out * d_out * rotate_g + d_a * d_a * rotate_a)
    after = d_out * d_a * (d_out * rotate_g + d_a * rotate_a)
    per = 2 * tokens * d_out * d_a + 2 * min(first, after) + 2 * d_out * d_a
    return int(sequences) * per


def correction_bytes(d_out: int, d_a: int, sequences: float, rotate_g: bool = True,
                     rotate_a: bool = True, itemsize: int = 2) -> float:
    """Device bytes one layer's correction moves per update (module docstring): the basis
    read once (``itemsize`` per entry: 2 for a 16-bit run, 4 in float32), the float32
    accumulator read and written, each sequence's ``[d_out, d_A]`` product written and read
    (``itemsize``); the inputs and gradients it reads are the training's own."""
    basis = itemsize * (d_out * d_out * rotate_g + d_a * d_a * rotate_a)
    return basis + 8 * d_out * d_a + 2 * itemsize * d_out * d_a * sequences


def sequence_correction(a: Tensor, g: Tensor, q_a: Tensor | None, q_g: Tensor | None,
                        chunk: int = CHUNK_ENTRIES) -> Tensor:
    """``Σ_n (Q_Gᵀ (Σ_t g_nt a_ntᵀ) Q_A)²`` over the ``B`` sequences of ``a [B, T, d_A]`` (bias
    column included, padding rows zero) and ``g [B, T, d_out]``: ``[d_out, d_A]``.

    ``q_a`` / ``q_g`` None: the identity (a diagonal factor). The order of the products is
    `correction_order`'s; the per-sequence matrices are formed ``chunk`` entries at a time.
    16-bit inputs: the products in that dtype, the squares summed in float32 (the result's
    dtype). Device ops only."""
    B, T, d_a = a.shape
    d_out = g.shape[-1]
    wide = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    out = torch.zeros(d_out, d_a, dtype=wide, device=a.device)
    first = correction_order(d_out, d_a, T, q_g is not None, q_a is not None) == "rotate_first"
    if first:
        a = a if q_a is None else a @ q_a
        g = g if q_g is None else g @ q_g
    step = max(1, chunk // max(d_out * d_a, 1))
    for s in range(0, B, step):
        m = torch.bmm(g[s:s + step].transpose(1, 2), a[s:s + step])  # [b, d_out, d_A]
        if not first:
            m = m if q_g is None else q_g.T @ m
            m = m if q_a is None else m @ q_a
        out += m.to(wide).square_().sum(0)
    return out


class EkfacState:
    """The tracker's EK-FAC state: the eigenbasis in use, the accumulated correction and the
    basis on its way from a snapshot (module docstring).

    Args:
        specs: ``{layer: LayerSpec}`` (``has_bias``).
        keys_of: ``{layer: (A key, G key)}`` of the factor plan.
        device: Where the bases and the accumulators live (the model's device).
        dtype: Their dtype (the storage's wide dtype: float32, float64 for float64 storage).

    Attributes:
        basis: ``{layer: (Q_A | None, Q_G | None)}`` in use (empty: none yet).
        basis_step: The snapshot step the basis is from (None: no basis).
    """

    def __init__(self, specs: Mapping[str, Any], keys_of: Mapping[str, tuple[str, str]],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.has_bias = {n: bool(s.has_bias) for n, s in specs.items()}
        self.keys_of = dict(keys_of)
        self.basis: dict[str, tuple[Tensor | None, Tensor | None]] = {}
        self.basis_step: int | None = None
        self._reset()
        self._lock = threading.Lock()
        self._pending: dict[str, Tensor | None] = {}
        self._pending_step: int | None = None
        self._pending_keys: dict[str, tuple[str, str]] = {}
        self._ready = False

    def _reset(self) -> None:
        self.num: dict[str, Tensor] = {}
        self.den: dict[str, Tensor] = {}
        self.updates = 0
        self.first_step: int | None = None
        self.last_step: int | None = None

    # -- the training thread ---------------------------------------------------------------------

    def begin_step(self) -> None:
        """Put a basis that has fully arrived into use (a host flag: no device read)."""
        if not self._ready:
            return
        with self._lock:
            pending, keys = self._pending, self._pending_keys
            self.basis = {n: (pending[a], pending[g]) for n, (a, g) in keys.items()}
            self.basis_step = self._pending_step
            self._pending, self._pending_keys, self._ready = {}, {}, False
            self._pending_step = None
        self._reset()

    def basis_of(self, layer: str) -> tuple[Tensor | None, Tensor | None] | None:
        """``(Q_A, Q_G)`` of ``layer`` in use, or None (no basis: nothing to accumulate)."""
        return self.basis.get(layer)

    def correction(self, layer: str, x: Tensor, grad: Tensor, usable: Tensor, batch: int,
                   basis: tuple[Tensor | None, Tensor | None]) -> Tensor:
        """One call's ``Σ_n (Q_Gᵀ ∇_W L_n Q_A)²`` (``[d_out, d_A]``) from the layer's input
        ``x`` (``[B, T, d_in]``, ``[B·T, d_in]`` or ``[B, d_in]``), its output gradient
        ``grad`` (same leading shape) and the usable rows ``usable`` (``[B·T]`` or ``[B]``)."""
        dtype = self.compute_dtype(grad.dtype)
        if basis[0] is not None and basis[0].dtype != dtype or \
                basis[1] is not None and basis[1].dtype != dtype:
            basis = self._basis_in(layer, basis, dtype)
        a = x.detach().reshape(batch, -1, x.shape[-1]).to(dtype)
        g = grad.detach().reshape(batch, -1, grad.shape[-1]).to(dtype)
        if self.has_bias[layer]:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
        a = a * usable.reshape(batch, -1, 1).to(dtype)
        return sequence_correction(a, g, basis[0], basis[1]).to(self.dtype)

    def compute_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype the rotations run in: bfloat16 when training runs in 16 bits (the output
        gradients are fp16 or bf16: tensor-core GEMMs at the training step's own rate, fp32
        accumulation inside each product; bf16, not fp16, so the sums over a sequence's tokens
        cannot overflow; ~3 significant digits per rotated entry, whose errors average over
        the sequences), else the accumulators' dtype (float32; float64 for float64
        storage)."""
        return torch.bfloat16 if grad_dtype in (torch.float16, torch.bfloat16) else self.dtype

    def _basis_in(self, layer: str, basis: tuple[Tensor | None, Tensor | None],
                  dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
        """``basis`` in ``dtype``, kept in its place for the calls that follow (a 16-bit run
        converts each layer's basis once and holds it in bf16: half the memory)."""
        out = tuple(None if q is None else q.to(dtype) for q in basis)
        if self.basis.get(layer) is basis:
            self.basis[layer] = out  # type: ignore[assignment]
        return out  # type: ignore[return-value]

    def add(self, step: int, nums: Mapping[str, Tensor], dens: Mapping[str, Tensor],
            ok: Tensor) -> None:
        """Add one update step's ``{layer: Σ w·(…)²}`` and ``{layer: N}`` where ``ok`` (a
        0-dim device bool: the step's statistics are finite and its loss scales known) and the
        layer's own sum is finite; device ops only."""
        if not nums:
            return
        for name, num in nums.items():
            good = ok & torch.isfinite(num).all()
            num = torch.where(good, num, torch.zeros_like(num))
            den = torch.where(good, dens[name].to(num.dtype), torch.zeros((), dtype=num.dtype,
                                                                          device=num.device))
            if name in self.num:
                self.num[name] += num
                self.den[name] += den
            else:
                self.num[name], self.den[name] = num, den
        self.updates += 1
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step

    def take(self, step: int, keys_of: Mapping[str, tuple[str, str]]
             ) -> tuple[dict[str, Tensor], dict[str, dict[str, Any]]]:
        """The correction accumulated since the basis came (snapshot ``step`` stores it) as
        ``({layer: λ [d_out, d_A] on the CPU}, {layer: manifest entry})`` (empty: none; a
        layer whose ``N`` is 0 has none), then start over: the basis is dropped and the
        eigenvectors of snapshot ``step`` (``keys_of``: its factor keys) are awaited
        (`sink`). Reads the accumulators (snapshot time)."""
        tensors: dict[str, Tensor] = {}
        entries: dict[str, dict[str, Any]] = {}
        if self.num and self.basis_step is not None:
            names = list(self.num)
            dens = torch.stack([self.den[n] for n in names]).tolist()  # one read
            for name, den in zip(names, dens):
                if den > 0:
                    tensors[name] = (self.num[name] / den).to("cpu", self.dtype).contiguous()
                    entries[name] = {"basis_step": int(self.basis_step),
                                     "updates": int(self.updates),
                                     "first_step": int(self.first_step),
                                     "last_step": int(self.last_step), "weight": float(den)}
        self.basis, self.basis_step = {}, None
        self._reset()
        with self._lock:
            self._pending, self._pending_step = {}, int(step)
            self._pending_keys, self._ready = dict(keys_of), False
        return tensors, entries

    # -- the snapshot's thread -------------------------------------------------------------------

    def sink(self, step: int) -> Callable[[str, Tensor | None], None]:
        """``receive(key, eigvecs)`` for snapshot ``step``'s eigendecompositions
        (`kfac_stream.snapshot.eigen_stream.EigenStream`'s ``on_result``): each factor's
        eigenvectors (None: diagonal) are copied to the device; when every factor of the plan
        has arrived the basis is ready for the next update step. Results of another step are
        dropped."""
        def receive(key: str, q: Tensor | None) -> None:
            with self._lock:
                if self._pending_step != step:
                    return
                needed = {k for pair in self._pending_keys.values() for k in pair}
            if key not in needed:
                return
            try:
                moved = None if q is None else q.to(self.device, self.dtype, copy=True)
                if moved is not None and moved.is_cuda:
                    torch.cuda.current_stream(moved.device).synchronize()  # this thread only
            except RuntimeError as e:  # out of device memory: no basis, the snapshot goes on
                logger.warning("kfac_stream: the EK-FAC basis of snapshot %d could not be "
                               "moved to %s (%s); the next snapshot carries no correction",
                               step, self.device, e)
                with self._lock:
                    if self._pending_step == step:
                        self._pending, self._pending_step, self._ready = {}, None, False
                return
            with self._lock:
                if self._pending_step != step:
                    return
                self._pending[key] = moved
                self._ready = needed <= set(self._pending)
        return receive

    def set_basis(self, step: int, eigvecs: Mapping[str, Tensor | None]) -> None:
        """Use ``{factor key: eigenvectors}`` (None: identity) of snapshot ``step`` from the
        next update step on (what `sink` does; also for a basis loaded from a snapshot)."""
        receive = None
        with self._lock:
            self._pending, self._pending_step = {}, int(step)
            self._pending_keys, self._ready = dict(self.keys_of), False
        receive = self.sink(step)
        for key, q in eigvecs.items():
            receive(key, q)


def ekfac_denominator(eigvals: Tensor, damping: float, like: Tensor) -> Tensor:
    """The EK-FAC eigenvalues ``λ`` (``[d_out, d_A]``) clamped at 0, plus ``damping``, in
    ``like``'s dtype and device: the denominator of
    `kfac_stream.query.kron_eigen.damped_solve` (the influence scores' ``eigenvalues="ekfac"``,
    `kfac_stream.query.influence`)."""
    return eigvals.to(like.device, like.dtype).clamp(min=0) + damping
