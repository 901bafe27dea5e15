r"""Which tracked layers read the same input tensor, and the factor plan that follows.

Layers whose forward sees the *same input tensor object* in a pass (q/k/v projections of an
attention block, gate/up of a gated MLP, the ``lora_A`` adapters of several projections when
LoRA dropout is off) have the same rows :math:`\bar a_s` at every sampled position, hence the
same A factor. They share one: captured, sent, stored and eigendecomposed once, under the key
of the group's first layer in ``named_modules`` order (its *leader*: only a name). Which
member captures the rows is decided by the model's own call order, per call: whichever is
called first (OPT, BioGPT, BART, Whisper register ``k_proj, v_proj, q_proj`` but call
``q_proj`` first), see `capture.hooks`.

Sharing is found by running the model once on a 2-token input with temporary forward
pre-hooks that note which tensor each layer receives (`probe_shared_inputs`): the truth of
the model's own code, not a guess from module names (an encoder-decoder also gets two
``decoder_input_ids``, `_probe_input`; a model the probe cannot drive keeps one A per layer,
said in one INFO line). "The same tensor" is `same_data`: the same object, or views of the
same storage with the same offset, shape, strides, dtype and version (DeepSpeed ZeRO-3 hands
every module its own autograd wrapper of its inputs, which shares the storage). The probe runs
in the model's current mode (training: a dropout in front of an adapter makes a new tensor,
so such adapters are correctly *not* shared) under ``torch.no_grad``. At run time the capture
hooks check the identity again for every call; a group whose members receive different inputs
(or are not called once each per call) is dissolved there and then: its members keep their
own A factors from that step on, each starting from the shared one (equal until then, so every
factor stays exact), with one warning naming the layers (`Tracker.dissolve_groups`; one process
only: with several ranks the plan must change on every rank at once, which the tracker refuses
with a clear error, see there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..utils.factor_keys import factor_key
from .selection import LayerSpec

logger = logging.getLogger("kfac_stream")


@dataclass(frozen=True)
class FactorPlan:
    """Every factor the tracker keeps, and which layer uses which.

    Attributes:
        dims: ``{key: (side d, diagonal)}`` for every factor, A keys first per layer in model
            order; a shared A appears once, under its leader's ``"<leader>.A"``.
        a_key: ``{layer: key of its A factor}`` (``"<layer>.A"`` unless shared).
        groups: Layers sharing one A, each ``(leader, follower, ...)`` (only groups of ≥ 2).
    """

    dims: dict[str, tuple[int, bool]]
    a_key: dict[str, str]
    groups: tuple[tuple[str, ...], ...] = ()

    @staticmethod
    def g_key(layer: str) -> str:
        """Key of a layer's G factor."""
        return factor_key(layer, "G")

    def keys_of(self, layer: str) -> tuple[str, str]:
        """``(A key, G key)`` of ``layer``."""
        return self.a_key[layer], self.g_key(layer)

    def describe(self) -> list[list[str]]:
        """The groups as JSON-able lists (manifests, cross-rank agreement)."""
        return [list(g) for g in self.groups]


def plan_factors(specs: dict[str, LayerSpec], max_dense_dim: int,
                 groups: list[tuple[str, ...]] | tuple[tuple[str, ...], ...] = ()) -> FactorPlan:
    """The factor plan of ``specs`` with the given shared-input ``groups``.

    A group is kept only if all its layers have the same A side and the same diagonal
    decision (``has_bias`` and ``d_in`` equal); its members are ordered as in ``specs``.
    """
    order = {name: i for i, name in enumerate(specs)}
    a_key = {name: factor_key(name, "A") for name in specs}
    kept = []
    for group in groups:
        members = sorted((n for n in group if n in specs), key=order.__getitem__)
        if len(members) < 2 or len({specs[n].a_dim for n in members}) != 1:
            continue
        kept.append(tuple(members))
        for follower in members[1:]:
            a_key[follower] = factor_key(members[0], "A")
    dims: dict[str, tuple[int, bool]] = {}
    for name, s in specs.items():
        if a_key[name] == factor_key(name, "A"):
            dims[a_key[name]] = (s.a_dim, s.a_dim > max_dense_dim)
        dims[factor_key(name, "G")] = (s.g_dim, s.g_dim > max_dense_dim)
    return FactorPlan(dims, a_key, tuple(kept))


