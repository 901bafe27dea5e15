r"""The LDS benchmark's peers, each at its best: kronfluence's K-FAC and EK-FAC refitted at the
final weights, dattri's TracIn, TRAK (one model, 50%-subset models, full-data models, the
trajectory's checkpoints) and IF-CG, and the plain gradient dot product.

`peer_scores` ``(task, run, train, queries, extra_states, out_dir, quick=False)`` returns
``({variant: scores [Q, N] float64}, {variant: seconds}, {variant: why it failed})``: ``Q``
queries (the validation queries, then the test queries) × ``N`` training examples, POSITIVE =
the training example helps (lowers the query's loss), the sign of
``kfac_stream.influence_scores``. A variant is ``"family:setting"``; the caller chooses, per
family, the setting of best mean LDS on the validation queries. A row of NaN: a query that
variant did not score (IF-CG only: `if_rows`, ``choose`` below). ``seconds``: what producing
that variant alone costs on the caller's threads, its family's shared work (a fit, the
features) included; ``details`` (optional dict, filled when given): per variant its absolute
damping / regularisation, the scored rows and the shared work's seconds.

Inputs, read from the examples and the model (no task name is needed for the scores):
an example is ``{<input key>: tensor, "labels": tensor}``, the input key the one that is not
``"labels"``; a 0-dim label is a classifier's (loss: the cross-entropy of the logits), a label
per position a causal LM's (loss: the NLL summed over the labelled next positions, ``-100``
unlabelled) — `Inputs`. A ``transformers`` model is called with the input key as keyword and
its ``.logits`` read, any other module with the input positionally. The parameters scored are
those of `tasks.lds_tasks.tracked_layers` (the blocks' Conv1D / Linear layers, weights and
biases: 25,152 for the two GPT-2 tasks), or every ``nn.Linear`` of a model that has no block
(a logistic regression). ``run``: `tasks.lds_tasks.train_tracked`'s dict (``model``, the final
weights; ``ckpt``: the weights and learning rates at the periodic snapshot steps and the last
step); ``extra_states``: ``{"subset_models": [state dicts of models trained on random 50%
subsets], "full_models": [... on the whole set, other seeds]}``.

Families and settings
---------------------
* ``kronfluence_kfac`` / ``kronfluence_ekfac``: kronfluence 1.0.1, ``fit_all_factors`` at
  the final weights over the training set on a float64 copy of the model in which every
  tracked ``Conv1D`` is the equal ``nn.Linear`` (kronfluence wraps Linear only), the same
  tracked layers; its DEFAULT true Fisher (``use_empirical_fisher=False``: labels sampled from
  the model, seeded), every kronfluence dtype float64 (covariances, eigendecomposition, lambda
  matrices, per-sample gradients, preconditioning, scores). Its task: the training loss summed
  over the batch, the measurement each query's own loss (the classifier's cross-entropy of the
  label; the LM's summed NLL); every position in its covariances (no attention mask, its
  default: kfac_stream counts, for examples without one, the positions that predict a label,
  so an LM window's last position is in kronfluence's ``A`` and not in ours;
  ``Kronfluence(labelled_only=True)`` aligns them, as the test that pins the two K-FACs equal
  does; for a causal LM both run, the aligned ones as families ``kronfluence_kfac_labelled`` /
  ``kronfluence_ekfac_labelled``: refitted against streamed factors on the same positions).
  Settings: ``heuristic`` (``damping_factor=None``: per module
  ``0.1 × mean`` of its eigenvalues — EK-FAC: of its corrected ones) and ``mean*f`` for ``f``
  in `KF_GRID`: one absolute damping for every module, ``f ×`` the heuristic's mean over the
  modules.
* ``dattri_tracin``: dattri 0.3.0 ``TracInAttributor`` over ``run["ckpt"]``'s checkpoints,
  weighted by the learning rate at each (the last step's is 0 and drops out), NO random
  projection (the gradients are ~25k long), setting ``exact``.
* ``dattri_trak1`` (the final model), ``dattri_trak_subsets{k}`` (``k`` = 10 of the 50%-subset
  models, as dattri's benchmarks build TRAK's ensemble), ``dattri_trak_full{k}`` (the
  full-data models given), ``dattri_trak_ckpts{c}`` (the ``c`` checkpoints of ``run["ckpt"]``,
  the ones ``trajectory_influence`` reads; the final one first so that it shares TRAK-1's
  features): TRAK as dattri's ``TRAKAttributor`` computes it (features: the gradient of the
  margin ``log p − log(1 − p)`` — a classifier's as ``z_y − logsumexp_{c≠y} z_c``, stable where
  ``p → 1`` — divided by the square root of the model's parameter count and projected by
  dattri's ``random_project`` (normal, seed 0, ensemble id = the model's index); per model
  ``φ_q (ΦᵀΦ + λI)⁻¹ Φᵀ``, averaged over the models, times the mean of ``1 − p`` of each
  training example) but with every model's features computed once for all settings: one
  ``eigh`` per model of the smaller Gram matrix, ``ΦΦᵀ`` where ``N ≤ dim`` (the solve written
  ``φ_q Φᵀ (ΦΦᵀ + λI)⁻¹``, the same matrix), else ``ΦᵀΦ`` (`trak_solve`), in float64
  (tests/bench/test_lds_peers.py checks it against ``TRAKAttributor`` itself). Settings
  ``{dim}/{r}``: projection ``dim`` in `TRAK_DIMS` (where ``dim > N``, ``ΦᵀΦ`` is singular and
  dattri's default ``λ = 0`` cannot be used) and ``λ = r ×`` the mean over the models of
  ``trace(ΦᵀΦ) / N`` (the mean non-zero eigenvalue where ``N ≤ dim``), ``r`` in `TRAK_REGS`.
* ``dattri_ifcg``: dattri's ``IFAttributorCG`` at the final weights (its Hessian of the mean
  training loss over the whole training set in one batch, its defaults ``max_iter`` 10 and
  ``rev-rev``), one query per solve (a batch of them goes through ``vmap`` and came out 1-18%
  off a plain CG loop on two random vectors of digits, float32, where one per solve is 1e-4 to
  2e-3 off, float32's rounding through 10 steps; it saved no time), run under
  ``torch.no_grad()`` (the same numbers; without it every CG step's graph is kept: 49 s and 12
  GB for one text query, 6.8 s and 1.5 GB with it). Setting ``{r}``:
  ``regularization = r ×`` the Hessian's mean eigenvalue (``trace(H) / P``, Hutchinson's
  estimate from 8 of dattri's own Hessian-vector products), ``r`` in `IF_REGS`. Its cost per
  query and setting (one core: digits ~2.3 s, text ~8.4 s; `IF_BUDGET`) leaves it rows, not
  the whole query set: every setting scores the first validation queries of `IF_BUDGET`, then
  the setting the caller's ``choose`` picks from those rows alone scores the first test
  queries (without ``choose``: every setting does); the other rows are NaN, ``details`` lists
  the scored rows.
* ``grad_dot``: dattri's Grad-Dot (``TracInAttributor`` at the final weights, weight 1, no
  projection), setting ``final``.

``quick``: the smoke sizes' settings (`QUICK`): fewer settings, two IF-CG rows.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tasks import lds_tasks as T
from torch import nn

from _common import conv1d_to_linear

#: kronfluence's absolute damping grid: these × the mean over modules of its heuristic (30 and
#: 100 added for mnist, after ours' validation LDS there still rose at the top of its grid;
#: 0.0001-0.03 after digits' and text's choices sat at the grid's lowest, three times)
KF_GRID = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
#: TRAK's projection dimensions and regularisations (× the mean non-zero eigenvalue of ΦᵀΦ).
TRAK_DIMS = (2048, 4096)
TRAK_REGS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
#: TRAK-k's ensemble size (subset and full-data models).
TRAK_MODELS = 10
#: IF-CG's regularisations (× the Hessian's mean eigenvalue) and its rows per task:
#: (validation rows, test rows), the first of each part, from its cost per query and setting
#: measured on one core of the shared 2-core machine (benchmarks/probes/lds_peers_cost.py:
#: digits 2.3 s, 14 × 3 + 50 rows in 214 s, so 20 × 3 + 50 ≈ 260 s; text 8.4 s, 5 × 3 + 10
#: rows in 217 s: the 50 test rows alone ≈ 420 s, past the ~300 s aimed at, and with 5 × 3
#: validation rows ≈ 550 s).
IF_REGS = (1e-2, 1e-1, 1.0)
IF_BUDGET = {"digits": (20, 50), "text": (5, 50), "mnist": (50, 100)}
IF_QUERY_BATCH = 1
IF_MODE = "rev-rev"
#: --quick: the settings of the smoke run.
QUICK = dict(kf_grid=(1.0,), trak_dims=(2048,), trak_regs=(1e-2,), trak_models=2,
             if_regs=(1.0,), if_rows=(1, 1))
BATCH = 64


def family_label(fam: str) -> str:
    """The table's name of a peer family (``fam`` as `peer_scores` names its variants)."""
    import re

    base = fam.removesuffix("_labelled")
    kf = {"kronfluence_kfac": "kronfluence K-FAC", "kronfluence_ekfac": "kronfluence EK-FAC"}
    if base in kf:
        return (f"{kf[base]}, refitted at the final weights (damping tuned"
                + ("; labelled positions only)" if fam != base else ")"))
    m = re.fullmatch(r"dattri_trak_(subsets|full|ckpts)(\d+)", fam)
    if m:
        what = {"subsets": "50%-subset models", "full": "full-data models",
                "ckpts": "checkpoints of the tracked run"}[m[1]]
        return f"dattri TRAK-{m[2]}, {what} (projection and λ tuned)"
    return {"dattri_trak1": "dattri TRAK-1 (projection and λ tuned)",
            "dattri_tracin": "dattri TracIn, the checkpoints, no projection",
            "grad_dot": "gradient dot product, final weights",
            "dattri_ifcg": "dattri IF-CG (regularisation tuned; the first test queries)"
            }.get(fam, fam)


