"""The project as a user installs it. A wheel is built from a copy of the project's
files, installed (not editable) into a temporary directory, and its console script
``kfac-stream`` runs ``train`` and ``demo`` from an unrelated working directory.

The installed copy comes first on ``sys.path`` (``PYTHONPATH`` = the install directory only;
the venv's site-packages, where the project's editable finder only answers what the path
does not, supplies torch and transformers); the repository is never on the path and never
the working directory. Each run proves which copy it used: Hydra records the config
directory it read (``.hydra/hydra.yaml``, ``runtime.config_sources``), and the app computes
that directory from its own ``__file__``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from kfac_stream import Snapshot

from repo_paths import ROOT

BIN = pathlib.Path(sys.executable).parent
# the app's offline defaults, shrunk: one 1 x 32 layer, 4 steps, snapshots at 2 and 4, no
# trackers (W&B, TensorBoard) and no end-of-run contrast
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.seq_len=32",
        "trainer.max_steps=4", "trainer.per_device_train_batch_size=4", "trainer.use_cpu=true",
        "trainer.logging_steps=2", "trainer.disable_tqdm=true", "trainer.report_to=[]",
        "kfac.update_every=1", "kfac.snapshot_every=2", "data.max_documents=40",
        "report.enabled=false"]
CONF_FILES = {"config.yaml", "demo.yaml", "data/hf.yaml", "data/pydoc.yaml",
              "kfac/default.yaml", "logging/default.yaml", "model/hf.yaml", "model/tiny.yaml",
              "report/default.yaml", "trainer/default.yaml"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(site, env)``: the wheel installed into ``site`` (console script in ``site/bin``)
    and the environment that runs it."""
    tmp = tmp_path_factory.mktemp("installed")
    # build from a copy: an in-tree build would reuse (stale) build/ and egg-info directories
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("kfac_stream", "conf"):  # conf/: the top-level configs, shipped in the wheel
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(wheels), str(src)], check=True, cwd=tmp,
                   timeout=300)
    (wheel,) = wheels.glob("kfac_stream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"kfac_stream/conf/{f}" for f in CONF_FILES} <= names, sorted(names)
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(site), str(wheel)], check=True, cwd=tmp, timeout=300)
    assert (site / "bin" / "kfac-stream").is_file()
    env = dict(os.environ, PYTHONPATH=str(site), WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([str(site / "bin"), str(BIN), os.environ.get("PATH", "")]),
               HF_DATASETS_CACHE=str(tmp / "hf_datasets"))
    for key in ("PYTHONHOME", "PYTHONSTARTUP", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    return site, env


def _cwd(tmp_path) -> pathlib.Path:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    assert ROOT not in cwd.parents and cwd != ROOT
    return cwd


def _kfac_stream(installed, cwd, *args) -> str:
    site, env = installed
    proc = subprocess.run([str(site / "bin" / "kfac-stream"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def _check_run(installed, run_dir: pathlib.Path) -> None:
    """A snapshot at the last step, written by the installed copy with its own configs."""
    site, _ = installed
    snap = Snapshot.latest(run_dir / "kfac")
    assert snap.step == 4 and snap.layer_names
    hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    main = [(s["schema"], s["path"]) for s in hydra["runtime"]["config_sources"]
            if s["provider"] == "main"]
    assert main == [("file", str(site / "kfac_stream" / "conf"))], main


def test_packages_listed_in_pyproject_are_the_package_directories():
    """pyproject.toml lists the packages (conf/ maps into the wheel as kfac_stream/conf): a new
    subpackage must be added there, or the wheel would lack it."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "kfac_stream").rglob("__init__.py")}
    conf = {"kfac_stream.conf"} | {f"kfac_stream.conf.{d.name}" for d in (ROOT / "conf").iterdir()
                                   if d.is_dir()}
    assert set(setup["packages"]) == found | conf
    assert setup["package-dir"] == {"kfac_stream.conf": "conf"}
    assert not (ROOT / "kfac_stream" / "conf").exists()  # one copy of the configs: conf/


def test_installed_copy_is_the_one_imported(installed, tmp_path):
    site, env = installed
    out = subprocess.run([sys.executable, "-c", "import kfac_stream, kfac_stream.app.main as t; "
                          "print(kfac_stream.__file__); print(t.CONF_DIR)"],
                         cwd=_cwd(tmp_path), env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == [str(site / "kfac_stream" / "__init__.py"), str(site / "kfac_stream" / "conf")]


def test_installed_train_runs_from_any_directory(installed, tmp_path):
    cwd = _cwd(tmp_path)
    _kfac_stream(installed, cwd, "train", "hydra.run.dir=run", *TINY)
    _check_run(installed, cwd / "run")


def test_installed_demo_runs_into_out_demo(installed, tmp_path):
    """``demo``: the defaults into ``out/demo`` of the working directory; Hydra's flags still
    pass (``--config-dir`` with a model of the user's own, chosen by an override)."""
    cwd = _cwd(tmp_path)
    mine = tmp_path / "my_conf" / "model"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("kind: tiny\nvocab_size: 256\nn_layer: 1\nn_embd: 16\n"
                                    "n_head: 2\nseq_len: 32\nseed: 0\n")
    _kfac_stream(installed, cwd, "demo", "--config-dir", str(tmp_path / "my_conf"), "model=mine",
                 *[o for o in TINY if not o.startswith("model.")])
    run_dir = cwd / "out" / "demo"
    _check_run(installed, run_dir)
    cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert cfg["model"]["n_embd"] == 16 and cfg["trainer"]["max_steps"] == 4
