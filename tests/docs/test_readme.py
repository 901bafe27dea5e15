"""Every command of the README's ``bash`` blocks is run by a test, on CPU and offline.

`README_COMMANDS` says how each line is run; a line of the README it does not know, or a line
it knows that the README lost, fails `test_every_readme_command_is_covered`, so the README and
its tests cannot drift apart. Long commands run shrunk, with the overrides written here:

* ``make demo``: the Makefile's recipe with ``DEMO_ARGS`` = `test_examples.TINY_DEMO` (a 1-layer
  model, 4 steps) in a temporary directory; ``kfac-stream inspect`` and ``query`` then run
  verbatim on its ``out/demo``.
* ``make test``: CI's own command (``.ci/run``); here its recipe is checked (``make -n``), not
  run inside the suite it runs.
* ``pip install``: verbatim with ``--dry-run --no-index`` (no download): every requirement,
  extras included, is already satisfied in this environment and the project builds.
* ``kfac-stream train ...`` on the offline defaults: verbatim plus the tiny overrides (Hydra's
  last value wins).
* lines that need the hub or a GPU: the app composes their overrides (``--cfg job``), and the
  launch config they name exists.
* ``python examples/...`` and the CPU ZeRO-3 launches: run by the tests named in the table
  (`test_examples.py`, `test_hydra_app.py`), which build their commands from the same argv.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from test_examples import EXAMPLES, LORA_QUERY, TINY_DEMO, ZERO3_EXAMPLE

from repo_paths import ROOT

VENV = pathlib.Path(sys.executable).parent.parent
APP_TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.seq_len=32",
            "trainer.max_steps=4", "trainer.per_device_train_batch_size=4",
            "trainer.use_cpu=true", "trainer.report_to=[]", "trainer.disable_tqdm=true",
            "kfac.update_every=1", "kfac.snapshot_every=2", "data.max_documents=40",
            "report.enabled=false"]

#: the README's and docs/influence.md's influence command on ``make demo``'s output
INFLUENCE_ON_DEMO = ('kfac-stream influence --snapshot out/demo/kfac --model out/demo/model '
                     '--train app --query "for i in" --completion " range(10):"')

# README line -> how a test runs it
README_COMMANDS = {
    "make demo": "make_demo",
    "make test": "make_test",
    "pip install torch==2.13.0": "pip",
    'pip install ".[app,plot]"': "pip",
    'pip install ".[peft]"': "pip",
    "python examples/causal_lm.py --out out/causal_lm --steps 200": "example",
    "python examples/sequence_classification.py --out out/classification": "example",
    "python examples/lora.py --out out/lora": "example",
    "DS_ACCELERATOR=cpu accelerate launch --config_file launch/cpu_zero3.yaml "
    "examples/causal_lm.py --out out --steps 20": "zero3_example",
    "kfac-stream train kfac.token_fraction=0.1 trainer.max_steps=2000 "
    "trainer.max_grad_norm=0.5": "train",
    "kfac-stream train model=hf model.name_or_path=gpt2 data=hf data.path=wikitext "
    "data.name=wikitext-2-raw-v1": "compose",
    "DS_ACCELERATOR=cpu accelerate launch --config_file launch/cpu_zero3.yaml "
    "-m kfac_stream.app trainer.use_cpu=true": "zero3_app",
    "accelerate launch --config_file launch/deepspeed_zero3.yaml -m kfac_stream.app "
    "kfac.fisher=mc": "compose",
    "deepspeed --num_gpus 8 --module kfac_stream.app "
    "trainer.deepspeed=launch/deepspeed/zero3.json": "compose",
    'kfac-stream query --snapshot out/demo/kfac --model out/demo/model --byte-level '
    '--text "def f(x):"': "on_demo",
    "kfac-stream inspect out/demo/kfac --plot spectra.png": "on_demo",
    INFLUENCE_ON_DEMO: "on_demo",
}


# docs page -> {command line of its ``bash`` blocks: how a test runs it}: a ``pip`` line must be
# one of the README's (run by `test_pip_install_lines`), an ``example`` line runs in
# `test_examples.test_example_runs` (``--steps`` shrunk), an ``example_query`` line is
# `test_examples.LORA_QUERY`, run there on the example's output, an ``on_demo`` line one of the
# README's, run on ``make demo``'s output (`test_make_demo_then_inspect_and_query`)
DOCS_COMMANDS = {
    "docs/classification.md": {
        "pip install torch==2.13.0": "pip",
        'pip install ".[app,plot]"': "pip",
        "python examples/sequence_classification.py --out out/classification": "example",
    },
    "docs/lora.md": {
        "pip install torch==2.13.0": "pip",
        'pip install ".[app,plot]"': "pip",
        'pip install ".[peft]"': "pip",
        "python examples/lora.py --out out/lora": "example",
        LORA_QUERY: "example_query",
    },
    "docs/influence.md": {INFLUENCE_ON_DEMO: "on_demo"},
}


def readme_commands(page: str = "README.md") -> list[str]:
    """The command lines of a page's ``bash`` blocks (comments stripped)."""
    text = (ROOT / page).read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if line:
                lines.append(line)
    return lines


