r"""How close the expand and the reduce K-FAC forms come to the exact GGN of a classifier's
layers: dense float64 matrices on tiny trained models, no sampling.

For each tracked Linear of a small BERT-style encoder classifier (pooled head) and a GPT-2
classifier (last-token head), at weights trained on real text, over ``--n`` sequences:

* the exact GGN block ``Σ_n Σ_c p_nc vec(∇W_n(c)) vec(∇W_n(c))ᵀ``, with
  ``∇W_n(c) = Σ_t g_nt(c) ā_ntᵀ`` the sequence's weight gradient for class ``c``;
* the expand form ``N_tok · G_e ⊗ A_e`` (means over token positions, ``N_tok`` positions);
* the reduce form ``N_seq · G_r ⊗ A_r`` (``ā_n`` the mean input, ``ĝ_n(c) = Σ_t g_nt(c)``,
  means over sequences);

both with the class expectation taken exactly (what ``fisher="mc"`` estimates). Printed: the
relative Frobenius error of each form per layer, and the median and worst over a model's
layers. A head on ``[B, d]`` (BERT's pooler and classifier) has one row per sequence under
either form, so both equal its exact block; it is listed once.

Usage: ``python benchmarks/probes/factor_forms.py [--n 48] [--steps 150]``; writes
``benchmarks/results/factor_forms.json`` and its RESULTS.md section.
"""

from __future__ import annotations

import argparse
import inspect
import json as jsonlib
import random
import statistics
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import machine, write_json, write_section  # noqa: E402

BEGIN, END = "<!-- factor-forms:begin -->", "<!-- factor-forms:end -->"
SEQ, CLASSES = 24, 3


