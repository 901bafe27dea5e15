"""`HeldoutConfig`: the held-out fit's and the queries' options, handed to the callback as
``KFACStreamCallback(config, heldout=HeldoutConfig(...))``.

* The old spelling, ``KFACConfig(eval_prior_precision=..., answer_tokens=...)``, is accepted
  with one ``FutureWarning`` naming the new place, validated as before, and gives a run whose
  snapshot and held-out fit equal the new spelling's, file by file (tensors bit for bit,
  JSON value for value but the write times); given both ways it is refused.
* Every snapshot's manifest records the options in ``config`` under their old names.
* The Hydra app: ``heldout.prior_precision`` / ``heldout.answer_tokens``, and the old
  ``kfac.*`` keys with a ``FutureWarning``; both ways refused.
"""

import json
import pathlib
import warnings
from dataclasses import fields

import pytest
import torch
from safetensors.torch import load_file

from kfac_stream import AppConfigError, HeldoutConfig, KFACConfig, KFACConfigError, Snapshot

from models import ListDataset, tiny_gpt2
from repo_paths import ROOT

ANSWERS = [65, 66]  # the bytes "A", "B" of the byte-level model
CONF = ROOT / "conf"
#: JSON keys that say when or which process wrote (`benchmarks/snapshot_equivalence.py`)
VOLATILE = {"created_unix", "run_id", "output_dir", "finished_unix", "seconds"}


