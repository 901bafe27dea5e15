"""Shared-input A factors and the device fold path.

* Layers that read the same input tensor (q/k/v, gate/up of a Llama block) share one A:
  stored once, and bit for bit the A each of them gets without sharing.
* ``fold_on="device"`` (second moments where the rows are, pending sums combined on the
  device, one host copy per flush) equals the float64 brute-force reference, with and without
  a device budget, exactly as the host path does (tests/runs/test_oracle.py).
"""

import pytest
import torch
from safetensors import safe_open
from transformers import TrainerCallback

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.capture.selection import select_layers
from kfac_stream.capture.sharing import plan_factors, probe_shared_inputs
from kfac_stream.config import KFACConfig
from kfac_stream.tracking.tracker import Tracker, plan_tracking

from harness import factor_errors, run, sum_nll_loss
from models import lora_gpt2, text_examples, tiny_biogpt, tiny_gpt2, tiny_llama, tiny_opt
from reference import reference_factors

ORACLE_TOL = 1e-10  # float64 end to end, as in test_oracle.py


def _groups(model):
    specs = select_layers(model)
    return probe_shared_inputs(model, {n: model.get_submodule(n) for n in specs})


def test_probe_finds_llama_groups_and_nothing_in_gpt2():
    p = "model.layers.{}."
    want = []
    for i in range(2):
        want += [tuple(p.format(i) + f"self_attn.{x}_proj" for x in "qkv"),
                 tuple(p.format(i) + f"mlp.{x}_proj" for x in ("gate", "up"))]
    model = tiny_llama()
    state = torch.get_rng_state()
    assert _groups(model) == want
    assert torch.equal(torch.get_rng_state(), state)  # the probe leaves the training RNG alone
    assert _groups(tiny_gpt2()) == []  # c_attn is one fused layer; c_fc reads another input
    assert _groups(lora_gpt2()) == []  # each adapter reads its own block's input


@pytest.mark.slow  # ~45 s on 2 cores; OPT's group below checks the same equality in make test
def test_shared_A_equals_per_layer_A_bit_for_bit(tmp_path):
    ex = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    cfg = {"token_fraction": 0.3, "ema_decay": 0.9, "storage_dtype": "float16",
           "snapshot_every": 2}
    shared, _, _ = run(tiny_llama(), ex, cfg, batch=2, tmp_path=tmp_path / "s", record=False)
    alone, _, _ = run(tiny_llama(), ex, {**cfg, "share_inputs": False}, batch=2,
                      tmp_path=tmp_path / "a", record=False)
    a, b = Snapshot.latest(tmp_path / "s" / "kfac"), Snapshot.latest(tmp_path / "a" / "kfac")
    assert a.layer_names == b.layer_names and a.step == b.step == 4
    for n in a.layer_names:
        assert torch.equal(a[n].A, b[n].A), n
        assert torch.equal(a[n].G, b[n].G), n
        assert torch.equal(a[n].A_eigvals, b[n].A_eigvals), n
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    assert a.manifest.shared_inputs == [list(g) for g in shared.tracker.plan.groups]
    assert a.manifest.layers[k].A.key == q + ".A"
    assert a[k].A is a[q].A  # loaded once, not once per layer
    assert a.manifest.layers[k].A.spectrum == a.manifest.layers[q].A.spectrum
    with safe_open(f"{a.path}/shard-00000-of-00001.safetensors", "pt") as f:
        stored = {key for key in f.keys() if key.endswith(".A")}
    assert q + ".A" in stored and k + ".A" not in stored
    assert len(stored) == 8 and len(b.manifest.layers) == 14  # 2 blocks × (qkv, o, gate/up, down)
    assert shared.tracker.counters.comm_bytes == 0
    # the posterior does not care how the factors were stored
    model = alone.tracker.capture.model
    batch = {"input_ids": ex[0]["input_ids"][None], "attention_mask": ex[0]["attention_mask"][None]}
    m1, v1 = LaplacePosterior(model, a, prior_precision=1.0).predictive(batch, positions=-1,
                                                                        token_ids=[1, 2, 3])
    m2, v2 = LaplacePosterior(model, b, prior_precision=1.0).predictive(batch, positions=-1,
                                                                        token_ids=[1, 2, 3])
    assert torch.equal(m1, m2) and torch.allclose(v1, v2, rtol=1e-10, atol=0)


@pytest.mark.parametrize("build", [pytest.param(tiny_opt, id="opt"),
                                   pytest.param(tiny_biogpt, id="biogpt", marks=pytest.mark.slow)])
def test_call_order_groups_share_A_bit_for_bit(tmp_path, build, caplog):
    """OPT and BioGPT register k, v, q but call q first: the group is kept (the member called
    first gathers the rows) and the shared A is the per-layer A bit for bit."""
    ex = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    cfg = {"token_fraction": 0.3, "ema_decay": 0.9, "storage_dtype": "float16",
           "snapshot_every": 2}
    with caplog.at_level("WARNING", logger="kfac_stream"):
        shared, _, _ = run(build(), ex, cfg, tmp_path=tmp_path / "s", record=False)
    assert not [r for r in caplog.records if "share one A" in r.getMessage()]
    alone, _, _ = run(build(), ex, {**cfg, "share_inputs": False}, tmp_path=tmp_path / "a",
                      record=False)
    a, b = Snapshot.latest(tmp_path / "s" / "kfac"), Snapshot.latest(tmp_path / "a" / "kfac")
    groups = shared.tracker.plan.groups
    assert len(groups) == 2 and all(g[-1].endswith("q_proj") for g in groups)  # k, v, q
    assert a.manifest.shared_inputs == [list(g) for g in groups]
    for n in a.layer_names:
        assert torch.equal(a[n].A, b[n].A), n
        assert torch.equal(a[n].G, b[n].G), n


