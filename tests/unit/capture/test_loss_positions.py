"""Rows only where the loss's gradient can be: an encoder-decoder's decoder positions are a
stream of their own (any decoder length), usable at or before each target's last labelled
position; a causal LM's rows stop at each sequence's last scored logit row.

The references are float64 brute force on a private copy of the model: per-position layer
inputs and output gradients of the summed NLL, the positions chosen by hand (a loop over
each row's labels), A = mean ā āᵀ and G = mean g gᵀ over them.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from harness import run
from models import tiny_seq2seq
from reference import float64_copy, rel_err

VOCAB, SRC = 24, 8
# a float64 model, float64 factors (storage_dtype="float64") against float64 references: only
# summation-order round-off, and the loss scale fitted from the logits' gradient
# (`stats.loss_scale`, exact to round-off here)
EXACT_TOL = 1e-10


def _model(family: str):
    """A tiny float64 encoder-decoder of ``family`` (``"t5"`` or ``"bart"``)."""
    return tiny_seq2seq(family, VOCAB, d_model=16).to(torch.float64)


def _examples(tgt: int) -> list[dict[str, torch.Tensor]]:
    """Four pairs: inputs of 8 tokens (the last 3 padding in two of them), targets of 1-3
    labels padded with -100 to ``tgt`` positions (one with an ignored label in the middle)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (src_len, lab_len) in enumerate([(8, 3), (5, 1), (8, 2), (5, 3)]):
        ids = torch.randint(3, VOCAB, (SRC,), generator=g)
        mask = (torch.arange(SRC) < src_len).long()
        labels = torch.full((tgt,), -100)
        labels[:lab_len] = torch.randint(3, VOCAB, (lab_len,), generator=g)
        if i == 3:
            labels[1] = -100  # an ignored label before the last one: its position is kept
        out.append({"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask,
                    "labels": labels})
    return out


def _decoder_positions(labels: torch.Tensor) -> torch.Tensor:
    """[B, T_dec] bool, by hand: positions up to each row's last labelled one."""
    keep = torch.zeros(labels.shape, dtype=torch.bool)
    for b in range(labels.shape[0]):
        labelled = [t for t in range(labels.shape[1]) if int(labels[b, t]) != -100]
        if labelled:
            keep[b, : max(labelled) + 1] = True
    return keep


def _brute_force(model, records, names):
    """``({name: (A, G)}, {name: rows})`` of the records' passes (float64), each layer over
    its own positions: encoder positions (``attention_mask``) for a layer that reads the
    encoder's output (a cross-attention key or value: ``[B, T_enc, d]`` input taken from the
    encoder), else the decoder positions that can carry a gradient."""
    m = float64_copy(model)
    modules = dict(m.named_modules())
    sums = {n: [0.0, 0.0, 0] for n in names}
    for rec in records:
        m.load_state_dict(rec["state"])
        kw = rec["kwargs"]
        seen, enc = {}, {}

        def keep_layer(mod, args, out, name, seen=seen):  # None: the module's output stays
            seen[name] = (args[0].detach(), out)

        def keep_encoder(mod, args, out, enc=enc):
            enc["out"] = out[0]

        hooks = [modules[n].register_forward_hook(
            lambda mod, a, o, n=n: keep_layer(mod, a, o, n)) for n in names]
        hooks.append(m.get_encoder().register_forward_hook(keep_encoder))
        try:
            with torch.enable_grad():
                out = m(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"],
                        labels=kw["labels"])
        finally:
            for h in hooks:
                h.remove()
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).double(), kw["labels"].reshape(-1),
                               ignore_index=-100, reduction="sum")
        grads = torch.autograd.grad(loss, [seen[n][1] for n in names])
        for n, g in zip(names, grads):
            a = seen[n][0]
            reads_encoder = a.shape == enc["out"].shape and torch.equal(a, enc["out"].detach())
            keep = kw["attention_mask"].bool() if reads_encoder else \
                _decoder_positions(kw["labels"])
            a = a[keep].double()
            if getattr(modules[n], "bias", None) is not None:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            g = g[keep].double()
            s = sums[n]
            s[0], s[1], s[2] = s[0] + a.T @ a, s[1] + g.T @ g, s[2] + a.shape[0]
    return {n: (s[0] / s[2], s[1] / s[2]) for n, s in sums.items()}, \
        {n: s[2] for n, s in sums.items()}


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("tgt", [SRC, 4])  # labels padded to the input's length, or shorter
def test_decoder_factors_take_loss_positions_only(tmp_path, family, tgt):
    model = _model(family)
    cb, records, _ = run(model, _examples(tgt), batch=2, epochs=1, lr=0.0, tmp_path=tmp_path)
    names = list(cb.tracker.specs)
    ref, rows = _brute_force(model, records, names)
    got = cb.factors()
    for n in names:
        assert rel_err(got[n][0], ref[n][0]) <= EXACT_TOL, n
        assert rel_err(got[n][1], ref[n][1]) <= EXACT_TOL, n
    # N: the decoder positions that can carry a gradient (by hand: 3+1+2+3), the encoder's
    # real tokens (8+5+8+5) for the cross-attention keys and values
    snap = sorted(p for p in (tmp_path / "kfac").glob("step-*") if p.is_dir())[-1]
    meta = json.loads((snap / "manifest.json").read_text())
    assert meta["counts"]["target_tokens_seen"] == 9
    assert meta["counts"]["tokens_seen"] == 26
    cross = [n for n in names if rows[n] == 26]
    assert cross and all(meta["layers"][n].get("rows") is None for n in cross), cross
    own = [n for n in names if n not in cross]
    assert own and all(meta["layers"][n]["rows"] == "target" for n in own)
    assert all(rows[n] == 9 for n in own)


def test_mc_replay_takes_the_same_positions(tmp_path):
    """The MC replay (a forward without labels) still knows which decoder positions carry
    the loss: its A factors are the brute force's over the same positions, exactly."""
    model = _model("t5")
    cb, records, _ = run(model, _examples(4), {"fisher": "mc", "mc_sequences": "all"},
                         batch=2, epochs=1, lr=0.0, tmp_path=tmp_path)
    names = list(cb.tracker.specs)
    ref, _ = _brute_force(model, records, names)
    got = cb.factors()
    for n in names:
        assert rel_err(got[n][0], ref[n][0]) <= EXACT_TOL, n


def test_causal_lm_rows_stop_at_the_last_scored_position(tmp_path):
    """A causal LM's last real token (it scores nothing) and the positions after an
    answer are not rows, and not in ``N``: a prompt with ignored labels is."""
    from models import tiny_gpt2

    model = tiny_gpt2()
    ex = []
    for i in range(4):
        ids = (torch.arange(10) * (i + 3)) % 50 + 3
        labels = ids.clone()
        labels[:4] = -100  # a prompt: no loss, but its positions reach the answer's
        labels[7:] = -100  # after the answer: no gradient at all
        ex.append({"input_ids": ids, "attention_mask": torch.ones(10, dtype=torch.long),
                   "labels": labels})
    cb, _, _ = run(model, ex, batch=2, epochs=1, lr=0.0, tmp_path=tmp_path)
    snap = sorted(p for p in (tmp_path / "kfac").glob("step-*") if p.is_dir())[-1]
    meta = json.loads((snap / "manifest.json").read_text())
    # logit rows 3..5 score labels 4..6: positions 0..5 of each sequence, by hand
    assert meta["counts"]["tokens_seen"] == 4 * 6
