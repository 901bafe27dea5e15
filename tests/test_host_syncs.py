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
makes whatever syncs the model's forward makes, counted separately as the only difference
allowed there: none for a batch without ``attention_mask`` (the replay spares the mask
builder its packed-sequence check, `kfac_stream.capture.mc_fisher.mc_fisher_pass`) or with
eager attention, 1–2 per forward for an SDPA model given an attention mask (transformers
reads it on the host to choose ``is_causal``).

The factor worker (``async_updates=True``, the default when training on CUDA) is the one
place allowed to read device values; it runs on its own thread, which the mode (thread-local)
does not see. Snapshots (``snapshot_every``) and the end-of-training snapshot are outside the
counted window: they may read, once per snapshot.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback
from kfac_stream.capture.mc_fisher import sampled_label_loss, sync_free_kwargs

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


def _examples(batch: str = "padded") -> list[dict]:
    """``padded``: padding on every other sequence (an attention mask); ``no-mask``: equal
    lengths, no ``attention_mask`` key at all (the collator passes none to the model)."""
    if batch == "padded":
        return text_examples(16, 12, lengths=[12, 9, 12, 7] * 4)
    return [{k: v for k, v in e.items() if k != "attention_mask"}
            for e in text_examples(16, 12)]


def _count(tmp_path, cfg: dict | None, batch: str = "padded", attn: str = "sdpa",
           **train_kwargs) -> SyncCounter:
    mode = SyncCounter()
    kfac = [] if cfg is None else [KFACStreamCallback(KFACConfig(**cfg))]
    ex = _examples(batch)
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, report_to=[], use_cpu=True,
        logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0, **train_kwargs)
    trainer = Trainer(model=tiny_llama(attn_implementation=attn), args=args,
                      train_dataset=ListDataset(ex),
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


REPLAYS = [({"mc_sequences": "all"}, True), ({"mc_sequences": 1}, False),
           ({"mc_sequences": 0.5, "min_window_sequences": 0}, False)]


@pytest.mark.parametrize("batch,attn", [("no-mask", "sdpa"), ("padded", "sdpa"),
                                        ("padded", "eager")],
                         ids=["no-mask-sdpa", "padded-sdpa", "padded-eager"])
@pytest.mark.parametrize("extra,ckpt", REPLAYS,
                         ids=["whole-batch-checkpointing", "sub-batch", "share-of-the-step"])
def test_replayed_mc_pass_adds_only_the_models_own_forward_syncs(tmp_path, extra, ckpt, batch,
                                                                 attn):
    """The MC pass replayed after the step: no host sync of kfac_stream's own on the training
    thread, and the replayed forward's own (the model's, attributed to the replay) are:

    * ``no-mask-sdpa`` (batches without ``attention_mask``, as in a packed or fixed-length
      pretraining run): none. Without the replay's cache the forward would read
      ``find_packed_sequence_indices``'s ``(packed_sequence_mask[:, -1] == 0).all()`` once
      (transformers 5.17 ``masking_utils.py:755``, 5.24 ``:761``), as the Trainer's own
      training forward still does here (asserted on the plain run);
    * ``padded-eager``: none (the eager mask is always built, nothing read);
    * ``padded-sdpa``: not removable on 5.24: ``_ignore_causal_mask_sdpa`` reads the padding
      mask to choose SDPA's ``is_causal``, ``fast_all(padding_mask)`` at 5.24
      ``masking_utils.py:292`` (5.17 ``:269``), and for a sub-batch with padding also
      ``fast_all(padding_mask[:, :q_length])`` at ``:298`` (5.17 ``:275``): 1–2 per forward,
      all in ``masking_utils.py``. Skipping them would take a precomputed 4D mask, which turns
      the ``is_causal`` kernel into a masked one on a batch without padding.

    The replay kinds: the whole batch under gradient checkpointing, a sub-batch of every
    micro-batch (an int), or a share of the step's sequences (a float, the default's kind;
    0.5 here so that both update steps replay: the default 0.05 of 2 x 2 sequences would
    replay in about one update of five; min_window_sequences=0 keeps the share: this 20-step
    run would otherwise raise it to every sequence, "all", whose gradient is taken inside the
    training forward) (kfac_stream/capture/mc_fisher.py).
    """
    cfg = {"async_updates": True, "snapshot_every": 10_000, "fisher": "mc", **extra}
    plain = _count(tmp_path / "plain", None, batch, attn, gradient_checkpointing=ckpt)
    tracked = _count(tmp_path / "tracked", cfg, batch, attn, gradient_checkpointing=ckpt)
    updates = -(-STEPS // 10)
    print(f"MC replayed, {batch} {attn}: host syncs over {STEPS} steps: plain {plain.count}, "
          f"with the callback {tracked.count}, of which the model's own in the replayed "
          f"forwards {tracked.replayed} ({tracked.replayed / (2 * updates):.1f} per forward): "
          f"{dict(tracked.replays)}")
    assert not tracked.ours, dict(tracked.ours)
    assert tracked.count - tracked.replayed == plain.count
    if batch == "padded" and attn == "sdpa":
        assert 0 < tracked.replayed <= 2 * 2 * updates  # ≤ 2 per forward, 2 micro-batches
        assert all("masking_utils.py" in where for where in tracked.replays), tracked.replays
    else:
        assert tracked.replayed == 0, dict(tracked.replays)
    if batch == "no-mask":  # the check the replay skips is live in this transformers
        assert any("masking_utils.py" in where and "_local_scalar_dense" in where
                   for where in plain.model), dict(plain.model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("batch", ["no-mask", "padded", "packed-positions"])
def test_sync_free_replay_forward_is_bit_identical(attn, ckpt, batch):
    """The replay's forward kwargs (`sync_free_kwargs`) give the same logits and the same
    sampled-label gradients, bit for bit, as the batch as recorded; for a batch without
    ``attention_mask`` with no host sync at all (the plain form: 1, the packed-sequence
    check). A batch with an attention mask, or with explicit ``position_ids`` (which may be
    packed sequences, which the check must see), is handed over unchanged."""
    model = tiny_llama(attn_implementation=attn)
    model.config.use_cache = False  # as the HF Trainer sets it (TrainingArguments.use_cache)
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ex = _examples(batch if batch != "packed-positions" else "no-mask")[:4]
    inputs = {k: torch.stack([e[k] for e in ex]) for k in ex[0]}
    if batch == "packed-positions":  # two sequences of 6 in each row
        inputs["position_ids"] = torch.arange(12).remainder(6).expand(4, -1).clone()
    kwargs = {k: v for k, v in inputs.items() if k != "labels"}
    forms = {"recorded": kwargs, "replayed": sync_free_kwargs(model, kwargs)}
    if batch != "no-mask":
        assert forms["replayed"] is kwargs
        return
    results = {}
    for name, kw in forms.items():
        model.zero_grad(set_to_none=True)
        counter = SyncCounter()
        with counter:
            logits = model(**kw).logits
            loss = sampled_label_loss(logits, inputs, torch.Generator().manual_seed(0))
            loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results[name] = (logits.detach(), grads, counter.count)
    (l0, g0, n0), (l1, g1, n1) = results["recorded"], results["replayed"]
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    assert n1 == 0, "the replayed form made a host sync"
    assert n0 == 1  # the packed-sequence check of transformers' create_causal_mask
