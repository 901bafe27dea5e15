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
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..capture.selection import layer_spec
from ..snapshot.adequacy import sampling_warning
from ..snapshot.snapshot import Snapshot
from . import inputs, layer_match, tau_grid
from . import kron_eigen as ke
from .calibration import (
    PROBS_METHODS,
    check_range,
    fit_confidence_beta,
    probs_from_gaussian,
)
from .eigen_cache import LazyBases, LazyEigen
from .layer_match import check_whole_weights, chosen_layers, match_layers, warn_other_weights
from .marglik import EvidenceBins
from .num_data import check_num_data, layer_num_data, num_data_unit, warn_far_num_data
from .per_example import QueryArgs, layer_gradients
from .prior_choice import PRIOR_WORDS, resolve_prior
from .sample_layers import weights_sampled

logger = logging.getLogger("kfac_stream")

#: Which logits to select: ``K`` indices for every row (a sequence of ints), or one row of ``K``
#: indices per example (a ``[B, K]`` integer tensor or ``B`` sequences of ``K`` ints).
TokenIds = Sequence[int] | Sequence[Sequence[int]] | Tensor

HELDOUT_ALLOWED = ("an iterable of dicts {'batch', 'token_ids', 'labels' [B], optionally "
                   "'positions'} (a list of one dict for one batch)")