# -- the examples ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    """What the examples are (module docstring): ``key``, the input's name; ``per_position``,
    a causal LM's labels (else a classifier's); ``dims``, one example's input dimensions."""

    key: str
    per_position: bool
    dims: int

    @classmethod
    def of(cls, example: dict[str, torch.Tensor]) -> Inputs:
        keys = [k for k in example if k != "labels"]
        if len(keys) != 1 or "labels" not in example:
            raise ValueError(f"an example needs one input and 'labels', got {sorted(example)}")
        return cls(keys[0], example["labels"].dim() > 0, example[keys[0]].dim())

    def logits(self, model: nn.Module, x: torch.Tensor, params: dict | None = None
               ) -> torch.Tensor:
        """``[B, C]`` or ``[B, T, V]``: the model's logits on ``x [B, ...]`` (``params``: a
        ``torch.func.functional_call`` with them)."""
        if x.is_floating_point():  # the model's precision (kronfluence's is float64)
            x = x.to(next(model.parameters()).dtype)
        hf = hasattr(model, "config")
        args, kwargs = ((), {self.key: x}) if hf else ((x,), {})
        out = (model(*args, **kwargs) if params is None
               else torch.func.functional_call(model, params, args, kwargs))
        return getattr(out, "logits", out)

    def losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[B]``: each example's loss (cross-entropy; the LM's NLL summed over its labelled
        next positions)."""
        if not self.per_position:
            return F.cross_entropy(logits, labels, reduction="none")
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none",
                              ignore_index=-100)
        return nll.sum(1)

    def margins(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[B]``: TRAK's ``log p − log(1 − p)`` of each example (module docstring)."""
        if not self.per_position:
            picked = logits.gather(1, labels[:, None])[:, 0]
            others = logits.scatter(1, labels[:, None], float("-inf"))
            return picked - torch.logsumexp(others, 1)
        logp = -self.losses(logits, labels)
        return logp - torch.log(-torch.expm1(logp))

    def sample(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Labels drawn from the model (kronfluence's true Fisher); unlabelled positions kept."""
        with torch.no_grad():
            if not self.per_position:
                return torch.multinomial(torch.softmax(logits.double(), -1), 1)[:, 0]
            probs = torch.softmax(logits[:, :-1].double(), -1)
            draw = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
            out = labels.clone()
            out[:, 1:] = torch.where(labels[:, 1:] == -100, labels[:, 1:], draw)
            return out

    def tensors(self, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs [B, ...], labels [B] or [B, T])`` stacked."""
        return (torch.stack([e[self.key] for e in examples]),
                torch.stack([e["labels"] for e in examples]))


def tracked(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(layers, parameters)``: the scored layers (module docstring) and their weights' and
    biases' names."""
    layers = T.tracked_layers(model) or [n for n, m in model.named_modules()
                                         if isinstance(m, nn.Linear)]
    names = dict(model.named_parameters())
    params = [p for n in layers for w in ("weight", "bias")
              for p in [f"{n}.{w}" if n else w] if p in names]
    return layers, params


class DattriView:
    """dattri's ``torch.func`` view of one model and its examples: the per-example loss over
    the tracked parameters (on a batch: the batch mean, the Hessian IF-CG inverts), the
    margin and the probability of the label (TRAK)."""

    def __init__(self, model: nn.Module, inputs: Inputs):
        self.model, self.inputs = copy.deepcopy(model).eval(), inputs
        self.layers, self.params = tracked(model)
        #: the final weights, a copy (dattri loads each checkpoint into its task's model)
        self.final = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def dataset(self, examples: list[dict]) -> torch.utils.data.TensorDataset:
        return torch.utils.data.TensorDataset(*self.inputs.tensors(examples))

    def _apply(self, fn, params, data) -> torch.Tensor:
        x, y = data
        one = x.dim() == self.inputs.dims
        if one:
            x, y = x.unsqueeze(0), y.unsqueeze(0)
        out = fn(self.inputs.logits(self.model, x, params), y)
        return out[0] if one else out.mean()

    def loss(self, params, data) -> torch.Tensor:
        return self._apply(self.inputs.losses, params, data)

    def margin(self, params, data) -> torch.Tensor:
        return self._apply(self.inputs.margins, params, data)

    def prob(self, params, data) -> torch.Tensor:
        return torch.exp(-self.loss(params, data))

    def task(self, loss, states: list[dict] | None = None):
        """dattri's ``AttributionTask`` of ``loss`` over ``states`` (default: the final
        weights), on its own copy of the model."""
        from dattri.task import AttributionTask

        return AttributionTask(loss_func=loss, model=copy.deepcopy(self.model),
                               checkpoints=list(states or [self.final]))


def quiet_peers() -> None:
    """dattri's progress bars off (its modules' ``tqdm``, read once at import, so patched)."""
    from functools import partial as bind

    import dattri.algorithm.base as base
    import dattri.algorithm.tracin as tracin
    import dattri.algorithm.trak as trak
    from tqdm import tqdm

    for mod in (base, tracin, trak):
        mod.tqdm = bind(tqdm, disable=True)


def loader(ds, batch: int | None = None) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=batch or len(ds), shuffle=False)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# -- kronfluence ----------------------------------------------------------------------------------

def kf_task(inputs: Inputs, layers: list[str], labelled_only: bool = False):
    """kronfluence's ``Task``: the training loss summed over the batch (``sample``: with labels
    drawn from the model, its true Fisher), the measurement the queries' own losses summed;
    every position in its covariances (no attention mask: its default), or with
    ``labelled_only`` (an LM) the positions that predict a labelled token, kfac_stream's
    positions for examples without an attention mask."""
    from kronfluence.task import Task

    class PeerTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits = inputs.logits(model, batch[inputs.key])
            labels = inputs.sample(logits, batch["labels"]) if sample else batch["labels"]
            return inputs.losses(logits, labels).sum()

        def compute_measurement(self, batch, model):
            return inputs.losses(inputs.logits(model, batch[inputs.key]), batch["labels"]).sum()

        def get_influence_tracked_modules(self):
            return list(layers)

        def get_attention_mask(self, batch):
            if not (labelled_only and inputs.per_position):
                return None
            labels = batch["labels"]
            mask = torch.zeros_like(labels)
            mask[:, :-1] = labels[:, 1:] != -100
            return mask

    return PeerTask()


class Kronfluence:
    """kronfluence's ``Analyzer`` on a float64 Linear copy of ``model`` tracking its scored
    layers (module docstring; ``labelled_only``: `kf_task`)."""

    def __init__(self, model: nn.Module, inputs: Inputs, out: str, labelled_only: bool = False):
        from kronfluence.analyzer import Analyzer, prepare_model

        self.layers, _ = tracked(model)
        self.task = kf_task(inputs, self.layers, labelled_only)
        lin = conv1d_to_linear(model, self.layers).double().eval()
        self.model = prepare_model(lin, self.task)
        self.analyzer = Analyzer("lds_peers", self.model, self.task, cpu=True,
                                 log_level=logging.WARNING, disable_tqdm=True, output_dir=out)

    def fit(self, name: str, train: list[dict], strategy: str, empirical: bool = False,
            seed: int = 0) -> None:
        """``fit_all_factors`` (``strategy`` "kfac" or "ekfac"), every dtype float64; the true
        Fisher's label draws seeded by ``seed``."""
        from kronfluence.arguments import FactorArguments

        from kfac_stream.app.data import ExampleDataset

        f64 = torch.float64
        args = FactorArguments(strategy=strategy, use_empirical_fisher=empirical,
                               activation_covariance_dtype=f64, gradient_covariance_dtype=f64,
                               eigendecomposition_dtype=f64, per_sample_gradient_dtype=f64,
                               lambda_dtype=f64)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(seed)
            self.analyzer.fit_all_factors(name, ExampleDataset(train),
                                          per_device_batch_size=BATCH, factor_args=args,
                                          overwrite_output_dir=True)

    def scores(self, name: str, queries: list[dict], train: list[dict],
               damping: float | None) -> torch.Tensor:
        """``[Q, N]`` float64 pairwise scores (kronfluence's sign: positive = helpful)."""
        from kronfluence.arguments import ScoreArguments

        from kfac_stream.app.data import ExampleDataset

        f64 = torch.float64
        args = ScoreArguments(damping_factor=damping, per_sample_gradient_dtype=f64,
                              precondition_dtype=f64, score_dtype=f64)
        sname = f"{name}_{damping}"
        self.analyzer.compute_pairwise_scores(sname, name, ExampleDataset(queries),
                                              ExampleDataset(train),
                                              per_device_query_batch_size=len(queries),
                                              per_device_train_batch_size=BATCH,
                                              score_args=args, overwrite_output_dir=True)
        return self.analyzer.load_pairwise_scores(sname)["all_modules"].double()

    def heuristic(self, name: str, strategy: str) -> dict[str, float]:
        """``{module: λ}`` of ``damping_factor=None``: ``0.1 × mean`` of the module's
        eigenvalues (K-FAC: ``kron(α, γ)``; EK-FAC: its lambda matrix over its count)."""
        from kronfluence.utils.constants import HEURISTIC_DAMPING_SCALE as S

        if strategy == "ekfac":
            lam = self.analyzer.load_lambda_matrices(name)
            return {n: float(S * (m.double() / lam["num_lambda_processed"][n]).mean())
                    for n, m in lam["lambda_matrix"].items()}
        eig = self.analyzer.load_eigendecomposition(name)
        return {n: float(S * torch.kron(a.double()[None],
                                        eig["gradient_eigenvalues"][n].double()[:, None]).mean())
                for n, a in eig["activation_eigenvalues"].items()}


def kronfluence_family(model, inputs, train, queries, out: str, cfg: dict, rec) -> None:
    """K-FAC and EK-FAC refitted at ``model``'s weights, every damping setting; for a causal
    LM also with kronfluence counting only the positions that predict a label (families
    ``..._labelled``, the positions kfac_stream's factors count)."""
    for labelled in (False, True) if inputs.per_position else (False,):
        kf = Kronfluence(model, inputs, str(Path(out) / f"kronfluence{int(labelled)}"),
                         labelled_only=labelled)
        kronfluence_fits(kf, train, queries, cfg, rec, "_labelled" if labelled else "")


def kronfluence_fits(kf: Kronfluence, train, queries, cfg: dict, rec, suffix: str) -> None:
    for strategy in ("kfac", "ekfac"):
        fam = f"kronfluence_{strategy}{suffix}"
        try:
            _, fit_s = timed(lambda s=strategy: kf.fit(s, train, s))
            mean = sum(kf.heuristic(strategy, strategy).values()) / len(kf.layers)
        except Exception as e:  # a peer that cannot run: said, the others go on
            rec.fail(f"{fam}:heuristic", e)
            continue
        settings = {"heuristic": None, **{f"mean*{f:g}": f * mean for f in cfg["kf_grid"]}}
        for setting, lam in settings.items():
            rec.run(f"{fam}:{setting}", lambda s=strategy, lam=lam: kf.scores(
                s, queries, train, lam), shared=fit_s,
                info={"damping": "heuristic" if lam is None else lam,
                      "heuristic_mean": mean, "fit_s": fit_s})


def dattri_self_scores(task: str, run: dict, train: list[dict]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, str]]:
    """Self-attribution for noisy-label detection, ``({detector: [N]}, {detector: seconds},
    {detector: why it failed})``: ``dattri_tracin_self`` (TracIn's ``Σ_c η_c ‖g_c(z)‖²`` over
    ``run["ckpt"]``, no projection) and ``dattri_trak1_self`` (TRAK-1's diagonal at the final
    weights, projection 2048, ``λ = 10⁻² × trace(ΦᵀΦ) / N``, `trak_scores`: fixed before
    measuring, the middle of `TRAK_REGS`; there are no validation labels to choose it on).
    ``task`` is unused (the contract of `lds_noisy`)."""
    quiet_peers()
    view = DattriView(run["model"].eval(), Inputs.of(train[0]))
    ck = run["ckpt"]
    keep = [i for i, lr in enumerate(ck.lrs) if lr > 0]
    rec = Recorder(None)
    rec.run("dattri_tracin_self", lambda: dattri_tracin(
        view, [ck.states[i] for i in keep], [ck.lrs[i] for i in keep], train, train
    ).diagonal()[None])
    rec.run("dattri_trak1_self", lambda: trak_scores(trak_features(
        view, [view.final], train, train, (2048,), {}), 2048, 1e-2).diagonal()[None])
    return {k: v[0] for k, v in rec.scores.items()}, rec.seconds, rec.failed


