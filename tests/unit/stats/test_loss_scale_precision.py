"""A float64 model with float64 storage: G is exact for a loss scale that float32 cannot hold.

The tracker recovers each pass's loss scale ``c`` (here the mean over 60 tokens, ``c = 1/60``)
and divides the output-gradient rows by it. The rows' weights were float32 and ``c`` a 0-dim
float64 tensor, whose quotient stays float32: G came out scaled by float32(1/60), 1.3e-7 off
(found by benchmarks/influence_peers.py against kronfluence). The reference: the same forward
without the tracker, the gradient of the SUM of token losses at the layer's output, ``gᵀg / n``.
"""

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from kfac_stream import KFACConfig
from kfac_stream.capture.selection import select_layers
from kfac_stream.tracking.tracker import Tracker

EXACT_TOL = 1e-12  # float64 throughout; 1.3e-7 before the fix


def test_g_is_exact_for_a_mean_loss_over_60_tokens():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                       n_positions=16, resid_pdrop=0, embd_pdrop=0,
                                       attn_pdrop=0)).double()
    ids = torch.randint(0, 64, (4, 16))
    cfg = KFACConfig(token_fraction=1.0, ema_decay=1.0, fisher="empirical", update_every=1,
                     final_window=0.0, storage_dtype="float64", min_window_sequences=0,
                     snapshot_every=10**9)
    specs = select_layers(model, None, None)
    mods = dict(model.named_modules())
    tracker = Tracker(model, {n: mods[n] for n in specs}, specs, cfg)
    name = next(iter(specs))
    tracker.begin_step(0)
    nll = F.cross_entropy(model(input_ids=ids).logits[:, :-1].transpose(1, 2), ids[:, 1:],
                          reduction="none")
    (nll.sum() / nll.numel()).backward()  # the mean: c = 1/60, inexact in float32
    tracker.end_step(model)
    _, g_ours = tracker.factors()[name]
    tracker.close()
    outs = {}
    h = mods[name].register_forward_hook(lambda m, a, o: outs.setdefault("z", o))
    nll = F.cross_entropy(model(input_ids=ids).logits[:, :-1].transpose(1, 2), ids[:, 1:],
                          reduction="none")
    (gz,) = torch.autograd.grad(nll.sum(), outs["z"])
    h.remove()
    g = gz[:, :-1].flatten(0, 1)  # the rows: each sequence's last position scores nothing
    g_ref = g.T @ g / g.shape[0]
    assert g_ours.dtype == torch.float64
    err = float((g_ours - g_ref).norm() / g_ref.norm())
    print(f"G vs reference: {err:.1e}")
    assert err <= EXACT_TOL
