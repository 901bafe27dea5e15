"""A snapshot from start to finish, in one place (the callback and the benchmarks call it).

1. `capture_snapshot`, on the training thread: the tracker flushes its factors (on a GPU
   the flush streams them through the device, each entry written once) and lends the stored
   tensors themselves (`kfac_stream.tracking.tracker.Tracker.export` with ``lend``: no copy; a write
   before they are released goes into a spare tensor, `kfac_stream.store.factor_store`), the
   shard's tensors and manifest part are made from them
   (`kfac_stream.snapshot.contents.snapshot_contents`) and the weights' fingerprint is read
   (`kfac_stream.snapshot.weights`), with the model's architecture
   (`kfac_stream.snapshot.architecture`). Nothing else touches a factor entry on this thread.
   Each tracker extension (`kfac_stream.extensions`) hands over what the snapshot stores of
   it (EK-FAC: the correction accumulated on the previous snapshot's eigenbasis,
   `kfac_stream.ekfac`, which then waits for this one's).
2. `finish_snapshot`, anywhere (the callback's background thread): the eigendecompositions
   stream into the shard as it is written and hashed (`kfac_stream.snapshot.eigen_stream`,
   `kfac_stream.snapshot.writer.write_snapshot`: atomic, every rank its shard, rank 0 the
   manifest; each factor's eigenvectors also go to the extensions' sinks, EK-FAC's next
   basis, and with several ranks from their owner to every rank once the shard is written);
   returns the directory and the eigenvalues (for the spectra media).

`take_snapshot` runs both in a row; `write_record` writes a `TrackerRecord` made elsewhere
(the default-selection suite's rebuilt factors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..distributed.context import LOCAL
from .architecture import model_identity
from .contents import merge_manifests, snapshot_contents
from .eigen_rule import EigenDecision, EighRate, decide
from .eigen_stream import EigenStream
from .spectra_estimate import estimate_spectra
from .weights import weights_fingerprint
from .writer import write_snapshot


@dataclasses.dataclass
class CapturedSnapshot:
    """What the training thread hands to the background: ``tensors`` (the shard's: stored
    factors ``[d, d]``/``[d]`` and their scales, sketches), ``manifest`` (this rank's part,
    with ``weights``, as JSON: `kfac_stream.snapshot.manifest_types.Manifest.to_json`; the
    eigendecomposition adds the spectra), ``step``, and ``lent`` (``{key: stored factor}``:
    the tracker's own tensors, unchanged until passed back with the next
    `capture_snapshot`'s ``release``, once this snapshot is written). ``basis_sink``: where the
    eigenvectors go as they are computed (the tracker extensions' sinks,
    `kfac_stream.extensions.ExtensionExport`: EK-FAC's next basis), else None."""

    step: int
    tensors: dict[str, Any]
    manifest: dict[str, Any]
    lent: dict[str, torch.Tensor]
    basis_sink: Callable[[str, torch.Tensor | None], None] | None = None


def capture_snapshot(tracker, step: int, epoch: float | None = None,
                     release: Mapping[str, torch.Tensor] | None = None) -> CapturedSnapshot:
    """The training thread's part: flush, lend the stored factors (no copy), contents,
    weights fingerprint (collective under ZeRO-3 and FSDP2: every rank calls it for the same
    step). ``release``: the previous capture's ``lent``, its snapshot written."""
    tracker.release(release or {})  # before the flush: it writes those factors in place
    record = tracker.export(lend=True)
    exports = tracker.export_extensions(step)  # empty without tracker extensions
    tensors, manifest = snapshot_contents(
        record, step, epoch, extensions=exports,
        weights=weights_fingerprint(tracker.layers),
        # the architecture: a query on another one says so
        model=model_identity(getattr(tracker, "model", None)))
    return CapturedSnapshot(int(step), tensors, manifest,
                            {k: f.data for k, f in record.factors.items()},
                            _sink([e.sink for e in exports.values() if e.sink is not None]))


def queue_capture(tracker, step: int, epoch: float | None = None,
                  release: Mapping[str, torch.Tensor] | None = None
                  ) -> Callable[[], CapturedSnapshot]:
    """`capture_snapshot` with the flush off the training thread: the weights' fingerprint
    and the counters are read now (they belong to this step), the fold and the lending are
    queued behind this step's update (`kfac_stream.tracking.tracker.Tracker.queue_export`:
    the training thread only enqueues), and the returned call waits for them and makes the
    contents (call it on the snapshot's thread). With a tracker extension it is
    `capture_snapshot` (what it exports is taken with the factors, on this thread)."""
    if getattr(tracker, "extensions", None):
        captured = capture_snapshot(tracker, step, epoch, release)
        return lambda: captured
    weights = weights_fingerprint(tracker.layers)  # collective under ZeRO-3 and FSDP2
    model = model_identity(getattr(tracker, "model", None))
    pending = tracker.queue_export(release)

    def contents() -> CapturedSnapshot:
        record = pending.result()
        tensors, manifest = snapshot_contents(record, step, epoch, weights=weights,
                                              model=model)
        return CapturedSnapshot(int(step), tensors, manifest,
                                {k: f.data for k, f in record.factors.items()})

    return contents


class _Sinks:
    """Several extensions' eigenvector sinks as one (each gets every result; `share`: theirs,
    in order)."""

    def __init__(self, sinks: list[Callable[[str, torch.Tensor | None], None]]) -> None:
        self.sinks = sinks

    def __call__(self, key: str, q: torch.Tensor | None) -> None:
        for sink in self.sinks:
            sink(key, q)

    def share(self, comm) -> None:
        for sink in self.sinks:
            share = getattr(sink, "share", None)
            if share is not None:
                share(comm)


def _sink(sinks: list[Callable[[str, torch.Tensor | None], None]]
          ) -> Callable[[str, torch.Tensor | None], None] | None:
    """The extensions' sinks as the one `EigenStream` calls (None: none)."""
    return None if not sinks else sinks[0] if len(sinks) == 1 else _Sinks(sinks)


@dataclasses.dataclass
class EigenPlan:
    """What decides whether a snapshot eigendecomposes in the run (`eigen_rule.decide`):
    ``policy`` (``KFACConfig.eigendecompose``), ``final`` (the run's last snapshot),
    ``step_seconds`` (measured; 0: unknown), ``snapshot_every`` and ``rate`` (seconds per
    ``d³``, updated by each decomposition this run makes)."""

    policy: str
    final: bool
    step_seconds: float
    snapshot_every: int
    rate: EighRate


def finish_snapshot(captured: CapturedSnapshot, root: str, comm=None,
                    eigh_device: torch.device | str | None = None, threads: int | None = None,
                    gather: bool = False, eigen: EigenPlan | None = None
                    ) -> tuple[str, dict[str, torch.Tensor]]:
    """Eigendecompose (or estimate the spectra of) and write ``captured`` under ``root`` (every
    rank of ``comm`` calls it); returns ``(snapshot directory, {key: eigenvalues [d]} of this
    rank's factors)`` (deferred: the estimated density's quantiles).

    ``eigen`` None: decomposed in the run; else as `eigen_rule.decide` says, on the busiest
    rank's predicted seconds and rank 0's step time (every rank decides the same). A failed
    eigendecomposition or write raises `kfac_stream.exceptions.SnapshotError` on every rank,
    and nothing is left under the snapshot's name."""
    comm = comm if comm is not None else LOCAL
    sides = [int(t.shape[0]) for k, t in captured.tensors.items()
             if f"{k}.scale" in captured.tensors and t.dim() == 2]
    decision = _agree(eigen, sides, comm)
    report = {**decision.to_json(), "device": None, "finished_unix": None, "seconds": None}
    captured.manifest["eigen"] = report
    if not decision.decompose:
        eigvals = estimate_spectra(captured.tensors, captured.manifest, eigh_device)
        path = write_snapshot(root, captured.step, captured.tensors, captured.manifest,
                              comm=comm, merge=merge_manifests, gather=gather)
        return path, eigvals
    report["device"] = "cpu" if eigh_device is None else str(torch.device(eigh_device))
    stream = EigenStream(captured.tensors, captured.manifest, eigh_device, threads,
                         on_result=captured.basis_sink, report=report)
    try:
        path = write_snapshot(root, captured.step, captured.tensors, captured.manifest,
                              comm=comm, merge=merge_manifests, gather=gather)
    finally:
        stream.close()
    share = getattr(captured.basis_sink, "share", None)
    if share is not None and not (eigen is not None and eigen.final):  # (the last: no use)
        share(comm)  # several ranks: every factor's eigenvectors reach every rank (collective,
        # EK-FAC's `kfac_stream.ekfac.sync.RankedSink`; ``final`` is the same on every rank)
    if eigen is not None:
        eigen.rate.measured(sides, stream.eigh_seconds)
    return path, stream.eigvals


def _agree(eigen: EigenPlan | None, sides: list[int], comm) -> EigenDecision:
    """The rule's decision, the same on every rank (collective with several)."""
    if eigen is None:
        return decide("always", final=False)
    mine = [eigen.rate.seconds(sides), eigen.step_seconds]
    every = comm.all_gather(mine) if comm.world_size > 1 else [mine]
    return decide(eigen.policy, eigen.final, max(e[0] for e in every), every[0][1],
                  eigen.snapshot_every, rate=eigen.rate.source)


def take_snapshot(tracker, root: str, step: int, epoch: float | None = None,
                  eigh_device: torch.device | str | None = None,
                  threads: int | None = None) -> str:
    """`capture_snapshot` then `finish_snapshot` (one process), as the callback's
    ``save_snapshot(step, wait=True)`` does; returns the snapshot directory.
    ``eigh_device`` None: the tracker's (``tracker.run.eigh_device``); ``threads`` None: its
    config's ``eigh_threads``."""
    if eigh_device is None:
        eigh_device = tracker.run.eigh_device
    captured = capture_snapshot(tracker, step, epoch)
    try:
        return finish_snapshot(captured, root, eigh_device=eigh_device,
                               threads=tracker.config.eigh_threads if threads is None
                               else threads)[0]
    finally:
        tracker.release(captured.lent)


def write_record(record, root: str, step: int, epoch: float | None = None,
                 eigh_device: torch.device | str | None = None,
                 threads: int | None = None) -> str:
    """A snapshot of ``record`` (a `kfac_stream.tracking.tracker.TrackerRecord` with factors; no
    weights fingerprint: no model here), eigendecomposed and written in one process;
    returns the snapshot directory."""
    tensors, manifest = snapshot_contents(record, step, epoch)
    return finish_snapshot(CapturedSnapshot(int(step), tensors, manifest, {}), root,
                           eigh_device=eigh_device, threads=threads)[0]