# -- dattri: TracIn, grad dot, IF-CG --------------------------------------------------------------

def dattri_tracin(view: DattriView, states: list[dict], weights: list[float],
                  train: list[dict], queries: list[dict]) -> torch.Tensor:
    """``[Q, N]``: dattri's ``TracInAttributor`` (no projection: its projector set to None)."""
    from dattri.algorithm.tracin import TracInAttributor

    att = TracInAttributor(view.task(view.loss, states), weight_list=torch.tensor(weights),
                           normalized_grad=False, layer_name=view.params)
    att.projector_kwargs = None  # its default would project to 512 dimensions
    tr, qu = view.dataset(train), view.dataset(queries)
    with torch.no_grad():  # torch.func's gradients are taken all the same; no graph kept
        return att.attribute(loader(tr), loader(qu)).T.double()


def hessian_scale(view: DattriView, train: list[dict], probes: int = 8) -> float:
    """The mean eigenvalue of the Hessian IF-CG inverts (the mean training loss's, over the
    tracked parameters): ``trace(H) / P`` by Hutchinson's estimate, ``probes`` Rademacher
    vectors (seeded), through dattri's own Hessian-vector product."""
    from dattri.func.hessian import hvp_at_x

    task = view.task(view.loss)
    params, _ = task.get_param(0, layer_name=view.params)
    func = partial(task.get_loss_func(layer_name=view.params, ckpt_idx=0),
                   **{task.loss_func_data_key: view.inputs.tensors(train)})
    hvp = hvp_at_x(func, x=(params,), mode="rev-rev")
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for _ in range(probes):
        v = (torch.randint(0, 2, params.shape, generator=gen) * 2 - 1).to(params.dtype)
        with torch.no_grad():
            total += float(v @ hvp(v))
    return total / probes / params.numel()


