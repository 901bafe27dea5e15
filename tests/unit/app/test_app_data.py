"""The training app's data and model helpers: tokenizer, offline sources, examples, hub paths.

The hub code paths (``load_hf_documents``, ``load_hf_model``) run on local files written here,
with the ``datasets`` cache inside the test's tmp_path; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch

from kfac_stream.app.data import (
    ByteTokenizer,
    encode_documents,
    lm_examples,
    load_hf_documents,
    ood_documents,
    pydoc_documents,
    split_documents,
)
from kfac_stream.app.models import load_hf_model, tiny_gpt2

from models import save_bpe_tokenizer


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """Point the ``datasets`` cache into tmp_path for this test."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    return tmp_path / "hf_datasets"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Größe: 3 µm — naïve café ✓ 日本"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and len(ids) > len(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character decodes, replaced
    assert (tok.vocab_size, tok.pad_token_id) == (256, 0)


def test_lm_examples_are_exact_consecutive_windows():
    tok = ByteTokenizer()
    docs = pydoc_documents()[:3]
    ids = encode_documents(docs, tok)
    assert ids == tok.encode("\n\n".join(docs))
    seq_len = 64
    ex = lm_examples(ids, seq_len)
    assert len(ex) == len(ids) // seq_len and len(ids) % seq_len != 0  # the tail is dropped
    for i, e in enumerate(ex):
        assert set(e) == {"input_ids", "attention_mask", "labels"}
        for v in e.values():
            assert v.shape == (seq_len,) and v.dtype == torch.long
        assert e["input_ids"].tolist() == ids[i * seq_len:(i + 1) * seq_len]
        assert torch.equal(e["labels"], e["input_ids"])
        assert e["attention_mask"].eq(1).all()
    flat = torch.cat([e["input_ids"] for e in ex]).tolist()
    assert flat == ids[:len(ex) * seq_len]
    assert len(lm_examples(torch.tensor(ids), seq_len, max_examples=5)) == 5
    assert torch.equal(lm_examples(torch.tensor(ids), seq_len, max_examples=5)[4]["input_ids"],
                       ex[4]["input_ids"])
    assert lm_examples(ids[:seq_len - 1], seq_len) == []


def test_split_documents():
    docs = pydoc_documents()
    train, held = split_documents(docs, 0.2, seed=3)
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(docs)
    assert len(held) == round(0.2 * len(docs))
    assert split_documents(docs, 0.2, seed=3) == (train, held)
    assert split_documents(docs, 0.2, seed=4)[1] != held
    assert train == [d for d in docs if d in set(train)]  # input order kept
    assert split_documents(docs, 0.0) == (docs, [])
    # duplicates of a held-out text stay out of train
    dup = ["a", "b", "a", "c", "d", "a", "e", "f", "g", "h"]
    for seed in range(10):
        tr, he = split_documents(dup, 0.3, seed=seed)
        assert not set(tr) & set(he) and sorted(tr + he) == sorted(dup)
    with pytest.raises(ValueError):
        split_documents(docs, 1.0)


def test_offline_sources():
    docs = pydoc_documents()
    assert len(docs) >= 50 and all(isinstance(d, str) and d for d in docs)
    assert sum(map(len, docs)) > 200_000
    from pydoc_data.topics import topics
    assert docs[0] == topics[min(topics)]

    ood = ood_documents(max_chars=50_000)
    assert len(ood) >= 20 and sum(map(len, ood)) == 50_000  # every module has its share
    assert all(ood) and "def " in "".join(ood) and "import " in "".join(ood)
    assert ood == ood_documents(max_chars=50_000)
    pydoc_text = "\n\n".join(docs)
    assert not set(ood) & set(docs)
    assert not any(d[:200] in pydoc_text for d in ood)
    assert sum(map(len, ood_documents(max_chars=10**9))) > 200_000


def test_load_hf_documents_from_local_text_and_json(tmp_path, datasets_cache):
    lines = ["first line", "", "second line — ünïcode", "   ", "third"]
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_hf_documents("text", data_files=str(txt)) == ["first line",
                                                                "second line — ünïcode", "third"]
    assert load_hf_documents("text", data_files=str(txt), max_documents=2) == [
        "first line", "second line — ünïcode"]

    records = [{"content": "def f():\n    return 1\n", "id": 0}, {"content": "", "id": 1},
               {"content": "x = [1, 2]", "id": 2}]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert load_hf_documents("json", data_files=str(jsonl), text_field="content") == [
        "def f():\n    return 1\n", "x = [1, 2]"]
    assert any(datasets_cache.iterdir())  # the builders cached under tmp_path


def test_tiny_gpt2_is_deterministic_and_keeps_global_rng():
    state = torch.random.get_rng_state()
    a = tiny_gpt2(n_layer=1, n_embd=32, n_head=2, seq_len=32, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = tiny_gpt2(n_layer=1, n_embd=32, n_head=2, seq_len=32, seed=1)
    c = tiny_gpt2(n_layer=1, n_embd=32, n_head=2, seq_len=32, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["transformer.h.0.attn.c_attn.weight"],
                           sc["transformer.h.0.attn.c_attn.weight"])
    assert a.training and all(p.dtype == torch.float32 for p in a.parameters())
    cfg = a.config
    assert (cfg.vocab_size, cfg.n_positions, cfg.bos_token_id, cfg.eos_token_id) == (256, 32, 0, 0)
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.0
    x = torch.randint(0, 256, (2, 32))
    assert a(input_ids=x).logits.shape == (2, 32, 256)


def test_load_hf_model_from_local_directory(tmp_path, caplog):
    docs = pydoc_documents()
    saved_tok = save_bpe_tokenizer(tmp_path / "ckpt", docs[:20])
    saved = tiny_gpt2(vocab_size=len(saved_tok), n_layer=1, n_embd=32, n_head=2, seq_len=32)
    saved.save_pretrained(tmp_path / "ckpt")

    model, tok = load_hf_model(str(tmp_path / "ckpt"))
    ref, got = saved.state_dict(), model.state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"  # none saved: pad = eos

    text = docs[30]
    ids = encode_documents([text, docs[31]], tok)
    assert ids[:len(tok(text, add_special_tokens=False)["input_ids"])] == tok(
        text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids).startswith(text[:200])
    assert len(ids) < len((text + docs[31]).encode("utf-8"))  # BPE merges bytes
    assert max(ids) < len(tok)
    # documents longer than model_max_length encode whole, without the tokenizer's warning
    tok.model_max_length = 16
    caplog.clear()
    assert encode_documents([text, docs[31]], tok) == ids
    assert "longer than" not in caplog.text
    tok(text, add_special_tokens=False)
    assert "longer than" in caplog.text  # (the warning the helper avoids)

    ex = lm_examples(ids, 32, max_examples=4)
    batch = {k: torch.stack([e[k] for e in ex]) for k in ex[0]}
    assert batch["input_ids"].shape == (4, 32)
    with torch.no_grad():
        out = model(**batch)
        ref_out = saved.eval()(**batch)
    assert out.logits.shape == (4, 32, len(tok))
    assert torch.isfinite(out.loss) and torch.equal(out.logits, ref_out.logits)

    model16, _ = load_hf_model(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    with pytest.raises(ValueError):
        load_hf_model(str(tmp_path / "ckpt"), dtype="float33")


def test_license_documents_reads_files_in_order_within_budget(tmp_path):
    from kfac_stream.app.data import license_documents

    (tmp_path / "B").write_text("b" * 50)
    (tmp_path / "A").write_text("a" * 10)
    assert license_documents(str(tmp_path), max_chars=40) == ["a" * 10, "b" * 30]
    assert license_documents(str(tmp_path / "absent")) == []
