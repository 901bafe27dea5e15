"""What a new user's slips at the command line get :

- docs/queries.md states the defaults ``kfac-stream query``'s parser has (the classifier
  query's ``--prior-precision`` is ``auto``, as the causal LM's);
- a misspelt option gets the sub-command's own usage and one error line with "did you mean"
  (``query``, ``influence``, ``inspect``, and Hydra's flags of ``train`` / ``demo``), exit 2;
- ``--snapshot`` (or ``inspect``, or ``Snapshot.latest``) pointed at a model folder says it is
  one and names the folder beside it that holds the snapshots.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys

import pytest
import torch

from kfac_stream import Snapshot
from kfac_stream.cli import build_parser
from kfac_stream.cli import main as cli_main
from kfac_stream.exceptions import SnapshotError

from harness import run
from models import text_examples, tiny_gpt2
from repo_paths import ROOT

DOCS = ROOT / "docs"

# -- 4. the docs state the parser's defaults -------------------------------------------------

#: "`--flag`: `VALUE` (default ..." (a value list that opens with its default).
LISTED_FIRST = re.compile(r": `([^`]+)` \(default\b")
#: "`--flag METAVAR` ... (default 32" / ", default `auto`" / "(default: `--model`)": the
#: literal (a number or a backticked word) right after "default", with no other backticked
#: text and no full stop between the flag and it. A default said in words ("default: the
#: stored fit's link, else ...") is not a literal and is not read.
DEFAULT_AFTER = re.compile(r"[^`.]{0,60}?\bdefault:? (?:`([^`]+)`|(\d[\w.]*))")


def documented_defaults(text: str, options: set[str]) -> list[tuple[str, str]]:
    """``[(option, value)]``: each place ``text`` (Markdown) states an option's default."""
    flat = " ".join(text.split())
    found = []
    for m in re.finditer(r"`(--[a-z][\w-]*)(?: [^`]*)?`", flat):
        if m.group(1) not in options:
            continue
        rest = flat[m.end():m.end() + 200]
        stated = LISTED_FIRST.match(rest) or DEFAULT_AFTER.match(rest)
        if stated:
            found.append((m.group(1), next(g for g in stated.groups() if g)))
    return found