def if_rows(n_queries: int, n_val: int, budget: tuple[int, int]) -> tuple[list[int], list[int]]:
    """``(validation rows, test rows)`` IF-CG scores: the first ``budget[0]`` validation queries
    and the first ``budget[1]`` test queries (rows ``n_val`` on)."""
    a, b = budget
    return list(range(min(a, n_val))), list(range(n_val, min(n_val + b, n_queries)))


def dattri_ifcg(view: DattriView, train: list[dict], queries: list[dict], rows: list[int],
                reg: float, max_iter: int = 10, mode: str = IF_MODE) -> torch.Tensor:
    """``[Q, N]``: dattri's ``IFAttributorCG`` on ``rows`` (the others NaN), its Hessian over
    the whole training set in one batch."""
    from dattri.algorithm.influence_function import IFAttributorCG

    att = IFAttributorCG(view.task(view.loss),
                         layer_name=view.params, regularization=reg, max_iter=max_iter,
                         mode=mode)
    tr = view.dataset(train)
    att.cache(loader(tr))
    few = torch.utils.data.Subset(view.dataset(queries), rows)
    with torch.no_grad():  # the same numbers; without it each CG step's graph is kept
        got = att.attribute(loader(tr), loader(few, IF_QUERY_BATCH)).T.double()
    out = torch.full((len(queries), len(train)), float("nan"), dtype=torch.float64)
    out[rows] = got
    return out


