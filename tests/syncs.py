"""Counting host synchronisations on one thread (tests/test_host_syncs.py on CPU, the CUDA
tests of tests/test_hot_path.py and benchmarks/gpu_check.py on a GPU).

`SyncCounter` is a ``TorchDispatchMode``: thread-local, it sees only the ops of the thread that
entered it (the training thread), never the factor worker's or the snapshot thread's.
It counts every op that makes the host wait for a device value: ``_local_scalar_dense``
(``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``), ``is_nonzero``, ``equal``, ``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without an output size, indexing or
``index_put`` with a boolean mask, and (on CUDA) a blocking copy from a CUDA tensor to the host.
`CudaSyncCounter` adds the explicit waits (``torch.cuda.synchronize``, ``Stream.synchronize``,
``Event.synchronize``) made on the counting thread. Unlike ``torch.cuda.set_sync_debug_mode``
(process-wide: the worker's own reads and the model's mask check would trip it), both count
only the training thread, and attribute each sync to kfac_stream's code or the model's.
"""

from __future__ import annotations

import collections
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero,
           aten.masked_select, aten._unique2, aten.unique_dim, aten.unique_consecutive,
           aten.nonzero_static}


def _bool_index(indices) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
               for t in indices if t is not None)


class SyncCounter(TorchDispatchMode):
    """Counts host-synchronising ops; remembers where kfac_stream issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ours: collections.Counter = collections.Counter()
        self.replayed = 0  # the model's own syncs inside kfac_stream's MC replay forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        sync = packet in _ALWAYS
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
            sync = _bool_index(args[1])
        if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
            sync = True
        if sync:
            self.count += 1
            stack = traceback.extract_stack()
            outside = [f for f in stack if "/torch/" not in f.filename
                       and not f.filename.endswith(("test_host_syncs.py", "syncs.py"))]
            if outside and "kfac_stream" in outside[-1].filename:
                self.ours[f"{func} at {outside[-1].filename}:{outside[-1].lineno}"] += 1
            elif any(f.filename.endswith("kfac_stream/capture/mc_fisher.py") for f in stack):
                self.replayed += 1
        return func(*args, **kwargs)


def _blocking_d2h(packet, args, kwargs) -> bool:
    """A copy from a CUDA tensor to the host that waits for it (not ``non_blocking``)."""
    if kwargs.get("non_blocking") or (packet is aten.copy_ and len(args) > 2 and args[2]):
        return False
    if packet is aten._to_copy:
        src, dev = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.is_cuda and dev is not None and \
            torch.device(dev).type == "cpu"
    if packet is aten.copy_:
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.is_cuda and not dst.is_cuda
    return False


class CudaSyncCounter(SyncCounter):
    """`SyncCounter` plus blocking CUDA→host copies and explicit synchronize calls made on the
    thread that entered it (counted in ``count`` and, from kfac_stream's frames, ``ours``)."""

    _PATCHED = (("synchronize", torch.cuda), ("synchronize", torch.cuda.Stream),
                ("synchronize", torch.cuda.Event))

    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.get_ident()
        self._saved: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _blocking_d2h(func.overloadpacket, args, kwargs or {}):
            self._record(f"{func} (blocking copy to the host)")
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, what: str) -> None:
        self.count += 1
        stack = traceback.extract_stack()
        outside = [f for f in stack if "/torch/" not in f.filename
                   and not f.filename.endswith("syncs.py")]
        if outside and "kfac_stream" in outside[-1].filename:
            self.ours[f"{what} at {outside[-1].filename}:{outside[-1].lineno}"] += 1

    def __enter__(self):
        self._thread = threading.get_ident()
        for name, owner in self._PATCHED:
            real = getattr(owner, name)
            self._saved.append((owner, name, real))

            def counted(*args, _real=real, _what=f"{owner.__name__}.{name}", **kwargs):
                if threading.get_ident() == self._thread:
                    self._record(_what)
                return _real(*args, **kwargs)

            setattr(owner, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._saved:
                owner, name, real = self._saved.pop()
                setattr(owner, name, real)
