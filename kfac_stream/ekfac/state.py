"""`EkfacState`: the eigenbasis in use, the accumulated correction and the basis on its way
from a snapshot, with the device bytes it holds and the solve's denominator (the package
docstring, `kfac_stream.ekfac`, derives the correction, its window, its cost and its
resume)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .arithmetic import sequence_correction
from .parts import EkfacWindow, PassCorrections

logger = logging.getLogger("kfac_stream")


class EkfacState:
    """The tracker's EK-FAC state: the eigenbasis in use, the accumulated correction and the
    basis on its way from a snapshot (module docstring).

    Args:
        specs: ``{layer: LayerSpec}`` (``has_bias``).
        keys_of: ``{layer: (A key, G key)}`` of the factor plan.
        device: Where the bases and the accumulators live (the model's device).
        dtype: Their dtype (the storage's wide dtype: float32, float64 for float64 storage).
        lockstep: Several ranks: a basis that has arrived goes into use only at an update step
            every rank agreed on (`agree`, `confirm`), never on this rank's arrival alone.

    Attributes:
        basis: ``{layer: (Q_A [d_A, d_A] | None, Q_G [d_out, d_out] | None)}`` in use (empty:
            none yet).
        basis_step: The snapshot step the basis is from (None: no basis).
        basis_keys: ``{layer: (A key, G key)}`` the basis was made from.
        num: ``{layer: Σ w·(Q_Gᵀ ∇_W L_n Q_A)² [d_out, d_A]}`` accumulated on this rank.
        den: ``{layer: 0-dim N}`` of the same update steps.
        calls: ``{layer: calls per pass}`` whose output receives a gradient (`learn_calls`).
    """

    def __init__(self, specs: Mapping[str, Any], keys_of: Mapping[str, tuple[str, str]],
                 device: torch.device, dtype: torch.dtype, lockstep: bool = False) -> None:
        self.device, self.dtype, self.lockstep = device, dtype, bool(lockstep)
        self.has_bias = {n: bool(s.has_bias) for n, s in specs.items()}
        self.keys_of = dict(keys_of)
        self.basis: dict[str, tuple[Tensor | None, Tensor | None]] = {}
        self.basis_step: int | None = None
        self.basis_keys: dict[str, tuple[str, str]] = {}
        self.calls: dict[str, int] = {}
        self._reset()
        self._lock = threading.Lock()
        self._pending: dict[str, Tensor | None] = {}
        self._pending_step: int | None = None
        self._pending_keys: dict[str, tuple[str, str]] = {}
        self._arrived = False  # every factor of the pending basis is here
        self._ready = False  # ... and may go into use (lockstep: confirmed on every rank)
        self._agreed: int | None = None  # lockstep: the pending step every rank agreed on
        self._trainer: threading.Thread | None = None  # the thread that calls `take`

    def _reset(self) -> None:
        self.num: dict[str, Tensor] = {}
        self.den: dict[str, Tensor] = {}
        self.updates = 0
        self.first_step: int | None = None
        self.last_step: int | None = None

    # -- the training thread ---------------------------------------------------------------------

    def begin_step(self) -> None:
        """Put a basis that has fully arrived into use (host flags: no device read); with
        ``lockstep`` only once every rank agreed on it (`agree`, `confirm`)."""
        if not self._ready or self.lockstep and self._agreed != self._pending_step:
            return
        with self._lock:
            pending, keys = self._pending, self._pending_keys
            self.basis = {n: (pending[a], pending[g]) for n, (a, g) in keys.items()}
            self.basis_step, self.basis_keys = self._pending_step, dict(keys)
            self._pending, self._pending_keys, self._ready = {}, {}, False
            self._pending_step, self._arrived, self._agreed = None, False, None
        self._reset()

    def ready_step(self) -> int:
        """The snapshot step whose basis is ready to go into use here, else -1 (a host flag:
        this rank's entry in the update's exchange table, `agree`)."""
        with self._lock:
            ready = self._ready and self._pending_step is not None
            return int(self._pending_step) if ready else -1

    def agree(self, steps: Sequence[int]) -> None:
        """Every rank's `ready_step` at one update step (the exchange's host table, the same on
        every rank): all equal to this rank's pending basis, it goes into use at the next
        `begin_step` on every rank."""
        if not steps or steps[0] < 0 or any(s != steps[0] for s in steps):
            return
        with self._lock:
            if self._ready and self._pending_step == steps[0]:
                self._agreed = int(steps[0])

    def basis_of(self, layer: str) -> tuple[Tensor | None, Tensor | None] | None:
        """``(Q_A, Q_G)`` of ``layer`` in use, or None (no basis: nothing to accumulate)."""
        return self.basis.get(layer)

    def correction(self, layer: str, calls: Sequence[tuple[Tensor, Tensor]], usable: Tensor,
                   batch: int, basis: tuple[Tensor | None, Tensor | None]) -> Tensor:
        """``Σ_n (Q_Gᵀ ∇_W L_n Q_A)²`` (``[d_out, d_A]``) of one pass, ``∇_W L_n`` summed over
        the layer's ``calls`` in it: ``[(x, grad)]`` of each call, the input ``x``
        (``[B, T, d_in]``, ``[B·T, d_in]`` or ``[B, d_in]``) and its output gradient ``grad``
        (same leading shape), with the pass's usable rows ``usable`` (``[B·T]`` or ``[B]``).
        The calls' positions are concatenated per sequence (``[B, K·T, d]``): one product
        ``Σ_calls Σ_t g ā ᵀ`` per sequence, squared once (a layer called twice per forward,
        ALBERT's shared layers: the square of the summed gradient, not a sum of squares)."""
        dtype = self.compute_dtype(calls[0][1].dtype)
        if basis[0] is not None and basis[0].dtype != dtype or \
                basis[1] is not None and basis[1].dtype != dtype:
            basis = self._basis_in(layer, basis, dtype)
        mask = usable.reshape(batch, -1, 1).to(dtype)
        a_parts, g_parts = [], []
        for x, grad in calls:
            a = x.detach().reshape(batch, -1, x.shape[-1]).to(dtype)
            if self.has_bias[layer]:
                a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
            a_parts.append(a * mask)
            g_parts.append(grad.detach().reshape(batch, -1, grad.shape[-1]).to(dtype))
        a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts, dim=1)  # [B, K·T, d_A]
        g = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts, dim=1)  # [B, K·T, d_out]
        return sequence_correction(a, g, basis[0], basis[1]).to(self.dtype)

    def new_pass(self, batch: int) -> PassCorrections:
        """The `PassCorrections` of one forward pass of ``batch`` sequences."""
        return PassCorrections(self, batch)

    def learn_calls(self, calls: Mapping[str, int]) -> None:
        """Note ``{layer: calls whose output received a gradient}`` of a finished pass: a
        later pass squares a layer's correction as soon as that many calls arrived
        (`PassCorrections`)."""
        self.calls.update({n: int(k) for n, k in calls.items() if k > 0})

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
        """``basis`` in ``dtype``: the whole basis in use is converted once, factor by factor
        (a 16-bit run holds it in bf16: half the memory; each wide tensor is freed as its
        copy replaces it, so the device holds at most one factor twice; a shared A stays one
        tensor)."""
        if self.basis.get(layer) is not basis:  # not the basis in use: this call's copy
            return tuple(None if q is None else q.to(dtype) for q in basis)  # type: ignore
        done: dict[int, Tensor] = {}
        for name, pair in list(self.basis.items()):
            new = []
            for q in pair:
                if q is not None and q.dtype != dtype:
                    if id(q) not in done:
                        done[id(q)] = q.to(dtype)
                    q = done[id(q)]
                new.append(q)
            self.basis[name] = (new[0], new[1])
        return self.basis[layer]

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

    def take(self, step: int, keys_of: Mapping[str, tuple[str, str]],
             combine: Callable[[EkfacWindow], tuple[dict, dict | None]] | None = None
             ) -> tuple[dict[str, Tensor], dict[str, dict[str, Any]]]:
        """The correction accumulated since the basis came (snapshot ``step`` stores it) as
        ``({layer: λ [d_out, d_A] on the CPU}, {layer: manifest entry})`` (empty: none; a
        layer whose ``N`` is 0 has none), then start over: the basis is dropped and the
        eigenvectors of snapshot ``step`` (``keys_of``: its factor keys) are awaited
        (`sink`). Reads the accumulators (snapshot time).

        ``combine``: several ranks, ``combine(window) -> ({layer: (Σ_ranks num [d_out, d_A],
        Σ_ranks N)}, window entry)`` of the layers this rank stores (the owner of their G
        factor; `kfac_stream.ekfac.sync.sum_to_owners`, collective); None: this
        rank's own window is the whole."""
        window = EkfacWindow(basis_step=self.basis_step, updates=self.updates,
                             first_step=self.first_step, last_step=self.last_step,
                             num=self.num, den=self.den, dtype=self.dtype, device=self.device)
        sums, entry = combine(window) if combine is not None else window.own()
        tensors: dict[str, Tensor] = {}
        entries: dict[str, dict[str, Any]] = {}
        for name, (num, den) in sums.items():
            tensors[name] = (num / den).to("cpu", self.dtype).contiguous()
            entries[name] = {**entry, "weight": float(den)}
        self.basis, self.basis_step, self.basis_keys = {}, None, {}
        self._reset()
        with self._lock:
            self._pending, self._pending_step = {}, int(step)
            self._pending_keys, self._ready, self._arrived = dict(keys_of), False, False
            self._agreed = None
        self._trainer = threading.current_thread()
        return tensors, entries

    @property
    def trainer(self) -> threading.Thread | None:
        """The thread that took the last window (the training thread)."""
        return self._trainer

    # -- the snapshot's thread -------------------------------------------------------------------

    def sink(self, step: int) -> Callable[[str, Tensor | None], None]:
        """``receive(key, eigvecs)`` for snapshot ``step``'s eigendecompositions
        (`kfac_stream.snapshot.eigen_stream.EigenStream`'s ``on_result``; with several ranks
        also the bases broadcast by their owners, `kfac_stream.ekfac.sync`): each
        factor's eigenvectors (``[d, d]``; None: diagonal) are copied to the device, row-major (the
        layout a checkpoint restores: a resumed run rotates with the same kernels); when every
        factor of the plan has arrived the basis is ready for the next update step (with
        ``lockstep``: once `confirm` says it arrived on every rank). Results of another step
        are dropped."""
        def receive(key: str, q: Tensor | None) -> None:
            with self._lock:
                if self._pending_step != step:
                    return
                needed = {k for pair in self._pending_keys.values() for k in pair}
            if key not in needed:
                return
            try:
                moved = None if q is None else q.to(self.device, self.dtype, copy=True,
                                                     memory_format=torch.contiguous_format)
                if moved is not None and moved.is_cuda:
                    torch.cuda.current_stream(moved.device).synchronize()  # this thread only
            except RuntimeError as e:  # out of device memory: no basis, the snapshot goes on
                logger.warning("kfac_stream: the EK-FAC basis of snapshot %d could not be "
                               "moved to %s (%s); the next snapshot carries no correction",
                               step, self.device, e)
                self.drop(step)
                return
            with self._lock:
                if self._pending_step != step:
                    return
                self._pending[key] = moved
                self._arrived = needed <= set(self._pending)
                self._ready = self._arrived and not self.lockstep
        return receive

    def pending_tensor(self, step: int, key: str) -> Tensor | None:
        """Factor ``key``'s eigenvectors of snapshot ``step`` received here (None: not, or
        diagonal)."""
        with self._lock:
            return self._pending.get(key) if self._pending_step == step else None

    def holds(self, step: int, keys: Sequence[str]) -> bool:
        """Every one of ``keys`` of snapshot ``step``'s basis has been received here."""
        with self._lock:
            return self._pending_step == step and set(keys) <= set(self._pending)

    def drop(self, step: int) -> None:
        """Forget snapshot ``step``'s basis (it cannot go into use: the next snapshot carries
        no correction)."""
        with self._lock:
            if self._pending_step == step:
                self._pending, self._pending_step = {}, None
                self._ready = self._arrived = False
                self._agreed = None

    def confirm(self, step: int, everywhere: bool, now: bool = False) -> None:
        """``lockstep``: whether snapshot ``step``'s basis arrived on every rank (decided
        collectively, the same on every rank); if not it is dropped everywhere. ``now``: the
        ranks decided it at the same point of training (a snapshot on the training thread):
        it goes into use at the next `begin_step` without waiting for `agree`."""
        if not everywhere:
            self.drop(step)
            return
        with self._lock:
            if self._pending_step == step and self._arrived:
                self._ready = True
                if now:
                    self._agreed = int(step)

    def set_basis(self, step: int, eigvecs: Mapping[str, Tensor | None]) -> None:
        """Use ``{factor key: eigenvectors}`` (None: identity) of snapshot ``step`` from the
        next update step on (what `sink` does; also for a basis loaded from a snapshot; with
        ``lockstep`` every rank must call it with the same basis)."""
        with self._lock:
            self._pending, self._pending_step = {}, int(step)
            self._pending_keys, self._ready, self._arrived = dict(self.keys_of), False, False
        receive = self.sink(step)
        for key, q in eigvecs.items():
            receive(key, q)
        self.confirm(step, self._arrived, now=True)

    # -- memory and checkpoints ------------------------------------------------------------------

    def device_bytes(self) -> int:
        """Bytes this state holds on its device now: the bases in use and pending (each
        tensor once) and the accumulators."""
        seen: dict[int, int] = {}
        tensors = [q for pair in self.basis.values() for q in pair] + \
            list(self._pending.values()) + list(self.num.values()) + list(self.den.values())
        for t in tensors:
            if t is not None:
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def state_dict(self, keep: Callable[[str], bool] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """``(meta, tensors)`` for a checkpoint (`load_state_dict`): the basis in use and its
        step, the pending basis if it may go into use (`ready_step`), this rank's
        accumulators ``num`` / ``den`` and the window's counts. ``keep(key)``: the factor keys
        whose eigenvectors this rank writes (with several ranks: its own; the others' are
        in their files); None: every key. Tensors, CPU copies: ``ekfac.basis.<key>`` and
        ``ekfac.pending.<key>`` ``[d, d]``, ``ekfac.num.<layer>`` ``[d_out, d_A]``,
        ``ekfac.den.<layer>`` ``[1]``; ``meta`` is JSON."""
        basis: dict[str, Tensor] = {}
        for name, (a_key, g_key) in self.basis_keys.items():
            for key, q in zip((a_key, g_key), self.basis.get(name, (None, None))):
                if q is not None and (keep is None or keep(key)):
                    basis.setdefault(key, q)
        with self._lock:
            ready = self._ready and self._pending_step is not None
            pending = dict(self._pending) if ready else {}
            meta = {"basis_step": self.basis_step,
                    "basis_keys": {n: list(k) for n, k in self.basis_keys.items()},
                    "pending_step": self._pending_step if ready else None,
                    "pending_keys": {n: list(k) for n, k in self._pending_keys.items()}
                    if ready else {},
                    "agreed": self._agreed if ready else None,
                    "updates": self.updates, "first_step": self.first_step,
                    "last_step": self.last_step, "calls": dict(self.calls)}
        tensors = {f"ekfac.basis.{k}": q for k, q in basis.items()}
        tensors.update({f"ekfac.pending.{k}": q for k, q in pending.items()
                        if q is not None and (keep is None or keep(k))})
        tensors.update({f"ekfac.num.{n}": t for n, t in self.num.items()})
        tensors.update({f"ekfac.den.{n}": t.reshape(1) for n, t in self.den.items()})
        return meta, {k: t.detach().to("cpu", copy=True).contiguous()
                      for k, t in tensors.items()}

    def load_state_dict(self, meta: Mapping[str, Any], get: Callable[[str], Tensor | None],
                        own: bool = True) -> None:
        """Restore a `state_dict`. ``get(name)``: that tensor from whichever file holds it
        (None: in none; a basis factor absent everywhere is diagonal). ``own``: the
        accumulators are this rank's to restore (False: they start empty; a re-sharded
        resume gives the sums to one rank, `kfac_stream.tracking.tracker_state`)."""
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(self.device)

        def pair(keys, prefix):
            return tuple(move(get(f"{prefix}{k}")) for k in keys)

        self.basis_keys = {n: (k[0], k[1]) for n, k in meta["basis_keys"].items()}
        self.basis = {}
        cache: dict[str, Tensor | None] = {}
        for name, keys in self.basis_keys.items():
            for key in keys:
                if key not in cache:
                    cache[key] = pair([key], "ekfac.basis.")[0]
            self.basis[name] = (cache[keys[0]], cache[keys[1]])
        self.basis_step = meta["basis_step"]
        self.calls = {n: int(k) for n, k in meta.get("calls", {}).items()}
        self._reset()
        self.updates, self.first_step, self.last_step = (meta["updates"], meta["first_step"],
                                                         meta["last_step"])
        if own:
            for name in self.basis_keys:
                num, den = get(f"ekfac.num.{name}"), get(f"ekfac.den.{name}")
                if num is not None and den is not None:
                    self.num[name] = num.to(self.device, self.dtype)
                    self.den[name] = den.to(self.device, self.dtype).reshape(())
        with self._lock:
            step = meta.get("pending_step")
            keys = {n: (k[0], k[1]) for n, k in meta.get("pending_keys", {}).items()}
            self._pending_step, self._pending_keys = step, keys
            self._pending = {k: move(get(f"ekfac.pending.{k}")) for pair_ in keys.values()
                             for k in pair_} if step is not None else {}
            self._arrived = self._ready = step is not None
            self._agreed = meta.get("agreed") if step is not None else None


def ekfac_device_bytes(keys_of: Mapping[str, tuple[str, str]],
                       dims: Mapping[str, tuple[int, bool]], dtype: torch.dtype
                       ) -> dict[str, int]:
    """The device bytes an `EkfacState` holds at most (what `EkfacState.device_bytes` counts
    once a basis is in use and every layer has accumulated): ``{"basis": ..., "accumulators":
    ..., "total": ...}``.

    ``basis``: every dense factor's eigenvectors once (``d²`` entries in ``dtype`` as they
    arrive, the storage's wide dtype: ``4·Σ d²`` in float32; a shared A is one tensor; a
    diagonal factor's basis is the identity, nothing held); a 16-bit run converts them to bf16
    at its first corrected pass (``2·Σ d²`` from then on, at most one factor held twice while
    it converts). ``accumulators``: a ``[d_out, d_A]`` numerator and a 0-dim ``N`` per layer
    in ``dtype``. A snapshot's take drops the basis and the accumulators before the next basis
    arrives, so the two never add up twice. Not counted: each pass's ``[b, d_out, d_A]`` chunk
    (`CHUNK_ENTRIES`) and the calls' output gradients `PassCorrections` holds, both freed
    within the pass."""
    size = torch.empty((), dtype=dtype).element_size()
    keys = {k for pair in keys_of.values() for k in pair}
    basis = sum(dims[k][0] ** 2 for k in keys if not dims[k][1])
    acc = sum(dims[g][0] * dims[a][0] + 1 for a, g in keys_of.values())
    return {"basis": size * basis, "accumulators": size * acc, "total": size * (basis + acc)}


def ekfac_denominator(eigvals: Tensor, damping: float, like: Tensor) -> Tensor:
    """The EK-FAC eigenvalues ``λ`` (``[d_out, d_A]``) clamped at 0, plus ``damping``, in
    ``like``'s dtype and device: the denominator of
    `kfac_stream.query.kron_eigen.damped_solve` (the influence scores' ``eigenvalues="ekfac"``,
    `kfac_stream.query.influence`)."""
    return eigvals.to(like.device, like.dtype).clamp(min=0) + damping