# -- dattri: TRAK ---------------------------------------------------------------------------------

@torch.no_grad()  # torch.func's gradients are taken all the same; no graph kept
def trak_features(view: DattriView, states: list[dict], train: list[dict],
                  queries: list[dict], dims: tuple[int, ...], cache: dict) -> list[dict]:
    """Per model ``c`` (ensemble id ``c``) and dimension: TRAK's projected features as dattri
    computes them, reduced to what every ``λ`` needs: `trak_solve`'s ``s``, ``B``, ``C``,
    ``"trace"``: trace(ΦᵀΦ), ``"q"``: 1 − p [N] (float64). ``cache``: ``{(id(state), c,
    dim): ...}``, shared between families."""
    from dattri.func.projection import random_project

    out = []
    for c, state in enumerate(states):
        missing = [d for d in dims if (id(state), c, d) not in cache]
        t0 = time.perf_counter()
        if missing:
            task = view.task(view.margin, [state])
            params, _ = task.get_param(ckpt_idx=0, layer_name=view.params)
            full, _ = task.get_param(ckpt_idx=0)
            scale = sum(p.numel() for p in view.model.parameters() if p.requires_grad) ** 0.5
            grad = task.get_grad_loss_func(in_dims=(None, 0), layer_name=view.params,
                                           ckpt_idx=0)
            gt = torch.nan_to_num(grad(params, view.inputs.tensors(train))).detach() / scale
            gq = torch.nan_to_num(grad(params, view.inputs.tensors(queries))).detach() / scale
            from dattri.func.utils import _unflatten_params

            p = torch.func.vmap(view.prob, in_dims=(None, 0))(
                _unflatten_params(full, task.get_model()), view.inputs.tensors(train))
            for d in missing:
                kw = dict(proj_dim=d, proj_max_batch_size=32, proj_seed=0, device="cpu")
                pt = random_project(gt, len(gt), **kw)(gt, ensemble_id=c).double()
                pq = random_project(gq, len(gq), **kw)(gq, ensemble_id=c).double()
                cache[id(state), c, d] = dict(trak_solve(pt, pq), trace=float(
                    pt.square().sum()), q=(1 - p.detach().double().flatten()))
            for d in missing:  # the model's time, its gradients shared by the dimensions
                cache[id(state), c, d]["seconds"] = (time.perf_counter() - t0) / len(missing)
        out.append({d: cache[id(state), c, d] for d in dims})
    return out


