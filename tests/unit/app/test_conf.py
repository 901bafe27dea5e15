"""conf/ mirrors KFACConfig; the CLI reads real snapshots."""

import dataclasses
import re

import pytest
import torch
import yaml

from kfac_stream import KFACConfig, Snapshot
from kfac_stream.cli import main as cli_main
from kfac_stream.stats.spectrum import spectrum_stats

from harness import run
from models import text_examples, tiny_gpt2
from repo_paths import ROOT

CONF = ROOT / "conf"


def test_conf_defaults_match_kfacconfig():
    """The app's composed ``kfac`` node is KFACConfig's defaults (the held-out options' old
    keys unset), its ``heldout`` node HeldoutConfig's; conf/kfac/default.yaml and
    conf/heldout/default.yaml repeat none of them (the dataclasses are the one source)."""
    from hydra import compose, initialize_config_dir

    from kfac_stream import HeldoutConfig
    from kfac_stream.app.schema import register

    for group in ("kfac", "heldout"):
        assert yaml.safe_load((CONF / group / "default.yaml").read_text()) is None
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        composed = compose("config")
    defaults = {f.name: f.default for f in dataclasses.fields(KFACConfig)}
    assert dict(composed.kfac) == {**defaults, "eval_prior_precision": None,
                                   "answer_tokens": None}
    assert dict(composed.heldout) == {f.name: f.default
                                      for f in dataclasses.fields(HeldoutConfig)}


