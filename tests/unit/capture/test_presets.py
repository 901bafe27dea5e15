"""Layer presets (`KFACConfig.preset`): exactly the documented layers on GPT-2, Llama, their
sequence classifiers and a LoRA GPT-2; errors; exclude on top; the memory cost by hand; and a
real Trainer run tracking only the LM head, whose vocabulary-sized G is kept diagonal."""

import math
import pathlib

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from kfac_stream import KFACConfig, KFACConfigError, LaplacePosterior, Snapshot
from kfac_stream.capture.preset_memory import preset_dims, preset_factor_bytes
from kfac_stream.capture.presets import preset_layers
from kfac_stream.capture.selection import select_layers
from kfac_stream.utils.enums import LayerPreset

from harness import run, sum_nll_loss
from models import lora_gpt2, text_examples, tiny_gpt2, tiny_llama, tiny_opt
from reference import reference_factors, rel_err

GPT2_ATTN = [f"transformer.h.{i}.attn.{m}" for i in range(2) for m in ("c_attn", "c_proj")]
GPT2_MLP = [f"transformer.h.{i}.mlp.{m}" for i in range(2) for m in ("c_fc", "c_proj")]
GPT2_ALL = [f"transformer.h.{i}.{m}" for i in range(2)
            for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
LLAMA_ATTN = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
LLAMA_MLP = [f"model.layers.{i}.mlp.{p}_proj" for i in range(2)
             for p in ("gate", "up", "down")]
LLAMA_ALL = [f"model.layers.{i}.{m}" for i in range(2)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
OPT_ATTN = [f"model.decoder.layers.{i}.self_attn.{p}_proj" for i in range(2)
            for p in ("k", "v", "q", "out")]
OPT_MLP = [f"model.decoder.layers.{i}.fc{j}" for i in range(2) for j in (1, 2)]  # in the block
OPT_ALL = [n for i in range(2) for n in OPT_ATTN[4 * i:4 * i + 4] + OPT_MLP[2 * i:2 * i + 2]]
LORA = "base_model.model.transformer.h.{}.{}.lora_{}.default"
LORA_ATTN = [LORA.format(i, "attn.c_attn", x) for i in range(2) for x in "AB"]
LORA_MLP = [LORA.format(i, "mlp.c_fc", x) for i in range(2) for x in "AB"]
LORA_ALL = [LORA.format(i, m, x) for i in range(2) for m in ("attn.c_attn", "mlp.c_fc")
            for x in "AB"]


def _seeded(cls, config):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config).double()


def gpt2_classifier():
    return _seeded(GPT2ForSequenceClassification, GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=256, n_positions=64, num_labels=3,
        pad_token_id=0))


def llama_classifier():
    return _seeded(LlamaForSequenceClassification, LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, num_labels=3,
        pad_token_id=0))


NO_LORA = "needs a PEFT LoRA model"
EXPECTED = {
    "gpt2": (tiny_gpt2, {"last_layer": ["lm_head"], "attention": GPT2_ATTN, "mlp": GPT2_MLP,
                         "all_linear": GPT2_ALL, "lora": NO_LORA}),
    "llama": (tiny_llama, {"last_layer": ["lm_head"], "attention": LLAMA_ATTN,
                           "mlp": LLAMA_MLP, "all_linear": LLAMA_ALL, "lora": NO_LORA}),
    "opt": (tiny_opt, {"last_layer": ["lm_head"], "attention": OPT_ATTN, "mlp": OPT_MLP,
                       "all_linear": OPT_ALL, "lora": NO_LORA}),
    "gpt2-cls": (gpt2_classifier, {"last_layer": ["score"], "attention": GPT2_ATTN,
                                   "mlp": GPT2_MLP, "all_linear": GPT2_ALL, "lora": NO_LORA}),
    "llama-cls": (llama_classifier, {"last_layer": ["score"], "attention": LLAMA_ATTN,
                                     "mlp": LLAMA_MLP, "all_linear": LLAMA_ALL,
                                     "lora": NO_LORA}),
    "gpt2-lora": (lora_gpt2, {
        "last_layer": "selects no layer of PeftModelForCausalLM: its output head "
                      "'base_model.model.lm_head' is frozen",
        "attention": LORA_ATTN, "mlp": LORA_MLP, "all_linear": LORA_ALL, "lora": LORA_ALL}),
}


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_presets_select_exactly_the_documented_layers(arch):
    build, expected = EXPECTED[arch]
    model = build()
    assert set(expected) == {p.value for p in LayerPreset}
    for preset, want in expected.items():
        if isinstance(want, str):  # an error, one line
            with pytest.raises(KFACConfigError, match=want) as e:
                select_layers(model, preset=preset)
            assert f"preset={preset!r}" in str(e.value) and type(model).__name__ in str(e.value)
            assert "\n" not in str(e.value)
            continue
        assert preset_layers(model, preset) == want, preset
        assert list(select_layers(model, None, None, preset)) == want, preset
    # all_linear is the default selection
    assert list(select_layers(model)) == list(select_layers(model, preset="all_linear"))


