"""Non-finite steps, hook lifecycle, repeated training, diagonal fallback, MC under GC."""

import pytest
import torch
from transformers import TrainerCallback

from harness import factor_errors, run, sum_nll_loss
from models import text_examples, tiny_gpt2
from reference import reference_factors, rel_err


class FrozenOptimizer(torch.optim.Optimizer):
    """Never changes the weights (an injected Inf would otherwise poison them via the grads)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        return None


class InjectInf(TrainerCallback):
    """Sets one activation to +Inf during the forward passes of optimizer step ``step``."""

    def __init__(self, model, module, step):
        self.step, self.active = step, False
        model.get_submodule(module).register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if self.active:
            out = out.clone()
            out[0, 3, 0] = float("inf")
            return out

    def on_step_begin(self, args, state, control, **kw):
        self.active = state.global_step == self.step


def test_injected_inf_step_is_skipped_and_counted(tmp_path):
    model = tiny_gpt2()
    inject = InjectInf(model, "transformer.h.1.ln_2", step=2)
    ex = text_examples(8, 12)
    cb, records, _ = run(model, ex, batch=2, loss=sum_nll_loss, tmp_path=tmp_path,
                         callbacks=[inject], optimizers=(FrozenOptimizer(model.parameters()), None))
    assert cb.tracker.counters.skipped_updates == 1
    assert cb.tracker.counters.skipped_steps == [2]
    assert cb.tracker.counters.updates == 3
    kept = [r for i, r in enumerate(records) if i != 2]  # batch 2, accum 1: record i = step i
    ref, _ = reference_factors(model, kept, list(cb.tracker.specs))
    errs = factor_errors(cb, ref)
    assert max(errs.values()) <= 1e-10
    for A, G in cb.factors().values():
        assert torch.isfinite(A).all() and torch.isfinite(G).all()


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_two_trainings_in_a_row_leave_no_hooks_and_do_not_double_count(tmp_path):
    model = tiny_gpt2()
    base = _hook_count(model)
    ex = text_examples(8, 12)
    first, _, _ = run(model, ex, batch=2, loss=sum_nll_loss, tmp_path=tmp_path / "1",
                      record=False)
    assert _hook_count(model) == base
    second, records, _ = run(model, ex, batch=2, loss=sum_nll_loss, tmp_path=tmp_path / "2")
    assert _hook_count(model) == base
    assert second.tracker.counters.positions_sampled == first.tracker.counters.positions_sampled
    ref, _ = reference_factors(model, records, list(second.tracker.specs))
    assert max(factor_errors(second, ref).values()) <= 1e-10


class Crash(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        raise RuntimeError("boom")


def test_crashed_run_hooks_are_removed_by_the_next_callback(tmp_path, caplog):
    model = tiny_gpt2()
    base = _hook_count(model)
    with pytest.raises(RuntimeError, match="boom"):
        run(model, text_examples(4, 12), batch=2, tmp_path=tmp_path / "1", record=False,
            callbacks=[Crash()])
    assert _hook_count(model) > base  # Trainer never called on_train_end
    with caplog.at_level("WARNING", logger="kfac_stream"):
        run(model, text_examples(4, 12), batch=2, tmp_path=tmp_path / "2", record=False)
    assert _hook_count(model) == base
    assert any("removing the hooks another tracker left" in r.message for r in caplog.records)


@pytest.mark.parametrize("fold_on", ["host", "device"])
def test_diagonal_fallback_keeps_the_exact_diagonal(tmp_path, fold_on):
    # diagonal factors are reduced to Σ w x⊙x in the hooks (their rows never travel)
    ex = text_examples(8, 12, lengths=[12, 9, 12, 7, 12, 12, 10, 12])
    dense, _, _ = run(tiny_gpt2(), ex, batch=2, loss=sum_nll_loss, tmp_path=tmp_path / "d",
                      record=False)
    diag, _, _ = run(tiny_gpt2(), ex, {"max_dense_dim": 20, "fold_on": fold_on}, batch=2,
                     loss=sum_nll_loss, tmp_path=tmp_path / "g", record=False)
    fd, fg = dense.factors(), diag.factors()
    n_diag = 0
    for n in fd:
        for i in range(2):
            if fd[n][i].shape[0] > 20:
                n_diag += 1
                assert fg[n][i].shape == (fd[n][i].shape[0],)
                assert rel_err(fg[n][i], fd[n][i].diagonal()) <= 1e-12
            elif fold_on == "host":  # the same fold path as the dense run: the same bits
                assert torch.equal(fg[n][i], fd[n][i])
            else:  # another summation order (per-update GEMM, pending sums): float64 rounding
                assert rel_err(fg[n][i], fd[n][i]) <= 1e-12
    assert n_diag == 6  # mlp.c_proj A (65), attn.c_attn G (48), mlp.c_fc G (64); 2 blocks


def test_snapshot_every_and_final_snapshot(tmp_path):
    cb, _, _ = run(tiny_gpt2(torch.float32), text_examples(10, 12), {"snapshot_every": 2},
                   batch=2, tmp_path=tmp_path, record=False)
    names = [p.rsplit("/", 1)[1] for p in cb.snapshots]
    assert names == ["step-00000002", "step-00000004", "step-00000005"]
    assert not [p for p in (tmp_path / "kfac").iterdir() if p.name.startswith(".")]


def test_mc_fisher_under_gradient_checkpointing(tmp_path):
    # Without checkpointing the MC gradient is taken inside the training forward; with it the
    # pass is replayed after the optimizer step (kfac_stream/fisher/mc_replay.py). With lr=0 the
    # weights are the same before and after the step and the label sampler draws the same numbers
    # in the same order: both ways must give the same factors.
    ex = text_examples(4, 12, lengths=[12, 9, 12, 7])
    cfg = {"fisher": "mc", "mc_sequences": 1}  # one sequence of each micro-batch, every step
    plain, _, _ = run(tiny_gpt2(), ex, cfg, batch=2, lr=0.0, tmp_path=tmp_path / "a",
                      record=False)
    ckpt, _, _ = run(tiny_gpt2(), ex, cfg, batch=2, lr=0.0, tmp_path=tmp_path / "b",
                     record=False, gradient_checkpointing=True)
    f1, f2 = plain.factors(), ckpt.factors()
    assert max(max(rel_err(f1[n][0], f2[n][0]), rel_err(f1[n][1], f2[n][1])) for n in f1) <= 1e-10
    with pytest.raises(RuntimeError, match="use_reentrant"):
        run(tiny_gpt2(), ex, cfg, batch=2, tmp_path=tmp_path / "c", record=False,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})


def test_background_worker_gives_the_same_factors(tmp_path):
    # async_updates is the GPU default; on CPU the same code path runs in a thread.
    ex = text_examples(8, 12)
    sync, _, _ = run(tiny_gpt2(), ex, {"storage_dtype": "float16"}, batch=2,
                     tmp_path=tmp_path / "a", record=False)
    bg, _, _ = run(tiny_gpt2(), ex, {"storage_dtype": "float16", "async_updates": True},
                   batch=2, tmp_path=tmp_path / "b", record=False)
    assert bg.tracker.updater.worker is not None and not bg.tracker.updater.worker.is_alive()
    f1, f2 = sync.factors(), bg.factors()
    for n in f1:
        assert torch.equal(f1[n][0], f2[n][0]) and torch.equal(f1[n][1], f2[n][1])


def test_update_steps_do_not_keep_logits_or_activations_alive(tmp_path):
    # A tensor hook whose closure holds its own tensor is a cycle that Python's GC cannot
    # see; it once leaked every update step's logits (~150 MB/step on the benchmark model).
    import gc
    import weakref

    model = tiny_gpt2()
    refs = []
    model.register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out.logits)))
    model.get_submodule("transformer.h.0.mlp.c_fc").register_forward_hook(
        lambda m, a, out: refs.append(weakref.ref(out)))
    for fisher in ("empirical", "mc"):
        run(model, text_examples(4, 12), {"fisher": fisher}, batch=2, tmp_path=tmp_path / fisher,
            record=False)
    gc.collect()
    assert len(refs) >= 8
    assert [r for r in refs if r() is not None] == []


class InjectGradNaN(TrainerCallback):
    """Makes one output gradient of ``module`` NaN in the backward of step ``step``."""

    def __init__(self, model, module, step):
        self.step, self.active = step, False
        model.get_submodule(module).register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if self.active and out.requires_grad:
            def poison(grad):
                grad = grad.clone()
                grad[0, 2, 1] = float("nan")
                return grad
            out.register_hook(poison)

    def on_step_begin(self, args, state, control, **kw):
        self.active = state.global_step == self.step


def overflowing_loss(step_box, bad_step):
    """A user loss whose scale overflows to +Inf on one step, as an fp16 loss scaler's does
    when it is too large (the scaler would then skip that optimizer step)."""
    def loss(outputs, labels, num_items_in_batch=None):
        value = sum_nll_loss(outputs, labels)
        return value * float("inf") if step_box[0] == bad_step else value
    return loss


class StepBox(TrainerCallback):
    def __init__(self, box):
        self.box = box

    def on_step_begin(self, args, state, control, **kw):
        self.box[0] = state.global_step


@pytest.mark.parametrize("fault", ["grad_nan", "loss_scale_inf"])
def test_non_finite_gradients_never_reach_the_factors(tmp_path, fault):
    """A NaN in one layer's output gradient, or an overflowed loss scale (every hook gradient
    Inf/NaN), skips exactly that update; the factors equal the reference without it."""
    model = tiny_gpt2()
    ex = text_examples(8, 12)
    box = [0]
    callbacks, loss = [StepBox(box)], sum_nll_loss
    if fault == "grad_nan":
        callbacks.append(InjectGradNaN(model, "transformer.h.0.mlp.c_fc", step=1))
    else:
        loss = overflowing_loss(box, bad_step=1)
    cb, records, _ = run(model, ex, batch=2, loss=loss, tmp_path=tmp_path, callbacks=callbacks,
                         optimizers=(FrozenOptimizer(model.parameters()), None))
    assert cb.tracker.counters.skipped_steps == [1]
    assert cb.tracker.counters.skipped_updates == 1 and cb.tracker.counters.updates == 3
    kept = [r for i, r in enumerate(records) if i != 1]
    ref, _ = reference_factors(model, kept, list(cb.tracker.specs))
    assert max(factor_errors(cb, ref).values()) <= 1e-10


def test_fp16_amp_scaler_skipped_steps_never_reach_the_factors(tmp_path):
    """Real fp16 AMP with a real ``torch.amp.GradScaler`` (CPU here, CUDA where there is one;
    accelerate makes no scaler for fp16 on CPU, so the test gives it one) and an initial loss
    scale so large that the first steps overflow: the scaler skips them (its scale halves) and
    the tracker skips exactly the same steps, counts them, and keeps finite factors."""
    from transformers import Trainer, TrainingArguments

    from kfac_stream import KFACConfig, KFACStreamCallback

    from models import ListDataset

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_gpt2(torch.float32).to(device)
    cb = KFACStreamCallback(KFACConfig(update_every=1, token_fraction=1.0, fisher="empirical",
                                       storage_dtype="float32", snapshot_every=1000))
    scales = []

    class Scale(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            scales.append(trainer.accelerator.scaler.get_scale())

    args = TrainingArguments(str(tmp_path), fp16=True, max_steps=8, report_to=[],
                             per_device_train_batch_size=2, save_strategy="no",
                             use_cpu=device == "cpu", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(text_examples(32, 16)),
                      callbacks=[cb, Scale()])
    init = 2.0**127  # 5 nats x 2^127 overflows float32: the first steps' gradients are Inf
    trainer.accelerator.scaler = torch.amp.GradScaler(device, init_scale=init,
                                                      growth_interval=1000)
    trainer.train()
    skipped = [i for i, (a, b) in enumerate(zip([init] + scales, scales)) if b < a]
    print(f"scaler skipped steps {skipped}; tracker skipped {cb.tracker.counters.skipped_steps}")
    assert skipped and skipped == cb.tracker.counters.skipped_steps
    assert cb.tracker.counters.skipped_updates == len(skipped)
    assert cb.tracker.counters.updates == 8 - len(skipped)
    for A, G in cb.factors().values():
        assert torch.isfinite(A).all() and torch.isfinite(G).all()
