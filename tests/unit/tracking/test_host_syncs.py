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
allowed there. The replay (`kfac_stream.fisher.mc_replay.replay_forward`) makes none on a
Llama-family model: a batch without ``attention_mask`` gets an empty cache (the mask builder's
packed-sequence check is skipped), and a padded batch on a full causal SDPA model hands the
decoder the 4-D boolean mask transformers would build (its host reads that choose
``is_causal`` are skipped); eager attention reads nothing anyway. A model with a sliding
window keeps the plain forward: 1–2 per forward for SDPA with an attention mask.

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
from kfac_stream.fisher import mc_replay
from kfac_stream.fisher.mc_replay import (
    MASK_FAMILIES,
    full_causal_sdpa_decoder,
    replay_forward,
    sampled_label_loss,
)

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
           model_fn=tiny_llama, **train_kwargs) -> SyncCounter:
    mode = SyncCounter()
    kfac = [] if cfg is None else [KFACStreamCallback(KFACConfig(**cfg))]
    ex = _examples(batch)
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, report_to=[], use_cpu=True,
        logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0, **train_kwargs)
    trainer = Trainer(model=model_fn(attn_implementation=attn), args=args,
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


REPLAYS = {"whole-batch-checkpointing": ({"mc_sequences": "all"}, True),
           "sub-batch": ({"mc_sequences": 1}, False),
           "share-of-the-step": ({"mc_sequences": 0.5, "min_window_sequences": 0}, False)}
MASKS = {"no-mask-sdpa": ("no-mask", "sdpa"), "padded-sdpa": ("padded", "sdpa"),
         "padded-eager": ("padded", "eager")}


def _replay_cases() -> list:
    """Every replay setting × mask case; one diagonal of the grid (each replay and each mask
    case once) runs in `make test`, the rest in `make test-slow` (~16 s a case on 2 cores)."""
    cases = []
    for i, (rid, (extra, ckpt)) in enumerate(REPLAYS.items()):
        for j, (mid, (batch, attn)) in enumerate(MASKS.items()):
            marks = () if i == j else (pytest.mark.slow,)
            cases.append(pytest.param(extra, ckpt, batch, attn, marks=marks, id=f"{rid}-{mid}"))
    return cases


@pytest.mark.parametrize("extra,ckpt,batch,attn", _replay_cases())
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
    * ``padded-sdpa``: none. The plain forward reads the padding mask to choose SDPA's
      ``is_causal`` in ``_ignore_causal_mask_sdpa``, ``fast_all(padding_mask)`` at 5.24
      ``masking_utils.py:292`` (5.17 ``:269``) and, for a sub-batch with padding,
      ``fast_all(padding_mask[:, :q_length])`` at ``:298`` (5.17 ``:275``): 1–2 per forward,
      as the Trainer's own training forward still does here (asserted on the plain run). The
      replay hands the decoder the 4-D mask instead (`mc_replay.padded_causal_mask`), which
      skips them (a 4-D mask is returned as is, 5.24 ``masking_utils.py:818``, 5.17 ``:812``).

    The replay kinds: the whole batch under gradient checkpointing, a sub-batch of every
    micro-batch (an int), or a share of the step's sequences (a float, the default's kind;
    0.5 here so that both update steps replay: the default 0.05 of 2 x 2 sequences would
    replay in about one update of five; min_window_sequences=0 keeps the share: this 20-step
    run would otherwise raise it to every sequence, "all", whose gradient is taken inside the
    training forward) (kfac_stream/fisher/mc_replay.py).
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
    assert tracked.replayed == 0, dict(tracked.replays)
    if attn == "sdpa":  # the checks the replay skips are live in this transformers
        assert any("masking_utils.py" in where for where in plain.model), dict(plain.model)


