"""Counting host synchronisations on one thread (tests/unit/tracking/test_host_syncs.py on CPU, the
CUDA tests of tests/unit/tracking/test_worker_eigh_and_cuda.py and benchmarks/gpu_check.py on a
GPU).

`SyncCounter` is a ``TorchDispatchMode``: thread-local, it sees only the ops of the thread that
entered it (the training thread), never the factor worker's or the snapshot thread's.
It counts every op that makes the host wait for a device value: ``_local_scalar_dense``
(``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``), ``is_nonzero``, ``equal``, ``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without an output size, indexing or
``index_put`` with a boolean mask, and (on CUDA) a blocking copy from a CUDA tensor to the host.
`CudaSyncCounter` adds the explicit waits (``torch.cuda.synchronize``, ``Stream.synchronize``,
``Event.synchronize``) made on the counting thread. Unlike ``torch.cuda.set_sync_debug_mode``
(process-wide: the worker's own reads and the model's mask check would trip it), both count
only the training thread, and attribute each sync to kfac_stream's code or the model's
(`attribute`).
"""

from __future__ import annotations

import collections
import functools
import os
import site
import sysconfig
import threading
import traceback
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kfac_stream

aten = torch.ops.aten
_ALWAYS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero,
           aten.masked_select, aten._unique2, aten.unique_dim, aten.unique_consecutive,
           aten.nonzero_static}


@functools.cache
def _real(path: str) -> str:
    return os.path.realpath(path)


def _as_dir(path: str) -> str:
    """``path`` resolved, with one trailing separator: a prefix that matches only what is
    inside it (``.../torch/`` is not a prefix of ``.../torchvision/...``)."""
    return _real(path).rstrip(os.sep) + os.sep


def _inside(filename: str, directory: str) -> bool:
    return _real(filename).startswith(directory)


# torch's own package directory and kfac_stream's: where a frame's file lies, not a substring
# of its path (Python itself may live under a directory named ``torch``, e.g. /opt/torch/.venv,
# and then every installed package's path contains "/torch/")
TORCH_DIR = _as_dir(os.path.dirname(torch.__file__))
OURS_DIR = _as_dir(os.path.dirname(kfac_stream.__file__))
_THIS_FILE = _real(__file__)
# the standard library (frames seen through, like torch's: a sync in ``contextlib`` or
# ``copy`` is its caller's); its directory may hold site-packages (a system Python, a venv's
# lib/pythonX.Y), which is not the standard library
_STDLIB_DIRS = tuple({_as_dir(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib")})
_SITE_DIRS = tuple({_as_dir(p) for p in (*site.getsitepackages(), site.getusersitepackages(),
                                         sysconfig.get_path("purelib"),
                                         sysconfig.get_path("platlib"))})


def see_through(filename: str) -> bool:
    """Frames that are not where a sync was asked for: this counter's own, the standard
    library's, and code without a file (``<frozen ...>``, ``<string>``)."""
    if filename.startswith("<") or _real(filename) == _THIS_FILE:
        return True
    return any(_inside(filename, d) for d in _STDLIB_DIRS) and \
        not any(_inside(filename, d) for d in _SITE_DIRS)


def attribute(frames: Sequence[traceback.FrameSummary], torch_dir: str = TORCH_DIR,
              ours_dir: str = OURS_DIR, skip: Callable[[str], bool] = see_through,
              ) -> tuple[str, traceback.FrameSummary | None]:
    """Whose code asked for a sync, from the stack it was asked on (outermost frame first).

    The frame that asked is the innermost one outside torch's package directory
    (``torch_dir``) and not seen through (``skip``). Returns ``("ours", frame)`` when that
    frame lies in kfac_stream's package directory (``ours_dir``); otherwise the model's (or
    the Trainer's, a collator's: any code but kfac_stream's): ``("replayed", frame)`` when
    kfac_stream's MC replay (``fisher/mc_replay.py``) is on the stack (the model's own syncs
    in the forward kfac_stream replays), else ``("model", frame)``. ``frame`` is None when
    every frame is torch's or seen through.
    """
    torch_dir, ours_dir = _as_dir(torch_dir), _as_dir(ours_dir)
    asked = [f for f in frames if not _inside(f.filename, torch_dir) and not skip(f.filename)]
    frame = asked[-1] if asked else None
    if frame is not None and _inside(frame.filename, ours_dir):
        return "ours", frame
    replay = _real(os.path.join(ours_dir, "fisher", "mc_replay.py"))
    if any(_real(f.filename) == replay for f in frames):
        return "replayed", frame
    return "model", frame


def _bool_index(indices) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
               for t in indices if t is not None)


class SyncCounter(TorchDispatchMode):
    """Counts host-synchronising ops and whose code asked for each (`attribute`).

    ``count``: all of them. ``ours``: kfac_stream's, ``{"<op> at <file>:<line>": n}``.
    ``model``: everyone else's (the model's, the Trainer's), keyed the same way, those inside
    kfac_stream's MC replay forward included; ``replayed``: how many of ``model``'s those are,
    ``replays``: those, keyed the same way. ``count == sum(ours.values()) +
    sum(model.values())``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ours: collections.Counter = collections.Counter()
        self.model: collections.Counter = collections.Counter()
        self.replayed = 0  # the model's own syncs inside kfac_stream's MC replay forward
        self.replays: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        sync = packet in _ALWAYS
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
            sync = _bool_index(args[1])
        if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
            sync = True
        if sync:
            self._record(str(func))
        return func(*args, **kwargs)

    def _record(self, what: str) -> None:
        self.count += 1
        whose, frame = attribute(traceback.extract_stack())
        where = f"{what} at {frame.filename}:{frame.lineno}" if frame is not None else \
            f"{what} (no frame outside torch)"
        (self.ours if whose == "ours" else self.model)[where] += 1
        if whose == "replayed":
            self.replayed += 1
            self.replays[where] += 1


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
    thread that entered it (counted and attributed like the others)."""

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

    def __enter__(self):
        self._thread = threading.get_ident()
        for name, owner in self._PATCHED:
            real = getattr(owner, name)
            self._saved.append((owner, name, real))

            def counted(*args, _wrapped=real, _what=f"{owner.__name__}.{name}", **kwargs):
                if threading.get_ident() == self._thread:
                    self._record(_what)
                return _wrapped(*args, **kwargs)

            setattr(owner, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._saved:
                owner, name, real = self._saved.pop()
                setattr(owner, name, real)
