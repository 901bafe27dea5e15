"""DeepSpeed on CPU in the test jobs: skip its op probe and its shared-memory all-reduce op.

When DeepSpeed creates its communication backend (``deepspeed.comm.torch.TorchBackend``) it
asks ``deepspeed.ops.__compatible_ops__`` whether its CPU shared-memory op may be built: that
probes every op builder (compiler subprocesses, ~3 s of CPU per process) and then JIT-compiles
the op (35-100 s on the first launch of a fresh environment, every launch when two
environments share the torch extensions folder). The op serves only
``deepspeed.comm.inference_all_reduce``; ZeRO training's collectives go through
``torch.distributed`` (gloo here), so the jobs declare no op compatible and DeepSpeed takes its
fallback. The user-facing launches (the app, the examples, the README's commands) keep
DeepSpeed's own behaviour.
"""

from __future__ import annotations

import os


def skip_deepspeed_op_probe() -> None:
    """Declare no DeepSpeed op compatible, in a process that ``accelerate launch`` started with
    a DeepSpeed config (``ACCELERATE_USE_DEEPSPEED``); elsewhere import nothing."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}
