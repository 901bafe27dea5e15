"""Expensive runs launched once per pytest session, shared by every test that reads them, also
across pytest-xdist workers (``make test`` runs the suite in worker processes).

The first process to ask for a run takes its lock (``fcntl.flock`` on ``<name>.lock`` in the
session's shared temporary folder), launches it and leaves ``<name>/DONE`` (or ``<name>/FAILED``
holding the log); any other process asking meanwhile waits on the lock and reuses the output,
so a run never launches twice and tests of one module can run on different workers.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def session_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """``<session temp root>/<name>``: under pytest-xdist the root every worker of this session
    shares (each worker's own base temp sits inside it), else this process's base temp."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


class SharedRuns:
    """``get(name)`` → the output directory of run ``name``, launched by ``launch(name, out)``
    the first time any process of the session asks for it. ``launch`` returns ``(ok, log)``;
    a failed run raises ``AssertionError`` with its log's tail in every test that asks."""

    def __init__(self, base: Path, launch: Callable[[str, str], tuple[bool, str]]) -> None:
        self.base, self.launch = base, launch

    def get(self, name: str) -> str:
        out = self.base / name
        with open(self.base / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (out / "DONE").exists() and not (out / "FAILED").exists():
                shutil.rmtree(out, ignore_errors=True)  # a launch killed half-way
                out.mkdir()
                ok, log = self.launch(name, str(out))
                (out / "log.txt").write_text(log)
                (out / ("DONE" if ok else "FAILED")).write_text("")
        if (out / "FAILED").exists():
            log = (out / "log.txt").read_text()
            raise AssertionError(f"{name} failed:\n{log[-4000:]}")
        return str(out)