def trak_solve(pt: torch.Tensor, pq: torch.Tensor) -> dict[str, torch.Tensor]:
    """``φ_q (ΦᵀΦ + λI)⁻¹ Φᵀ = (B / (s + λ)) Cᵀ`` for every ``λ`` from one ``eigh`` of the
    smaller Gram matrix: ``pt`` ``Φ [N, d]``, ``pq`` ``[Q, d]`` → ``{"s": [k], "B": [Q, k],
    "C": [N, k]}``, ``k = min(N, d)``; ``N ≤ d``: ``ΦΦᵀ = U s Uᵀ``, ``B = φ_q Φᵀ U``,
    ``C = U``; else ``ΦᵀΦ = V s Vᵀ``, ``B = φ_q V``, ``C = Φ V`` (the same matrix for
    ``λ > 0``)."""
    if pt.shape[0] <= pt.shape[1]:
        s, u = torch.linalg.eigh(pt @ pt.T)
        return {"s": s, "B": (pq @ pt.T) @ u, "C": u}
    s, v = torch.linalg.eigh(pt.T @ pt)
    return {"s": s, "B": pq @ v, "C": pt @ v}


def trak_scores(feats: list[dict], dim: int, reg: float, absolute: bool = False
                ) -> torch.Tensor:
    """``[Q, N]``: TRAK over the models of ``feats`` (`trak_features`) at projection ``dim``,
    ``λ = reg ×`` the mean of ``trace(ΦᵀΦ) / N`` (``absolute``: ``λ = reg``)."""
    n = len(feats[0][dim]["C"])
    lam = reg if absolute else reg * sum(f[dim]["trace"] for f in feats) / len(feats) / n
    total = 0
    for f in feats:
        x = f[dim]
        total = total + (x["B"] / (x["s"].clamp(min=0) + lam)) @ x["C"].T
    q = sum(f[dim]["q"] for f in feats) / len(feats)
    return total / len(feats) * q[None, :]


