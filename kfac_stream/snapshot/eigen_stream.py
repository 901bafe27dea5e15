"""A snapshot's eigendecompositions, computed while the shard is written (bounded memory).

`EigenStream` puts a `kfac_stream.snapshot.writer.Deferred` under ``<key>.eigvals`` and
``<key>.eigvecs`` of every owned factor in the shard's tensors; a producer thread decomposes the
factors (`kfac_stream.stats.spectrum.eigh_stored`: on the GPU in float32 or on the CPU in
float64) in the order the writer lays their results out, at most ``ahead`` factors ahead of
it, and the writer takes each result when its bytes are due. So the decompositions (GPU or
LAPACK, outside the GIL) overlap the write and its sha256 (file I/O and hashing release the
GIL too), and the host holds at most ``ahead + 1`` factors' results instead of every
eigenvector matrix of the shard (10.6 GB at 1.1B parameters: docs/performance.md).

The spectrum statistics go into the manifest part as each factor arrives; the writer sends the
part to rank 0 only after the shard is written, so it is complete by then
(`kfac_stream.snapshot.writer.write_snapshot`).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from ..exceptions import EigendecompositionError
from ..stats.spectrum import eigh_stored
from ..utils.enums import StorageDtype
from .spectra_estimate import owned_entries
from .writer import Deferred, write_order

#: Factors the producer may run ahead of the writer (their results held on the host).
AHEAD = 2
_DONE = object()  # the producer's last item


class EigenStream:
    """The eigendecompositions of ``tensors``' factors, as deferred shard tensors.

    Args:
        tensors: A shard's tensors (`kfac_stream.snapshot.contents.snapshot_contents`):
            ``<key>`` ``[d, d]`` or ``[d]`` stored data and ``<key>.scale`` per factor. The
            deferred ``<key>.eigvals`` ``[d]`` and ``<key>.eigvecs`` ``[d, d]`` (dense only)
            are added in place, in the storage's wide dtype (float32; float64 storage:
            float64).
        manifest: The shard's manifest part: ``spectrum`` is filled in per factor entry (a
            shared A in every layer entry that names it) as its decomposition arrives.
        device: Where dense factors are decomposed (`eigh_stored`); None: the CPU.
        threads: CPU threads for the CPU decompositions.
        ahead: Factors the producer may run ahead of the writer.
        on_result: Called with ``(key, eigvecs [d, d] | None)`` for each factor as its
            decomposition is done, on the producer's thread (the tracker's next EK-FAC basis,
            `kfac_stream.ekfac.EkfacState.sink`); None: nothing.
        report: The manifest part's ``eigen`` entry: its ``seconds`` (the decompositions'
            time so far) and ``finished_unix`` are kept current as results arrive (the part
            goes to rank 0 once the shard is written, so it then holds the last); None:
            nothing.

    ``eigvals`` (``{key: [d]}``, kept: they are small) holds every factor's eigenvalues once
    the shard is written; `close` stops the producer (call it in ``finally``).
    ``eigh_seconds``: the producer's time in the decompositions; ``wait_seconds``: the
    writer's time waiting for a result (what the overlap did not hide).
    """

    def __init__(self, tensors: dict[str, Any], manifest: dict[str, Any],
                 device: torch.device | str | None = None, threads: int | None = None,
                 ahead: int = AHEAD, on_result=None, report: dict | None = None) -> None:
        self.manifest, self.device, self.threads = manifest, device, threads
        self.on_result, self.report = on_result, report
        self.dtype = StorageDtype(manifest["storage_dtype"]).wide_dtype
        self.eigvals: dict[str, torch.Tensor] = {}
        self._entries = owned_entries(tensors, manifest)  # key -> manifest factor entries
        for key in self._entries:
            d = tuple(tensors[key].shape)
            tensors[f"{key}.eigvals"] = Deferred(self.dtype, d[:1], self._getter(key, 0))
            if len(d) == 2:
                tensors[f"{key}.eigvecs"] = Deferred(self.dtype, d, self._getter(key, 1))
        # the factors in the order the writer asks for their results
        order: dict[str, None] = {}
        for name in write_order(tensors):
            if name.endswith((".eigvals", ".eigvecs")) and isinstance(tensors[name], Deferred):
                order.setdefault(name.rsplit(".", 1)[0], None)
        self._stored = [(k, tensors[k], float(tensors[f"{k}.scale"])) for k in order]
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, ahead))
        self._ready: dict[str, list] = {}  # key -> [eigvals, eigvecs] not yet taken
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.eigh_seconds = self.wait_seconds = 0.0

    # -- the writer's side -----------------------------------------------------------------------

    def _getter(self, key: str, part: int):
        return lambda: self._take(key, part)

    def _take(self, key: str, part: int) -> torch.Tensor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, daemon=True,
                                            name="kfac-stream-eigh")
            self._thread.start()
        while key not in self._ready:
            t0 = time.perf_counter()
            item = self._queue.get()
            self.wait_seconds += time.perf_counter() - t0
            if item is _DONE:  # cannot happen: every deferred key is in `_stored`
                raise EigendecompositionError(f"eigendecomposition of {key} never produced")
            if isinstance(item, BaseException):
                raise EigendecompositionError(
                    f"eigendecomposition failed: {type(item).__name__}: {item}") from item
            got, w, q, stats = item
            self._ready[got] = [w, q]
            self.eigvals[got] = w
            for entry in self._entries[got]:
                entry["spectrum"] = stats
            if self.report is not None:
                self.report.update(seconds=self.eigh_seconds, finished_unix=time.time())
        parts = self._ready[key]
        out, parts[part] = parts[part], None
        if all(p is None for p in parts):
            del self._ready[key]
        return out

    # -- the producer ----------------------------------------------------------------------------

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        results = eigh_stored(iter(self._stored), self.dtype, self.device, self.threads)
        try:
            t0 = time.perf_counter()
            for key, w, q, stats in results:
                self.eigh_seconds += time.perf_counter() - t0
                if self.on_result is not None:
                    self.on_result(key, q)
                if not self._put((key, w, q, stats)):
                    return
                t0 = time.perf_counter()
            self._put(_DONE)
        except BaseException as e:  # re-raised on the writer's thread
            self._put(e)
        finally:
            results.close()  # restores the torch threads now, also when stopped early

    def close(self) -> None:
        """Stop the producer (if the writer gave up early) and drop what it held."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._ready.clear()
        self._stored = []
