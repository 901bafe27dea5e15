"""laplace-torch's ``KronLaplace`` as the classification benchmarks run it (the peer the stream
posterior is compared with): its default backend (the exact GGN) fitted on the training set,
``tau`` by its marginal likelihood, and its GLM covariance of the logits a task predicts from;
with the plain-logits views of the models it needs (`SeqClassifierHead`, and
`multiple_choice.AnswerHead` for the LoRA answer tokens)."""

from __future__ import annotations

import copy
import time

import torch
from multiple_choice import ANSWER_IDS, AnswerHead, prompt_batch
from torch import nn

from _common import batches, conv1d_to_linear


def fit_kron_lora(model, train_items, a):
    """laplace-torch KronLaplace, its DEFAULT backend (exact GGN), on the LoRA weights of a copy
    of ``model``; the training likelihood (full-vocabulary softmax at the answer position),
    tau by its marginal likelihood. Returns ``(la, head, fit s, marglik s)``."""
    lm = copy.deepcopy(model).eval()
    for n, p in lm.named_parameters():
        p.requires_grad_("lora_" in n)
    batch, y = prompt_batch(train_items)
    targets = torch.tensor([ANSWER_IDS[c] for c in y.tolist()])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(batch["input_ids"], targets), batch_size=a.kron_batch)
    return fit_kron(AnswerHead(lm), loader)


def fit_kron(head, loader):
    """``(la, head, fit s, marglik s)``: ``KronLaplace(head)`` (default backend) fitted on
    ``loader``, its ``tau`` by marginal likelihood (GLM)."""
    import laplace

    t0 = time.perf_counter()
    la = laplace.KronLaplace(head, "classification", prior_precision=1.0)  # default backend
    la.fit(loader)
    t_fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    la.optimize_prior_precision(pred_type="glm", method="marglik")
    return la, head, t_fit, time.perf_counter() - t0


def kron_covs(la, head, batch, size: int = 4) -> torch.Tensor:
    """``[n, C, C]``: laplace-torch's GLM covariance of the logits the task predicts from. Its
    Jacobians come from ``torch.func.jacrev`` over the whole batch output (``B·C``
    vector-Jacobian products of the whole batch each), so the cost grows with B²: small
    batches."""
    covs = []
    head.answers_only = True
    try:
        for b in batches(batch, size):
            Js, _ = la.backend.jacobians(b["input_ids"])
            covs.append(la.functional_variance(Js).detach().double())
    finally:
        head.answers_only = False
    return torch.cat(covs)


class SeqClassifierHead(nn.Module):
    """laplace-torch view of the man-page classifier: ``input_ids [B, T]`` -> logits
    ``[B, C]`` (a copy whose tracked GPT-2 ``Conv1D`` s are equal ``nn.Linear`` s, the only
    weights with gradients)."""

    def __init__(self, model, layers: list[str]):
        super().__init__()
        self.m = conv1d_to_linear(model, layers).eval()
        keep = {f"{name}.{p}" for name in layers for p in ("weight", "bias")}
        for n, p in self.m.named_parameters():
            p.requires_grad_(n in keep)
        self.answers_only = False  # the head has C outputs already

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