class ProbeUnsupported(Exception):
    """The probe cannot build this model's inputs (its main input is not token ids)."""


def _probe_input(model: nn.Module) -> dict[str, torch.Tensor]:
    """``[1, 2]`` token ids (id 0). An encoder-decoder (``config.is_encoder_decoder``: T5,
    BART, ...) gets its end-of-sequence id last (BART's classifier reads the decoder there) and
    ``decoder_input_ids`` of the same shape (its decoder start token, then id 0): its decoder
    needs inputs (T5 has no default; BART would shift ``input_ids``)."""
    param = next((p for p in model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    name = getattr(model, "main_input_name", "input_ids") or "input_ids"
    if name != "input_ids":
        raise ProbeUnsupported(f"its main input is {name!r}, not token ids")
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    out = {"input_ids": ids}
    cfg = getattr(model, "config", None)
    if getattr(cfg, "is_encoder_decoder", False):
        vocab = getattr(cfg, "vocab_size", None)

        def token(attr: str) -> int | None:
            t = getattr(cfg, attr, None)
            return t if isinstance(t, int) and 0 <= t < (vocab or t + 1) else None

        dec = ids.clone()
        if token("eos_token_id") is not None:
            ids[:, -1] = token("eos_token_id")
        if token("decoder_start_token_id") is not None:
            dec[:, 0] = token("decoder_start_token_id")
        out["decoder_input_ids"] = dec
    return out


def data_key(x: torch.Tensor) -> tuple:
    """What identifies a tensor's data without reading it (host attributes only): storage
    address, offset, shape, strides, dtype, device and version counter; on the ``meta``
    device (no storage) the object's identity."""
    if x.device.type == "meta":
        return ("object", id(x))
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(),
            x.dtype, x.device, x._version)


def same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same tensor or views of the same data (see `data_key`)."""
    return a is b or data_key(a) == data_key(b)


def probe_shared_inputs(model: nn.Module, layers: dict[str, nn.Module]
                        ) -> list[tuple[str, ...]]:
    """Groups of layers (names from ``layers``) that received the same input tensor object
    in one forward pass of ``model`` on a ``[1, 2]`` token input (``model.main_input_name``
    must be ``input_ids``). A layer called several times is judged by its first call.

    Collective under DeepSpeed ZeRO-3 (the forward gathers parameters): every rank must call
    it at the same point. Returns ``[]`` (and logs why) if the probe forward fails: then no
    layer shares its A, which is always correct, only less economical.
    """
    seen: dict[str, tuple] = {}
    alive: list[torch.Tensor] = []  # keeps ids unique during the probe

    def pre_hook(name):
        def hook(module, args):
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[name] = data_key(args[0])
                alive.append(args[0])  # no address is reused while the probe runs
        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n)) for n, m in layers.items()]
    try:
        inputs = _probe_input(model)
        devices = [inputs["input_ids"].device] if inputs["input_ids"].is_cuda else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):  # training RNG untouched
            model(**inputs)
    except Exception as e:  # a model this probe cannot drive: no sharing, still exact
        why = f" ({e})" if isinstance(e, ProbeUnsupported) else ""
        logger.info("kfac_stream: layers that read one input (q/k/v) are not grouped for this "
                    "model%s: each tracked layer keeps its own A factor, which is exact (a "
                    "shared one only saves memory and time); nothing is wrong", why)
        logger.debug("kfac_stream: the shared-input probe forward failed: %s: %s",
                      type(e).__name__, " ".join(str(e).split()))
        return []
    finally:
        for h in handles:
            h.remove()
    by_input: dict[tuple, list[str]] = {}
    for name in layers:
        if name in seen:
            by_input.setdefault(seen[name], []).append(name)
    alive.clear()
    return [tuple(g) for g in by_input.values() if len(g) > 1]
