"""Bad configurations fail before any training step, with a message naming field and value."""

import dataclasses
import inspect

import pytest
import torch
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACConfigError, KFACStreamCallback, UnsupportedModuleError

from models import ListDataset, text_examples, tiny_gpt2


@pytest.mark.parametrize("field,value,needle", [
    ("token_fraction", 0.0, "KFACConfig.token_fraction=0.0 is out of range: must be in (0, 1]"),
    ("token_fraction", 1.5, "KFACConfig.token_fraction=1.5 is out of range: must be in (0, 1]"),
    ("token_fraction", float("nan"), "KFACConfig.token_fraction=nan is out of range"),
    ("ema_decay", -0.1, "KFACConfig.ema_decay=-0.1 is out of range: must be in [0, 1]"),
    ("ema_decay", 1.01, "KFACConfig.ema_decay=1.01 is out of range: must be in [0, 1]"),
    ("update_every", 0, "KFACConfig.update_every=0 is not allowed: must be a positive integer"),
    ("update_every", 2.5, "KFACConfig.update_every=2.5 is not allowed: must be a positive int"),
    ("snapshot_every", -3, "KFACConfig.snapshot_every=-3 is not allowed: must be a positive"),
    ("fisher", "", "KFACConfig.fisher='' is not allowed: must be one of the Fisher estimators"),
    ("storage_dtype", "bfloat16", "KFACConfig.storage_dtype='bfloat16' is not allowed"),
    ("include", ["(unclosed"], "KFACConfig.include has an invalid regex '(unclosed'"),
    ("exclude", "mlp", "KFACConfig.exclude='mlp' is not allowed: must be a list of regex"),
    ("max_dense_dim", 0, "KFACConfig.max_dense_dim=0 is not allowed: must be a positive"),
    ("seed", 1.5, "KFACConfig.seed=1.5 is not allowed: must be an int"),
    ("fail_on_snapshot_error", "yes", "KFACConfig.fail_on_snapshot_error='yes' is not allowed"),
    ("include", {"x": 1}, "KFACConfig.include={'x': 1} is not allowed: must be a list of regex"),
    ("output_dir", [1], "KFACConfig.output_dir=[1] is not allowed: must be None or a path"),
    ("async_updates", "eight", "KFACConfig.async_updates='eight' is not allowed: must be None"),
    ("fisher", [1], "KFACConfig.fisher=[1] is not allowed: must be one of"),
])
def test_field_errors_name_field_value_and_range(field, value, needle):
    with pytest.raises(KFACConfigError) as e:
        KFACConfig(**{field: value})
    assert needle in str(e.value) and "\n" not in str(e.value)  # one line


def test_misspelt_argument_names_the_closest_in_one_line():
    """A typo is Python's TypeError, with the argument meant named (one line)."""
    with pytest.raises(TypeError) as e:
        KFACConfig(eval_prior_precison=True)
    assert str(e.value) == ("KFACConfig: 'eval_prior_precison' is not an argument: did you mean "
                            "eval_prior_precision?")
    with pytest.raises(TypeError, match="'zzz' is not an argument: the arguments are listed"):
        KFACConfig(zzz=1)
    cfg = KFACConfig(token_fraction=0.5)  # right names pass through, replace() too
    assert cfg.token_fraction == 0.5 and dataclasses.replace(cfg, seed=3).seed == 3
    assert "token_fraction" in inspect.signature(KFACConfig).parameters  # docs still see them


def test_option_fields_take_the_enum_or_its_string_and_hold_the_string():
    """``fold_on=FoldOn.HOST`` and ``fold_on="host"`` build the same config, whose fields,
    ``asdict`` and pickle hold plain strings (as the manifests and checkpoints always had)."""
    import pickle

    from kfac_stream import (
        Eigendecompose,
        EighDevice,
        ExchangeMode,
        FactorForm,
        FinalRefresh,
        FisherType,
        FoldOn,
        LayerPreset,
        StorageDtype,
    )

    strings = dict(final_refresh="off", fisher="empirical", factor_form="reduce", preset="mlp",
                   storage_dtype="float32", fold_on="host", exchange="rows", eigh_device="cpu",
                   eigendecompose="always")
    members = dict(final_refresh=FinalRefresh.OFF, fisher=FisherType.EMPIRICAL,
                   factor_form=FactorForm.REDUCE, preset=LayerPreset.MLP,
                   storage_dtype=StorageDtype.FLOAT32, fold_on=FoldOn.HOST,
                   exchange=ExchangeMode.ROWS, eigh_device=EighDevice.CPU,
                   eigendecompose=Eigendecompose.ALWAYS)
    by_member, by_string = KFACConfig(**members), KFACConfig(**strings)
    assert by_member == by_string
    assert pickle.dumps(by_member) == pickle.dumps(by_string)
    held = dataclasses.asdict(by_member)
    assert {k: held[k] for k in strings} == strings
    assert all(type(held[k]) is str for k in strings)
    with pytest.raises(KFACConfigError, match=r"KFACConfig.fold_on='gpu' is not allowed: must "
                                              r"be one of \('auto', 'device', 'host'\)"):
        KFACConfig(fold_on="gpu")
    with pytest.raises(KFACConfigError, match="KFACConfig.eigendecompose=<FisherType.MC: 'mc'> "
                                              "is not allowed"):
        KFACConfig(eigendecompose=FisherType.MC)  # another option's member


def _trainer(cb, tmp_path):
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    return Trainer(model=tiny_gpt2(torch.float32), args=args,
                   train_dataset=ListDataset(text_examples(4, 8)), callbacks=[cb])



@pytest.mark.parametrize("cfg,err,needle", [
    (dict(include=[r"no_such_layer"]), KFACConfigError,
     "KFACConfig.include regex 'no_such_layer' matches no trainable Linear/Conv1D module"),
    (dict(include=[r"wte$"]), UnsupportedModuleError,
     "matches module 'transformer.wte' of type Embedding, which kfac_stream cannot track"),
    (dict(exclude=[r".*"]), KFACConfigError, "select no layer"),
    # a Fisher name is checked against the estimators registered when the run starts
    (dict(fisher="true"), KFACConfigError, "KFACConfig.fisher='true' is not allowed: must be "
     "one of the registered Fisher estimators ('empirical', 'mc')"),
])
def test_model_dependent_errors_at_train_begin(cfg, err, needle, tmp_path):
    cb = KFACStreamCallback(KFACConfig(**cfg))
    trainer = _trainer(cb, tmp_path)
    steps = []
    from transformers import TrainerCallback

    class Count(TrainerCallback):
        def on_step_begin(self, *a, **k):
            steps.append(1)

    trainer.add_callback(Count())
    with pytest.raises(err) as e:
        trainer.train()
    assert needle in str(e.value)
    assert steps == []  # failed before the first training step
