"""Any Hugging Face model a user brings: 15 families with the defaults; and
10 sequence classifiers, 7 encoders with a pooled head and 3 decoders with a
``score`` head, under ``preset="last_layer"`` and ``preset="all_linear"``.

Each family is a tiny model built from its config (hidden 32, 2 layers, byte vocabulary 256,
random init, no hub), trained for 12 steps by a real ``Trainer`` (``Seq2SeqTrainer`` for T5)
with ``KFACStreamCallback()`` and its defaults (MC sub-batch Fisher, ``token_fraction=0.05``,
``share_inputs=True``, ...), then queried as a new user would: ``Snapshot.latest``,
``LaplacePosterior(prior_precision="marglik")`` (the marginal likelihood), the exact
linearised ``predictive`` and ``sampled_predictive``. Every step must work; a query a model's
layout cannot support must refuse with one clear error (`REFUSED` lists those, with the
error), never crash with a shape error deep inside.

What the numbers must satisfy (independent of the code under test): the snapshot covers every
layer the callback tracked, at step 12, with finite positive factors; the chosen prior
precision is the maximiser of the marginal likelihood over a grid (`MARGLIK_GRID_TOL`); the
predictive mean equals the model's own logits (`MEAN_TOL`) and the covariance is symmetric
positive semi-definite; the sampled predictive's probabilities sum to 1 (`PROB_SUM_TOL`).
"""

from __future__ import annotations

import math

import pytest
import torch

from kfac_stream import Influence, KFACStreamCallback, LaplacePosterior, Snapshot
from kfac_stream.exceptions import QueryInputError
from kfac_stream.query.sampled import sampled_predictive

from models import ListDataset, text_examples

STEPS = 12
SEQ = 16
HIDDEN, FFN, HEADS, VOCAB = 32, 64, 4, 256
#: The predictive mean is the MAP logits: float32 model, same forward twice (eval mode).
MEAN_TOL = 1e-5
#: Symmetry and positive semi-definiteness of the predictive covariance, relative to its
#: largest entry: the Jacobian features of a float32 model are float32 (~6e-8 relative per
#: entry), summed over the layers' d_out·d_in products.
COV_TOL = 1e-5
#: A probability vector from float64 sums of float32 softmax rows.
PROB_SUM_TOL = 1e-6
#: `optimize_prior_precision` stops on a bracket of relative width ~1e-3 in log tau (Brent on
#: log tau); the grid's best value may exceed its optimum only by this relative amount.
MARGLIK_GRID_TOL = 1e-6

#: Influence at a damping λ far above the factors' eigenvalues: ``λ · I(x, x)`` is the squared
#: norm of the example's gradient over the tracked layers, ``Σ_l ‖∇_l L(x)‖²``, to relative
#: ``O(‖F‖/λ)`` (nil at 1e12), plus the float32 round-off of the two gradients' sums of squares.
GRAD_DOT_DAMPING = 1e12
GRAD_DOT_TOL = 1e-4

#: Queries a family's layout cannot support, refused with this error (none so far).
REFUSED: dict[str, str] = {}
#: Families whose forward has an operation without a forward-mode derivative (BLOOM's GELU is
#: a custom autograd.Function without jvp): the linearised predictive asked for by name is one
#: clear error; the default falls back to the weight samples' predictive with a warning.
NO_FORWARD_AD = ("bloom",)


def _causal(cls_name: str, cfg_name: str, **kw):
    def build():
        import transformers

        cfg = getattr(transformers, cfg_name)(**kw)
        return getattr(transformers, cls_name)(cfg)
    return build


