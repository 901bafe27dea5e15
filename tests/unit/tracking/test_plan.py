"""`RunPlan.resolve` is the one place a run's "auto" and derived settings are decided, and the
plan it returns is what the tracker runs with.

The source scan fails if any module other than `kfac_stream/tracking/plan.py` calls one of
the functions that derive a run setting (the MC share, the sequences per update, the final
window, the curvature) or resolves one of the config's ``"auto"`` run settings itself."""

import ast
import pathlib

import torch

import kfac_stream
from kfac_stream import HeldoutConfig, KFACConfig
from kfac_stream.tracking.plan import RunPlan, RunShape, plan_window, sequences_per_update

from models import tiny_gpt2

PACKAGE = pathlib.Path(kfac_stream.__file__).resolve().parent
PLAN = PACKAGE / "tracking" / "plan.py"
#: the functions that derive a run setting (defined in tracking/plan.py, or Curvature.of)
DERIVING = {"window_mc_share", "sequences_per_update", "update_sequences", "plan_window",
            "mc_sequences_of", "resolve_settings"}
#: the config's run settings whose "auto" the plan resolves
AUTO_SETTINGS = {"fold_on", "device_memory_budget", "eigh_device", "async_updates",
                 "factor_form", "prior_precision", "eval_prior_precision"}


def _offences(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else None
            if name in DERIVING:
                out.append(f"{path.name}:{node.lineno} calls {name}")
            if isinstance(f, ast.Attribute) and f.attr == "of" and \
                    isinstance(f.value, ast.Name) and f.value.id == "Curvature":
                out.append(f"{path.name}:{node.lineno} calls Curvature.of")
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and \
                node.left.attr in AUTO_SETTINGS and \
                all(isinstance(op, (ast.Eq, ast.Is)) for op in node.ops):  # not validation
            consts = [c.value for c in node.comparators if isinstance(c, ast.Constant)]
            if "auto" in consts or None in consts:
                out.append(f"{path.name}:{node.lineno} resolves {node.left.attr}")
    return out


def test_only_the_run_plan_derives_run_settings():
    offences = [o for p in sorted(PACKAGE.rglob("*.py")) if p != PLAN for o in _offences(p)]
    assert offences == []


def test_the_scan_finds_a_derivation_outside_the_plan(tmp_path):
    """The scan above is not vacuous: it flags each kind of offence it looks for."""
    bad = tmp_path / "bad.py"
    bad.write_text("x = window_mc_share(c, 1, 1, 1, 1)\ny = Curvature.of(c)\n"
                   "z = c.fold_on == 'auto'\nw = c.async_updates is None\n")
    assert len(_offences(bad)) == 4
    assert _offences(PLAN)  # the plan itself does all of it
    assert any(o.endswith("resolves prior_precision") for o in _offences(PLAN))


def test_plan_resolves_the_run_and_the_tracker_runs_with_it():
    """A short MC run on the CPU: the share is raised for the final window, every "auto"
    resolved, the window planned with the raised share; the tracker built from the plan holds
    it and its resolved config."""
    model = tiny_gpt2(torch.float64)
    cfg = KFACConfig(min_window_sequences=64, update_every=2)
    plan = RunPlan.resolve(cfg, model, shape=RunShape(batch=4, accumulation=2, world=1,
                                                      max_steps=20))
    assert plan.requested is cfg and plan.mc_share_raised == 0.05
    assert plan.config.mc_sequences > 0.05 and plan.config.async_updates is False
    assert (plan.fold_on, plan.eigh_device, plan.device_budget) == \
        ("host", torch.device("cpu"), 0)
    assert plan.curvature.describe() == "mc Fisher, expand form"
    per = sequences_per_update(plan.config, 4, 2, 1)
    assert plan.sequences_per_update == per
    window = plan_window(plan.config, 20, per, plan.sequences_at)
    assert plan.window == window and window.sequences >= 64
    d = plan.to_dict()
    assert d["window"]["restart_step"] == window.restart_step and d["mc_share_raised"] == 0.05
    assert "sequences per update" in plan.describe()


class _Eval:
    """A front end's eval set (`EvalBatches`) holding ``dataset``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def batches(self):
        return iter(())


def test_plan_resolves_the_heldout_fit():
    """``HeldoutConfig.prior_precision``: on for True and "auto" with a non-empty eval set in
    one process; off, each for its own reason, otherwise (True only says it louder)."""
    def plan(mode, world=1, eval_set=None):
        got = RunPlan.resolve(KFACConfig(), heldout=HeldoutConfig(prior_precision=mode),
                              shape=RunShape(world=world), eval_set=eval_set).heldout
        return got.on, got.why, got.asked

    assert plan("auto", eval_set=_Eval([1, 2])) == (True, "on", False)
    assert plan(True, eval_set=_Eval({"a": [1], "b": []})) == (True, "on", True)
    assert plan(True, eval_set=_Eval(x for x in ())) == (True, "on", True)  # no length
    assert plan(False, eval_set=_Eval([1]))[:2] == (False, "off")
    assert plan("auto", world=2, eval_set=_Eval([1])) == (False, "ranks", False)
    assert plan(True) == (False, "no front end", True)
    assert plan("auto", eval_set=_Eval(None)) == (False, "no eval set", False)
    assert plan(True, eval_set=_Eval([])) == (False, "empty", True)
    assert plan("auto", eval_set=_Eval({"a": [], "b": []})) == (False, "empty", False)
    assert RunPlan.resolve(KFACConfig()).heldout.on is False  # no eval set handed: no fit
