"""The tracker adds no host synchronisation to the training thread.

A ``TorchDispatchMode`` on the training thread counts every op that makes the host wait for
a device value: ``_local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``),
``is_nonzero``, ``equal``, ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
without an output size, and indexing or ``index_put`` with a boolean mask. CPU training runs
the backward on the calling thread, so the capture hooks are counted too. The count of a real
``Trainer`` run with the callback is compared with the same run without it, step for step.

Every sync is attributed by the innermost frame outside torch: kfac_stream's own code, or the
model's (transformers). The MC Fisher gradient is taken inside the training forward here (one
process, no checkpointing): no extra forward, so no extra syncs at all. Where it must be
replayed after the step (ZeRO-3, gradient checkpointing, fp16 autocast) the replayed forward
makes whatever syncs the model's forward makes (transformers' SDPA mask builder checks
``padding_mask.all()`` on the host, 1–2 per forward with an attention mask): the last case
below counts those separately, as the only difference allowed there.

The factor worker (``async_updates=True``, the default when training on CUDA) is the one
place allowed to read device values; it runs on its own thread, which the mode (thread-local)
does not see. Snapshots (``snapshot_every``) and the end-of-training snapshot are outside the
counted window: they may read, once per snapshot.
"""

from __future__ import annotations

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback

from models import ListDataset, text_examples, tiny_llama
from syncs import SyncCounter

STEPS = 20


class StartCounting(TrainerCallback):
    """Enters the mode after every other callback's ``on_train_begin`` (put it last)."""

    def __init__(self, mode: SyncCounter) -> None:
        self.mode = mode

    def on_train_begin(self, args, state, control, **kwargs):
        self.mode.__enter__()


class StopCounting(TrainerCallback):
    """Leaves the mode before the K-FAC callback's final snapshot (put it first)."""

    def __init__(self, mode: SyncCounter) -> None:
        self.mode = mode

    def on_train_end(self, args, state, control, **kwargs):
        self.mode.__exit__(None, None, None)


def _count(tmp_path, cfg: dict | None, **train_kwargs) -> SyncCounter:
    mode = SyncCounter()
    kfac = [] if cfg is None else [KFACStreamCallback(KFACConfig(**cfg))]
    ex = text_examples(16, 12, lengths=[12, 9, 12, 7] * 4)  # padding on every other sequence
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, report_to=[], use_cpu=True,
        logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0, **train_kwargs)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=ListDataset(ex),
                      callbacks=[StopCounting(mode), *kfac, StartCounting(mode)])
    trainer.train()
    if kfac:
        tr = kfac[0].tracker
        assert tr.counters.updates == -(-STEPS // tr.config.update_every)  # all applied
        assert tr.counters.skipped_updates == 0
        assert tr.plan.groups  # q/k/v and gate/up share their A: that path is counted too
    return mode


# the Fisher made explicit (the default is the MC sub-batch replay: counted in
# test_replayed_mc_pass_adds_only_the_models_own_forward_syncs)
@pytest.mark.parametrize("extra", [{"fisher": "empirical"},
                                   {"fisher": "empirical", "update_every": 1},
                                   {"fisher": "mc", "mc_sequences": "all"},
                                   {"fisher": "mc", "mc_sequences": "all", "update_every": 1},
                                   {"fisher": "empirical", "update_every": 1,
                                    "fold_on": "device"}],
                         ids=["empirical", "update_every=1", "mc-all", "mc-all-update_every=1",
                              "device-path-update_every=1"])
def test_callback_adds_no_host_sync_per_step(tmp_path, extra):
    # async_updates=True is the CUDA default (None → on when the model is on CUDA); on CPU
    # the default applies updates on the training thread, where reading CPU tensors is free.
    cfg = {"async_updates": True, "snapshot_every": 10_000, **extra}
    plain = _count(tmp_path / "plain", None)
    tracked = _count(tmp_path / "tracked", cfg)
    print(f"{extra}: host syncs over {STEPS} steps: plain Trainer {plain.count}, "
          f"with the callback {tracked.count}")
    assert plain.count > 0  # the counter sees the Trainer's own syncs (loss .item(), ...)
    assert not tracked.ours, dict(tracked.ours)  # kfac_stream's own code: none at all
    assert tracked.replayed == 0  # the MC gradient was taken inside the training forward
    assert tracked.count == plain.count


@pytest.mark.parametrize("extra,ckpt", [({"mc_sequences": "all"}, True),
                                        ({"mc_sequences": 1}, False),
                                        ({"mc_sequences": 0.5, "min_window_sequences": 0},
                                         False)],
                         ids=["whole-batch-checkpointing", "sub-batch", "share-of-the-step"])
def test_replayed_mc_pass_adds_only_the_models_own_forward_syncs(tmp_path, extra, ckpt):
    # the MC pass replayed after the step: the whole batch under gradient checkpointing, a
    # sub-batch of every micro-batch (an int), or a share of the step's sequences (a float,
    # the default's kind; 0.5 here so that both update steps replay: the default 0.05 of
    # 2 x 2 sequences would replay in about one update of five; min_window_sequences=0 keeps
    # the share: this 20-step run would otherwise raise it to every sequence, "all", whose
    # gradient is taken inside the training forward) (kfac_stream/capture/mc_fisher.py)
    cfg = {"async_updates": True, "snapshot_every": 10_000, "fisher": "mc", **extra}
    plain = _count(tmp_path / "plain", None, gradient_checkpointing=ckpt)
    tracked = _count(tmp_path / "tracked", cfg, gradient_checkpointing=ckpt)
    updates = -(-STEPS // 10)
    print(f"MC replayed: host syncs over {STEPS} steps: plain {plain.count}, with the callback "
          f"{tracked.count}, of which the model's own in the replayed forwards "
          f"{tracked.replayed} ({tracked.replayed / (2 * updates):.1f} per forward)")
    assert not tracked.ours, dict(tracked.ours)
    assert 0 < tracked.replayed <= 2 * 2 * updates  # ≤ 2 per forward, 2 micro-batches
    assert tracked.count - tracked.replayed == plain.count