def windows(seed: int, n_per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte windows of three kinds of text: prose (pydoc), Python source, JSON."""
    rng = random.Random(seed)
    sources = ["\n".join(topics.values()), inspect.getsource(jsonlib.decoder)
               + inspect.getsource(random), jsonlib.dumps(dict(list(topics.items())[:40]),
                                                         indent=1)]
    ids, labels = [], []
    for c, text in enumerate(sources):
        data = text.encode("utf-8")
        for _ in range(n_per_class):
            s = rng.randrange(len(data) - SEQ)
            ids.append(torch.tensor(list(data[s:s + SEQ - 1])))
            labels.append(c)
    x = torch.stack(ids) + 1  # 0: the [CLS]-like id
    x = torch.cat([torch.zeros(len(x), 1, dtype=torch.long), x], 1)
    return x, torch.tensor(labels)


def build(kind: str) -> nn.Module:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
    )

    torch.manual_seed(0)
    if kind == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=258, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=SEQ, num_labels=CLASSES,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    return GPT2ForSequenceClassification(GPT2Config(
        vocab_size=258, n_embd=16, n_layer=2, n_head=2, n_positions=SEQ, num_labels=CLASSES,
        pad_token_id=257, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).double()


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (16,), generator=gen)
        loss = model(input_ids=x[idx], labels=y[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def linears(model: nn.Module) -> dict[str, nn.Module]:
    from transformers.pytorch_utils import Conv1D

    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}


def forms(model: nn.Module, x: torch.Tensor) -> list[dict]:
    """Per layer: the relative Frobenius errors of the expand and reduce forms vs the GGN."""
    mods = linears(model)
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        def hook(module, args, out):
            seen[name] = [args[0], out]
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in mods.items()]
    try:
        logits = model(input_ids=x).logits  # [B, C]
    finally:
        for h in handles:
            h.remove()
    p = logits.softmax(-1).detach()  # [B, C]
    names = list(mods)
    grads = []  # per class: {name: [B, ..., d_out]}
    for c in range(CLASSES):
        loss = F.cross_entropy(logits, torch.full((len(x),), c), reduction="sum")
        gs = torch.autograd.grad(loss, [seen[n][1] for n in names], retain_graph=True)
        grads.append(dict(zip(names, gs)))
    rows = []
    for n in names:
        a = seen[n][0].detach()
        a = torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype)], -1)
        per_seq = a.dim() == 2  # [B, d]: a head on one row per sequence
        a3 = a[:, None] if per_seq else a  # [B, T, dA]
        B, T = a3.shape[:2]
        d_a, d_g = a3.shape[-1], grads[0][n].shape[-1]
        if d_a * d_g > 3000:
            continue
        ggn = torch.zeros(d_a * d_g, d_a * d_g, dtype=torch.float64)
        g_e = torch.zeros(d_g, d_g, dtype=torch.float64)
        g_r = torch.zeros(d_g, d_g, dtype=torch.float64)
        for c in range(CLASSES):
            g3 = grads[c][n].detach()
            g3 = g3[:, None] if per_seq else g3  # [B, T, dG]
            w = p[:, c]
            vec = torch.einsum("bti,btj->bij", g3, a3).reshape(B, -1)  # row-major vec(∇W)
            ggn += torch.einsum("b,bi,bj->ij", w, vec, vec)
            g_e += torch.einsum("b,bti,btj->ij", w, g3, g3)
            gs = g3.sum(1)
            g_r += torch.einsum("b,bi,bj->ij", w, gs, gs)
        n_tok = B * T
        a_e = torch.einsum("bti,btj->ij", a3, a3) / n_tok
        expand = n_tok * torch.kron(g_e / n_tok, a_e)
        am = a3.mean(1)
        reduce = B * torch.kron(g_r / B, am.T @ am / B)
        norm = float(ggn.norm())
        rows.append({"layer": n, "rows": "sequence" if per_seq else "position",
                     "expand": float((expand - ggn).norm()) / norm,
                     "reduce": float((reduce - ggn).norm()) / norm})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=48, help="sequences the blocks are computed over")
    p.add_argument("--steps", type=int, default=150, help="training steps before")
    p.add_argument("--quick", action="store_true", help="tiny sizes, writes nothing")
    a = p.parse_args()
    if a.quick:
        a.n, a.steps = 6, 5
    t0 = time.perf_counter()
    torch.set_num_threads(2)
    x, y = windows(0, 64)
    xq, _ = windows(1, a.n // CLASSES + 1)
    xq = xq[torch.randperm(len(xq), generator=torch.Generator().manual_seed(0))[:a.n]]
    result = {}
    lines = [BEGIN, "## Factor forms against the exact GGN", "",
             f"`python benchmarks/probes/factor_forms.py --n {a.n} --steps {a.steps}`: relative "
             "Frobenius error of each form's Kronecker block against the exact GGN block of the "
             f"same layer, float64, over {a.n} held-out sequences of {SEQ} tokens, after "
             f"{a.steps} AdamW steps on prose / Python / JSON windows (3 classes). Exact class "
             "expectations, no sampling.", "",
             "| model | layers (position rows) | expand: median | expand: worst | "
             "reduce: median | reduce: worst | reduce better on |", "| --- | --- | --- | --- | "
             "--- | --- | --- |"]
    for kind in ("bert", "gpt2"):
        model = build(kind)
        train(model, x, y, a.steps)
        rows = forms(model, xq)
        result[kind] = rows
        pos = [r for r in rows if r["rows"] == "position"]
        for r in rows:
            print(f"{kind:5s} {r['layer']:45s} {r['rows']:8s} expand {r['expand']:.3f} "
                  f"reduce {r['reduce']:.3f}", flush=True)
        e, rd = [r["expand"] for r in pos], [r["reduce"] for r in pos]
        better = sum(r["reduce"] < r["expand"] for r in pos)
        lines.append(f"| {kind} | {len(pos)} | {statistics.median(e):.3f} | {max(e):.3f} | "
                     f"{statistics.median(rd):.3f} | {max(rd):.3f} | {better} of {len(pos)} |")
        heads = [r for r in rows if r["rows"] == "sequence"]
        if heads:
            lines.append(f"| {kind} heads on [B, d] | {len(heads)} (sequence rows) | "
                         f"{max(r['expand'] for r in heads):.2g} (= reduce) | | | | |")
    lines += ["", f"Total {time.perf_counter() - t0:.0f} s. Per layer: "
              "`benchmarks/results/factor_forms.json`.", END]
    section = "\n".join(lines)
    print(section)
    if a.quick:
        return
    write_json("factor_forms", {"machine": machine(), "args": vars(a), "layers": result})
    write_section(BEGIN, END, section)


if __name__ == "__main__":
    main()
