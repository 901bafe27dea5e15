"""conf/ mirrors KFACConfig; the CLI reads real snapshots."""

import dataclasses
import pathlib

import torch
import yaml

from harness import run
from kfac_stream import KFACConfig, Snapshot
from kfac_stream.cli import main as cli_main
from kfac_stream.stats.spectrum import spectrum_stats
from models import text_examples, tiny_gpt2

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_conf_defaults_match_kfacconfig():
    conf = yaml.safe_load((ROOT / "conf" / "kfac" / "default.yaml").read_text())
    defaults = {f.name: f.default for f in dataclasses.fields(KFACConfig)}
    assert conf == defaults


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
