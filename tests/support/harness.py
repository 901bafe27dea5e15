"""Run a real ``transformers.Trainer`` with the callback and an independent forward recorder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from kfac_stream import KFACConfig, KFACStreamCallback

from models import ListDataset
from reference import ForwardRecorder

# fisher="empirical": the tests built on `run` check the observed-label factors against
# `reference.reference_factors` (the default is the MC sub-batch Fisher);
# final_window=0: the EMA over every update, as the references compute it
EXACT = dict(token_fraction=1.0, ema_decay=1.0, storage_dtype="float64", update_every=1,
             fisher="empirical", final_window=0.0)


def sum_nll_loss(outputs, labels, num_items_in_batch=None):
    """A user ``compute_loss_func`` returning the SUM of token NLLs, in the logits' dtype."""
    logits = outputs.logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1).to(logits.device),
                           ignore_index=-100, reduction="sum")


def hf_like_loss(outputs, labels, num_items_in_batch=None):
    """transformers' default semantics (sum / tokens of the whole accumulated batch), float64."""
    return sum_nll_loss(outputs, labels) / num_items_in_batch


def mean_nll_loss(outputs, labels, num_items_in_batch=None):
    """A user ``compute_loss_func`` that averages over the micro-batch's own tokens."""
    n = (labels[:, 1:] != -100).sum()
    return sum_nll_loss(outputs, labels) / n


def run(model, examples, cfg: dict | None = None, *, batch=2, accum=1, steps=None, epochs=1,
        lr=1e-2, loss=None, tmp_path, record=True, callbacks=(), optimizers=(None, None),
        resume=None, callback_kwargs=None, **train_kwargs):
    """Train ``model`` on ``examples`` with a `KFACStreamCallback`; return (cb, records, trainer).

    Data order is sequential-equivalent across batch sizes (Trainer's seeded RandomSampler
    draws one permutation; batch 8 × accum 1 and batch 2 × accum 4 see the same sequences
    per optimizer step).
    """
    cb = KFACStreamCallback(KFACConfig(**{**EXACT, "snapshot_every": 10_000, **(cfg or {})}),
                            **(callback_kwargs or {}))
    train_kwargs.setdefault("save_strategy", "no")
    train_kwargs.setdefault("use_cpu", True)
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
        max_steps=steps if steps is not None else -1, num_train_epochs=epochs,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, report_to=[],
        logging_strategy="no", disable_tqdm=True, seed=0,
        **train_kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(examples),
                      callbacks=[cb, *callbacks], compute_loss_func=loss,
                      optimizers=optimizers)
    if record:
        with ForwardRecorder(model) as rec:
            trainer.train(resume_from_checkpoint=resume)
        return cb, rec.records, trainer
    trainer.train(resume_from_checkpoint=resume)
    return cb, [], trainer


def factor_errors(cb, ref) -> dict[str, float]:
    """Max of the A and G relative Frobenius errors per layer."""
    from reference import rel_err

    got = cb.factors()
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    return {n: max(rel_err(got[n][0], ref[n][0]), rel_err(got[n][1], ref[n][1])) for n in ref}


def set_threads(n=1):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    return prev


def lm_posterior(tmp_path, tau: float, num_data: float):
    """A `LaplacePosterior` (prior ``tau``, ``N = num_data``) of a float64 tiny GPT-2 (8
    tracked Conv1D layers with bias) trained 4 steps on 8 examples of 12 tokens (SUM loss)."""
    from kfac_stream import LaplacePosterior, Snapshot

    from models import text_examples, tiny_gpt2

    model = tiny_gpt2()
    run(model, text_examples(8, 12), {"snapshot_every": 10**6}, batch=2, loss=sum_nll_loss,
        tmp_path=tmp_path, record=False)
    return LaplacePosterior(model, Snapshot.latest(tmp_path / "kfac"), tau, num_data)


def classifier_posterior(tmp_path, tau: float, num_data: float):
    """A `LaplacePosterior` of `models.tiny_classifier_run`'s sequence classifier."""
    from kfac_stream import LaplacePosterior

    from models import tiny_classifier_run

    model, snap, _ = tiny_classifier_run(tmp_path)
    return LaplacePosterior(model, snap, tau, num_data)


#: The links the held-out fit chooses among; the first is the guard's base (`heldout_tau.LINKS`,
#: `heldout_tau.BASE_LINK`).
HELDOUT_LINKS = ("probit", "meanfield")


def brute_heldout_choice(post, grid, predictive, y):
    """``((tau, link), {candidate: mean NLL}, map_kept)`` of the held-out fit's guarded rule
    over ``grid`` × `HELDOUT_LINKS`, by brute force: ``predictive()`` → ``(mean [B, K], cov
    [B, K, K])`` at every candidate tau set on ``post``; each link's lowest mean NLL (ties: the
    larger tau); probit unless the other link's best beats probit's by more than 2 paired
    standard errors; MAP (``softmax(mean)``) kept unless that candidate beats it by more than
    2 (`statistics`: sample sd of the per-example differences / sqrt(n))."""
    import math
    import statistics

    from kfac_stream.query.calibration import probs_from_gaussian

    nll, per = {}, {}
    for tau in grid:
        post.prior_precision = tau
        mean, cov = predictive()
        for link in HELDOUT_LINKS:
            p = probs_from_gaussian(mean, cov, link)
            per[(tau, link)] = (-p[torch.arange(len(y)), y].log()).tolist()
            nll[(tau, link)] = statistics.fmean(per[(tau, link)])
    p_map = torch.softmax(mean.double(), -1)
    map_nll = (-p_map[torch.arange(len(y)), y].log()).tolist()

    def beats(a, b):  # b beats a by more than 2 paired standard errors
        d = [x - z for x, z in zip(a, b)]
        return len(d) > 1 and statistics.fmean(d) > 2 * statistics.stdev(d) / math.sqrt(len(d))

    best = {k: min((c for c in nll if c[1] == k), key=lambda c: (nll[c], -c[0]))
            for k in HELDOUT_LINKS}
    base, other = best[HELDOUT_LINKS[0]], best[HELDOUT_LINKS[1]]
    chosen = other if beats(per[base], per[other]) else base
    return chosen, nll, not beats(map_nll, per[chosen])
