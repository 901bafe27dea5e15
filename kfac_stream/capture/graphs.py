"""Refusing CUDA graphs: the tracker cannot be captured into one.

Its hooks draw positions with a generator, append rows to Python lists and hand them to a
worker thread after the step; a captured graph would replay the first capture's kernels on
stale buffers and never run the Python side again (and the worker's reads of the capturing
stream are illegal during capture). Two guards, each with a message that says what to change:

* at train begin, `compile_mode_error` refuses ``TrainingArguments(torch_compile=True)`` with a
  mode that captures CUDA graphs (``"reduce-overhead"``, ``"max-autotune"``);
* in every captured forward, `check_not_capturing` raises if the batch's CUDA stream is being
  captured (``torch.cuda.graphs`` / ``torch.cuda.make_graphed_callables`` or a compiled
  module that captures).
"""

from __future__ import annotations

from typing import Any

import torch

from ..exceptions import KFACConfigError

GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that use CUDA graphs
_ADVICE = ("kfac_stream cannot run inside a CUDA graph: its hooks sample positions and hand "
           "rows to a worker thread on every update step, which a replayed graph would skip. "
           "Use torch_compile_mode='default' (or 'max-autotune-no-cudagraphs'), or train "
           "without CUDA graphs while the callback is on.")


def compile_mode_error(args: Any) -> KFACConfigError | None:
    """The error for HF ``TrainingArguments`` (``args``) that compile with CUDA graphs; None
    when they do not."""
    if not getattr(args, "torch_compile", False):
        return None
    mode = getattr(args, "torch_compile_mode", None)
    if mode in GRAPH_MODES:
        return KFACConfigError(f"TrainingArguments.torch_compile_mode={mode!r}: {_ADVICE}")
    return None


def capturing(x: torch.Tensor) -> bool:
    """The current CUDA stream of ``x``'s device is being captured (False off CUDA)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_not_capturing(x: torch.Tensor) -> None:
    """Raise `RuntimeError` if a forward on ``x`` (a batch input) is being captured."""
    if capturing(x):
        raise RuntimeError(f"kfac_stream: a forward pass is being captured into a CUDA graph. "
                           f"{_ADVICE}")
