"""The training run's random number generators, kept as the tracker found them.

A model trained with the tracker must be the model trained without it, bit for bit. Every
draw the tracker makes on its own account (the token sampler, the MC labels, the replay's
sequences) comes from a ``torch.Generator`` of its own; what remains are draws the tracker
cannot give a generator: the dropout masks of a forward it runs itself (the MC replay of a
micro-batch after the optimizer step, a probe forward), which PyTorch takes from the global
generators the training's own dropout reads next.

`kept_generators` saves the global generators a training run reads (torch's CPU generator,
the CUDA generator of each listed device, Python's `random`, NumPy's legacy global state
when NumPy is loaded) and restores them on exit, whatever ran inside; `own_draws` also seeds
torch's global generators inside from a seed of the tracker's own, so the replay's dropout
is a draw of the tracker's stream (a fixed function of ``(seed, rank, step)``: a resumed run
draws the same), not a copy of the masks the next training step is about to draw.

Cost: one copy of each generator's state in and out (torch's CPU state is 5,056 bytes, a
CUDA one 16, Python's 625 ints); no device work and no host sync (a CUDA generator's state
is its seed and offset, held on the host).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator, Sequence

import torch

__all__ = ["kept_generators", "own_draws"]


def _cuda_indices(devices: Sequence[torch.device | str | int | None]) -> list[int]:
    """The distinct CUDA device indices among ``devices`` (others dropped)."""
    out: list[int] = []
    for d in devices:
        if d is None:
            continue
        d = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
        if d.type != "cuda":
            continue
        index = torch.cuda.current_device() if d.index is None else d.index
        if index not in out:
            out.append(index)
    return out


@contextlib.contextmanager
def kept_generators(devices: Sequence[torch.device | str | int | None] = ()) -> Iterator[None]:
    """Restore, on exit, every global generator a training run reads.

    Args:
        devices: The devices whose CUDA generators to keep (CPU devices and None add
            nothing: torch's CPU generator is always kept).
    """
    cuda = _cuda_indices(devices)
    cpu_state = torch.get_rng_state()
    cuda_states = [torch.cuda.get_rng_state(i) for i in cuda]
    py_state = random.getstate()
    np = sys.modules.get("numpy")  # only when the process has loaded it
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        for i, state in zip(cuda, cuda_states):
            torch.cuda.set_rng_state(state, i)
        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)


@contextlib.contextmanager
def own_draws(seed: int, devices: Sequence[torch.device | str | int | None] = ()
              ) -> Iterator[None]:
    """Run the block on global generators seeded from ``seed`` (torch's CPU generator and the
    CUDA generators of ``devices``), all global generators restored on exit
    (`kept_generators`)."""
    cuda = _cuda_indices(devices)
    with kept_generators(devices):
        torch.default_generator.manual_seed(seed)
        for i in cuda:
            torch.cuda.default_generators[i].manual_seed(seed)
        yield