def test_wrong_sharing_dissolves_and_stays_exact(tmp_path, caplog):
    """A group whose members receive different inputs stops sharing at once (one warning
    naming its layers) and every factor equals the unshared run's bit for bit."""
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"

    def tracked(share: bool):
        model = tiny_llama()
        specs = select_layers(model)
        plan = plan_factors(specs, 8192, [(q, o)] if share else [])  # same width, other inputs
        return model, Tracker(model, {n: model.get_submodule(n) for n in specs}, specs,
                              KFACConfig(token_fraction=1.0, fisher="empirical",
                                         storage_dtype="float64"), plan=plan)

    ids = text_examples(1, 8)[0]["input_ids"][None]
    out = {}
    for share in (True, False):
        model, tracker = tracked(share)
        try:
            with caplog.at_level("WARNING", logger="kfac_stream"):
                for step in range(2):
                    tracker.begin_step(step)
                    model(input_ids=ids, labels=ids).loss.backward()
                    tracker.end_step(model)
            out[share] = (tracker.factors(), tracker.plan)
        finally:
            tracker.close()
    warned = [r for r in caplog.records if "share one A" in r.getMessage()]
    assert len(warned) == 1 and q in warned[0].getMessage() and o in warned[0].getMessage()
    assert out[True][1].groups == () and out[True][1].a_key[o] == o + ".A"
    for n, (a, g) in out[False][0].items():
        assert torch.equal(out[True][0][n][0], a), n
        assert torch.equal(out[True][0][n][1], g), n


class _CloneInputAt(TrainerCallback):
    """From optimizer step ``step`` on, ``layer`` receives a copy of its input (same values,
    another tensor): a shared-input group that was right so far breaks in training."""

    def __init__(self, model, layer: str, step: int):
        self.module, self.step, self.handle = model.get_submodule(layer), step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.handle is None:
            self.handle = self.module.register_forward_pre_hook(
                lambda m, a: (a[0].clone(), *a[1:]))
        return control


def test_group_dissolved_mid_run_keeps_its_history(tmp_path, caplog):
    """Dissolved after 3 update steps: the members start from the shared A (their common
    history) and go on with their own rows; every factor equals the unshared run's, bit for
    bit, and the snapshot stores the members' own A."""
    ex = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    cfg = {"token_fraction": 0.5, "ema_decay": 0.9, "storage_dtype": "float16",
           "snapshot_every": 10_000}
    k = "model.layers.1.self_attn.k_proj"
    runs = {}
    for share in (True, False):
        model = tiny_llama()
        with caplog.at_level("WARNING", logger="kfac_stream"):
            cb, _, _ = run(model, ex, {**cfg, "share_inputs": share}, batch=1, steps=6,
                           tmp_path=tmp_path / str(share), record=False,
                           callbacks=[_CloneInputAt(model, k, 3)])
        runs[share] = cb
    warned = [r for r in caplog.records if "share one A" in r.getMessage()]
    assert len(warned) == 1 and k in warned[0].getMessage()
    a, b = (Snapshot.latest(tmp_path / str(s) / "kfac") for s in (True, False))
    assert len(a.manifest.shared_inputs) == 3  # layer 1's q/k/v group dissolved; 3 left
    assert a.manifest.layers[k].A.key == k + ".A"
    assert a[k].A.abs().sum() > 0
    for n in a.layer_names:
        assert torch.equal(a[n].A, b[n].A), n
        assert torch.equal(a[n].G, b[n].G), n


@pytest.mark.parametrize("budget", [4 * 2**30, 0], ids=["pending-on-device", "every-update"])
def test_device_fold_equals_bruteforce_reference(tmp_path, budget):
    model = tiny_llama(torch.float64)
    examples = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    cfg = {"fold_on": "device", "device_memory_budget": budget, "async_updates": True}
    cb, records, _ = run(model, examples, cfg, batch=2, accum=2, loss=sum_nll_loss,
                         tmp_path=tmp_path)
    ref, count = reference_factors(model, records, list(cb.tracker.specs))
    errs = factor_errors(cb, ref)
    assert max(errs.values()) <= ORACLE_TOL, errs
    assert cb.tracker.counters.positions_sampled == count
    assert cb.tracker.fold_on == "device"


def test_plan_tracking_on_meta_device_reads_no_weights():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    specs, plan = plan_tracking(model, KFACConfig())
    assert len(specs) == 21 and len(plan.groups) == 6
    assert len(plan.dims) == 21 * 2 - 3 * 3  # per block: q/k/v share one A, gate/up one
    assert plan.dims["model.layers.0.mlp.down_proj.A"] == (172, False)