def test_last_layer_takes_a_trainable_head_copy_under_peft():
    """A PEFT classifier with ``modules_to_save=["score"]``: the trainable copy of the head."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(gpt2_classifier(), LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True, task_type="SEQ_CLS"))
    got = preset_layers(model, "last_layer")
    assert got == ["base_model.model.score.modules_to_save.default"]


@pytest.mark.parametrize("cfg,needle", [
    (dict(preset="heads"), "KFACConfig.preset='heads' is not allowed: must be None or one of "
                           "('last_layer', 'lora', 'attention', 'mlp', 'all_linear')"),
    (dict(preset="mlp", include=["attn"]), "KFACConfig.preset='mlp' and include=['attn'] are "
                                           "both set"),
    (dict(preset=["mlp"]), "KFACConfig.preset=['mlp'] is not allowed"),
])
def test_config_errors(cfg, needle):
    with pytest.raises(KFACConfigError) as e:
        KFACConfig(**cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_config_accepts_every_preset_and_exclude_with_it():
    for p in LayerPreset:
        assert KFACConfig(preset=p.value, exclude=["h\\.0\\."]).preset == p.value
    assert KFACConfig().preset is None


def test_selection_errors():
    model = tiny_gpt2()
    with pytest.raises(KFACConfigError, match="are both set"):
        select_layers(model, include=["attn"], preset="mlp")
    with pytest.raises(KFACConfigError, match="KFACConfig.preset='heads' is not allowed"):
        select_layers(model, preset="heads")
    with pytest.raises(KFACConfigError, match="GPT2LMHeadModel has no lora_A/lora_B"):
        select_layers(model, preset="lora")
    with pytest.raises(KFACConfigError, match=r"preset='mlp' with exclude=\['mlp'\] selects no "
                                              r"layer: exclude removes all 4"):
        select_layers(model, exclude=["mlp"], preset="mlp")


def test_exclude_applies_on_top_of_a_preset():
    model = tiny_llama()
    got = select_layers(model, exclude=[r"layers\.1\.", r"k_proj$"], preset="attention")
    assert list(got) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                         "model.layers.0.self_attn.o_proj"]
    assert list(select_layers(lora_gpt2(), exclude=["lora_B"], preset="lora")) == [
        LORA.format(i, m, "A") for i in range(2) for m in ("attn.c_attn", "mlp.c_fc")]


def test_factor_bytes_by_hand():
    """tiny GPT-2 (16 wide, vocab 256, c_attn 16->48, c_fc 16->64) at max_dense_dim=32."""
    model = tiny_gpt2()
    # lm_head (no bias): A 16x16 dense, G over the 256-token vocabulary diagonal
    assert preset_dims(model, "last_layer", 32) == {"lm_head.A": (16, False),
                                                    "lm_head.G": (256, True)}
    assert preset_factor_bytes(model, "last_layer", 32) == 2 * (16**2 + 256)
    # per block: c_attn A 17², G 48 (diag); c_proj A 17², G 16²
    assert preset_factor_bytes(model, "attention", 32) == 2 * 2 * (289 + 48 + 289 + 256)
    # per block: c_fc A 17², G 64 (diag); c_proj A 65 (diag), G 16²; float32: 4 bytes
    assert preset_factor_bytes(model, "mlp", 32, storage_bytes=4) == 4 * 2 * (289 + 64 + 65
                                                                            + 256)
    assert preset_factor_bytes(model, "all_linear", 32) == 2 * 2 * (882 + 674)
    assert preset_factor_bytes(model, None, 32) == preset_factor_bytes(model, "all_linear", 32)
    # default max_dense_dim: all dense
    assert preset_factor_bytes(model, "last_layer") == 2 * (16**2 + 256**2)
    # Llama mlp: gate A 16², G 32²; up A 16² (shared with gate when share_inputs), G 32²;
    # down A 32², G 16²
    llama = tiny_llama()
    assert preset_factor_bytes(llama, "mlp") == 2 * 2 * (256 + 1024 + 256 + 1024 + 1024 + 256)
    assert preset_factor_bytes(llama, "mlp", share_inputs=True) == 2 * 2 * (
        256 + 1024 + 1024 + 1024 + 256)
    # exclude counts too
    assert preset_factor_bytes(llama, "mlp", exclude=["down"]) == 2 * 2 * (256 + 1024) * 2


def _vocab64_examples(n, seq_len, seed=0):
    ex = text_examples(n, seq_len, seed=seed)
    for e in ex:
        e["input_ids"] = e["input_ids"] % 64
        e["labels"] = torch.where(e["labels"] >= 0, e["labels"] % 64, e["labels"])
    return ex


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_last_layer_end_to_end_with_a_diagonal_vocabulary_G(fisher, tmp_path):
    """A real Trainer run with ``preset="last_layer"`` on a tiny GPT-2 whose vocabulary (64)
    exceeds ``max_dense_dim`` (32): only ``lm_head`` (tied to ``wte``) is tracked, its G is
    kept diagonal and its A dense (with the empirical Fisher both equal to the brute-force
    factors), and the Laplace predictive of the snapshot is finite."""
    model = tiny_gpt2(vocab_size=64)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied embeddings
    ex = _vocab64_examples(8, 12)
    cfg = {"preset": "last_layer", "max_dense_dim": 32, "fisher": fisher}
    if fisher == "mc":  # the package's defaults: FP16 storage, 5% of tokens, a sub-batch
        cfg.update(storage_dtype="float16", token_fraction=0.5, mc_sequences=0.5)
    cb, records, _ = run(model, ex, cfg, batch=2, loss=sum_nll_loss, tmp_path=tmp_path)
    assert list(cb.tracker.specs) == ["lm_head"]
    assert cb.tracker.dims == {"lm_head.A": (16, False), "lm_head.G": (64, True)}
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.layer_names == ["lm_head"] and snap.manifest.config["preset"] == "last_layer"
    A, G = snap["lm_head"].A, snap["lm_head"].G
    assert A.shape == (16, 16) and G.shape == (64,)  # A dense, G diagonal (1-D)
    assert (G >= 0).all() and G.sum() > 0
    if fisher == "empirical":
        ref, _ = reference_factors(model, records, ["lm_head"])
        assert rel_err(A, ref["lm_head"][0]) <= 1e-10
        assert rel_err(G, torch.diagonal(ref["lm_head"][1])) <= 1e-10

    post = LaplacePosterior(model, snap, 1.0)
    batch = {k: torch.stack([e[k] for e in _vocab64_examples(2, 10, seed=7)])
             for k in ("input_ids", "attention_mask")}
    mean, cov = post.predictive(batch, positions=-1, token_ids=[5, 40])
    assert mean.shape == (2, 2) and cov.shape == (2, 2, 2)
    assert torch.isfinite(mean).all() and torch.isfinite(cov).all()
    assert all(cov[b, k, k] > 0 for b in range(2) for k in range(2))
    assert math.isfinite(post.log_marginal_likelihood())


def test_hydra_override_sets_the_preset():
    from hydra import compose, initialize_config_dir

    from kfac_stream.app.main import CONF_DIR
    from kfac_stream.app.schema import kfac_config, register

    register()
    conf_dir = pathlib.Path(CONF_DIR)
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        conf = compose("config", overrides=["kfac.preset=last_layer"]).kfac
    assert kfac_config(conf).preset == "last_layer"


def test_model_dependent_preset_error_fails_before_the_first_step(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from kfac_stream import KFACStreamCallback

    from models import ListDataset

    steps = []

    class Count(TrainerCallback):
        def on_step_begin(self, *a, **k):
            steps.append(1)

    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=tiny_gpt2(torch.float32), args=args,
                      train_dataset=ListDataset(text_examples(4, 8)),
                      callbacks=[KFACStreamCallback(KFACConfig(preset="lora")), Count()])
    with pytest.raises(KFACConfigError, match="GPT2LMHeadModel has no lora_A/lora_B"):
        trainer.train()
    assert steps == []
