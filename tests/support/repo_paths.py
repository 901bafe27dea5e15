"""Where the tests find the repository's files, whatever folder a test file sits in.

* ``ROOT``: the repository (``pathlib.Path``), the parent of ``tests/``.
* ``SUPPORT``: ``tests/support/``, the shared helper modules and the job scripts that the
  tests start as subprocesses (``ROOT / "tests" / "support"``).
* ``BENCHMARKS``: ``benchmarks/``, for the tests that import a benchmark script.
"""

from __future__ import annotations

import pathlib

SUPPORT = pathlib.Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
BENCHMARKS = ROOT / "benchmarks"