def test_every_docs_command_is_covered():
    """A docs page's commands are exactly its `DOCS_COMMANDS` table's, and each is run: a
    ``pip`` line is the README's own (verbatim), an ``example`` line is an `EXAMPLES` script
    with nothing but ``--out`` and the arguments its test shortens, an ``example_query`` line
    the query `test_examples` runs on an example's output, an ``on_demo`` line the README's."""
    for page, table in DOCS_COMMANDS.items():
        lines = readme_commands(page)
        assert sorted(set(lines)) == sorted(table), (
            f"{page}: not covered: {sorted(set(lines) - set(table))}; "
            f"gone from the page: {sorted(set(table) - set(lines))}")
        for line, how in table.items():
            if how == "pip":
                assert README_COMMANDS.get(line) == "pip", (page, line)
                continue
            if how == "example_query":
                assert line == LORA_QUERY, (page, line)
                continue
            if how == "on_demo":  # run on make demo's output as the README's line
                assert README_COMMANDS.get(line) == "on_demo", (page, line)
                continue
            assert how == "example", (page, line, how)
            python, script, *rest = shlex.split(line)
            assert python == "python" and script.startswith("examples/"), (page, line)
            shortened = EXAMPLES[os.path.basename(script)][0]
            flags = {a for a in rest if a.startswith("--")}
            assert (ROOT / script).is_file() and flags <= {"--out", *shortened[::2]}, line


def commands(how: str) -> list[str]:
    return [c for c, h in README_COMMANDS.items() if h == how]


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


def sh(argv, cwd, timeout=600) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{argv}\n{out[-4000:]}"
    return out


def kfac_stream(line: str, cwd, *extra: str) -> str:
    argv = shlex.split(line)
    assert argv[0] == "kfac-stream"
    return sh([sys.executable, "-m", "kfac_stream.cli", *argv[1:], *extra], cwd)


def test_every_readme_command_is_covered():
    """The README's commands are exactly the table's; the first block is the two make
    commands a fresh clone starts with; CI's script runs ``make lint`` and ``make test``."""
    lines = readme_commands()
    assert lines[:2] == ["make demo", "make test"]
    assert sorted(set(lines)) == sorted(README_COMMANDS), (
        f"not covered: {sorted(set(lines) - set(README_COMMANDS))}; "
        f"gone from the README: {sorted(set(README_COMMANDS) - set(lines))}")
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make lint\b", ci, re.M) and re.search(r"^make test\b", ci, re.M)
    assert len((ROOT / "README.md").read_text()) <= 12_000


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """``make demo`` from the Makefile, shrunk by ``DEMO_ARGS``, in a fresh directory (the
    venv's install stamp taken as done: ``-o``; nothing is installed)."""
    cwd = tmp_path_factory.mktemp("readme")
    out = sh(["make", "-f", str(ROOT / "Makefile"), "-o", str(VENV / ".installed"), "demo",
              f"VENV={VENV}", f"DEMO_ARGS={' '.join(TINY_DEMO)}"], cwd)
    assert f"{VENV}/bin/kfac-stream demo " in out  # the recipe ran
    hydra = yaml.safe_load((cwd / "out" / "demo" / ".hydra" / "hydra.yaml").read_text())
    sources = hydra["hydra"]["runtime"]["config_sources"]
    assert ("file", str(ROOT / "conf")) in [(s["schema"], s["path"]) for s in sources]
    return cwd


def test_make_demo_then_inspect_and_query(demo_dir):
    assert (demo_dir / "out" / "demo" / "model" / "config.json").is_file()
    for line in commands("on_demo"):
        out = kfac_stream(line, demo_dir)
        if " query " in f" {line} ":
            assert "±" in out and "snapshot out/demo/kfac/step-" in out
        elif " influence " in f" {line} ":
            assert "most helpful" in out and "most harmful" in out
            assert "training examples (windows of 32 tokens of the app's training data, " \
                "out/demo/.hydra/config.yaml)" in out
        else:
            assert "λ_max" in out and (demo_dir / "spectra.png").is_file()


