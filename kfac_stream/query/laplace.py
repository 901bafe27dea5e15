r"""`LaplacePosterior`: linearised-Laplace queries of a trained model and a snapshot.

Posterior over the tracked layers' weights ``W̄ = [W b]``: a Gaussian around the trained
weights with block-diagonal precision ``N·(A⊗G) + τI`` per layer (``kron_eigen``), exact in the
snapshot's eigenbases for any prior precision ``τ`` chosen after training. Everything else in
the model is held at its trained value.

Predictive of chosen logits ``f`` (``[B, K]``), linearised: ``f ~ N(f_MAP, J Σ Jᵀ)`` with, per
layer and logit ``c``, ``J_c = Σ_s g_s^{(c)} ā_sᵀ`` (``g^{(c)} = ∂f_c/∂z``, one backward per
logit) and ``Cov[f_c, f_c'] = Σ_layers Σ_ij M_c[i,j] M_c'[i,j] / D_ij``,
``M_c = Q_Gᵀ J_c Q_A``. Computed in float64.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..capture.hooks import logits_of
from ..capture.presets import preset_layers
from ..capture.selection import layer_spec
from ..distributed.engines import engine_for
from ..enums import LayerPreset
from ..exceptions import (
    KFACConfigError,
    PartitionedModelError,
    QueryInputError,
    SnapshotMismatchError,
    UnsupportedLayoutError,
)
from ..progress import progress
from ..snapshot.adequacy import sampling_warning
from ..snapshot.manifest import stored_key
from ..snapshot.snapshot import Snapshot
from ..snapshot.weights import compare_weights
from . import inputs
from . import kron_eigen as ke
from .marglik import EvidenceBins
from .prior_choice import PRIOR_WORDS, resolve_prior

logger = logging.getLogger("kfac_stream")

#: `LaplacePosterior` warns when ``num_data`` is more than this factor away (either way) from
#: the snapshot's own count (`default_num_data`).
NUM_DATA_WARN_FACTOR = 4.0

#: Which logits to select: ``K`` indices for every row (a sequence of ints), or one row of ``K``
#: indices per example (a ``[B, K]`` integer tensor or ``B`` sequences of ``K`` ints).
TokenIds = Sequence[int] | Sequence[Sequence[int]] | Tensor

PROBS_METHODS = ("probit", "meanfield", "mc")
HELDOUT_ALLOWED = ("an iterable of dicts {'batch', 'token_ids', 'labels' [B], optionally "
                   "'positions'} (a list of one dict for one batch)")


@dataclass
class _Query:
    """Checked arguments of one predictive query (names as the caller knows them)."""

    where: str
    names: tuple[str, str, str]  # the batch, positions and token_ids arguments
    batch: Mapping[str, Tensor]
    size: int  # B
    positions: int | list[int]
    positions_given: object
    ids: Tensor | None  # [K] (CPU) or [B, K] int64
    ids_given: object


#: The snapshot counter each unit of ``N`` is read from.
UNIT_COUNTERS = {"position": "tokens_seen", "sequence": "sequences_seen"}


def num_data_unit(meta: dict, names: Sequence[str]) -> str:
    """What ``num_data`` counts for a posterior over ``names``: ``"sequence"`` when every one
    of them has one row per sequence (a ``[B, d]`` head, or the reduce form: the manifest's
    ``layers.<name>.rows``), else ``"position"`` (token positions)."""
    rows = [meta["layers"][n].get("rows", "position") for n in names]
    return "sequence" if rows and all(r == "sequence" for r in rows) else "position"


def default_num_data(meta: dict, unit: str = "position") -> float:
    """``N`` in ``unit``, from the snapshot's counts: the non-padding positions
    (``tokens_seen``) or the sequences with one (``sequences_seen``) of every training forward,
    divided by the epochs run (when known and positive): the data set's size, also after a
    partial epoch."""
    seen = float(meta["counts"][UNIT_COUNTERS[unit]])
    epoch = meta.get("epoch")
    return seen / epoch if epoch and epoch > 0 else seen


def layer_num_data(meta: dict, names: Sequence[str], num_data: float,
                   unit: str = "position") -> dict[str, float]:
    """``N`` of each layer, for ``num_data`` in ``unit`` (`num_data_unit`): ``num_data`` for a
    layer whose rows are in that unit; for one whose rows are the other (token positions vs
    sequences, the manifest's ``layers.<name>.rows``) ``num_data`` times the snapshot's ratio
    of the two counts (``counts.sequences_seen / counts.tokens_seen`` or its inverse), so the
    default ``num_data`` gives each layer its own count per epoch and a ``num_data`` of your
    own rescales every layer alike."""
    counts = {u: float(meta["counts"].get(c, 0)) for u, c in UNIT_COUNTERS.items()}
    out = {}
    for name in names:
        rows = meta["layers"][name].get("rows", "position")
        out[name] = num_data if rows == unit else num_data * counts[rows] / counts[unit]
    return out


class LaplacePosterior:
    """Laplace posterior over the tracked layers of ``model`` from ``snapshot``.

    Every argument is checked at the call (here and in every method): a value of the wrong type
    or out of range raises `QueryInputError` (a `ValueError`), one line naming the argument,
    the value and what is allowed.

    Args:
        model: The trained model (the one the snapshot was tracked on, or a copy), an
            ``nn.Module`` with whole weights (after DeepSpeed ZeRO-3 training:
            ``kfac_stream.whole_model(trainer, save_dir)``).
        snapshot: A loaded `Snapshot` (``Snapshot.load(path)`` or ``Snapshot.latest(dir)``).
        prior_precision: ``τ``: ``"auto"`` (default: the ``τ`` fitted on held-out data and
            stored beside the snapshot, ``snap.heldout_prior``, when there is one and
            ``layers`` and ``num_data`` are the snapshot's own; else the rule without held-out
            data, the marginal likelihood: `kfac_stream.query.prior_choice`),
            ``"heldout"`` (the stored fit, an error without one), ``"marglik"`` (maximise the
            Laplace marginal likelihood over one shared ``τ``), a positive finite float, or
            ``{layer: positive finite float}`` with exactly the snapshot's layers. Where it
            came from: ``prior_source``; `describe`.
        num_data: ``N``, a positive finite number; default (None) `default_num_data`. The
            posterior precision scales with it. ``N`` counts token positions (the expand form
            sums the Fisher over every non-padding position of the training forwards, labelled
            or not: 300 examples of 65 tokens are ``N = 19,500``, also when the loss is taken
            at one answer token of each; docs/queries.md, "What N counts"), not examples as
            laplace-torch's ``num_data``; over layers that all have one row per sequence (a
            ``[B, d]`` head, or ``factor_form="reduce"``) it counts sequences
            (``num_data_unit`` attribute, `num_data_unit`). Layers of the other unit get their
            own ``N`` in proportion (``layer_num_data`` attribute, `layer_num_data`). A value
            more than `NUM_DATA_WARN_FACTOR` times away from the snapshot's own count warns
            (``UserWarning``).
        layers: The layers the posterior is over (the others stay at their trained values,
            as the block-diagonal posterior's marginal): None (every layer of the snapshot),
            a preset name (``"last_layer"``, ``"lora"``, ``"attention"``, ``"mlp"``,
            ``"all_linear"``: `kfac_stream.capture.presets`, resolved on ``model``; every layer
            it selects must be in the snapshot), or a list of the snapshot's layer names. Track
            broadly once, query any subset (e.g. ``layers="mlp"``).
        link: The K-way link of `predictive_probs` and the other probability queries when
            they are not given one: None (default: the stored held-out fit's link with
            ``"auto"`` / ``"heldout"``, else ``"meanfield"``), ``"meanfield"``, ``"probit"``
            or ``"mc"`` (`probs_from_gaussian`). Where it came from: ``link_source``.

    Warns:
        UserWarning: the model's tracked weights are not those the snapshot was taken at
            (the snapshot's ``weights`` fingerprint, `kfac_stream.snapshot.weights`: a model of
            another run or another step; snapshots older than the fingerprint are not
            checked). A warning, not an error: a model cast to another precision, or one
            queried on purpose with an earlier snapshot's curvature, still works; the message
            names the snapshot, its step and run and the first layer that differs.

    Raises:
        QueryInputError: an argument of the wrong type or out of range.
        PartitionedModelError: a model whose weights DeepSpeed ZeRO-3 partitions or FSDP2
            shards (also right after ``trainer.train()`` in the same script);
            `kfac_stream.whole_model` gives a whole copy.
        SnapshotMismatchError: the model's layers differ from the snapshot's.
    """

    def __init__(self, model: nn.Module, snapshot: Snapshot,
                 prior_precision: float | dict[str, float] | str = "auto",
                 num_data: float | None = None,
                 layers: str | Sequence[str] | None = None,
                 link: str | None = None) -> None:
        where = "LaplacePosterior"
        if not isinstance(model, nn.Module):
            raise inputs.error(where, "model", model, "a torch.nn.Module (the trained model)",
                               typed=True)
        if not isinstance(snapshot, Snapshot):
            raise inputs.error(where, "snapshot", snapshot,
                               "a kfac_stream.Snapshot (load one with Snapshot.load(path), or "
                               "Snapshot.latest(dir) for the newest in a directory)", typed=True)
        self.layer_names = _chosen_layers(where, model, snapshot, layers)
        self.num_data_unit = unit = num_data_unit(snapshot.meta, self.layer_names)
        self.num_data = _check_num_data(where, num_data, snapshot.meta, unit)
        if num_data is not None:
            _warn_far_num_data(where, self.num_data, snapshot.meta, unit)
        few = sampling_warning(where, snapshot.meta, once=True)
        if few is not None:
            warnings.warn(few, UserWarning, stacklevel=2)
        self.layer_num_data = layer_num_data(snapshot.meta, self.layer_names, self.num_data,
                                             unit)
        words = isinstance(prior_precision, str) and prior_precision in PRIOR_WORDS
        choice = resolve_prior(
            where, prior_precision if words else None, link, snapshot.heldout_prior,
            layers is None and num_data is None, PROBS_METHODS)
        prior = inputs.check_prior(where, "prior_precision",
                                   choice.tau if words else prior_precision,
                                   self.layer_names, marglik=True)
        self.link, self.link_source = choice.link, choice.link_source
        self.prior_source, self.heldout = choice.source, choice.heldout
        self.model, self.snapshot = model, snapshot
        self.modules = _match_layers(model, snapshot, self.layer_names)
        _check_whole_weights(where, model, self.modules)
        _warn_other_weights(where, snapshot, self.modules)
        self._vocab = inputs.input_vocab(model)
        # Eigenvalue algebra (D, log-determinants, samples) runs in float64; the per-token
        # Jacobian features run in the model's precision (float64 models: float64, else
        # float32 — a float32 model's gradients carry no more digits than that).
        wdtypes = {m.weight.dtype for m in self.modules.values()}
        self.feature_dtype = torch.float64 if torch.float64 in wdtypes else torch.float32
        self.device = next(iter(self.modules.values())).weight.device
        # Nothing widened or moved here: eigenvalues and eigenvectors are converted lazily,
        # per layer, when a query needs them, and cached per stored tensor (a shared A once).
        self.eig = _LazyEigen(snapshot, self.layer_names)
        self._qf = _LazyBases(snapshot, self.layer_names, self.device, self.feature_dtype)
        self._prior: float | dict[str, float] = 1.0
        if prior == "marglik":
            self.optimize_prior_precision()
        else:
            self._prior = prior  # type: ignore[assignment]
        self._sourced = self._prior  # the value prior_source describes

    def describe(self) -> str:
        """One line: the ``τ`` and link in use and where each came from."""
        tau = self._prior
        shown = (f"{tau:.4g}" if isinstance(tau, float) else
                 f"per layer {min(tau.values()):.3g}..{max(tau.values()):.3g}")
        source = self.prior_source if tau == self._sourced else "set by hand"
        return f"tau {shown} ({source}), {self.link} link ({self.link_source})"

    # -- prior precision -------------------------------------------------------------------------

    @property
    def prior_precision(self) -> float | dict[str, float]:
        """``τ`` of the queries: a float, or ``{layer: float}`` over every tracked layer.

        Assigning checks the value (a positive finite float or such a dict, else
        `QueryInputError`); ``optimize_prior_precision()`` sets the marginal-likelihood one."""
        return self._prior

    @prior_precision.setter
    def prior_precision(self, value: float | dict[str, float]) -> None:
        self._prior = inputs.check_prior(  # type: ignore[assignment]
            "LaplacePosterior", "prior_precision", value, self.layer_names,
            marglik=False)

    # -- helpers ---------------------------------------------------------------------------------

    def tau(self, name: str, prior_precision: float | dict[str, float] | None = None) -> float:
        """Prior precision of one layer.

        Args:
            name: A tracked layer (one of ``snapshot.layer_names``).
            prior_precision: None (``self.prior_precision``), a positive finite float or
                ``{layer: positive finite float}`` over every tracked layer.
        """
        self._check_layer("LaplacePosterior.tau", name)
        if prior_precision is None:
            return self._tau(name, self._prior)
        return self._tau(name, inputs.check_prior(
            "LaplacePosterior.tau", "prior_precision", prior_precision,
            self.layer_names, marglik=False))  # type: ignore[arg-type]

    @staticmethod
    def _tau(name: str, prior: float | dict[str, float]) -> float:
        """``τ`` of one layer under a checked prior precision."""
        return prior[name] if isinstance(prior, dict) else prior

    def weights(self, name: str) -> Tensor:
        """Trained ``W̄ = [W b]`` of a layer, ``[d_out, d_A]`` float64 (Conv1D transposed).

        Args:
            name: A tracked layer (one of ``snapshot.layer_names``).
        """
        self._check_layer("LaplacePosterior.weights", name)
        return self._weights(name)

    def eigenbases(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """``(Q_A [d_A, d_A], Q_G [d_out, d_out])`` of a layer in ``feature_dtype`` on
        ``self.device`` (converted at the first query that needs them and kept, shared by every
        query and, for an A factor several layers share, by those layers; None for a diagonal
        factor, whose eigenbasis is the identity).

        Args:
            name: A tracked layer (one of ``layer_names``).
        """
        self._check_layer("LaplacePosterior.eigenbases", name)
        return self._qf[name]

    def _weights(self, name: str) -> Tensor:
        m = self.modules[name]
        w = m.weight.detach().double()
        w = w.T if layer_spec(name, m).kind == "conv1d" else w
        if getattr(m, "bias", None) is not None:
            w = torch.cat([w, m.bias.detach().double()[:, None]], dim=1)
        return w

    def _check_layer(self, where: str, name: object) -> None:
        if not isinstance(name, str) or name not in self.modules:
            names = self.layer_names
            raise inputs.error(where, "name", name, f"one of the posterior's {len(names)} "
                               f"layers (its layer_names, e.g. {names[0]!r})")

    def _query(self, where: str, batch, positions, token_ids,
               names: tuple[str, str, str] = ("batch", "positions", "token_ids"),
               options: bool = False) -> _Query:
        """Check the arguments of a predictive query (before any model call); ``options``: a
        probability over the ids (``K ≥ 2``). ``token_ids`` None: the snapshot's answer tokens
        when it has them (`Snapshot.answer_tokens`)."""
        size, length = inputs.check_batch(where, names[0], batch, self._vocab)
        batch = inputs.query_batch(where, names[0], batch, self.model)  # seq2seq: decoder ids
        length, _ = inputs.output_positions(batch, length)  # an encoder-decoder's: decoder's
        pos = inputs.answer_positions(where, names[1], positions, batch, size, length,
                                      shift=not inputs.seq2seq_lm(self.model))
        if token_ids is None:
            token_ids = self.answer_tokens
        ids = inputs.check_token_ids(where, names[2], token_ids, size, options)
        return _Query(where, names, batch, size, pos, positions, ids, token_ids)

    @property
    def answer_tokens(self) -> list[int] | None:
        """The snapshot's answer options (``KFACConfig.answer_tokens`` as token ids), the
        default ``token_ids`` of a language-model head's queries; None when the run set none."""
        ids = self.snapshot.answer_tokens
        return None if ids is None else list(ids)

    # -- predictive ------------------------------------------------------------------------------

    def jacobian_features(self, batch: dict[str, Tensor],
                          positions: int | Sequence[int] | None = None,
                          token_ids: TokenIds | None = None
                          ) -> tuple[Tensor, Iterator[tuple[str, Tensor]]]:
        """MAP logits and, layer by layer, ``M = Q_Gᵀ J Q_A`` for the chosen logits.

        Args:
            batch: Model inputs, a dict with ``input_ids`` ``[B, T]`` (an integer tensor; on
                the CPU, ids within the model's input embeddings) or ``inputs_embeds``
                ``[B, T, d]``, optionally ``attention_mask`` ``[B, T]`` and ``labels``
                ``[B, T]`` (an answer-token batch as training sees it, ``-100`` where there is
                no label: the answer is read at each row's first labelled position; a
                classifier's ``labels [B]`` are ignored). An encoder-decoder LM (T5, BART) also
                needs ``labels`` ``[B, T']`` (the decoder inputs are made from them as in
                training) or ``decoder_input_ids`` ``[B, T']`` (`inputs.query_batch`).
            positions: Where the logits are read when the batch has no ``labels [B, T]``
                (`inputs.answer_positions`: with labels, each row's first labelled position,
                where training scores it, minus one for a causal LM; positions must then be
                None). One int for all or ``B`` ints (a sequence or a 1-D integer tensor), each
                in ``[-T, T)``; negative counts back from the last non-padding token (None or
                ``-1``: the last one; it must land on a token of the example). Ignored for
                classification heads (``logits [B, C]``). An encoder-decoder's are decoder
                positions (``T'``) of ``decoder_input_ids``: position ``t`` predicts the token
                at ``t + 1`` of the decoder inputs, and ``-1`` is ``decoder_attention_mask``'s
                last 1 when given.
            token_ids: The ``K ≥ 1`` vocabulary (or class) indices, each in ``[0, V)`` (``[0,
                C)``): one sequence of ``K`` ints for every example (``[383, 657, 370,
                468]``), or per example a row of ``K`` (a ``[B, K]`` integer tensor or ``B``
                sequences of ``K ≥ 2`` ints; row ``b`` selects ``f[b, k] = logits[b, ids[b,
                k]]``; one id per example only as a ``[B, 1]`` tensor: ``B`` one-int lists,
                a tokenizer's ``input_ids`` of one-token answers, are refused as ambiguous).
                Default: all classes of a classification head; for a language-model head the
                snapshot's answer tokens (``KFACConfig.answer_tokens``), else required. (A
                ``[B, K]`` tensor on an accelerator is not range-checked: that would need a
                host sync.)

        Returns:
            ``(f [B, K] float64, iterator of (layer, M [B, K, d_out, d_A]))``; the features
            of one layer at a time (in ``feature_dtype``), so memory stays at one layer's
            ``B·K·d_out·d_A``.

        Raises:
            QueryInputError: an argument of the wrong type, shape or range.
        """
        return self._jacobian(self._query("LaplacePosterior.jacobian_features", batch,
                                          positions, token_ids))

    def _jacobian(self, q: _Query) -> tuple[Tensor, Iterator[tuple[str, Tensor]]]:
        """`jacobian_features` of checked arguments. A layer applied several times in one
        forward (ALBERT's shared layers) contributes the sum over its calls, as its weight's
        Jacobian does."""
        with layer_calls(self.modules) as calls, torch.enable_grad():
            logits = logits_of(self.model(**inputs.forward_inputs(q.batch)))
            f = _select_logits(logits, q)  # [B, K]
            names = list(calls)
            flat = [out for n in names for _, out in calls[n]]
            grads = iter(_logit_gradients(f, flat))
            per_call = {n: [(a, next(grads)) for a, _ in calls[n]] for n in names}
        calls.clear()
        size = f.shape[0]
        for n in names:  # every layout checked before the first feature is made
            for a, _ in per_call[n]:
                per_example_inputs(q.where, n, a, size)

        def features(n: str) -> Tensor:
            parts = per_call.pop(n)
            return sum((self._features(n, a, g, size) for a, g in parts[1:]),
                       self._features(n, *parts[0], size))

        return f.detach().double(), ((n, features(n)) for n in names)

    def _features(self, name: str, a: Tensor, g: Tensor, size: int) -> Tensor:
        """``M[b, k] = Σ_t (Q_Gᵀ g_{k,b,t}) (Q_Aᵀ ā_{b,t})ᵀ`` from the layer's input ``a``
        (``[B, T, d_in]``, ``[B, ..., d_in]`` or batch-major rows ``[B*T, d_in]``, as OPT's
        fc1/fc2 see them) and the output gradients ``g`` (``[K, *output shape]``) of a batch of
        ``size`` = B examples; the input side is rotated once for all K logits."""
        qa, qg = self._qf[name]
        fd = self.feature_dtype
        a = per_example_inputs("LaplacePosterior", name, a.to(fd), size)  # [B, T, d_in]
        if self.snapshot[name].has_bias:
            a = torch.cat([a, a.new_ones(a.shape[0], a.shape[1], 1)], dim=-1)  # [B, T, d_A]
        g = g.to(fd).reshape(g.shape[0], size, a.shape[1], g.shape[-1])  # [K, B, T, d_out]
        return torch.einsum("kbti,btj->bkij", ke.rotate(g, qg), ke.rotate(a, qa))

    def predictive(self, batch: dict[str, Tensor], positions: int | Sequence[int] | None = None,
                   token_ids: TokenIds | None = None) -> tuple[Tensor, Tensor]:
        """Linearised predictive of chosen logits under ``self.prior_precision``.

        Arguments (and their allowed values) as in `jacobian_features`.

        Returns:
            ``(mean [B, K], cov [B, K, K])``, float64.
        """
        q = self._query("LaplacePosterior.predictive", batch, positions, token_ids)
        mean, covs = self._covariances(q, [self._prior])
        return mean, covs[0]

    def predictive_covariances(self, batch: dict[str, Tensor],
                               positions: int | Sequence[int] | None = None,
                               token_ids: TokenIds | None = None, *,
                               prior_precisions: Sequence[float | dict[str, float]]
                               ) -> tuple[Tensor, Tensor]:
        """The linearised predictive for several prior precisions from ONE Jacobian pass.

        The Jacobian features (`jacobian_features`: the model's forward and one backward per
        chosen logit) do not depend on ``τ``; only the eigenvalues they are divided by do. So
        choosing ``τ`` on held-out data costs one pass, not one per candidate. Entry ``p``
        equals `predictive` with ``prior_precision = prior_precisions[p]`` bit for bit (the
        same float64 operations in the same order).

        Args:
            batch: As in `jacobian_features`.
            positions: As in `jacobian_features`.
            token_ids: As in `jacobian_features`.
            prior_precisions: ``P ≥ 1`` candidates (a list or tuple), each a positive finite
                float ``τ`` or ``{layer: positive finite float}`` over every tracked layer.

        Returns:
            ``(mean [B, K], covs [P, B, K, K])``, float64; ``covs[p]`` is the covariance
            under ``prior_precisions[p]``.
        """
        where = "LaplacePosterior.predictive_covariances"
        priors = inputs.check_priors(where, "prior_precisions", prior_precisions,
                                     self.layer_names)
        return self._covariances(self._query(where, batch, positions, token_ids), priors)

    def _covariances(self, q: _Query, priors: list[float | dict[str, float]]
                     ) -> tuple[Tensor, Tensor]:
        """`predictive_covariances` of checked arguments."""
        f, feats = self._jacobian(q)
        B, K = f.shape
        covs = f.new_zeros(len(priors), B, K, K)  # on the model's device
        for name, m in feats:
            _, aval, _, gval = self.eig[name]
            for p, prior in enumerate(priors):
                d = ke.precision_eigenvalues(gval, aval, self.layer_num_data[name],
                                             self._tau(name, prior))
                covs[p] += torch.einsum("bkij,blij->bkl", m / d.to(m.device, m.dtype), m).double()
        return f, covs

    def predictive_probs(self, batch: dict[str, Tensor],
                         positions: int | Sequence[int] | None = None,
                         token_ids: TokenIds | None = None, method: str | None = None,
                         n_samples: int = 1000, seed: int = 0) -> Tensor:
        """Predictive probabilities over the ``K`` chosen logits (a K-way softmax).

        Args:
            batch: As in `jacobian_features`.
            positions: As in `jacobian_features`.
            token_ids: As in `jacobian_features`.
            method: None (default): the posterior's ``link`` (the held-out fit's, or
                ``"meanfield"``); ``"meanfield"``: the pairwise mean-field link, which uses the
                variances of the logit *differences* (the covariances between the K logits;
                see `probs_from_gaussian`); ``"probit"``: ``softmax(μ / sqrt(1 + π/8 ·
                diag Σ))``, laplace-torch's default link; ``"mc"``: the mean of ``softmax(f)``
                over ``n_samples`` draws ``f ~ N(μ, Σ)``.
            n_samples: Draws for ``"mc"``, an int ≥ 1.
            seed: Seed of the draws, an int.

        Returns:
            ``[B, K]``.
        """
        where = "LaplacePosterior.predictive_probs"
        method = self.link if method is None else method
        inputs.check_choice(where, "method", method, PROBS_METHODS)
        inputs.check_int(where, "n_samples", n_samples, 1)
        inputs.check_seed(where, "seed", seed)
        mean, covs = self._covariances(
            self._query(where, batch, positions, token_ids, options=True), [self._prior])
        return probs_from_gaussian(mean, covs[0], method, n_samples, seed)

    # -- posterior samples -----------------------------------------------------------------------

    def sampled_weights(self, seed: int = 0) -> contextlib.AbstractContextManager[None]:
        """Replace the tracked weights by one posterior sample inside the block.

        The trained values are restored bit-identically on exit, also when the body raises.

        Args:
            seed: Seed of the draw, an int (checked at the call, before the block).
        """
        return self._sampled_weights(inputs.check_seed("LaplacePosterior.sampled_weights",
                                                       "seed", seed))

    @contextlib.contextmanager
    def _sampled_weights(self, seed: int) -> Iterator[None]:
        gen = torch.Generator().manual_seed(seed)
        saved = {}
        with torch.no_grad():
            for name, m in self.modules.items():
                saved[name] = [p.detach().clone() for p in (m.weight, getattr(m, "bias", None))
                               if p is not None]
            try:
                for name, m in self.modules.items():
                    qa, aval, qg, gval = self.eig[name]
                    dw = ke.sample_block(qg, gval, qa, aval, self.layer_num_data[name],
                                         self._tau(name, self._prior), gen)
                    if self.snapshot[name].has_bias:
                        m.bias.add_(dw[:, -1].to(m.bias.device, m.bias.dtype))
                        dw = dw[:, :-1]
                    kind = layer_spec(name, m).kind
                    m.weight.add_((dw.T if kind == "conv1d" else dw).to(m.weight.device,
                                                                        m.weight.dtype))
                yield
            finally:
                for name, m in self.modules.items():
                    for p, old in zip([p for p in (m.weight, getattr(m, "bias", None))
                                       if p is not None], saved[name]):
                        p.copy_(old)

    # -- confidence score ------------------------------------------------------------------------

    def confidence(self, variance: Tensor | float) -> Tensor | float:
        """The seed report's score ``1 / (1 + β·var)`` (``β`` from `fit_beta`, default 1).

        Args:
            variance: Predictive variance(s), a tensor (any shape) or a float.
        """
        if not isinstance(variance, Tensor) and not inputs.is_real(variance):
            raise inputs.error("LaplacePosterior.confidence", "variance", variance,
                               "a tensor or a float (predictive variances >= 0)", typed=True)
        return 1.0 / (1.0 + getattr(self, "beta", 1.0) * variance)

    def fit_beta(self, heldout: Iterable[Mapping]) -> float:
        """Fit ``β`` of `confidence` on held-out data; sets and returns it.

        Args:
            heldout: Iterable (e.g. a list) of dicts ``{"batch", "token_ids", "labels" [B]
                (index into token_ids of the right answer, in ``[0, K)``), "positions"
                (optional, default None)}``, at least one; ``batch``, ``token_ids`` and
                ``positions`` as in `jacobian_features`. The score uses the predictive
                variance of the MAP-predicted logit and is fitted to whether that prediction
                is right (`fit_confidence_beta`).
        """
        where = "LaplacePosterior.fit_beta"
        if isinstance(heldout, (Mapping, Tensor, str, bytes)) or not isinstance(heldout,
                                                                               Iterable):
            raise inputs.error(where, "heldout", heldout, HELDOUT_ALLOWED, typed=True)
        variances, correct = [], []
        for i, item in enumerate(heldout):
            arg = f"heldout[{i}]"
            if not isinstance(item, Mapping) or not {"batch", "token_ids", "labels"} <= set(item):
                raise inputs.error(where, arg, item, "a dict {'batch', 'token_ids', 'labels', "
                                   "optionally 'positions'}", typed=not isinstance(item, Mapping))
            q = self._query(where, item["batch"], item.get("positions"), item["token_ids"],
                            (f"{arg}['batch']", f"{arg}['positions']", f"{arg}['token_ids']"),
                            options=True)
            labels = inputs.check_labels(where, f"{arg}['labels']", item["labels"], q.size)
            mean, covs = self._covariances(q, [self._prior])
            inputs.check_id_range(where, f"{arg}['labels']", item["labels"], labels,
                                  mean.shape[1], f"the {mean.shape[1]} token_ids of a row")
            pred = mean.argmax(-1)  # [B]
            variance = torch.diagonal(covs[0], dim1=-2, dim2=-1)  # [B, K]
            variances.append(variance.gather(1, pred[:, None])[:, 0].cpu())
            correct.append(pred.cpu() == labels)
        if not variances:
            raise inputs.error(where, "heldout", heldout, HELDOUT_ALLOWED, problem="is empty")
        self.beta = fit_confidence_beta(torch.cat(variances), torch.cat(correct))
        return self.beta

    # -- evidence --------------------------------------------------------------------------------

    def log_marginal_likelihood(self, prior_precision: float | dict[str, float] | None = None,
                                log_likelihood: float = 0.0) -> float:
        r"""Laplace log marginal likelihood over the tracked weights.

        :math:`\log p(D|\theta^*) + \log p(\theta^*) + \frac P2\log 2\pi - \frac12\log\det H`
        with ``H`` the posterior precision. ``log_likelihood`` is :math:`\log p(D|\theta^*)`
        (minus the training loss summed over the data); it does not depend on ``τ``, so the
        default 0 gives the evidence up to that constant, enough to choose ``τ``.

        Args:
            prior_precision: None (``self.prior_precision``), a positive finite float or
                ``{layer: positive finite float}`` over every tracked layer.
            log_likelihood: A finite float.
        """
        where = "LaplacePosterior.log_marginal_likelihood"
        prior = self._prior if prior_precision is None else inputs.check_prior(
            where, "prior_precision", prior_precision, self.layer_names, marglik=False)
        return self._log_evidence(prior, inputs.check_finite(where, "log_likelihood",
                                                             log_likelihood))  # type: ignore

    def _log_evidence(self, prior: float | dict[str, float], log_likelihood: float,
                      norms: dict[str, tuple[int, float]] | None = None) -> float:
        """``norms``: ``{layer: (weights, squared norm)}`` when known (`_weight_norms`)."""
        norms = norms or self._weight_norms()
        total = log_likelihood
        for name in self.modules:
            aval, gval = self.eig.eigvals(name, self.device)  # float64, on the model's device
            tau = self._tau(name, prior)
            numel, sq = norms[name]
            logdet = ke.log_det_precision(gval, aval, self.layer_num_data[name], tau)
            total += float(ke.marglik_terms(numel, sq, logdet, tau))
        return total

    def _weight_norms(self) -> dict[str, tuple[int, float]]:
        """``{layer: (number of weights of W̄, ‖W̄‖²)}``."""
        out = {}
        for name in self.modules:
            w = self._weights(name)
            out[name] = (w.numel(), float((w * w).sum()))
        return out

    def optimize_prior_precision(self, lower: float = 1e-6, upper: float = 1e6,
                                 grid: int = 61, iters: int = 60, *,
                                 show_progress: bool | None = None) -> float:
        """Maximise `log_marginal_likelihood` over one shared ``τ``; sets and returns it.

        A log-spaced grid over ``[lower, upper]`` brackets the maximum, golden-section search
        on ``log τ`` refines it: ``grid + iters + 2`` evaluations of the evidence with the
        eigenvalue pairs binned in log space (`kfac_stream.query.marglik`: within ``P·w/2`` of
        the exact, ``P`` the weights, ``w`` = `marglik.BIN_WIDTH`), then Newton steps on the
        exact derivative (one pass over every layer's ``d_out·d_A`` eigenvalue pairs each,
        usually one or two) make it the exact maximiser (the evidence is unimodal in
        ``log τ``). Eigenvalues only: no eigenvector is touched. A progress bar counts the
        evaluations (`kfac_stream.query.progress`: on a terminal by default), and the result
        is logged (logger ``kfac_stream``, INFO) with its time.

        Args:
            lower: The lower end of the range of ``τ``, finite with ``0 < lower < upper``.
            upper: The upper end of that range.
            grid: Grid points, an int ≥ 1.
            iters: Golden-section steps, an int ≥ 1.
            show_progress: None (a bar when stderr is a terminal), True or False.
        """
        where = "LaplacePosterior.optimize_prior_precision"
        lower, upper = _check_range(where, lower, upper)
        grid = inputs.check_int(where, "grid", grid, 1)
        iters = inputs.check_int(where, "iters", iters, 1)
        t0 = time.perf_counter()
        norms = self._weight_norms()  # once, not per evaluation
        bins = EvidenceBins([_scaled(self.eig.eigvals(n, self.device)[::-1],
                                     self.layer_num_data[n]) for n in self.modules],
                            1.0, [norms[n] for n in self.modules])  # N_l in each γ
        bar = progress(total=grid + iters + 2, desc=f"marglik prior precision "
                       f"({len(self.modules)} layers)", unit="eval", show=show_progress)

        def negative_evidence(log_tau: float) -> float:
            value = -bins.surrogate(log_tau)
            bar.update()
            return value

        try:
            start = _minimise_over_log_range(negative_evidence, lower, upper, grid, iters)
        finally:
            bar.close()
        log_tau, passes = bins.newton_polish(math.log(start), lower, upper)
        self._prior = math.exp(log_tau)
        logger.info("kfac_stream: marginal-likelihood prior precision %.4g over %d layers "
                    "(%d evaluations over %d eigenvalue bins, %d exact Newton passes, %.1f s)",
                    self._prior, len(self.modules), grid + iters + 2, bins.bins, passes,
                    time.perf_counter() - t0)
        return self._prior


class _LazyEigen(Mapping):
    """``{layer: (Q_A, α, Q_G, γ)}`` in float64 on the CPU (None for a diagonal factor's Q),
    each converted from the snapshot's tensors at its first use and cached per stored tensor
    (an A shared by several layers is widened once; the snapshot's own fp32 tensors are never
    copied before a query needs them)."""

    def __init__(self, snapshot: Snapshot, names: Sequence[str]) -> None:
        self._snap, self._names = snapshot, list(names)
        self._cache: dict[tuple, Tensor] = {}

    def _get(self, name: str, factor: str, part: str, device=None) -> Tensor | None:
        t = getattr(self._snap[name], f"{factor}_{part}")
        if t is None:
            return None
        dev = torch.device("cpu") if device is None else torch.device(device)
        key = (_source_key(self._snap, name, factor), part, str(dev))
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = t.to(dev, torch.float64)
        return out

    def eigvals(self, name: str, device=None) -> tuple[Tensor, Tensor]:
        """``(α, γ)`` float64 on ``device`` (default the CPU)."""
        return self._get(name, "A", "eigvals", device), self._get(name, "G", "eigvals", device)

    def __getitem__(self, name: str) -> tuple:
        if name not in self._names:
            raise KeyError(name)
        return (self._get(name, "A", "eigvecs"), self._get(name, "A", "eigvals"),
                self._get(name, "G", "eigvecs"), self._get(name, "G", "eigvals"))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _LazyBases(Mapping):
    """``{layer: (Q_A, Q_G)}`` in the feature dtype on the model's device, each converted at
    its first use and cached per stored tensor (a shared A once)."""

    def __init__(self, snapshot: Snapshot, names: Sequence[str], device: torch.device,
                 dtype: torch.dtype) -> None:
        self._snap, self._names = snapshot, list(names)
        self._device, self._dtype = device, dtype
        self._cache: dict[str, Tensor] = {}

    def _get(self, name: str, factor: str) -> Tensor | None:
        t = getattr(self._snap[name], f"{factor}_eigvecs")
        if t is None:
            return None
        key = _source_key(self._snap, name, factor)
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = t.to(self._device, self._dtype)
        return out

    def __getitem__(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        if name not in self._names:
            raise KeyError(name)
        return self._get(name, "A"), self._get(name, "G")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _source_key(snapshot: Snapshot, name: str, factor: str) -> str:
    """The stored tensor a layer's factor is read from (an A shared by several layers: the
    one key they share, manifest ``shared_inputs``); the layer's own name when the manifest
    does not say (a hand-built snapshot)."""
    try:
        return stored_key(snapshot.meta, name, factor)
    except (KeyError, TypeError, AttributeError):
        return f"{name}/{factor}"


def probs_from_gaussian(mean: Tensor, cov: Tensor, method: str = "meanfield",
                        n_samples: int = 1000, seed: int = 0) -> Tensor:
    """K-way softmax probabilities under ``f ~ N(mean, cov)``.

    Args:
        mean: ``[B, K]`` floating tensor.
        cov: ``[B, K, K]`` floating tensor.
        method: ``"meanfield"`` (default), ``"probit"`` or ``"mc"`` (as in
            `LaplacePosterior.predictive_probs`).
        n_samples: Draws for ``"mc"``, an int ≥ 1.
        seed: Seed of the draws, an int.

    Returns:
        ``[B, K]``.

    The probit link scales each logit by its own variance and ignores the covariances: where
    the K logits move together (answer logits read from one shared representation), it
    flattens and can reorder the probabilities although no logit *difference* is uncertain.
    ``"meanfield"`` is the pairwise mean-field approximation of Lu, Ie & Sha (2020,
    arXiv:2006.07584): with ``Δ_kj = μ_k − μ_j`` and ``s²_kj = Σ_kk + Σ_jj − 2Σ_kj``,
    ``p_k ∝ 1 / Σ_j exp(−Δ_kj / sqrt(1 + π/8 · s²_kj))`` (the ``j = k`` term is 1),
    normalised over k. A noise shared by all logits leaves it at ``softmax(μ)``, and for
    K = 2 it is the probit approximation of the sigmoid of the difference (so it keeps the
    MAP's decision there). It is the default because on the LoRA multiple-choice benchmark
    (``benchmarks/uncertainty_classification.py``, 3 seeds) probit changed 22% of MAP's
    decisions and cost 2.9 points of accuracy, the mean-field link 8% and none (+1.3 points),
    with a lower NLL (1.235 vs 1.327); see ``benchmarks/RESULTS.md``.
    """
    where = "probs_from_gaussian"
    inputs.check_choice(where, "method", method, PROBS_METHODS)
    if not isinstance(mean, Tensor) or not mean.is_floating_point() or mean.dim() != 2:
        raise inputs.error(where, "mean", mean, "a [B, K] floating tensor",
                           typed=not isinstance(mean, Tensor))
    if not isinstance(cov, Tensor) or not cov.is_floating_point() or tuple(cov.shape) != (
            *mean.shape, mean.shape[-1]):
        raise inputs.error(where, "cov", cov, f"a [B, K, K] = {[*mean.shape, mean.shape[-1]]} "
                           "floating tensor (mean is [B, K])", typed=not isinstance(cov, Tensor))
    n_samples = inputs.check_int(where, "n_samples", n_samples, 1)
    seed = inputs.check_seed(where, "seed", seed)
    if method == "probit":
        kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * torch.diagonal(cov, dim1=-2, dim2=-1))
        return torch.softmax(mean * kappa, dim=-1)
    if method == "meanfield":
        var = torch.diagonal(cov, dim1=-2, dim2=-1)  # [B, K]
        diff_var = (var[:, :, None] + var[:, None, :] - 2.0 * cov).clamp(min=0.0)  # [B, K, K]
        diff = mean[:, :, None] - mean[:, None, :]  # [B, K, K]: Δ_kj
        # −log p_k (unnormalised) = logsumexp_j(−Δ_kj / sqrt(1 + π/8 s²_kj)); diagonal: 0
        score = -torch.logsumexp(-diff / torch.sqrt(1.0 + math.pi / 8.0 * diff_var), dim=-1)
        return torch.softmax(score, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    k = mean.shape[-1]
    jitter = 1e-10 * torch.diagonal(cov, dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30)
    chol = torch.linalg.cholesky(cov + jitter[:, None, None] * torch.eye(k, dtype=cov.dtype))
    z = torch.randn(n_samples, *mean.shape, generator=gen, dtype=mean.dtype)  # [S, B, K]
    f = mean + torch.einsum("bkl,sbl->sbk", chol, z)
    return torch.softmax(f, dim=-1).mean(0)


def fit_confidence_beta(variances: Tensor, correct: Tensor, lower: float = 1e-8,
                        upper: float = 1e8) -> float:
    """``β ≥ 0`` minimising the binary cross-entropy of ``1/(1+β·var)`` against correctness.

    Args:
        variances: ``[n]`` predictive variances (≥ 0), ``n ≥ 1``.
        correct: ``[n]`` bool, whether each prediction was right.
        lower, upper: The range of ``β``, finite with ``0 < lower < upper``.

    Returns:
        The minimiser over a log-spaced grid on ``[lower, upper]`` refined by golden section.
    """
    where = "fit_confidence_beta"
    if not isinstance(variances, Tensor) or variances.dim() != 1 or variances.numel() == 0:
        raise inputs.error(where, "variances", variances, "a [n] tensor with n >= 1",
                           typed=not isinstance(variances, Tensor))
    if not isinstance(correct, Tensor) or tuple(correct.shape) != tuple(variances.shape):
        raise inputs.error(where, "correct", correct,
                           f"a [n] = {list(variances.shape)} bool tensor like variances",
                           typed=not isinstance(correct, Tensor))
    lower, upper = _check_range(where, lower, upper)
    v = variances.double().clamp(min=0.0)
    y = correct.double()

    def nll(log_beta: float) -> float:
        conf = (1.0 / (1.0 + math.exp(log_beta) * v)).clamp(1e-12, 1 - 1e-12)
        return -float((y * conf.log() + (1 - y) * (1 - conf).log()).mean())

    return _minimise_over_log_range(nll, lower, upper, grid=161, iters=80)


def _check_range(where: str, lower: object, upper: object) -> tuple[float, float]:
    """``(lower, upper)`` as floats, finite with ``0 < lower < upper``."""
    allowed = "a finite float with 0 < lower < upper"
    lo = inputs.check_positive(where, "lower", lower, allowed)
    hi = inputs.check_positive(where, "upper", upper, allowed)
    if not lo < hi:
        raise inputs.error(where, "upper", upper, allowed, problem=f"is not above lower={lo!r}")
    return lo, hi


def _minimise_over_log_range(f: Callable[[float], float], lower: float, upper: float,
                             grid: int, iters: int) -> float:
    """``x`` in ``[lower, upper]`` minimising ``f(log x)`` (``f`` takes the logarithm).

    ``grid`` log-spaced points bracket the minimum (the best point and its two neighbours),
    ``iters`` golden-section steps on ``log x`` refine it, one evaluation of ``f`` per step;
    ties keep the left part. Returns ``x`` at the centre of the final bracket.
    """
    xs = torch.linspace(math.log(lower), math.log(upper), grid).tolist()
    values = [f(x) for x in xs]
    best = min(range(grid), key=values.__getitem__)
    lo, hi = xs[max(best - 1, 0)], xs[min(best + 1, grid - 1)]
    r = (math.sqrt(5) - 1) / 2  # 1/φ: each step keeps this fraction of the bracket
    c, d = hi - r * (hi - lo), lo + r * (hi - lo)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:  # the minimum lies in [lo, d]; the old c becomes the new d
            hi, d, fd = d, c, fc
            c = hi - r * (hi - lo)
            fc = f(c)
        else:  # in [c, hi]; the old d becomes the new c
            lo, c, fc = c, d, fd
            d = lo + r * (hi - lo)
            fd = f(d)
    return math.exp((lo + hi) / 2)


def _scaled(eigvals: tuple[Tensor, Tensor], num_data: float) -> tuple[Tensor, Tensor]:
    """``(N·γ, α)`` from a layer's ``(γ, α)``: its own ``N`` folded into the G side."""
    return eigvals[0] * num_data, eigvals[1]


def _check_num_data(where: str, num_data: object, meta: dict, unit: str = "position"
                    ) -> float:
    """``N`` in ``unit``: ``num_data`` (a positive finite number) or, when None, the
    snapshot's own."""
    what = {"position": "training positions", "sequence": "training sequences"}[unit]
    allowed = ("None (N from the snapshot's counts) or a positive finite number (N: the "
               f"{what} the factors average over)")
    if num_data is not None:
        return inputs.check_positive(where, "num_data", num_data, allowed)
    counter = UNIT_COUNTERS[unit]
    try:
        n = default_num_data(meta, unit)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise QueryInputError(f"{where}: num_data=None takes N from the snapshot's counts, which "
                              f"are unreadable ({type(e).__name__}: {e}): pass num_data, "
                              "a positive finite number") from None
    if not (math.isfinite(n) and n > 0):
        raise QueryInputError(f"{where}: num_data=None takes N from the snapshot's counts, which "
                              f"give N={n!r} (counts.{counter}={meta['counts'][counter]!r},"
                              f" epoch={meta.get('epoch')!r}): pass num_data, a positive finite "
                              "number")
    return n


def _warn_far_num_data(where: str, num_data: float, meta: dict, unit: str = "position"
                       ) -> None:
    """Warn (``UserWarning``) when ``num_data`` is more than `NUM_DATA_WARN_FACTOR` times away
    from the snapshot's own count; silent when the counts are unreadable (nothing to compare)."""
    try:
        own = default_num_data(meta, unit)
    except (KeyError, TypeError, ValueError, AttributeError):
        return
    if not (math.isfinite(own) and own > 0):
        return
    ratio = num_data / own
    if 1 / NUM_DATA_WARN_FACTOR <= ratio <= NUM_DATA_WARN_FACTOR:
        return
    epoch = meta.get("epoch")
    per = f" over {epoch:.3g} epochs" if isinstance(epoch, (int, float)) and epoch > 0 else ""
    factor = max(ratio, 1 / ratio)
    times = f"{factor:,.0f}x" if factor >= 10 else f"{factor:.2g}x"
    far = f"{times} below" if ratio < 1 else f"{times} above"
    small, wide = ("small", "wide") if ratio < 1 else ("large", "narrow")
    counter = UNIT_COUNTERS[unit]
    why = ("Here N counts token positions, not examples: the K-FAC Fisher (expand form) is a "
           "sum over every position of the training forwards (e.g. 300 examples of 65 tokens "
           "are N=19,500), unlike laplace-torch's num_data." if unit == "position" else
           "Here N counts the training sequences (every layer of this posterior has one row "
           "per sequence).")
    warnings.warn(
        f"{where}: num_data={num_data:,.6g} is {far} the snapshot's own count N={own:,.0f} "
        f"(counts.{counter}={meta['counts'][counter]:,}{per}). {why} The data term "
        f"N*(A(x)G) of the posterior precision scales with N, so it is {times} too {small} "
        f"here (the posterior up to {times} too {wide}). Pass num_data=None for the "
        "snapshot's count.", UserWarning, stacklevel=3)


def _warn_other_weights(where: str, snapshot: Snapshot, modules: dict[str, nn.Module]) -> None:
    """One ``UserWarning`` when the model's tracked weights are not those the snapshot was
    taken at (its ``weights`` fingerprint, `snapshot.weights`; snapshots written before it
    existed are not checked): a model of another run, or of another step of the same run."""
    recorded = snapshot.meta.get("weights")
    if not recorded:
        return
    differ = compare_weights(recorded, modules)
    if differ:
        run = snapshot.meta.get("run_id")
        warnings.warn(
            f"{where}: the model's weights are not those snapshot {snapshot.path} was taken at "
            f"(step {snapshot.step}{f', run {run}' if run else ''}): {len(differ)} of "
            f"{len(modules)} layers differ, e.g. {differ[0]}. The posterior pairs this model "
            "with another model's curvature: load the model saved at that step (or the "
            "snapshot of this model's run and step)", UserWarning, stacklevel=3)


def _check_whole_weights(where: str, model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """The model holds its whole weights in this process and keeps them: no parameter its
    distributed engine shards (`EngineAdapter.sharded_parameter_problem`: DeepSpeed ZeRO-3
    partitions them again after the next forward even when gathered right after
    ``trainer.train()``; an FSDP2 ``DTensor``'s values are not here), and every tracked weight
    of its full size."""
    engine = engine_for(model)
    for pname, p in model.named_parameters():
        problem = engine.sharded_parameter_problem(where, pname, p)
        if problem is not None:
            raise PartitionedModelError(problem)
    for name, m in modules.items():
        spec = layer_spec(name, m)
        w = m.weight
        full = spec.d_in * spec.d_out
        if w.numel() != full:
            raise PartitionedModelError(
                f"{where}: model has its weights partitioned (layer {name!r} holds "
                f"{w.numel()} of its {full} weights in this process): query a model with whole "
                "weights: save it (trainer.save_model(dir)) and load it again with "
                "from_pretrained(dir) in one process")


@contextlib.contextmanager
def layer_calls(modules: Mapping[str, nn.Module]
                ) -> Iterator[dict[str, list[tuple[Tensor, Tensor]]]]:
    """Within the block, every call of each of ``modules`` (``{name: module}``) records
    ``(input, output)`` in the yielded ``{name: [(input, output), ...]}`` (a layer run several
    times per forward, ALBERT's shared layers, once per call); an output that does not require
    grad (frozen weights) is replaced by a differentiable copy, so the queries' backward reaches
    it. The hooks are removed on exit."""
    calls: dict[str, list[tuple[Tensor, Tensor]]] = {}

    def hook(name):
        def fn(module, args, out):
            if not out.requires_grad:  # frozen weights: make the output differentiable
                out = out.detach().requires_grad_()
            calls.setdefault(name, []).append((args[0].detach(), out))
            return out
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def per_example_inputs(where: str, name: str, x: Tensor, size: int) -> Tensor:
    """A tracked layer's input ``x`` as ``[B, T, d]`` for a batch of ``size`` = B examples:
    ``[B, ..., d]`` (the positions of each example flattened) or batch-major rows ``[B*T, d]``
    (a 2-D input whose rows are the examples' positions, example by example: OPT's fc1/fc2,
    a pooled ``[B, d]`` head with T = 1).

    Raises:
        UnsupportedLayoutError: any other layout (e.g. sequence-first ``[T, B, d]``), whose
            rows cannot be told apart by example.
    """
    if x.dim() >= 2 and x.numel() > 0 and (
            (x.dim() >= 3 and x.shape[0] == size) or (x.dim() == 2 and x.shape[0] % size == 0)):
        return x.reshape(size, -1, x.shape[-1])
    raise UnsupportedLayoutError(
        f"{where}: layer {name!r} receives its input as {list(x.shape)} for a batch of {size} "
        f"examples: queries need [B, ..., d] ([{size}, T, d]) or batch-major rows [B*T, d]; "
        "leave this layer out of the posterior (layers=[...])")


def _logit_gradients(f: Tensor, outs: list[Tensor]) -> list[Tensor]:
    """``[K, *out.shape]`` per tensor of ``outs``: ``∂f[:, k].sum() / ∂out`` for every chosen
    logit ``k`` of ``f [B, K]`` (rows are independent examples, so the sum over rows gives each
    row's own gradient).

    The ``K`` backward passes run as one batched backward (``is_grads_batched``: vmap over the
    cotangents ``e_k``; the graph is walked once, with ``K``-wide kernels); where an operation
    of the graph has no batching rule, as a loop of ``K`` backward passes (the same numbers).
    """
    k_count = f.shape[1]
    if k_count > 1:
        eye = torch.eye(k_count, dtype=f.dtype, device=f.device)[:, None, :].expand(
            k_count, *f.shape)
        try:
            gs = torch.autograd.grad(f, outs, grad_outputs=eye, retain_graph=True,
                                     allow_unused=True, is_grads_batched=True)
            return [torch.zeros(k_count, *o.shape, dtype=o.dtype, device=o.device) if g is None
                    else g.detach() for g, o in zip(gs, outs)]
        except RuntimeError:  # an operation without a vmap rule: fall back to the loop
            pass
    per_k: list[list[Tensor]] = [[] for _ in outs]
    for k in range(k_count):  # one backward per chosen logit
        gs = torch.autograd.grad(f[:, k].sum(), outs, retain_graph=k + 1 < k_count,
                                 allow_unused=True)
        for i, (g, o) in enumerate(zip(gs, outs)):
            per_k[i].append(torch.zeros_like(o) if g is None else g.detach())
    return [torch.stack(g) for g in per_k]


def _select_logits(logits: Tensor | None, q: _Query) -> Tensor:
    """``f [B, K]``: the chosen logits of each example.

    ``logits`` is ``[B, C]`` (classification head: ``positions`` ignored, ``token_ids``
    default all ``C`` classes) or ``[B, T, V]`` (language-model head: the row at each
    example's position, then ``token_ids``, required).
    """
    if logits is None or logits.dim() not in (2, 3):
        raise QueryInputError(f"{q.where}: the model's output holds no logits [B, C] or "
                              f"[B, T, V] (got {inputs.show(logits)}): the model must return "
                              "logits (a tensor, or an output with .logits)")
    if logits.dim() == 2:  # classification head: [B, C]
        rows = logits
        ids = q.ids if q.ids is not None else torch.arange(logits.shape[1])
        what = f"the head's {logits.shape[1]} classes"
    else:
        if q.ids is None:
            raise inputs.error(q.where, q.names[2], None,
                               "the K vocabulary ids to query (only a classification head "
                               "defaults to all classes)",
                               problem="is not allowed: token_ids is required for a "
                                       "language-model head (logits [B, T, V])")
        rows = _rows_at_positions(logits, q)  # [B, V]
        ids = q.ids
        what = f"the model's {logits.shape[-1]} vocabulary logits"
    inputs.check_id_range(q.where, q.names[2], q.ids_given, ids, rows.shape[1], what)
    if ids.dim() == 1:
        return rows[:, ids.to(rows.device)]
    return rows.gather(1, ids.to(rows.device))


def _rows_at_positions(logits: Tensor, q: _Query) -> Tensor:
    """``[B, V]`` rows of ``logits [B, T, V]`` at one position per example (negative: counted
    back from the example's last non-padding token, with right or left padding)."""
    B, T = logits.shape[:2]
    idx = inputs.position_index(q.where, q.names[1], q.positions_given,
                                inputs.output_positions(q.batch, T)[1], B, T,
                                q.positions)
    return logits[torch.arange(B, device=logits.device), torch.tensor(idx, device=logits.device)]


def _chosen_layers(where: str, model: nn.Module, snapshot: Snapshot,
                   layers: object) -> list[str]:
    """The snapshot's layers the posterior is over, in the snapshot's order."""
    names = snapshot.layer_names
    if layers is None:
        return list(names)
    presets = tuple(p.value for p in LayerPreset)
    allowed = (f"None, a preset ({', '.join(map(repr, presets))}) or a non-empty list of the "
               f"snapshot's layer names (snapshot.layer_names, e.g. {names[0]!r})")
    if isinstance(layers, str):
        if layers not in presets:
            raise inputs.error(where, "layers", layers, allowed)
        try:
            chosen = preset_layers(model, layers)
        except KFACConfigError as e:
            raise inputs.error(where, "layers", layers, allowed,
                               problem=f"selects nothing here ({e})") from None
        missing = [n for n in chosen if n not in names]
        if missing:
            raise inputs.error(where, "layers", layers, allowed,
                               problem=f"selects {len(missing)} layer(s) the snapshot did not "
                                       f"track (e.g. {missing[0]!r})")
    elif isinstance(layers, Sequence) and layers and all(isinstance(n, str) for n in layers):
        chosen = list(layers)
        unknown = [n for n in chosen if n not in names]
        if unknown:
            raise inputs.error(where, "layers", layers, allowed,
                               problem=f"names {unknown[0]!r}, which the snapshot did not track")
    else:
        raise inputs.error(where, "layers", layers, allowed, typed=not isinstance(layers, list))
    keep = set(chosen)
    return [n for n in names if n in keep]


def _match_layers(model: nn.Module, snapshot: Snapshot,
                  names: Sequence[str]) -> dict[str, nn.Module]:
    from .peft_layers import missing_layer_message, other_architecture

    modules = dict(model.named_modules())
    out = {}
    where = f"snapshot {snapshot.path}"
    for name in names:
        info = snapshot[name].meta
        if name not in modules:  # another architecture; a LoRA layer of a merged model
            raise SnapshotMismatchError(
                other_architecture(where, snapshot.meta, model, modules, snapshot.layer_names,
                                   name, "is not a module of the model")
                or missing_layer_message(where, name, modules))
        spec = layer_spec(name, modules[name])
        want = (info["d_in"], info["d_out"], bool(info["has_bias"]))
        have = (spec.d_in, spec.d_out, spec.has_bias)
        if want != have:
            shapes = (f"has (d_in, d_out, bias) = {have} in the model but {want} in the "
                      "snapshot")
            raise SnapshotMismatchError(
                other_architecture(where, snapshot.meta, model, modules, snapshot.layer_names,
                                   name, shapes)
                or f"{where}: layer {name!r} {shapes}")
        out[name] = modules[name]
    return out
