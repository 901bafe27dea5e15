"""One background thread that finishes snapshots (eigendecomposition + write) off the step.

At most one snapshot is in flight: submitting the next one waits for the previous one (the
step only stalls if snapshots come faster than they can be finished). An error in the worker
is re-raised on the training thread at the next `submit` or `wait`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class SnapshotWorker:
    """Runs submitted jobs one at a time on a daemon thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Wait for the previous job, then start ``job`` in the background."""
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as e:  # surfaced by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="kfac-stream-snapshot", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a job is still running (never blocks)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the job in flight (if any) is done; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("kfac_stream: writing a snapshot failed") from err