def tiny_mistral(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A 2-layer byte-level Mistral shaped as `tiny_llama` (``sliding_window`` 64 unless
    overridden: longer than any sequence here, so its mask is the full causal one, but the
    config names a window: the replay keeps the plain forward)."""
    from transformers import MistralConfig, MistralForCausalLM

    kw = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=64, tie_word_embeddings=False, attention_dropout=0.0,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=64)
    kw.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MistralForCausalLM(MistralConfig(**kw))
    return model.to(dtype).train()


def test_replayed_mc_pass_of_a_windowed_model_keeps_the_mask_syncs(tmp_path):
    """A padded SDPA model with a sliding window: the replay keeps the plain forward (its
    mask is not the full causal one in general), so its forward reads the padding mask as the
    training forward does: 1–2 per replayed forward, all in ``masking_utils.py``."""
    cfg = {"async_updates": True, "snapshot_every": 10_000, "fisher": "mc", "mc_sequences": 1}
    plain = _count(tmp_path / "plain", None, model_fn=tiny_mistral)
    tracked = _count(tmp_path / "tracked", cfg, model_fn=tiny_mistral)
    updates = -(-STEPS // 10)
    assert not tracked.ours, dict(tracked.ours)
    assert tracked.count - tracked.replayed == plain.count
    assert 0 < tracked.replayed <= 2 * 2 * updates  # ≤ 2 per forward, 2 micro-batches
    assert all("masking_utils.py" in where for where in tracked.replays), tracked.replays


def _batch(kind: str) -> dict[str, torch.Tensor]:
    """Four sequences of 12 tokens: ``no-mask`` (no ``attention_mask``), ``padded`` (lengths
    12, 9, 12, 7, padded on the right), ``left-padded`` (the same, padded on the left: the pad
    queries have no key at all, an all-False row of the mask), ``all-ones`` (a mask without
    padding), ``packed-positions`` (no mask, two sequences of 6 in each row's
    ``position_ids``)."""
    ex = _examples("padded" if kind in ("padded", "left-padded") else "no-mask")[:4]
    if kind == "all-ones":
        ex = text_examples(4, 12)
    if kind == "left-padded":
        ex = [{k: torch.roll(v, int((e["attention_mask"] == 0).sum())) for k, v in e.items()}
              for e in ex]
    inputs = {k: torch.stack([e[k] for e in ex]) for k in ex[0]}
    if kind == "packed-positions":
        inputs["position_ids"] = torch.arange(12).remainder(6).expand(4, -1).clone()
    return inputs


def _forward(model, inputs: dict, form) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """``form(model, kwargs)``'s logits, the sampled-label loss's parameter gradients, and the
    host syncs of forward and backward."""
    kwargs = {k: v for k, v in inputs.items() if k != "labels"}
    model.zero_grad(set_to_none=True)
    counter = SyncCounter()
    with counter:
        logits = form(model, kwargs).logits
        loss = sampled_label_loss(logits, inputs, torch.Generator().manual_seed(0))
        loss.backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()], counter.count


def _plain(model, kwargs):
    return model(**kwargs)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """``|a - b| ≤ rel · max|a|`` everywhere."""
    return bool((a - b).abs().max() <= rel * a.abs().max())


# syncs of the plain forward + backward (the replay's own form: 0, but packed positions)
PLAIN_SYNCS = {("no-mask", "sdpa"): 1, ("no-mask", "eager"): 1,  # the packed-sequence check
               ("padded", "sdpa"): 2, ("left-padded", "sdpa"): 2,  # _ignore_causal_mask_sdpa
               ("all-ones", "sdpa"): 1, ("padded", "eager"): 0, ("left-padded", "eager"): 0,
               ("all-ones", "eager"): 0,
               ("packed-positions", "sdpa"): 1, ("packed-positions", "eager"): 1}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("batch", ["no-mask", "padded", "left-padded", "all-ones",
                                   "packed-positions"])
def test_replay_forward_is_sync_free_and_bit_identical(attn, ckpt, batch):
    """The replay's forward (`replay_forward`) gives the same logits and the same
    sampled-label gradients as the plain forward of the batch as recorded, bit for bit, with
    no host sync at all (float32, the training dtype):

    * ``no-mask``: an empty cache skips the packed-sequence check (the plain form: 1 sync);
    * ``padded``, ``left-padded`` on SDPA: the decoder gets the 4-D boolean mask
      transformers builds from the 2-D one, the very same mask reaches SDPA (the plain form:
      2 syncs, ``_ignore_causal_mask_sdpa``); eager attention: the plain call (no sync);
    * ``all-ones`` on SDPA: the plain form finds no padding on the host and calls SDPA with
      ``is_causal=True`` and no mask (and GQA in the kernel); the replay cannot tell without a
      host read, so it passes the explicit causal mask (and transformers then repeats k/v):
      another kernel path, equal up to float32 rounding, asserted to 1e-5 of each tensor's
      largest magnitude (a few ulps of reordered sums; CPU torch 2.13 gives equal bits);
    * ``packed-positions`` (explicit ``position_ids`` that may be packed sequences, which the
      check must see): the plain call, its 1 sync kept.
    """
    model = tiny_llama(dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False  # as the HF Trainer sets it (TrainingArguments.use_cache)
    if ckpt:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    inputs = _batch(batch)
    l0, g0, n0 = _forward(model, inputs, _plain)
    l1, g1, n1 = _forward(model, inputs, replay_forward)
    assert n0 == PLAIN_SYNCS[batch, attn]
    assert n1 == (1 if batch == "packed-positions" else 0), "the replayed form made a host sync"
    if batch == "all-ones" and attn == "sdpa":
        assert _close(l0, l1, 1e-5)
        assert all(_close(a, b, 1e-5) for a, b in zip(g0, g1, strict=True))
        return
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def _family_model(family: str, attn: str = "sdpa", **overrides):
    """A tiny float32 model of a `MASK_FAMILIES` family (Mistral without a window unless
    ``overrides`` give one)."""
    import transformers

    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    kw = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
              tie_word_embeddings=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
              pad_token_id=0)
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    config = getattr(transformers, config_cls)(**kw)
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
    model.config.use_cache = False
    return model.float().train()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_mask_family_replays_bit_identically(family):
    """Every family the replay hands a 4-D mask (`MASK_FAMILIES`, all of them here): a padded
    batch, on the right and on the left, gives the plain forward's logits and gradients bit
    for bit, with no host sync."""
    assert {"llama", "mistral", "qwen2", "qwen3"} == MASK_FAMILIES  # a new one needs a case
    model = _family_model(family)
    assert full_causal_sdpa_decoder(model) is model.base_model
    for batch in ("padded", "left-padded"):
        inputs = _batch(batch)
        l0, g0, n0 = _forward(model, inputs, _plain)
        l1, g1, n1 = _forward(model, inputs, replay_forward)
        assert (n0, n1) == (2, 0), batch
        assert torch.equal(l0, l1), batch
        assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True)), batch


def _with_full_causal_mask(model, kwargs):
    """The 4-D full causal mask forced on a model the replay refuses it to."""
    mask = kwargs["attention_mask"]
    with mc_replay._decoder_mask(model.base_model, mask, mc_replay.padded_causal_mask(mask)):
        return model(**kwargs)


@pytest.mark.parametrize("family,overrides", [
    ("mistral", {"sliding_window": 4}),
    ("mistral", {"sliding_window": 64}),  # ≥ T: no different mask here, still refused
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
               "use_sliding_window": True}),
    ("llama", {"attn": "eager"}),
], ids=["mistral-window-4", "mistral-window-64", "qwen2-window-layers", "qwen3-layer-types",
        "llama-eager"])
def test_windowed_model_keeps_the_plain_replay(family, overrides):
    """A model whose layers are not all full causal attention (a ``sliding_window``, sliding
    ``layer_types``) or not SDPA: no 4-D mask (`full_causal_sdpa_decoder` is None), the replay
    is the plain forward: the training forward's logits and gradients bit for bit, and the
    same host syncs. With a window shorter than the batch, the full causal mask would change
    the logits: the refusal is needed."""
    overrides = dict(overrides)
    model = _family_model(family, overrides.pop("attn", "sdpa"), **overrides)
    assert full_causal_sdpa_decoder(model) is None
    inputs = _batch("padded")
    l0, g0, n0 = _forward(model, inputs, _plain)
    l1, g1, n1 = _forward(model, inputs, replay_forward)
    assert n1 == n0
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    if overrides.get("sliding_window") == 4:
        forced, _, _ = _forward(model, inputs, _with_full_causal_mask)
        assert not torch.allclose(forced, l0)
