"""Shared-input A factors and the device fold path (issue 12).

* Layers that read the same input tensor (q/k/v, gate/up of a Llama block) share one A:
  stored once, and bit for bit the A each of them gets without sharing.
* ``fold_on="device"`` (second moments where the rows are, pending sums combined on the
  device, one host copy per flush) equals the float64 brute-force reference, with and without
  a device budget, exactly as the host path does (tests/test_oracle.py).
"""

import pytest
import torch
from safetensors import safe_open

from kfac_stream import LaplacePosterior, Snapshot
from kfac_stream.capture.selection import select_layers
from kfac_stream.capture.sharing import plan_factors, probe_shared_inputs
from kfac_stream.config import KFACConfig
from kfac_stream.tracker import Tracker, plan_tracking

from harness import factor_errors, run, sum_nll_loss
from models import lora_gpt2, text_examples, tiny_gpt2, tiny_llama
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
    assert a.meta["shared_inputs"] == [list(g) for g in shared.tracker.plan.groups]
    assert a.meta["layers"][k]["A"]["key"] == q + ".A"
    assert a[k].A is a[q].A  # loaded once, not once per layer
    assert a.meta["layers"][k]["A"]["spectrum"] == a.meta["layers"][q]["A"]["spectrum"]
    with safe_open(f"{a.path}/shard-00000-of-00001.safetensors", "pt") as f:
        stored = {key for key in f.keys() if key.endswith(".A")}
    assert q + ".A" in stored and k + ".A" not in stored
    assert len(stored) == 8 and len(b.meta["layers"]) == 14  # 2 blocks × (qkv, o, gate/up, down)
    assert shared.tracker.counters.comm_bytes == 0
    # the posterior does not care how the factors were stored
    model = alone.tracker.capture.model
    batch = {"input_ids": ex[0]["input_ids"][None], "attention_mask": ex[0]["attention_mask"][None]}
    m1, v1 = LaplacePosterior(model, a, prior_precision=1.0).predictive(batch, positions=-1,
                                                                        token_ids=[1, 2, 3])
    m2, v2 = LaplacePosterior(model, b, prior_precision=1.0).predictive(batch, positions=-1,
                                                                        token_ids=[1, 2, 3])
    assert torch.equal(m1, m2) and torch.allclose(v1, v2, rtol=1e-10, atol=0)


def test_wrong_sharing_is_caught_at_run_time():
    model = tiny_llama()
    specs = select_layers(model)
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    plan = plan_factors(specs, 8192, [(q, o)])  # same width, different inputs
    tracker = Tracker(model, {n: model.get_submodule(n) for n in specs}, specs,
                      KFACConfig(token_fraction=1.0, fisher="empirical"), plan=plan)
    try:
        tracker.begin_step(0)
        ids = text_examples(1, 8)[0]["input_ids"][None]
        with pytest.raises(RuntimeError, match="share_inputs=False"):
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        tracker.close()


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