# -- the families together ------------------------------------------------------------------------

class Recorder:
    """The three dicts of `peer_scores` and its ``details``."""

    def __init__(self, details: dict | None):
        self.scores, self.seconds, self.failed = {}, {}, {}
        self.details = details if details is not None else {}

    def fail(self, name: str, e: Exception) -> None:
        self.failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) \
            else type(e).__name__

    def run(self, name: str, fn, shared: float = 0.0, info: dict | None = None) -> None:
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                s = fn().detach().double()
            if s.dim() != 2 or not torch.isfinite(s[~torch.isnan(s).all(1)]).all():
                raise FloatingPointError(f"scores {tuple(s.shape)} not finite")
            self.scores[name] = s
        except Exception as e:  # a peer that cannot run: said, the others go on
            self.fail(name, e)
        self.seconds[name] = shared + time.perf_counter() - t0
        self.details[name] = dict(info or {}, own_s=time.perf_counter() - t0, shared_s=shared)

    def extend(self, name: str, rows: list[int], fn) -> None:
        """``rows`` of variant ``name`` filled by ``fn()`` (``[Q, N]``, those rows finite); on
        a failure the variant is dropped and said."""
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                s = fn().detach().double()
            if not torch.isfinite(s[rows]).all():
                raise FloatingPointError("scores not finite")
            self.scores[name][rows] = s[rows]
            self.details[name]["rows"] = self.details[name]["rows"] + rows
        except Exception as e:  # a peer that cannot run: said, the others go on
            self.scores.pop(name, None)
            self.fail(name, e)
        self.seconds[name] += time.perf_counter() - t0
        self.details[name]["own_s"] += time.perf_counter() - t0


