"""An FSDP launch that did not shard the model is reported (what a CPU can check of FSDP).

accelerate 1.15 drops its FSDP plugin on CPU (the Trainer then trains with DDP); the callback
says so at ``on_train_begin`` instead of letting the user believe the run was sharded. The
FSDP2 runs themselves are in tests/runs/test_distributed.py (``fsdp2*``), two machines in
tests/runs/test_multinode.py.
"""

from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.distributed.engines.fsdp2 import is_fsdp_sharded, unsharded_class

from models import ListDataset, text_examples, tiny_gpt2

NOT_SHARDED = "accelerate was launched with an FSDP config, but no parameter"


def _train(tmp_path) -> None:
    model = tiny_gpt2(torch.float32, n_embd=16, n_layer=1, n_head=2)
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    cb = KFACStreamCallback(KFACConfig(token_fraction=1.0, snapshot_every=100,
                                       fisher="empirical"), spectra_media=False)
    Trainer(model=model, args=args, train_dataset=ListDataset(text_examples(4, 8, seed=0)),
            callbacks=[cb]).train()


def test_fsdp_launch_without_sharded_parameters_warns(tmp_path, caplog, monkeypatch):
    model = tiny_gpt2(torch.float32, n_embd=16, n_layer=1, n_head=2)
    assert not is_fsdp_sharded(model) and unsharded_class(model) is type(model)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` exports
    with caplog.at_level("WARNING", logger="kfac_stream"):
        _train(tmp_path / "fsdp")
    assert sum(NOT_SHARDED in r.message for r in caplog.records) == 1
    caplog.clear()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with caplog.at_level("WARNING", logger="kfac_stream"):
        _train(tmp_path / "plain")
    assert not any(NOT_SHARDED in r.message for r in caplog.records)