def test_conf_demo_is_config_into_out_demo():
    """``kfac-stream demo`` (``--config-name demo``): the job config of ``config``, and the run
    directory ``out/demo``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kfac_stream.app.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        assert compose("demo", return_hydra_config=True).hydra.run.dir == "out/demo"
        assert compose("config", return_hydra_config=True).hydra.run.dir != "out/demo"
        demo, config = compose("demo"), compose("config")
    assert OmegaConf.to_container(demo) == OmegaConf.to_container(config)
    assert OmegaConf.get_type(demo) is OmegaConf.get_type(config)


def test_cli_inspect_prints_the_snapshot_table(tmp_path, capsys):
    run(tiny_gpt2(torch.float32), text_examples(4, 12), {"storage_dtype": "float16"}, batch=2,
        tmp_path=tmp_path, record=False)
    snap = Snapshot.latest(tmp_path / "kfac")
    assert cli_main(["inspect", str(tmp_path / "kfac")]) == 0
    out = capsys.readouterr().out
    name = snap.layer_names[0]
    st = spectrum_stats(snap[name].A_eigvals)
    assert f"{st['max']:.3e}" in out and f"{st['trace']:.3e}" in out
    assert str(snap.path) in out
    assert cli_main(["inspect", str(tmp_path / "nowhere")]) == 2


def test_cli_inspect_plot_writes_a_png(tmp_path, capsys):
    run(tiny_gpt2(torch.float32), text_examples(4, 12), {"storage_dtype": "float16"}, batch=2,
        tmp_path=tmp_path, record=False)
    png = tmp_path / "spectra.png"
    assert cli_main(["inspect", str(tmp_path / "kfac"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_query_prints_what_the_python_api_returns(tmp_path, capsys):
    from kfac_stream import LaplacePosterior
    from kfac_stream.query.topk import topk_predictive

    model = tiny_gpt2(torch.float32)
    run(model, text_examples(8, 12), {"storage_dtype": "float32"}, batch=2, tmp_path=tmp_path,
        record=False)
    model.save_pretrained(tmp_path / "model")
    text = "def f(x):"
    argv = ["query", "--snapshot", str(tmp_path / "kfac"), "--model", str(tmp_path / "model"),
            "--text", text, "--byte-level", "--top-k", "3", "--prior-precision", "2.0",
            "--samples", "400"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    model.eval()
    post = LaplacePosterior(model, Snapshot.latest(tmp_path / "kfac"), prior_precision=2.0)
    rows = topk_predictive(post, torch.tensor(list(text.encode())), k=3, n_samples=400)
    assert len(rows) == len(text)
    for row in rows:
        for m, mu, sd in zip(row["map_prob"], row["mean_prob"], row["std_prob"]):
            assert f"{m:.4f} {mu:.4f}±{sd:.4f}" in out
    assert any(sd > 0 for row in rows for sd in row["std_prob"])


def test_launch_configs_parse_and_are_self_contained():
    """Every accelerate config in launch/ loads with accelerate's own reader and names no
    other file (a relative ``deepspeed_config_file`` breaks outside the repository root):
    the DeepSpeed ones set the ZeRO stage of their file name inline. Every DeepSpeed
    JSON (for the ``deepspeed`` launcher and ``TrainingArguments(deepspeed=...)``) parses and
    names the stage of its file name."""
    import glob
    import json
    import os
    import re

    from accelerate.commands.config.config_args import load_config_from_file

    root = str(ROOT)
    files = sorted(glob.glob(os.path.join(root, "launch", "*.yaml")))
    assert len(files) >= 10
    stages = set()
    for path in files:
        cfg = load_config_from_file(path)
        ds = getattr(cfg, "deepspeed_config", None) or {}
        assert "deepspeed_config_file" not in ds, path
        if str(cfg.distributed_type).endswith("DEEPSPEED"):
            stage = int(ds["zero_stage"])
            assert f"zero{stage}" in os.path.basename(path), (path, stage)
            assert ds["offload_param_device"] == ("cpu" if "offload" in path else "none"), path
            if stage == 3:  # trainer.save_model must write whole weights (README, ZeRO-3)
                assert ds["zero3_save_16bit_model"] is True, path
            stages.add(stage)
        if os.path.basename(path).startswith("cpu_"):
            assert cfg.use_cpu, path
    assert stages == {1, 2, 3}
    jsons = sorted(glob.glob(os.path.join(root, "launch", "deepspeed", "*.json")))
    assert len(jsons) == 4
    for path in jsons:
        with open(path) as f:
            stage = json.load(f)["zero_optimization"]["stage"]
        assert f"zero{stage}" in os.path.basename(path), (path, stage)
    slurm = open(os.path.join(root, "launch", "slurm_multinode.sh")).read()
    assert re.search(r"--config_file launch/multinode_zero3\.yaml", slurm)


def test_hydra_schema_mirrors_kfac_config():
    """The app's typed `KFACConf` has exactly `KFACConfig`'s fields and defaults (then the
    held-out options' old keys, unset), `HeldoutConf` `HeldoutConfig`'s, and `kfac_config` /
    `heldout_config` turn them into equal configs."""
    from dataclasses import fields

    from kfac_stream import HeldoutConfig, KFACConfig
    from kfac_stream.app.schema import HeldoutConf, KFACConf, heldout_config, kfac_config

    assert [f.name for f in fields(KFACConf)] == [f.name for f in fields(KFACConfig)] + [
        "eval_prior_precision", "answer_tokens"]
    assert KFACConf().eval_prior_precision is None and KFACConf().answer_tokens is None
    assert [f.name for f in fields(HeldoutConf)] == [f.name for f in fields(HeldoutConfig)]
    assert kfac_config(KFACConf()) == KFACConfig()
    composed = _compose("trainer.report_to=[]")
    assert heldout_config(composed) == HeldoutConfig()
    types = {f.name: f.type for f in fields(KFACConf)}  # an option's enum is a str there
    assert types["fisher"] is str and types["fold_on"] is str and types["preset"] == str | None
    assert types["mc_sequences"] == int | float | str  # the other unions as written
    kfac = _compose("kfac.fold_on=host", "kfac.preset=lora", "trainer.report_to=[]").kfac
    cfg = kfac_config(kfac)
    assert (cfg.fold_on, cfg.preset) == ("host", "lora") and type(cfg.fold_on) is str


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from kfac_stream.app.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_trainer_takes_any_training_arguments_field(tmp_path):
    """``trainer.<field>=value`` for every ``TrainingArguments`` field, no ``+`` (the README
    promises it): the schema declares them all; the value reaches ``TrainingArguments``; the
    default config builds the same arguments as before (transformers' defaults but the app's)."""
    from transformers import TrainingArguments

    from kfac_stream.app.main import training_arguments
    from kfac_stream.app.schema import AppTrainerDefaults, TrainerConf

    declared = {f.name for f in dataclasses.fields(TrainerConf)}
    every = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    assert every - {"output_dir"} <= declared
    cfg = _compose("trainer.max_grad_norm=0.5", "trainer.optim=adafactor",
                   "trainer.adam_beta2=0.99", "trainer.lr_scheduler_kwargs={min_lr: 1e-5}",
                   "trainer.save_total_limit=2", "trainer.report_to=[]")
    args = training_arguments(cfg, str(tmp_path))
    assert args.max_grad_norm == 0.5 and args.adam_beta2 == 0.99
    assert args.optim == "adafactor" and args.save_total_limit == 2
    assert args.lr_scheduler_kwargs == {"min_lr": 1e-5}
    default = training_arguments(_compose("trainer.report_to=[]"), str(tmp_path)).to_dict()
    app = {f.name: f.default for f in dataclasses.fields(AppTrainerDefaults)
           if f.default is not dataclasses.MISSING}
    plain = TrainingArguments(str(tmp_path), **{**app, "report_to": "none"}).to_dict()
    assert default == plain


def test_unknown_keys_say_did_you_mean():
    """A typo under a group, with or without Hydra's ``+``, is one line with the nearest
    names; group choices, Hydra's keys and flags and ``trainer.extra.*`` pass through."""
    from kfac_stream import AppConfigError
    from kfac_stream.app.schema import check_keys, check_override_keys, kfac_config

    for arg, needle in [
        ("+kfac.token_fracton=0.1", "kfac.token_fracton is not a key of the kfac config: "
                                    "did you mean kfac.token_fraction?"),
        ("trainer.max_grad_nrom=1", "did you mean trainer.max_grad_norm?"),
        ("++model.n_layers=3", "did you mean model.n_layer?"),
        ("~report.enabeld", "did you mean report.enabled?"),
        ("logging.zzz=1", "logging.zzz is not a key of the logging config: the logging keys "
                          "are listed by `kfac-stream train --cfg job`"),
    ]:
        with pytest.raises(AppConfigError) as e:
            check_override_keys(["-cd", "my_conf", arg])
        assert needle in str(e.value) and "\n" not in str(e.value)
    check_override_keys(["model=hf", "hydra.run.dir=x", "--config-name=demo", "-m",
                         "trainer.extra.optim=adafactor", "kfac.token_fraction=0.1,0.2",
                         "output_dir=out/x", "+trainer.max_grad_norm=0.5"])
    cfg = _compose("+kfac.token_fracton=0.1")  # Hydra adds it to the typed node ...
    with pytest.raises(AppConfigError, match="did you mean kfac.token_fraction"):
        kfac_config(cfg.kfac)  # ... the app refuses it, not KFACConfig's TypeError
    with pytest.raises(AppConfigError, match="did you mean trainer.max_steps"):
        check_keys("trainer", {"max_step": 1})


def test_checkout_reads_top_level_conf_from_any_directory(tmp_path):
    """In a checkout the app reads ``conf/`` at the top of the repository (the design card's
    layout; the wheel ships it as kfac_stream/conf), from an unrelated working directory."""
    import os
    import subprocess
    import sys

    from kfac_stream.app.main import CONF_DIR

    root = CONF.parent
    assert CONF_DIR == str(CONF) and (CONF / "config.yaml").is_file()
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", "kfac_stream.app", "--cfg", "job",
                           "trainer.max_grad_norm=0.5"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = yaml.safe_load(proc.stdout)
    assert job["trainer"]["max_grad_norm"] == 0.5 and job["model"]["kind"] == "tiny"


def test_app_refuses_a_missing_local_model_path_at_once(tmp_path, monkeypatch):
    """``model=hf model.name_or_path=./nomodel`` (or ``out/x`` beside ``out/``) is refused by
    the app's checks, before ``from_pretrained`` would ask the hub for it."""
    from kfac_stream import AppConfigError
    from kfac_stream.app.main import _check_choices

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    for name, needle in [("./nomodel", "is a local path that does not exist"),
                         ("out/nomodel", "does not exist (out/ is a directory here")]:
        cfg = _compose("model=hf", f"model.name_or_path={name}")
        with pytest.raises(AppConfigError, match=re.escape(
                f"model.name_or_path={name!r} {needle}")):
            _check_choices(cfg)
    _check_choices(_compose("model=hf", "model.name_or_path=gpt2"))  # may be a hub name