def test_make_test_is_the_suite():
    """``make test``'s recipe is the CPU suite (CI runs it: ``.ci/run``)."""
    out = sh(["make", "-n", "-f", str(ROOT / "Makefile"), "-o", str(VENV / ".installed"), "-o",
              str(VENV / ".peers"), "test", f"VENV={VENV}"], ROOT)
    assert f'{VENV}/bin/python -m pytest -q -rs -n auto --dist loadfile -m "not slow" tests' \
        in out


def test_pip_install_lines(tmp_path):
    """Verbatim plus ``--dry-run --no-index``: the pinned torch is the one installed, and the
    project with its extras installs from the clone (every requirement already satisfied)."""
    src = tmp_path / "clone"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("kfac_stream", "conf"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for line in commands("pip"):
        argv = shlex.split(line)
        assert argv[:2] == ["pip", "install"]
        out = sh([sys.executable, "-m", *argv, "--dry-run", "--no-index",
                  "--no-build-isolation"], src)
        assert "does not provide the extra" not in out, out
        if "torch" in line:
            assert "Requirement already satisfied: torch==2.13.0" in out, out
        else:
            assert "Would install kfac_stream-0.1.0" in out, out
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_VERSION ?= 2.13.0" in makefile


def test_train_line_runs_shrunk(tmp_path):
    (line,) = commands("train")
    kfac_stream(line, tmp_path, "hydra.run.dir=run", *APP_TINY)
    assert sorted(p.name for p in (tmp_path / "run" / "kfac").glob("step-*[0-9]")) == [
        "step-00000002", "step-00000004"]
    job = yaml.safe_load((tmp_path / "run" / ".hydra" / "config.yaml").read_text())
    assert job["trainer"]["max_grad_norm"] == 0.5 and job["kfac"]["token_fraction"] == 0.1


def compose_job(overrides: list[str]) -> dict:
    """The app's composed job config for ``overrides``, as ``kfac-stream train --cfg job``
    prints it (in-process: the app's config directory and schema, Hydra's compose API), after
    the app's own key check."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kfac_stream.app.main import CONF_DIR
    from kfac_stream.app.schema import check_override_keys, register

    check_override_keys(overrides)
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides))


def test_hub_and_gpu_lines_compose():
    """The lines that need the hub or GPUs: their overrides compose (``--cfg job``), and the
    launch configs they name exist."""
    for line in commands("compose"):
        argv = shlex.split(line)
        i = argv.index("kfac_stream.app") + 1 if "kfac_stream.app" in argv else 2
        for a in argv:
            if a.startswith("launch/") or "=launch/" in a:
                assert (ROOT / a.split("=", 1)[-1]).is_file(), a
        job = compose_job(argv[i:])
        for a in argv[i:]:
            key, value = a.split("=", 1)
            if "." not in key:  # a group's option: model=hf is the model group's kind
                key = f"{key}.kind"
            node = job
            for k in key.split("."):
                node = node[k]
            assert str(node) == value, (line, key)


def test_lines_run_by_other_tests():
    """``python examples/...`` runs in `test_examples.test_example_runs` (``--steps`` shrunk);
    the CPU ZeRO-3 example launch is `test_examples.ZERO3_EXAMPLE`, run by
    ``test_causal_lm_example_under_zero3_from_outside_the_repo``; the CPU ZeRO-3 app launch
    runs in ``test_hydra_app.test_app_under_accelerate_deepspeed_zero3`` (with its tiny
    overrides)."""
    for line in commands("example"):
        argv = shlex.split(line)
        assert argv[0] == "python" and os.path.basename(argv[1]) in EXAMPLES
    (z3,) = commands("zero3_example")
    assert shlex.split(z3) == ZERO3_EXAMPLE
    (app,) = commands("zero3_app")
    argv = shlex.split(app)
    source = (ROOT / "tests" / "runs" / "test_hydra_app.py").read_text()
    assert argv[:5] == ["DS_ACCELERATOR=cpu", "accelerate", "launch", "--config_file",
                        "launch/cpu_zero3.yaml"]
    assert 'launch="cpu_zero3.yaml"' in source and 'DS_ACCELERATOR="cpu"' in source
    assert all(f'"{a}"' in source for a in argv[argv.index("kfac_stream.app") + 1:])