_DROP0 = {}
FAMILIES = {
    "opt": _causal("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                   num_hidden_layers=2, ffn_dim=FFN, num_attention_heads=HEADS,
                   max_position_embeddings=64, word_embed_proj_dim=HIDDEN, pad_token_id=1,
                   bos_token_id=0, eos_token_id=0),
    "biogpt": _causal("BioGptForCausalLM", "BioGptConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                      num_hidden_layers=2, intermediate_size=FFN, num_attention_heads=HEADS,
                      max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                      eos_token_id=2),
    "bloom": _causal("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                     n_layer=2, n_head=HEADS, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "falcon": _causal("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB,
                      hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                      pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gptj": _causal("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_embd=HIDDEN,
                    n_layer=2, n_head=HEADS, n_positions=64, rotary_dim=4, pad_token_id=0,
                    bos_token_id=0, eos_token_id=0),
    "gpt_neox": _causal("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=VOCAB,
                        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0),
    "gemma": _causal("GemmaForCausalLM", "GemmaConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                     num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                     head_dim=8, intermediate_size=FFN, max_position_embeddings=64,
                     pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "phi": _causal("PhiForCausalLM", "PhiConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                   num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
                   max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                   eos_token_id=0),
    "mistral": _causal("MistralForCausalLM", "MistralConfig", vocab_size=VOCAB,
                       hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                       num_key_value_heads=2, intermediate_size=FFN,
                       max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                       eos_token_id=0),
    "qwen2": _causal("Qwen2ForCausalLM", "Qwen2Config", vocab_size=VOCAB, hidden_size=HIDDEN,
                     num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                     intermediate_size=FFN, max_position_embeddings=64, pad_token_id=0,
                     bos_token_id=0, eos_token_id=0),
    "olmo": _causal("OlmoForCausalLM", "OlmoConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                    num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
                    max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                    eos_token_id=0),
    "gpt2": _causal("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2,
                    n_head=HEADS, n_positions=64, bos_token_id=0, eos_token_id=0),
    "llama": _causal("LlamaForCausalLM", "LlamaConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                     num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                     intermediate_size=FFN, max_position_embeddings=64, pad_token_id=0,
                     bos_token_id=0, eos_token_id=0),
    "roberta_cls": _causal("RobertaForSequenceClassification", "RobertaConfig",
                           vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                           num_attention_heads=HEADS, intermediate_size=FFN,
                           max_position_embeddings=SEQ + 4, num_labels=3, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2),
    "t5_seq2seq": _causal("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB,
                          d_model=HIDDEN, d_kv=8, d_ff=FFN, num_layers=2, num_heads=HEADS,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
}
CAUSAL = [f for f in FAMILIES if f not in ("roberta_cls", "t5_seq2seq")]


def _examples(family: str) -> list[dict[str, torch.Tensor]]:
    ex = text_examples(2 * STEPS, SEQ, seed=3)
    if family == "roberta_cls":
        for i, e in enumerate(ex):
            e["input_ids"] = e["input_ids"].clamp(min=3)  # 0-2: special ids
            e["labels"] = torch.tensor(i % 3)
    elif family == "t5_seq2seq":  # translate a window into the next one (bytes shifted by 1)
        for e in ex:
            e["labels"] = (e["input_ids"] + 1) % VOCAB
            e["labels"][e["labels"] < 2] = 2
    return ex


def _train(family: str, tmp_path):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FAMILIES[family]()
    seq2seq = family == "t5_seq2seq"
    args_cls, trainer_cls = ((Seq2SeqTrainingArguments, Seq2SeqTrainer) if seq2seq
                             else (TrainingArguments, Trainer))
    args = args_cls(str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS,
                    learning_rate=1e-3, report_to=[], logging_strategy="no",
                    save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    cb = KFACStreamCallback()  # the defaults
    trainer = trainer_cls(model=model, args=args, train_dataset=ListDataset(_examples(family)),
                          callbacks=[cb])
    trainer.train()
    return model.eval(), cb


def _query_batch(family: str) -> dict[str, torch.Tensor]:
    ex = _examples(family)[:2]
    batch = {k: torch.stack([e[k] for e in ex]) for k in ("input_ids", "attention_mask")}
    if family == "t5_seq2seq":
        batch["decoder_input_ids"] = torch.stack([e["labels"][:8] for e in ex])
    return batch


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_snapshots_and_answers_queries(family, tmp_path):
    model, cb = _train(family, tmp_path)
    tracked = list(cb.tracker.specs)
    snap = Snapshot.latest(tmp_path / "kfac")
    assert snap.step == STEPS and sorted(snap.layer_names) == sorted(tracked)
    assert len(tracked) >= 8
    for n in tracked:
        a, g = snap[n].A, snap[n].G
        assert torch.isfinite(a).all() and torch.isfinite(g).all(), n
        assert float(a.diagonal().sum() if a.dim() == 2 else a.sum()) > 0, n
    post = LaplacePosterior(model, snap, prior_precision="marglik")
    tau = post.prior_precision
    grid = [tau * 2.0 ** e for e in (-2, -1, 1, 2)]  # the chosen tau beats its neighbours
    best = post.log_marginal_likelihood(tau)
    for t in grid:
        assert post.log_marginal_likelihood(t) <= best + MARGLIK_GRID_TOL * abs(best), (t, tau)
    batch = _query_batch(family)
    token_ids = None if family == "roberta_cls" else [5, 32, 101]
    if family in REFUSED:
        with pytest.raises(Exception, match=REFUSED[family]):
            post.predictive(batch, positions=-1, token_ids=token_ids)
        return
    mean, cov = post.predictive(batch, positions=-1, token_ids=token_ids)
    with torch.no_grad():
        logits = model(**batch).logits.double()
    want = logits if logits.dim() == 2 else logits[:, -1]
    want = want if token_ids is None else want[:, token_ids]
    assert (mean - want).abs().max() <= MEAN_TOL * (1 + want.abs().max())
    assert torch.allclose(cov, cov.transpose(1, 2), rtol=0, atol=COV_TOL * cov.abs().max())
    assert torch.linalg.eigvalsh(cov).min() >= -COV_TOL * cov.abs().max()
    assert cov.diagonal(dim1=1, dim2=2).min() > 0
    if family in NO_FORWARD_AD:  # linearised by name: one clear error; by default: weights
        with pytest.raises(QueryInputError, match=r"^sampled_predictive: the linearised "
                           r"predictive .* needs forward-mode derivatives"):
            sampled_predictive(post, batch, n_samples=2, seed=0, linearized=True)
        with pytest.warns(UserWarning, match="posterior weight samples'"):
            pred = sampled_predictive(post, batch, n_samples=2, seed=0)
        assert not pred.linearized
    else:
        pred = sampled_predictive(post, batch, n_samples=2, seed=0)
        assert pred.linearized
    sums = pred.probs.sum(-1)
    assert (sums - 1).abs().max() <= PROB_SUM_TOL and math.isfinite(float(pred.entropy.sum()))
    _check_influence(post, _examples(family)[:5], seq2seq=family == "t5_seq2seq")


def _stack(examples) -> dict[str, torch.Tensor]:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def _summed_loss(model, batch, seq2seq: bool) -> torch.Tensor:
    """The example's loss as influence takes it, from the model's logits alone: the summed
    cross-entropy of its labels (a causal LM's shifted, a seq2seq LM's decoder labels as the
    model makes its decoder inputs from them, a classifier's one label)."""
    import torch.nn.functional as F

    kw = {k: v for k, v in batch.items() if k != "labels" or seq2seq}
    logits = model(**kw).logits
    labels = batch["labels"]
    if logits.dim() == 2:
        return F.cross_entropy(logits, labels, reduction="sum")
    if not seq2seq:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum")


def _check_influence(post, examples, seq2seq: bool = False) -> None:
    """Influence scores of 2 queries on 3 training examples: ``[Q, N]``, finite,
    not all zero, under the ``"prior"`` and the default ``"heuristic"`` damping (whose zero
    factors, e.g. an encoder classifier's last block under token sampling, take the prior's
    ``τ/N``); and the gradient-dot limit at a huge damping, against the squared norm of the
    parameters' gradients by autograd (independent of the hooks and of each layer's weight
    layout: a Frobenius norm is the same in any orientation; a module run several times per
    forward, ALBERT's shared layers, sums its calls)."""
    queries, train = _stack(examples[:2]), [_stack(examples[2:5])]
    for damping in ("prior", "heuristic"):
        got = Influence(post, damping).scores(queries, train)
        assert got.scores.shape == (2, 3) and torch.isfinite(got.scores).all(), damping
        assert got.scores.abs().max() > 0 and min(got.damping.values()) > 0, damping
    x = _stack(examples[:1])
    far = Influence(post, GRAD_DOT_DAMPING).scores(x, [x]).scores[0, 0] * GRAD_DOT_DAMPING
    params = [p for n in post.layer_names for p in (post.modules[n].weight,
                                                    getattr(post.modules[n], "bias", None))
              if p is not None]
    grads = torch.autograd.grad(_summed_loss(post.model, x, seq2seq), params)
    want = sum(float(g.double().square().sum()) for g in grads)
    assert abs(float(far) - want) <= GRAD_DOT_TOL * want, (float(far), want)


# -- sequence classifiers: heads on [B, d] are tracked in the sequence row space ---------------

_CLS = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
            intermediate_size=FFN, max_position_embeddings=SEQ + 4, num_labels=3)
CLASSIFIERS = {
    "bert": _causal("BertForSequenceClassification", "BertConfig", **_CLS, pad_token_id=0),
    "roberta": _causal("RobertaForSequenceClassification", "RobertaConfig", **_CLS,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2),
    "deberta_v2": _causal("DebertaV2ForSequenceClassification", "DebertaV2Config", **_CLS,
                          pad_token_id=0),
    "electra": _causal("ElectraForSequenceClassification", "ElectraConfig", **_CLS,
                       embedding_size=HIDDEN, pad_token_id=0),
    "distilbert": _causal("DistilBertForSequenceClassification", "DistilBertConfig",
                          vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=HEADS,
                          hidden_dim=FFN, max_position_embeddings=SEQ + 4, num_labels=3,
                          pad_token_id=0),
    "albert": _causal("AlbertForSequenceClassification", "AlbertConfig", **_CLS,
                      embedding_size=16, pad_token_id=0),
    "xlm_roberta": _causal("XLMRobertaForSequenceClassification", "XLMRobertaConfig", **_CLS,
                           pad_token_id=1, bos_token_id=0, eos_token_id=2),
    "gpt2": _causal("GPT2ForSequenceClassification", "GPT2Config", vocab_size=VOCAB,
                    n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=64, num_labels=3,
                    pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "llama": _causal("LlamaForSequenceClassification", "LlamaConfig", **_CLS,
                     num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "qwen2": _causal("Qwen2ForSequenceClassification", "Qwen2Config", **_CLS,
                     num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
}
#: decoders score every position and read the last one: their head sees [B, T, d]
DECODER_CLASSIFIERS = ("gpt2", "llama", "qwen2")


@pytest.mark.parametrize("preset", ["last_layer", "all_linear"])
@pytest.mark.parametrize("family", list(CLASSIFIERS))
def test_classifier_family_preset_trains_and_answers(family, preset, tmp_path):
    from transformers import Trainer, TrainingArguments

    from kfac_stream import KFACConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CLASSIFIERS[family]()
    ex = text_examples(2 * STEPS, SEQ, seed=3)
    ex[1]["attention_mask"][SEQ // 2:] = 0  # one padded sequence: padding is never a row
    for i, e in enumerate(ex):
        e["input_ids"] = e["input_ids"].clamp(min=3)  # 0-2: special ids
        e["labels"] = torch.tensor(i % 3)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS,
                             learning_rate=1e-3, report_to=[], logging_strategy="no",
                             save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    cb = KFACStreamCallback(KFACConfig(preset=preset))
    Trainer(model=model, args=args, train_dataset=ListDataset(ex), callbacks=[cb]).train()
    model.eval()
    snap = Snapshot.latest(tmp_path / "kfac")
    rows = {n: snap.manifest.layers[n].rows or "position" for n in snap.layer_names}
    if preset == "last_layer":  # the head: a [B, d] layer for an encoder's pooled head
        (head,) = rows
        assert head.rsplit(".", 1)[-1] in ("classifier", "out_proj", "score"), head
        assert rows[head] == ("position" if family in DECODER_CLASSIFIERS else "sequence")
    else:  # the blocks: one row per token position
        assert len(rows) >= 6 and set(rows.values()) == {"position"}
    counts = snap.manifest.counts  # 24 sequences of 16 tokens, one half padded, one epoch
    assert (counts.sequences_seen, counts.tokens_seen) == (24, 24 * SEQ - SEQ // 2)
    post = LaplacePosterior(model, snap, prior_precision="marglik")
    for n, space in rows.items():  # N: the sequences of a head on [B, d], else the tokens
        assert post.layer_num_data[n] == (24.0 if space == "sequence" else 24.0 * SEQ - SEQ // 2)
    batch = {k: torch.stack([e[k] for e in ex[:2]]) for k in ("input_ids", "attention_mask")}
    mean, cov = post.predictive(batch)
    with torch.no_grad():
        want = model(**batch).logits.double()
    assert (mean - want).abs().max() <= MEAN_TOL * (1 + want.abs().max())
    assert torch.allclose(cov, cov.transpose(1, 2), rtol=0, atol=COV_TOL * cov.abs().max())
    assert torch.linalg.eigvalsh(cov).min() >= -COV_TOL * cov.abs().max()
    assert cov.diagonal(dim1=1, dim2=2).min() > 0
    probs = post.predictive_probs(batch)
    assert (probs.sum(-1) - 1).abs().max() <= PROB_SUM_TOL
    _check_influence(post, ex[:5])