def _questions(n: int, seed: int) -> list[dict]:
    """``n`` answer-token examples: 8 random bytes, then the answer ``A`` or ``B`` (by the
    first byte's parity) as the only labelled position."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(67, 120, (9,), generator=g)
        ids[8] = ANSWERS[int(ids[0]) % 2]
        labels = torch.full((9,), -100)
        labels[8] = ids[8]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": labels})
    return out


def _run(tmp: pathlib.Path, config: KFACConfig, heldout: HeldoutConfig | None) -> pathlib.Path:
    """A 4-step Trainer run with an eval set; returns its snapshot directory."""
    from transformers import Trainer, TrainingArguments

    from kfac_stream import KFACStreamCallback

    cb = KFACStreamCallback(config, heldout=heldout, spectra_media=False)
    args = TrainingArguments(str(tmp), per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=4, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0)
    Trainer(model=tiny_gpt2(torch.float32), args=args,
            train_dataset=ListDataset(_questions(16, 0)),
            eval_dataset=ListDataset(_questions(8, 1)), callbacks=[cb]).train()
    return pathlib.Path(cb.output_dir)


def _without_volatile(value):
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items()
                if k not in VOLATILE and not k.endswith("_seconds")}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def test_old_and_new_spelling_write_the_same_snapshot_and_heldout_fit(tmp_path):
    """The same run configured both ways: the same files, the same tensors bit for bit, the
    same JSON (manifest and held-out fit) but the write times, and the options recorded."""
    base = dict(token_fraction=1.0, update_every=1, fisher="empirical", snapshot_every=100)
    new = _run(tmp_path / "new", KFACConfig(output_dir=str(tmp_path / "new" / "kfac"), **base),
               HeldoutConfig(prior_precision=True, answer_tokens=ANSWERS))
    with pytest.warns(FutureWarning):
        old_config = KFACConfig(output_dir=str(tmp_path / "old" / "kfac"),
                                eval_prior_precision=True, answer_tokens=ANSWERS, **base)
    old = _run(tmp_path / "old", old_config, None)
    files_new, files_old = _files(new), _files(old)
    assert sorted(files_new) == sorted(files_old)
    assert any(name.endswith(".safetensors") for name in files_new)
    heldout_files = [n for n in files_new if n.endswith(".json") and "manifest" not in n]
    assert heldout_files, sorted(files_new)  # the held-out fit ran and was stored
    for name, path in files_new.items():
        if name.endswith(".safetensors"):
            a, b = load_file(path), load_file(files_old[name])
            assert sorted(a) == sorted(b)
            assert all(torch.equal(a[k], b[k]) for k in a), name
        elif name.endswith(".json"):
            assert _without_volatile(json.loads(path.read_text())) == \
                _without_volatile(json.loads(files_old[name].read_text())), name
    snap = Snapshot.latest(str(new), show_progress=False)
    assert snap.answer_tokens == tuple(ANSWERS) and snap.heldout_prior is not None
    config = snap.manifest.config
    assert (config["eval_prior_precision"], config["answer_tokens"]) == (True, ANSWERS)
    assert set(config) == {f.name for f in fields(KFACConfig) if f.name != "ekfac"} | {
        "eval_prior_precision", "answer_tokens"}


def test_the_old_spelling_warns_once_and_validates_as_before():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = KFACConfig(eval_prior_precision=False, answer_tokens=[" A", 66])
    assert len(caught) == 1 and caught[0].category is FutureWarning
    message = str(caught[0].message)
    assert "HeldoutConfig(prior_precision=..., answer_tokens=...)" in message
    assert "KFACStreamCallback(heldout=" in message and caught[0].filename == __file__
    assert cfg.moved_options == {"eval_prior_precision": False, "answer_tokens": [" A", 66]}
    assert HeldoutConfig.of_run(cfg) == HeldoutConfig(prior_precision=False,
                                                      answer_tokens=[" A", 66])
    assert HeldoutConfig.of_run(KFACConfig()) == HeldoutConfig()
    with pytest.warns(FutureWarning, match="KFACConfig.answer_tokens moved"):
        assert cfg.answer_tokens == [" A", 66]  # read in the old place: the same value
    for bad in ([65], [65, 65], "AB"):
        with pytest.raises(KFACConfigError, match=r"KFACConfig.answer_tokens=.* is not allowed"):
            KFACConfig(answer_tokens=bad)
    with pytest.raises(KFACConfigError, match=r"KFACConfig.eval_prior_precision='yes' is not "
                                              r"allowed: must be 'auto', True or False"):
        KFACConfig(eval_prior_precision="yes")
    assert "eval_prior_precision" not in {f.name for f in fields(KFACConfig)}
    with pytest.warns(FutureWarning):
        assert KFACConfig().to_dict() == KFACConfig(answer_tokens=[1, 2]).to_dict()


def test_given_both_ways_is_refused():
    from kfac_stream import KFACStreamCallback

    with pytest.warns(FutureWarning):
        old = KFACConfig(answer_tokens=ANSWERS)
    with pytest.raises(KFACConfigError, match=r"given twice: KFACConfig\(answer_tokens=\[65, "
                                              r"66\]\) and KFACStreamCallback\(heldout="):
        KFACStreamCallback(old, heldout=HeldoutConfig(prior_precision=False))
    with pytest.raises(KFACConfigError, match="must be None or a HeldoutConfig"):
        KFACStreamCallback(KFACConfig(), heldout={"prior_precision": False})


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from kfac_stream.app.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*overrides, "trainer.report_to=[]"])


def test_hydra_heldout_group_and_the_old_kfac_keys():
    from kfac_stream.app.schema import heldout_config, kfac_config

    assert heldout_config(_compose()) == HeldoutConfig()
    cfg = _compose("heldout.prior_precision=false", "heldout.answer_tokens=[65,66]")
    assert heldout_config(cfg) == HeldoutConfig(prior_precision=False, answer_tokens=ANSWERS)
    assert kfac_config(cfg.kfac) == KFACConfig()
    old = _compose("kfac.eval_prior_precision=false", "kfac.answer_tokens=[65,66]")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert heldout_config(old) == heldout_config(cfg)
        assert kfac_config(old.kfac) == KFACConfig()
    assert [str(w.message) for w in caught] == [
        "kfac.eval_prior_precision, kfac.answer_tokens moved to the heldout group: set "
        "heldout.prior_precision, heldout.answer_tokens (the old keys still work for now)"]
    with pytest.raises(AppConfigError, match="heldout.prior_precision and "
                                             "kfac.eval_prior_precision are both set"):
        heldout_config(_compose("kfac.eval_prior_precision=true",
                                "heldout.prior_precision=false"))
    with pytest.raises(KFACConfigError, match="KFACConfig.eval_prior_precision='maybe'"):
        heldout_config(_compose("kfac.eval_prior_precision=maybe"))
    with pytest.raises(KFACConfigError, match="HeldoutConfig.answer_tokens=.* is not allowed"):
        heldout_config(_compose("heldout.answer_tokens=[65]"))
