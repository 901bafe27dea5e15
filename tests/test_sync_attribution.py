"""Whose code asked for a host sync (`syncs.attribute`, used by `syncs.SyncCounter`).

A GPU run (Python under /opt/torch/.venv) blamed 8 of the model's own ``.item()`` calls on
kfac_stream's MC replay (``fisher/mc_replay.py``, ``out = model(**kwargs)``): the counter
dropped every frame whose path contained ``/torch/``, and under /opt/torch/ that is every
installed package's, transformers' too. Frames are now told apart by the package directory
they lie in: torch's own (``os.path.dirname(torch.__file__)``), kfac_stream's, or anything
else (the model's). Fake stacks check the rule; a real one (a module imported from a
``.../torch/.venv/...`` path under ``tmp_path``) checks the counter end to end, on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sysconfig
import traceback

import torch

from kfac_stream.stats.spectrum import spectrum_stats

from syncs import OURS_DIR, TORCH_DIR, SyncCounter, attribute

SITE = "/opt/torch/.venv/lib/python3.12/site-packages"  # the GPU machine's layout
GPU_TORCH = f"{SITE}/torch"
MC_FISHER = os.path.join(OURS_DIR, "fisher", "mc_replay.py")


def frame(filename: str, lineno: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(filename, lineno, name, lookup_line=False, line="")


def replay_stack(*inner: traceback.FrameSummary) -> list[traceback.FrameSummary]:
    """The Trainer's step, kfac_stream's MC replay forward, torch's ``Module.__call__``, the
    model's forward, then ``inner`` (outermost first, as ``traceback.extract_stack``)."""
    return [frame(f"{SITE}/transformers/trainer.py", 2000, "training_step"),
            frame(MC_FISHER, 185, "mc_gradient"),
            frame(f"{GPU_TORCH}/nn/modules/module.py", 1775, "_call_impl"),
            frame(f"{SITE}/transformers/models/gpt2/modeling_gpt2.py", 900, "forward"),
            *inner]


def old_rule(stack: list[traceback.FrameSummary]) -> bool:
    """The counter's rule before the fix (kept to show the bug): "ours" when the innermost
    frame whose path has no ``/torch/`` substring has ``kfac_stream`` in its path."""
    outside = [f for f in stack if "/torch/" not in f.filename]
    return bool(outside) and "kfac_stream" in outside[-1].filename


def test_the_models_sync_in_the_mc_replay_is_the_models_under_a_torch_named_prefix():
    mask = frame(f"{SITE}/transformers/masking_utils.py", 230, "sdpa_mask")
    stack = replay_stack(mask, frame(f"{GPU_TORCH}/_tensor.py", 1100, "__bool__"))
    assert attribute(stack, GPU_TORCH, OURS_DIR) == ("replayed", mask)
    assert old_rule(stack)  # the bug: transformers' frames dropped, mc_replay.py:185 blamed
    # the same sync outside the replay (the Trainer's own forward) is the model's alone
    assert attribute([stack[0], *stack[2:]], GPU_TORCH, OURS_DIR) == ("model", mask)


def test_kfac_streams_own_sync_is_ours():
    hooks = frame(os.path.join(OURS_DIR, "capture", "hooks.py"), 120, "backward_hook")
    item = frame(f"{GPU_TORCH}/_tensor.py", 1100, "item")
    # called from the model's forward (a forward hook), and from torch's autograd engine
    assert attribute(replay_stack(hooks, item), GPU_TORCH, OURS_DIR) == ("ours", hooks)
    autograd = frame(f"{GPU_TORCH}/autograd/graph.py", 824, "_engine_run_backward")
    assert attribute([autograd, hooks, item], GPU_TORCH, OURS_DIR) == ("ours", hooks)
    # trailing separators or none: the same directories
    assert attribute([hooks, item], GPU_TORCH + "/", OURS_DIR.rstrip(os.sep))[0] == "ours"


def test_directories_are_matched_whole_not_as_prefixes():
    ours = frame(os.path.join(OURS_DIR, "tracker.py"), 10, "step")
    vision = frame(f"{SITE}/torchvision/ops/boxes.py", 40, "nms")  # not torch's own
    assert attribute([ours, vision], GPU_TORCH, OURS_DIR) == ("model", vision)
    sibling = frame(OURS_DIR.rstrip(os.sep) + "_plugins/x.py", 5, "f")  # not kfac_stream's
    assert attribute([ours, sibling], GPU_TORCH, OURS_DIR) == ("model", sibling)


def test_the_standard_library_is_seen_through_but_not_its_site_packages():
    ours = frame(os.path.join(OURS_DIR, "tracker.py"), 10, "step")
    stdlib = frame(contextlib.__file__, 140, "__exit__")
    frozen = frame("<frozen importlib._bootstrap>", 1, "_call_with_frames_removed")
    assert attribute([ours, stdlib, frozen], TORCH_DIR, OURS_DIR) == ("ours", ours)
    # a package installed next to the standard library (a venv's or a system Python's
    # lib/pythonX.Y/site-packages) is somebody's code, not Python's
    installed = frame(os.path.join(sysconfig.get_path("purelib"), "transformers", "x.py"), 3,
                      "f")
    assert attribute([ours, installed], TORCH_DIR, OURS_DIR) == ("model", installed)


def test_a_stack_of_torch_alone_is_nobodys_frame_and_not_ours():
    assert attribute([frame(f"{GPU_TORCH}/_tensor.py", 1, "item")], GPU_TORCH, OURS_DIR) == \
        ("model", None)


def _torch_named_module(tmp_path):
    """A 'model' module imported from a path like the GPU machine's site-packages."""
    path = tmp_path / "opt" / "torch" / ".venv" / "lib" / "python3.12" / "site-packages" / \
        "fakemodel" / "masking_utils.py"
    path.parent.mkdir(parents=True)
    path.write_text("def padding_is_full(mask):\n"
                    "    return mask.all().item()  # the model's own host read\n")
    spec = importlib.util.spec_from_file_location("fakemodel_masking_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "/torch/" in module.__file__
    return module


def test_counter_end_to_end_a_model_under_a_torch_named_prefix_is_not_ours(tmp_path):
    model = _torch_named_module(tmp_path)
    # kfac_stream's MC replay calling the model: code compiled under mc_replay.py's real path
    # puts that file's frame on the stack without running a model
    scope: dict = {}
    exec(compile("def replay(check, mask):\n    return check(mask)\n", MC_FISHER, "exec"),
         scope)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with SyncCounter() as direct:
        assert model.padding_is_full(mask)
    with SyncCounter() as replayed:
        assert scope["replay"](model.padding_is_full, mask)
    where = f"aten._local_scalar_dense.default at {model.__file__}:2"
    assert direct.count == 1 and not direct.ours and direct.model == {where: 1}
    assert direct.replayed == 0
    assert replayed.count == 1 and not replayed.ours, dict(replayed.ours)
    assert replayed.model == {where: 1} and replayed.replayed == 1


def test_counter_end_to_end_kfac_streams_own_reads_are_ours():
    with SyncCounter() as mode:
        spectrum_stats(torch.tensor([3.0, 1.0, 0.5, 0.0], dtype=torch.float64))
    assert mode.count > 0 and not mode.model, dict(mode.model)
    assert sum(mode.ours.values()) == mode.count
    spectrum = os.path.join(OURS_DIR, "stats", "spectrum.py")
    assert all(f" at {spectrum}:" in k for k in mode.ours), dict(mode.ours)