def trak_families(view: DattriView, run: dict, extra: dict, train, queries, cfg, rec) -> None:
    final = view.final
    ck = run["ckpt"]
    last = ck.at.index(max(ck.at))
    k = cfg["trak_models"]
    ensembles = {"dattri_trak1": [final],
                 f"dattri_trak_ckpts{len(ck.states)}": [final] + [
                     s for i, s in enumerate(ck.states) if i != last]}
    if extra.get("subset_models"):
        ensembles[f"dattri_trak_subsets{len(extra['subset_models'][:k])}"] = \
            extra["subset_models"][:k]
    if extra.get("full_models"):
        ensembles[f"dattri_trak_full{len(extra['full_models'][:k])}"] = extra["full_models"][:k]
    cache: dict = {}
    for fam, states in ensembles.items():
        try:
            feats = trak_features(view, states, train, queries, cfg["trak_dims"], cache)
        except Exception as e:  # a peer that cannot run: said, the others go on
            rec.fail(f"{fam}:features", e)
            continue
        # its models' features at every dimension, those shared with another family included
        feat_s = sum(x["seconds"] for f in feats for x in f.values())
        for d in cfg["trak_dims"]:
            for r in cfg["trak_regs"]:
                rec.run(f"{fam}:{d}/{r:g}", lambda f=feats, d=d, r=r: trak_scores(f, d, r),
                        shared=feat_s, info={"proj_dim": d, "reg_relative": r,
                                             "models": len(states), "features_s": feat_s})


def ifcg_family(view: DattriView, train, queries, n_val: int, cfg: dict, rec, choose) -> None:
    """IF-CG at every regularisation on its validation rows, then on its test rows at the
    setting ``choose`` picks from those (None: at every setting)."""
    val, test = if_rows(len(queries), n_val, cfg["if_rows"])
    try:
        scale, scale_s = timed(lambda: hessian_scale(view, train))
    except Exception as e:  # a peer that cannot run: said, the others go on
        rec.fail("dattri_ifcg:scale", e)
        return
    regs = {f"dattri_ifcg:{r:g}": r * scale for r in cfg["if_regs"]}
    for name, lam in regs.items():
        rec.run(name, lambda lam=lam: dattri_ifcg(view, train, queries, val, lam),
                shared=scale_s, info={"regularization": lam, "hessian_scale": scale,
                                      "rows": val})
    done = {k: v.clone() for k, v in rec.scores.items() if k in regs}
    if not done or not test:
        return
    for name in [choose(done)] if choose else list(done):
        rec.extend(name, test, lambda lam=regs[name]: dattri_ifcg(view, train, queries, test,
                                                                  lam))


def kronfluence_scores(run: dict, train: list[dict], queries: list[dict], out_dir: str
                       ) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, str]]:
    """The kronfluence families alone at every `KF_GRID` setting (`peer_scores`' contract): to
    add settings to a task and seed whose other peers are cached."""
    quiet_peers()
    rec = Recorder(None)
    cfg = dict(kf_grid=KF_GRID)
    kronfluence_family(run["model"].eval(), Inputs.of(train[0]), train, queries, out_dir, cfg,
                       rec)
    return rec.scores, rec.seconds, rec.failed


def peer_scores(task: str, run: dict, train: list[dict], queries: list[dict],
                extra_states: dict, out_dir: str, quick: bool = False, *,
                n_val: int | None = None, choose=None, details: dict | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, str]]:
    """Every peer's scores (module docstring): ``({variant: [Q, N] float64}, {variant:
    seconds}, {variant: why it failed})``. ``task`` names the IF-CG budget only
    (`IF_BUDGET`); ``n_val``: the validation queries (the first ``n_val`` rows; default: a
    third, the split of `lds_truth`); ``choose``: IF-CG's selection, ``choose({variant:
    scores [Q, N] with only its validation rows}) -> variant``, whose test rows alone are then
    scored (None: every setting's); ``details``: filled per variant (module docstring)."""
    cfg = dict(kf_grid=KF_GRID, trak_dims=TRAK_DIMS, trak_regs=TRAK_REGS,
               trak_models=TRAK_MODELS, if_regs=IF_REGS,
               if_rows=IF_BUDGET.get(task, IF_BUDGET["digits"]))
    if quick:
        cfg.update(QUICK)
    n_val = len(queries) // 3 if n_val is None else n_val
    quiet_peers()
    rec = Recorder(details)
    inputs = Inputs.of(train[0])
    model = run["model"].eval()
    view = DattriView(model, inputs)
    kronfluence_family(model, inputs, train, queries, out_dir, cfg, rec)
    ck = run["ckpt"]
    keep = [i for i, lr in enumerate(ck.lrs) if lr > 0]  # η = 0 weighs 0
    rec.run("dattri_tracin:exact", lambda: dattri_tracin(
        view, [ck.states[i] for i in keep], [ck.lrs[i] for i in keep], train, queries),
        info={"steps": [ck.at[i] for i in keep], "lrs": [ck.lrs[i] for i in keep]})
    rec.run("grad_dot:final", lambda: dattri_tracin(view, [view.final], [1.0], train,
                                                     queries))
    trak_families(view, run, extra_states, train, queries, cfg, rec)
    ifcg_family(view, train, queries, n_val, cfg, rec, choose)
    return rec.scores, rec.seconds, rec.failed