def parser_defaults(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Each long option's default(s): the parser's own value, or where that is None (a default
    that depends on the mode or on other flags) the values its help text gives after
    "default" (``--samples``: 32 and 2000)."""
    out = {}
    for action in parser._actions:
        for opt in (s for s in action.option_strings if s.startswith("--")):
            if action.default not in (None, False, argparse.SUPPRESS):
                out[opt] = {str(action.default)}
            else:
                out[opt] = set(re.findall(r"default:? ([^\s;,)]+)", action.help or ""))
    return out


def test_queries_docs_state_the_query_parsers_defaults():
    _, commands = build_parser()
    defaults = parser_defaults(commands["query"])
    stated = documented_defaults((DOCS / "queries.md").read_text(), set(defaults))
    wrong = [(opt, value, defaults[opt]) for opt, value in stated if value not in defaults[opt]]
    assert wrong == [], f"docs/queries.md states defaults the parser does not have: {wrong}"
    # what is read: the causal LM's options list and the classifier section both say `auto`
    assert stated.count(("--prior-precision", "auto")) == 2, stated
    assert {("--samples", "32"), ("--samples", "2000"), ("--seed", "0"),
            ("--tokenizer", "--model")} <= set(stated), stated
    # the old sentence (default marglik) is caught
    old = "builds the same posterior (`--prior-precision`,\ndefault `marglik`) and prints"
    assert documented_defaults(old, set(defaults)) == [("--prior-precision", "marglik")]
    assert "marglik" not in defaults["--prior-precision"] == {"auto"}


# -- 5. "did you mean" under each sub-command's usage ----------------------------------------

QUERY = ["query", "--snapshot", "s", "--model", "m"]
INFLUENCE = ["influence", "--snapshot", "s", "--model", "m", "--train", "t.jsonl"]


@pytest.mark.parametrize("argv, error", [
    ([*QUERY, "--prior-precison", "10"], "unrecognized arguments: --prior-precison 10 "
     "(--prior-precison: did you mean --prior-precision?)"),
    ([*QUERY, "--prior-precison=10"], "unrecognized arguments: --prior-precison=10 "
     "(--prior-precison: did you mean --prior-precision?)"),
    (["query", "--snapshto", "s", "--model", "m"], "the following arguments are required: "
     "--snapshot (--snapshto: did you mean --snapshot?)"),
    ([*QUERY, "--frobnicate", "--wieght-samples"], "unrecognized arguments: --frobnicate "
     "--wieght-samples (no option --frobnicate in kfac-stream query: kfac-stream query -h lists "
     "its options; --wieght-samples: did you mean --weight-samples or --samples?)"),
    ([*INFLUENCE, "--top-kk", "3"], "unrecognized arguments: --top-kk 3 "
     "(--top-kk: did you mean --top-k?)"),
    ([*INFLUENCE, "--max-trian", "8"], "unrecognized arguments: --max-trian 8 "
     "(--max-trian: did you mean --max-train?)"),
    (["inspect", "--plto", "x.png", "out/kfac"], "unrecognized arguments: --plto out/kfac "
     "(--plto: did you mean --plot?)"),
    (["inspect", "out/kfac", "--damping", "0.1"], "unrecognized arguments: --damping 0.1 "
     "(no option --damping in kfac-stream inspect: kfac-stream inspect -h lists its options)"),
    (["train", "--config-nme", "demo"], "unrecognized arguments: --config-nme "
     "(--config-nme: did you mean --config-name or --config-dir or --config-path?)"),
    (["demo", "--trainer.max_steps=5"], "unrecognized arguments: --trainer.max_steps (no option "
     "--trainer.max_steps in kfac-stream demo: an override is key=value, without dashes; "
     "kfac-stream train -h lists both)"),
])
def test_misspelt_option_says_did_you_mean_under_its_commands_usage(argv, error, capsys,
                                                                    monkeypatch):
    """Exit code 2; stderr: the sub-command's usage, then exactly one error line."""
    monkeypatch.setattr(sys, "argv", ["kfac-stream"])  # train / demo set it for Hydra
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    cmd = f"kfac-stream {argv[0]}"
    assert out == "" and err.startswith(f"usage: {cmd} "), err
    lines = err.rstrip("\n").splitlines()
    assert [ln for ln in lines if ": error: " in ln] == [f"{cmd}: error: {error}"], err
    assert lines[-1] == f"{cmd}: error: {error}"


def test_abbreviations_values_and_hydra_flags_are_not_typos(capsys, monkeypatch):
    """What argparse accepts is not called a typo: an abbreviation (``--prior``), a negative
    number as a value, Hydra's flags in each spelling and the deepspeed launcher's
    ``--local_rank``; the composed config prints and nothing trains (``--cfg job``)."""
    p, _ = build_parser()
    args = p.parse_args([*QUERY, "--prior", "10", "--seed", "-3", "--text", "x"])
    assert (args.prior_precision, args.seed) == ("10", -3)
    monkeypatch.setattr(sys, "argv", ["kfac-stream"])
    monkeypatch.setenv("LOCAL_RANK", "0")  # where the app moves --local_rank; unset after
    assert cli_main(["train", "-cn", "demo", "--config-name=demo", "--local_rank=0", "--cfg",
                     "job", "trainer.max_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "  max_steps: 1\n" in out, out


# -- 6. --snapshot pointed at the model folder -----------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny GPT-2's run: snapshots in ``kfac/``, the model saved beside them in ``model/``."""
    tmp = tmp_path_factory.mktemp("typos_run")
    model = tiny_gpt2(torch.float32)
    run(model, text_examples(4, 12), batch=2, tmp_path=tmp, record=False)
    model.save_pretrained(tmp / "model")
    return tmp


MODEL_FOLDER = ("is a model folder (it holds config.json, model.safetensors), not a snapshot "
                "folder: the callback writes its snapshots as step-XXXXXXXX folders into "
                "KFACConfig.output_dir (default: <TrainingArguments.output_dir>/kfac)")


def test_snapshot_at_the_model_folder_names_the_snapshots_beside_it(run_dir, capsys):
    model, kfac = run_dir / "model", run_dir / "kfac"
    expected = (f"{model}: no complete snapshot found; {model} {MODEL_FOLDER}; beside it, "
                f"snapshots are in {kfac}: pass that")
    with pytest.raises(SnapshotError) as e:
        Snapshot.latest(model)
    assert str(e.value) == expected
    for argv in (["inspect", str(model)],
                 ["query", "--snapshot", str(model), "--model", str(model), "--byte-level",
                  "--text", "def"]):
        capsys.readouterr()
        assert cli_main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.strip().splitlines()[-1] == (
            f"kfac-stream {argv[0]}: error: {expected}"), err
    capsys.readouterr()
    assert cli_main(["inspect", str(kfac)]) == 0  # the folder it names is the one to pass
    assert "step-" in capsys.readouterr().out


def test_model_folder_hint_for_an_output_dir_an_adapter_and_a_lone_model(run_dir, tmp_path):
    """The Trainer's output_dir saved as the model (``kfac/`` inside it), a PEFT adapter
    folder, and a model folder with no snapshot near it."""
    out = tmp_path / "out"
    shutil.copytree(run_dir / "model", out)
    shutil.copytree(run_dir / "kfac", out / "kfac")
    with pytest.raises(SnapshotError) as e:
        Snapshot.latest(out)
    assert str(e.value) == (f"{out}: no complete snapshot found; {out} {MODEL_FOLDER}; "
                            f"snapshots are in {out / 'kfac'} (a run directory holds them in "
                            "its kfac/ folder): pass that")
    adapter = out / "adapter"  # saved into the output_dir: its kfac/ is beside it
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(SnapshotError) as e:
        Snapshot.latest(adapter)
    assert str(e.value) == (
        f"{adapter}: no complete snapshot found; {adapter} is a model folder (it holds "
        "adapter_config.json), not a snapshot folder: the callback writes its snapshots as "
        "step-XXXXXXXX folders into KFACConfig.output_dir (default: "
        "<TrainingArguments.output_dir>/kfac); beside it, snapshots are in "
        f"{out / 'kfac'}: pass that")
    lone = tmp_path / "elsewhere" / "model"
    shutil.copytree(run_dir / "model", lone)
    with pytest.raises(SnapshotError) as e:
        Snapshot.latest(lone)
    assert str(e.value) == f"{lone}: no complete snapshot found; {lone} {MODEL_FOLDER}"