class LaplacePosterior:
    """Laplace posterior over the tracked layers of ``model`` from ``snapshot``.

    Every argument is checked at the call (here and in every method): a value of the wrong type
    or out of range raises `QueryInputError` (a `ValueError`), one line naming the argument,
    the value and what is allowed; so does an input longer than the model's positions
    (``config.n_positions`` or ``max_position_embeddings``: `inputs.check_length`, the CLI's
    message), before the model's forward would fail on it.

    Args:
        model: The trained model (the one the snapshot was tracked on, or a copy), an
            ``nn.Module`` with whole weights (after DeepSpeed ZeRO-3 training:
            ``kfac_stream.gather_model(trainer, save_dir)``).
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
            ``"auto"`` / ``"heldout"``, ``"map"`` if it kept MAP's, else ``"probit"``), or one
            of `PROBS_METHODS` (`probs_from_gaussian`). Where it came from: ``link_source``.

    Warns:
        UserWarning: the model's tracked weights are not those the snapshot was taken at
            (the snapshot's ``weights`` fingerprint, `kfac_stream.snapshot.weights`: a model of
            another run or another step; snapshots older than the fingerprint are not
            checked). A warning, not an error: a model cast to another precision, or one
            queried on purpose with an earlier snapshot's curvature, still works; the message
            names the snapshot, its step and run and the first layer that differs.
        UserWarning: the model has layers the run's selection picks but the snapshot lacks,
            with the snapshot's tracked weights (left out of the run, e.g. frozen: named;
            `layer_match.check_untracked_layers`).

    Raises:
        QueryInputError: an argument of the wrong type or out of range.
        PartitionedModelError: a model whose weights DeepSpeed ZeRO-3 partitions or FSDP2
            shards (also right after ``trainer.train()`` in the same script);
            `kfac_stream.gather_model` gives a whole copy.
        SnapshotMismatchError: the model's layers differ from the snapshot's (missing, of
            another shape, or more of them with other weights: another, deeper network).
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
        self.layer_names = chosen_layers(where, model, snapshot, layers)
        manifest = snapshot.manifest
        self.num_data_unit = unit = num_data_unit(manifest, self.layer_names)
        self.num_data = check_num_data(where, num_data, manifest, unit)
        if num_data is not None:
            warn_far_num_data(where, self.num_data, manifest, unit)
        few = sampling_warning(where, manifest, once=True, source=str(snapshot.path))
        if few is not None:
            warnings.warn(few, UserWarning, stacklevel=2)
        self.layer_num_data = layer_num_data(manifest, self.layer_names, self.num_data, unit)
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
        self.modules = match_layers(model, snapshot, self.layer_names)
        check_whole_weights(where, model, self.modules)
        layer_match.check_untracked_layers(where, model, snapshot, self.modules)
        warn_other_weights(where, snapshot, self.modules)
        self._vocab = inputs.input_vocab(model)
        self._positions = inputs.input_positions(model)
        # Eigenvalue algebra (D, log-determinants, samples) runs in float64; the per-token
        # Jacobian features run in the model's precision (float64 models: float64, else
        # float32 — a float32 model's gradients carry no more digits than that).
        wdtypes = {m.weight.dtype for m in self.modules.values()}
        self.feature_dtype = torch.float64 if torch.float64 in wdtypes else torch.float32
        self.device = next(iter(self.modules.values())).weight.device
        # Nothing widened or moved here: eigenvalues and eigenvectors are converted lazily,
        # per layer, when a query needs them, and cached per stored tensor (a shared A once).
        self.eig = LazyEigen(snapshot, self.layer_names)
        self._qf = LazyBases(snapshot, self.layer_names, self.device, self.feature_dtype)
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
               options: bool = False) -> QueryArgs:
        """Check the arguments of a predictive query (before any model call); ``options``: a
        probability over the ids (``K ≥ 2``). ``token_ids`` None: the snapshot's answer tokens
        when it has them (`Snapshot.answer_tokens`)."""
        size, length = inputs.check_batch(where, names[0], batch, self._vocab,
                                           self._positions)
        batch = inputs.query_batch(where, names[0], batch, self.model)  # seq2seq: decoder ids
        length, _ = inputs.output_positions(batch, length)  # an encoder-decoder's: decoder's
        pos = inputs.answer_positions(where, names[1], positions, batch, size, length,
                                      shift=not inputs.seq2seq_lm(self.model))
        if token_ids is None:
            token_ids = self.answer_tokens
        ids = inputs.check_token_ids(where, names[2], token_ids, size, options)
        return QueryArgs(where=where, names=names, batch=batch, size=size, positions=pos,
                         positions_given=positions, ids=ids, ids_given=token_ids)

    @property
    def answer_tokens(self) -> list[int] | None:
        """The snapshot's answer options (``HeldoutConfig.answer_tokens`` as token ids), the
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
                snapshot's answer tokens (``HeldoutConfig.answer_tokens``), else required. (A
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

    def _jacobian(self, q: QueryArgs) -> tuple[Tensor, Iterator[tuple[str, Tensor]]]:
        """`jacobian_features` of checked arguments. A layer applied several times in one
        forward (ALBERT's shared layers) contributes the sum over its calls, as its weight's
        Jacobian does."""
        f, per_call = layer_gradients(self.model, self.modules, q)

        def features(n: str) -> Tensor:
            return sum(self._features(n, a, g) for a, g in per_call.pop(n))  # over calls

        return f.detach().double(), ((n, features(n)) for n in list(per_call))

    def _features(self, name: str, a: Tensor, g) -> Tensor:
        """``M[b, k] = Σ_t (Q_Gᵀ g_{k,b,t}) (Q_Aᵀ ā_{b,t})ᵀ`` (`tau_grid.layer_features`) of
        the layer's input ``a [B, T, d_in]`` and its K output gradients ``g`` (output-shaped)."""
        return tau_grid.layer_features(*tau_grid.kept_positions(
            a, g, self.snapshot[name].has_bias, self.feature_dtype), *self._qf[name])

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

    def covariance_grid(self, batch: dict[str, Tensor], positions: int | Sequence[int] | None
                        = None, token_ids: TokenIds | None = None, *,
                        prior_precisions: Sequence[float], links: Sequence[str]
                        ) -> tuple[Tensor, dict[str, Tensor]]:
        """`predictive_covariances` at many positive float ``τ``, for what ``links`` (some of
        `PROBS_METHODS`) read, at about the cost of one (`kfac_stream.query.tau_grid`): the
        variances exact (``"probit"``'s, zeros off the diagonal), other links' ``K × K``
        covariances binned by eigenvalue pair: every variance of a logit or of a difference of
        two within a factor `tau_grid.VARIANCE_FACTOR` of the exact. Returns ``(mean [B, K],
        {link: covs [P, B, K, K]})``, float64."""
        where = "LaplacePosterior.covariance_grid"
        taus = tuple(inputs.check_positive(where, "prior_precisions", t) for t in prior_precisions)
        links = tuple(inputs.check_choice(where, "links", k, PROBS_METHODS) for k in links)
        q = self._query(where, batch, positions, token_ids)
        if getattr(self, "_grid", None) is None or self._grid.taus != taus:
            self._grid = tau_grid.PairGrid(self.eig, self.layer_num_data, taus, self.device)
        f, per_call = layer_gradients(self.model, self.modules, q)
        layers = ((n, self.snapshot[n].has_bias, c) for n, c in per_call.items())
        return tau_grid.grid_covariances(self._grid, f, layers, self._qf,
                                         dtype=self.feature_dtype, links=links)

    def _covariances(self, q: QueryArgs, priors: list[float | dict[str, float]]
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
                ``"probit"``); ``"map"``: ``softmax(μ)``, MAP's own; ``"meanfield"``: the
                pairwise mean-field link, which uses the variances of the logit *differences*
                (`probs_from_gaussian`); ``"probit"``: ``softmax(μ / sqrt(1 + π/8 · diag Σ))``,
                laplace-torch's default link; ``"mc"``: the mean of ``softmax(f)`` over
                ``n_samples`` draws ``f ~ N(μ, Σ)``.
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
        return weights_sampled(self, inputs.check_seed("LaplacePosterior.sampled_weights",
                                                        "seed", seed))

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
        lower, upper = check_range(where, lower, upper)
        grid = inputs.check_int(where, "grid", grid, 1)
        iters = inputs.check_int(where, "iters", iters, 1)
        t0 = time.perf_counter()
        norms = self._weight_norms()  # once, not per evaluation
        pairs = [self.eig.eigvals(n, self.device) for n in self.modules]  # (α, γ)
        bins = EvidenceBins([(g * self.layer_num_data[n], a) for n, (a, g) in
                             zip(self.modules, pairs)],  # N_l folded into each γ
                            1.0, [norms[n] for n in self.modules])
        self._prior, passes = bins.maximise(lower, upper, grid, iters,
                                            show_progress=show_progress)
        logger.info("kfac_stream: marginal-likelihood prior precision %(tau).4g over %(layers)d "
                    "layers (%(evals)d evaluations over %(bins)d eigenvalue bins, %(passes)d "
                    "exact Newton passes, %(seconds).1f s)",
                    {"tau": self._prior, "layers": len(self.modules), "evals": grid + iters + 2,
                     "bins": bins.bins, "passes": passes, "seconds": time.perf_counter() - t0})
        return self._prior
