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
``num_lambda_processed``, the number ``n`` of SEQUENCES, while its K-FAC eigenvalues come from
factors divided by the number of token positions. Ours divides by the usable positions ``N``:
``λ_kronfluence = m·λ_ours``, ``m = N / n`` the mean usable positions per sequence (``T − 1``
for unpadded causal-LM sequences of ``T`` tokens: the last one scores nothing). Its heuristic
damping ``0.1·mean(λ)`` scales with ``λ``, so each side's heuristic is the same damping
relative to ``λ`` and the influence scores are exactly ``m`` times kronfluence's (derived in
docs/computed.md, pinned by tests/unit/ekfac/test_kronfluence_ekfac.py).

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
it and carries no correction; a snapshot whose basis never arrived (a failed one) neither. A run
no longer than ``snapshot_every`` (its final snapshot would be its first) takes one extra
snapshot midway whose basis the final snapshot's correction is measured in (`schedule`,
`basis_snapshot_step`, said at train begin); a run with no update step after its last snapshot
before the final one ends with NO correction: the train-begin log says so with the reason
(`final_correction_gap`), and ``eigenvalues="auto"`` of the influence scores falls back to
K-FAC's eigenvalues with a warning naming it.
With background snapshots (the default) the eigenvectors arrive when the snapshot's
eigendecompositions are done: the update steps in between add nothing (nothing is accumulated
on a basis that is about to be replaced). The staleness accepted: snapshot ``k`` stores
``λ`` measured on snapshot ``k − 1``'s basis (``basis_step`` in its manifest) with the
gradients of the weights of the window, next to its own eigenvectors; the two bases differ by
one ``snapshot_every`` of training. Measured in tests/unit/ekfac/test_ekfac.py and docs/computed.md.
Resume: the state rides with checkpoints (`EkfacState.state_dict`,
`kfac_stream.tracking.tracker_state`): the basis in use and its step, a pending basis that
may go into use, the accumulators and the window's counts, so a run resumed between two
snapshots stores at the next one what the uninterrupted run stores (bit for bit with the same
world size: tests/runs/test_ekfac_ranks.py). Each rank writes its own accumulators and the
eigenvectors of the factors it owns (the others' are in their owners' files; a resume with
another world size sums the accumulators onto rank 0). A checkpoint written without the state
(older ones) still loads: the correction then restarts (the next snapshot carries none).

Several ranks (`kfac_stream.ekfac.sync`): every rank accumulates on its own
sequences; at a snapshot the accumulators are summed onto the owner of each layer's G factor,
which stores ``λ = Σ_ranks num / Σ_ranks N`` (what one process gives on the concatenated
data); each rank decomposes its own factors and broadcasts their eigenvectors to the others
from the snapshot's thread; the new basis goes into use at an update step every rank agreed
on (`EkfacState.agree`, through the exchange's host table), never on one rank's arrival.

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
Memory on the model's device (of every rank): every factor's eigenvectors (``4·Σ d²`` bytes
as they arrive, ``2·Σ d²`` once a 16-bit run has converted them; ``4·Σ d²`` is what the device
path's pending statistics hold) and a ``[d_out, d_A]`` float32 accumulator per layer (a float32
copy of the tracked weights), plus each pass's ``[b, d_o, d_A]`` chunk. `ekfac_device_bytes`
counts the first two; the tracker reserves them in the device budget before any pending
statistic (`kfac_stream.store.residency.Residency`) and refuses an explicit budget that cannot
hold them. With gradient checkpointing each
tracked layer's input of the captured sequences is held until its backward.

Nothing here reads a device value on the host during training (tests/unit/ekfac/test_ekfac.py
counts): the decision whether an update counts (finite, loss scale known) is a ``torch.where`` on
the device, and the accumulator is read only when a snapshot takes it.

The package: `state` (`EkfacState`, its device bytes, the solve's denominator), `arithmetic`
(one layer's correction, its order, FLOPs and bytes), `parts` (a window, a pass), `schedule`
(which snapshots of a run can carry a correction), `sync` (the
ranks' sums and bases), `extension` (`EkfacExtension`: the tracker's extension points,
`kfac_stream.extensions`, registered as ``"ekfac"`` when this package is imported).
"""

from .arithmetic import (
    CHUNK_ENTRIES,
    correction_bytes,
    correction_flops,
    correction_order,
    sequence_correction,
)
from .extension import EkfacExtension
from .parts import EkfacWindow, PassCorrections
from .schedule import (
    basis_snapshot_step,
    final_correction_gap,
    missing_correction_reason,
    schedule_advice,
)
from .state import EkfacState, ekfac_denominator, ekfac_device_bytes

__all__ = ["CHUNK_ENTRIES", "EkfacExtension", "EkfacState", "EkfacWindow", "PassCorrections",
           "basis_snapshot_step", "correction_bytes", "correction_flops", "correction_order",
           "ekfac_denominator", "ekfac_device_bytes", "final_correction_gap",
           "missing_correction_reason", "schedule_advice", "sequence_correction"]
