"""Run ``kfac-stream train``'s entry point (`kfac_stream.app.main.cli_main`) once per command line
in ONE process: tests/runs/test_hydra_app.py's bad-override cases, each a real Hydra composition and
validation as ``python -m kfac_stream.app ARGS`` does it, without a process start per case.

    python tests/support/app_overrides_job.py OUT.json 'ARGS...' ['ARGS...' ...]

Writes ``[{"rc": exit code, "out": stdout + stderr}, ...]``; an exception that escapes the
entry point is recorded with its traceback (rc 99), as a subprocess would print it.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
import traceback


def run_one(argv: list[str]) -> dict:
    from hydra.core.global_hydra import GlobalHydra

    from kfac_stream.app.main import cli_main

    GlobalHydra.instance().clear()
    out = io.StringIO()
    rc = 0
    saved = sys.argv
    sys.argv = ["kfac_stream.app.main", *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli_main()
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - recorded for the test to see
            traceback.print_exc()
            rc = 99
        finally:
            sys.argv = saved
    return {"rc": rc, "out": out.getvalue()}


if __name__ == "__main__":
    results = [run_one(shlex.split(line)) for line in sys.argv[2:]]
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
