"""The exact-curvature helpers (benchmarks/exact_curvature.py, influence_peers.py's part 2):
the GGN from ``d`` rows per position at the LM head's input equals the direct ``V``-row form,
the hooks' per-example gradients equal autograd's, and the dense solve gives the damped
inverse's inner products."""

import sys

import torch

from kfac_stream.app.models import tiny_gpt2

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import exact_curvature as ec  # noqa: E402
import influence_peers as ip  # noqa: E402

LAYERS = ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj"]


def micro():
    model = tiny_gpt2(vocab_size=32, n_layer=1, n_embd=8, n_head=2, seq_len=6, seed=3)
    x = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(0))
    return model.double().eval(), ip.examples(x)


def test_exact_ggn_equals_the_direct_vocabulary_rows():
    model, exs = micro()
    assert ec.ggn_direct_check(model, LAYERS, exs[0]) < 1e-12
    ggn = ec.exact_ggn(model, LAYERS, exs, chunk=2)
    one = [ec.exact_ggn(model, LAYERS, [e], chunk=1) for e in exs]
    for n in LAYERS:
        assert ec.rel(ggn[n], sum(o[n] for o in one)) < 1e-12  # chunks add up
        assert torch.linalg.eigvalsh(ggn[n]).min() > -1e-10 * ggn[n].diagonal().max()


def test_per_example_gradients_and_the_dense_solve():
    model, exs = micro()
    assert ec.check_per_example_grad(model, LAYERS, exs[1]) < 1e-12
    g = ec.per_example_grads(model, LAYERS, ip.batches(exs, 2))
    curv = {n: g[n].T @ g[n] for n in LAYERS}
    damp = dict.fromkeys(LAYERS, 0.3)
    got = ec.exact_scores(curv, damp, {n: g[n][:1] for n in LAYERS}, g)
    want = sum(g[n][:1] @ torch.linalg.solve(curv[n] + 0.3 * torch.eye(len(curv[n]),
                                                                        dtype=torch.float64),
                                              g[n].T) for n in LAYERS)
    assert ec.rel(got, want) < 1e-10
