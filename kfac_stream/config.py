"""`KFACConfig`: every knob of the tracker, validated when it is built.

Validation that needs the model (do the include/exclude regexes match a supported layer?) runs
in `KFACStreamCallback.on_train_begin`, before the first training step.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from .curvature import fisher_names
from .enums import FactorForm, LayerPreset, StorageDtype
from .exceptions import KFACConfigError, did_you_mean


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """Configuration of the streaming K-FAC tracker.

    Attributes:
        token_fraction: Share of each forward pass's ``B·T`` positions sampled for the
            factors: a fixed ``ceil(token_fraction·B·T)`` slots drawn on the device among the
            usable (non-padding) positions, weighted so the estimate is unbiased
            (`stats.rows.sample_positions`); the same positions serve every layer of that
            pass. ``1.0`` gives the exact full-batch factors. (Default: 0.05)
        ema_decay: Per-update decay ``λ`` of the token-weighted, bias-free EMA
            ``w ← λ·w + n;  F ← F + (n/w)·(S − F)``; ``1.0`` is the exact running mean
            over every update of the run: ``final_window`` is then off. (Default: 0.95)
        final_window: Share of the training steps at the end (``state.max_steps``, known to
            the Trainer) over which the factors are the exact token-weighted mean of the
            updates instead of the EMA: the first update step at or after ``(1 −
            final_window)·max_steps`` restarts the average (``λ = 0``) and the later ones add
            to it (``λ = 1``), so the last snapshot holds the curvature of the end of training,
            near the trained weights the posterior is for. On a model that fits its data the
            Fisher shrinks by orders of magnitude as the loss falls, and an EMA over earlier
            steps then overstates it by as much (measured on a classifier that reaches 100%
            training accuracy: ``N·tr A·tr G`` summed over layers 2184 with the EMA against
            0.032 from a pass at the trained weights, 0.019 with the final mean; the
            posterior too narrow by that much). Snapshots before the window hold the EMA.
            ``0``: the EMA throughout. The window starts earlier when it would hold fewer than
            ``min_window_sequences`` sequences. Off with ``ema_decay=1.0``, which asks for the
            mean over the whole run (the tracker says so at train begin). (Default: 0.1)
        final_refresh: ``"auto"``, ``"on"`` or ``"off"``: at train end, before the final
            snapshot, replace the factors by their plain mean over a pass at the final weights
            (eval mode, the run's Fisher, every usable position; no optimizer step, the
            training's weights, gradients, data order and generators untouched), over at most
            one epoch and 10% of the training's FLOPs (`kfac_stream.tracking.refresh`). ``"auto"``:
            when the planned final window starts in the first half of the run (its factors
            average weights far from the final ones: a short fine-tune whose window
            ``min_window_sequences`` pushed back); off without a window, under ZeRO-3 / FSDP2
            and with ``ekfac`` (``"on"`` is refused there). (Default: "auto")
        min_window_sequences: The fewest sequences the final window's mean may rest on: the
            window's first update is moved back until its updates hold at least this many
            (``sequences_per_update``: the MC replay's sequences, or every sequence with the
            empirical Fisher, over micro-batches and ranks), up to the whole run. A factor
            ``A`` or ``G`` estimated from few sequences is rank-poor and noisy: the posterior
            falls back to the prior in most directions and comes out far too wide (reported on
            a 300-sequence classifier with 40 updates: the last 10% held 16 sequences and the
            predictive's NLL was up to 1.3x the trained model's). In `benchmarks/suite.py` (six
            tasks) this rule ties the best worst case of the window rules tried (all within
            0.001), and the plain 10% window is the worst on the sample-starved next-token
            task. With a share ``mc_sequences`` (the default), a run whose update steps hold too few
            sequences at that share even over the whole run replays a larger share
            (`kfac_stream.tracking.plan.window_mc_share`, logged at train begin and recorded as the
            snapshot's ``config.mc_sequences``): the same whole number of every update step's
            sequences, so the window then reaches this minimum whenever the run's update steps offer
            as many sequences (counted for full micro-batches; the window counts each step's own
            draw of a share). A run too short to reach it even so uses all its updates, and the
            tracker warns at train begin; snapshots record the window's sequences and each factor's
            sampling error (``sampling`` in the manifest). ``0``: the window is ``final_window``
            alone, and the share is never raised. (Default: 256)
        update_every: Update the factors on every ``update_every``-th optimizer step (steps
            0, k, 2k, ... counted from 0); other steps cost one Python branch per hook. At
            ``token_fraction=0.05`` the factor GEMMs (``n·d(d+1)`` FLOPs per factor and update)
            are ~2.4% of a training step's FLOPs when every step updates, ~0.24% with the
            default (``benchmarks/RESULTS.md``). With ``ema_decay=0.95`` the EMA then spans
            ~200 steps.
            (Default: 10)
        snapshot_every: Write a snapshot every ``snapshot_every`` optimizer steps; one is
            also written at the end of training. (Default: 500)
        fisher: Which Fisher the G factor estimates. ``"mc"``: the Monte-Carlo (type-2)
            Fisher, labels sampled from the model, ``E_y[g gᵀ]`` of the GGN's quality; on
            update steps a REPLAY (a forward and a backward to the tracked layers' outputs
            only, no weight gradients) of ``mc_sequences`` sequences per micro-batch, see
            `kfac_stream.capture.mc_fisher`. ``"empirical"``: the observed labels' gradients,
            taken from the training backward itself (no extra pass); it shrinks with the
            training loss on a model that fits its data, so the posterior it gives is too wide
            (Kunstner et al. 2019). (Default: "mc")
        factor_form: How a layer applied at every token position makes its rows
            (`kfac_stream.curvature`). ``"expand"``: every sampled position is a row, ``N``
            counts token positions (the form for a loss at every position, a causal LM).
            ``"reduce"``: one row per sequence, the mean input and the summed output
            gradient, ``N`` counts sequences (the form for a loss taken once per sequence, a
            classifier; every sequence of a captured micro-batch, no token sampling).
            ``"auto"``: ``"reduce"`` for a ``*ForSequenceClassification`` /
            ``*ForMultipleChoice`` model or a classification / regression ``problem_type``,
            else ``"expand"``. A pooler or head on ``[batch, features]`` has one row per
            sequence under either form. (Default: "expand")
        mc_sequences: What the MC replay runs on (``fisher="mc"``). A share ``f`` in
            ``(0, 1)`` of each update step's sequences on a rank: every sequence of the
            step's micro-batches is drawn with probability exactly ``f`` by systematic
            sampling over them (`kfac_stream.replay_draws.replay_counts`; the same draw
            on every rank), a micro-batch with no sequence drawn is not replayed, so at
            micro-batch 1 a share of the MICRO-BATCHES is replayed, and an update whose
            draw is empty moves no factor (except at step 0, which replays at least one
            sequence, uniform over the step's, so that no run ends with empty factors); the
            drawn rows weigh ``1/f`` (``C`` for that one sequence of ``C``). An int ``k ≥ 1``:
            ``min(k, B)`` sequences of EVERY micro-batch of
            ``B`` (weights ``B/k``). ``"all"`` / ``1.0``: the whole micro-batch, its gradient
            taken inside the training forward (replayed after the step under DeepSpeed
            ZeRO-3, gradient checkpointing, fp16 autocast or active dropout: every replay runs
            in eval mode, ``capture/posterior_mode.py``). Within a replayed micro-batch the
            sequences are drawn uniformly without replacement from a generator seeded by
            ``(seed, rank, step)``, and inside them ``ceil(token_fraction·B·T)`` slots (as
            many as the empirical path takes from the whole micro-batch) with Horvitz–Thompson
            weights.
            A replay (forward + backward to the tracked layers' outputs, no weight
            gradients) costs ~2/3 of a training step's work on what it replays, so the
            default costs ~3.3% of an update step, ~0.33% per step at ``update_every=10``,
            whatever the micro-batch size (`benchmarks/scale.py`: ≤ 1% of a step at
            Llama-2-7B × 8 H100, micro-batch 1). Earlier versions defaulted to ``0.125`` of
            EACH micro-batch, at least one sequence: every sequence at micro-batch 1, ~67%
            extra on update steps. (Default: 0.05)
        include: Regexes (``re.search``) over module names from ``model.named_modules()``;
            a supported layer is tracked if one matches. ``None``: every trainable
            Linear/Conv1D inside the transformer blocks (not the LM head or embeddings).
            (Default: None)
        exclude: Regexes; a layer matching one is never tracked, also with a ``preset``.
            (Default: None)
        preset: A named selection instead of ``include``: ``"last_layer"`` (the output head:
            ``lm_head``, or a classifier's ``score``/``classifier``), ``"lora"`` (the PEFT
            ``lora_A``/``lora_B`` adapters), ``"attention"`` / ``"mlp"`` (the attention /
            feed-forward layers inside the transformer blocks) or ``"all_linear"`` (every
            trainable Linear/Conv1D in the blocks, the same as ``include=None``); rules and
            memory cost in `kfac_stream.capture.presets` and docs/configuration.md. Only
            trainable layers count; ``exclude`` applies on top; setting ``include`` too is an error.
            (Default: None)
        output_dir: Where snapshots go. ``None``: ``<TrainingArguments.output_dir>/kfac``.
            (Default: None)
        storage_dtype: CPU dtype of the stored factors: ``"float16"`` (with a float32 scale
            per factor, EMA arithmetic in float32), ``"float32"`` or ``"float64"`` (EMA in
            float64; for exact tests with float64 models). (Default: "float16")
        max_dense_dim: A factor whose side is longer than this is kept diagonal (the diagonal
            of the same statistic), to bound memory at ``O(d)`` instead of ``O(d²)``.
            (Default: 8192)
        seed: Seed of the token sampler's generator. (Default: 0)
        async_updates: Run the factor arithmetic (second moments, EMA, CPU store) on a
            background thread. ``None``: on when the model is on a CUDA device (the CPU is then
            idle during the step), off on CPU-only training, where a second thread only
            competes with the training thread for the same cores. (Default: None)
        share_inputs: Layers that read the same input tensor (q/k/v, gate/up) share one A
            factor: captured, exchanged, stored and eigendecomposed once (found by a 2-token
            probe forward when training starts; the manifest records it; ``snap[name].A``
            works for every layer). ``False``: one A per layer. (Default: True)
        fold_on: Where the second moments ``XᵀX`` are formed and the EMA runs
            (`kfac_stream.folding`). ``"device"``: on the rows' device (GPU: tensor cores,
            fp32 accumulation) into pending statistics that stay there until a snapshot,
            checkpoint or export reads the factors, then stream through the device into the
            FP16 CPU store (no per-entry host arithmetic); ``"host"``: rows are copied to the
            CPU store, which folds them. ``"auto"``: ``"device"`` on CUDA, ``"host"`` on CPU.
            (Default: "auto")
        device_memory_budget: Bytes of accelerator memory for the resident pending
            statistics (fp32, ``4·d²`` per dense factor, planned largest first) plus the
            accumulation's work space; a factor that does not fit is folded into the host
            store at every update (streamed through the device). ``"auto"``: decided at the
            first update, after the first optimizer step, as ``min(25% of the device,
            50% of what training left free)`` (`kfac_stream.settings.device_budget_from_memory`;
            on an out-of-memory error the store moves its statistics to the host and halves
            the budget). (Default: "auto")
        exchange: How each update's contributions reach a factor's owner with several ranks
            (`distributed.exchange`): ``"rows"`` (the sampled rows, folded by the owner),
            ``"stats"`` (each rank's folded statistic, reduced at the owner) or ``"auto"``
            (per factor, whichever moves fewer bytes). (Default: "auto")
        eigh_device: Where snapshots eigendecompose the factors: ``"auto"`` (the owner's GPU
            when training on one, one factor at a time, float32 with a float64 CPU fallback for a
            factor that fails; else the CPU in float64) or ``"cpu"``. (Default: "auto")
        eigendecompose: When snapshots eigendecompose their factors
            (`kfac_stream.snapshot.eigen_rule`). Every snapshot holds the exact factors and
            their spectra estimated by Lanczos; the eigendecomposition of a periodic one runs
            ``"auto"``: in the run only when its predicted share of the snapshot interval is
            at most 1%, else at its first use (``Snapshot.load(..., eigen=True)``, a
            posterior, the CLI), cached beside it; ``"always"``: in the run; ``"final"``:
            only the final snapshot in the run. The final snapshot is always decomposed.
            With ``ekfac=True`` every snapshot is (its eigenbasis is the next correction's):
            ``"final"`` is refused. (Default: "auto")
        eigh_threads: CPU threads for snapshot eigendecompositions. ``None``: the cores this
            process may use divided by the processes on the node (``LOCAL_WORLD_SIZE``),
            whatever ``OMP_NUM_THREADS`` the launcher set. (Default: None)
        eval_prior_precision: Fit the prior precision ``τ`` and the K-way link on the
            Trainer's ``eval_dataset`` at the end of training (one process; the held-out NLL
            of the linearised predictive over a log grid of ``τ`` and the marginal-likelihood
            value, with the probit link unless the mean-field one wins beyond 2 paired
            standard errors, and MAP's own probabilities kept unless the posterior beats them
            by more than 2 paired standard errors:
            `kfac_stream.query.heldout_tau.fit_prior_precision`: a forward, ``K`` backwards
            and the features per eval batch for ``K`` classes or answer options, 37 eval passes
            at ``K = 10`` on the suite's encoder, ``benchmarks/heldout_cost.py``) and store the
            choice beside the final snapshot (``snap.heldout_prior``), where
            ``LaplacePosterior(model, snap)`` and ``kfac-stream query`` take it by default.
            The end of training logs its verdict: which way the guard went and why, the eval
            NLL of MAP and of the posterior, and MAP's confidence gap.
            ``"auto"`` and ``True`` fit whenever the Trainer has an ``eval_dataset``: a
            classification head on its ``labels [B]``, a language model with
            ``answer_tokens`` on the eval set's answer positions (each row's first labelled
            position, whose label must be one of the answer tokens), and a language model
            without them (a causal LM's texts, a seq2seq LM's targets) per label token of its
            linearised next-token predictive, by Monte Carlo on at most 32 positions of each
            of the first 64 eval rows at 5 ``τ`` around the marginal likelihood's (about 161
            forwards of those rows, `kfac_stream.query.heldout_tokens`), under the same
            guard. ``"auto"`` says in one line why it does not fit (no eval set, an empty
            one, several ranks); ``True`` warns. ``False`` never fits. Without a fit, queries use
            the rule without held-out data (`kfac_stream.query.prior_choice`).
            (Default: "auto")
        answer_tokens: The answer options of a language model's multiple-choice or
            answer-token fine-tune (e.g. ``[" A", " B", " C", " D"]``): two or more distinct
            token ids, or strings that the Trainer's tokenizer (its ``processing_class``)
            encodes as exactly one token each, without special tokens (tokenised once, at train
            begin). Every snapshot records them (``Snapshot.answer_tokens`` ids,
            ``Snapshot.answer_texts``): a query of a language-model head uses them when
            ``token_ids`` / ``options`` is None, ``kfac-stream query`` takes them as its
            ``--options`` by default, and ``eval_prior_precision`` fits ``τ`` on them. A model
            without a language-model head, an id outside its vocabulary, a string that is not
            one token or two options that are the same token fail at train begin, in one line.
            (Default: None)
        fail_on_snapshot_error: Make a failed snapshot (unwritable directory, full disk, a
            failed eigendecomposition) stop training. By default it is logged and counted
            (``counts.snapshot_failures`` in later manifests), training goes on and earlier
            snapshots stay valid. (Default: False)
        ekfac: Also stream the EK-FAC eigenvalue correction (George et al. 2018; kronfluence's
            EK-FAC), `kfac_stream.ekfac`: at every update step after a snapshot, the second
            moment of the per-sequence gradients ``Σ_t g_t ā_tᵀ`` in that snapshot's
            eigenbasis, ``E[(Q_Gᵀ ∇_W L_n Q_A)²]`` (``[d_out, d_A]`` per layer), from the
            sequences the factors are built from at that step (the MC replay's with
            ``fisher="mc"``, every sequence with ``"empirical"``), averaged over the update
            steps until the next snapshot, which stores it beside its eigenvectors
            (``snap[name].ekfac_eigvals``; the first snapshot has none). Its basis is one
            snapshot old (the staleness this accepts: docs/computed.md). Costs, at the
            defaults, ~0.6% of a training step on a 1B Llama (``benchmarks/ekfac_cost.py``)
            and holds every factor's eigenvectors and a weight-sized float32 accumulator per
            layer on the model's device of every rank (counted in the device budget). Several
            ranks sum their corrections at each snapshot (`kfac_stream.distributed.ekfac_sync`);
            the state rides with checkpoints. ``False``: nothing of it runs and the snapshots
            are as without it. (Default: False)
    """

    token_fraction: float = 0.05
    ema_decay: float = 0.95
    final_window: float = 0.1
    final_refresh: str = "auto"
    min_window_sequences: int = 256
    update_every: int = 10
    snapshot_every: int = 500
    fisher: str = "mc"
    factor_form: str = "expand"
    mc_sequences: int | float | str = 0.05
    include: list[str] | None = None
    exclude: list[str] | None = None
    preset: str | None = None
    output_dir: str | None = None
    storage_dtype: str = "float16"
    max_dense_dim: int = 8192
    seed: int = 0
    async_updates: bool | None = None
    share_inputs: bool = True
    fold_on: str = "auto"
    device_memory_budget: int | str = "auto"
    exchange: str = "auto"
    eigh_device: str = "auto"
    eigh_threads: int | None = None
    eigendecompose: str = "auto"
    eval_prior_precision: bool | str = "auto"
    answer_tokens: list[int | str] | None = None
    fail_on_snapshot_error: bool = False
    ekfac: bool = False

    def __post_init__(self) -> None:
        self._check_rates()
        self._check_switches()
        self._check_sizes()
        self._check_kinds()
        self._check_layers()

    def _check_rates(self) -> None:
        """Validate the rates and step counts."""
        _check_range("token_fraction", self.token_fraction, "in (0, 1]",
                     lambda v: 0.0 < v <= 1.0)
        _check_range("ema_decay", self.ema_decay, "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        _check_range("final_window", self.final_window, "in [0, 1)",
                     lambda v: 0.0 <= v < 1.0)
        for name in ("update_every", "snapshot_every", "max_dense_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KFACConfigError(
                    f"KFACConfig.{name}={value!r} is not allowed: must be a positive integer"
                )

    def _check_switches(self) -> None:
        """Validate the switches and the device choices."""
        if not (isinstance(self.eval_prior_precision, bool)
                or self.eval_prior_precision in ("auto",)):  # resolved in the RunPlan
            raise KFACConfigError(f"KFACConfig.eval_prior_precision={self.eval_prior_precision!r}"
                                  " is not allowed: must be 'auto', True or False")
        for name in ("share_inputs", "fail_on_snapshot_error", "ekfac"):
            if not isinstance(getattr(self, name), bool):
                raise KFACConfigError(f"KFACConfig.{name}={getattr(self, name)!r} is not "
                                      "allowed: must be a bool")
        for name, allowed in (("fold_on", ("auto", "device", "host")),
                              ("exchange", ("auto", "rows", "stats")),
                              ("eigh_device", ("auto", "cpu")),
                              ("eigendecompose", ("auto", "always", "final")),
                              ("final_refresh", ("auto", "on", "off"))):
            if getattr(self, name) not in allowed:
                raise KFACConfigError(f"KFACConfig.{name}={getattr(self, name)!r} is not "
                                      f"allowed: must be one of {allowed}")
        if self.ekfac and self.eigendecompose == "final":
            raise KFACConfigError("KFACConfig.eigendecompose='final' is not allowed with "
                                  "ekfac=True: each snapshot's eigenbasis is the next EK-FAC "
                                  "correction's, so every snapshot is decomposed in the run "
                                  "(use 'auto' or 'always')")

        if self.ekfac and self.final_refresh == "on":
            raise KFACConfigError("KFACConfig.final_refresh='on' is not allowed with ekfac=True: "
                                  "the EK-FAC correction is streamed on the previous snapshot's "
                                  "basis over the training steps, which a refresh at the final "
                                  "weights would not match (use 'auto' or 'off')")

    def _check_sizes(self) -> None:
        """Validate the sizes and counts."""
        mws = self.min_window_sequences
        if isinstance(mws, bool) or not isinstance(mws, int) or mws < 0:
            raise KFACConfigError(f"KFACConfig.min_window_sequences={mws!r} is not allowed: "
                                  "must be a non-negative integer (sequences)")
        budget = self.device_memory_budget
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                                 or budget < 0):
            raise KFACConfigError(f"KFACConfig.device_memory_budget={budget!r} is not allowed: "
                                  "must be 'auto' or a non-negative integer (bytes)")
        threads = self.eigh_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):
            raise KFACConfigError(f"KFACConfig.eigh_threads={threads!r} is not allowed: must "
                                  "be None or a positive integer")

    def _check_kinds(self) -> None:
        """Validate the types and the named kinds (Fisher, form, MC share, answers, storage)."""
        if not isinstance(self.fail_on_snapshot_error, bool):
            raise KFACConfigError(f"KFACConfig.fail_on_snapshot_error="
                                  f"{self.fail_on_snapshot_error!r} is not allowed: must be a bool")
        if self.output_dir is not None and not isinstance(self.output_dir, str):
            raise KFACConfigError(f"KFACConfig.output_dir={self.output_dir!r} is not allowed: "
                                  "must be None or a path string")
        if self.async_updates is not None and not isinstance(self.async_updates, bool):
            raise KFACConfigError(f"KFACConfig.async_updates={self.async_updates!r} is not "
                                  "allowed: must be None or a bool")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise KFACConfigError(f"KFACConfig.seed={self.seed!r} is not allowed: must be an int")
        if self.fisher not in fisher_names():
            raise KFACConfigError(
                f"KFACConfig.fisher={self.fisher!r} is not allowed: "
                f"must be one of {fisher_names()}"
            )
        if self.factor_form not in FactorForm:
            raise KFACConfigError(
                f"KFACConfig.factor_form={self.factor_form!r} is not allowed: "
                f"must be one of {tuple(f.value for f in FactorForm)}")
        _check_mc_sequences(self.mc_sequences)
        _check_answer_tokens(self.answer_tokens)
        if self.storage_dtype not in StorageDtype:
            raise KFACConfigError(
                f"KFACConfig.storage_dtype={self.storage_dtype!r} is not allowed: "
                f"must be one of {tuple(d.value for d in StorageDtype)}"
            )

    def _check_layers(self) -> None:
        """Validate the layer selection (regexes, preset)."""
        for name in ("include", "exclude"):
            patterns = getattr(self, name)
            if patterns is None:
                continue
            if not isinstance(patterns, (list, tuple)) or not all(
                    isinstance(p, str) for p in patterns):
                raise KFACConfigError(
                    f"KFACConfig.{name}={patterns!r} is not allowed: must be a list of regex "
                    "strings"
                )
            for p in patterns:
                try:
                    re.compile(p)
                except re.error as e:
                    raise KFACConfigError(
                        f"KFACConfig.{name} has an invalid regex {p!r}: {e}"
                    ) from None
        if self.preset is not None:
            if self.preset not in LayerPreset:
                raise unknown_preset_error(self.preset)
            if self.include is not None:
                raise KFACConfigError(
                    f"KFACConfig.preset={self.preset!r} and include={self.include!r} are both "
                    "set: a preset chooses the layers itself; set one of them (exclude still "
                    "applies on top of a preset)"
                )

    @property
    def mc_full_batch(self) -> bool:
        """The MC pass runs on whole micro-batches (``mc_sequences`` ``"all"`` or ``1.0``)."""
        return mc_full_batch(self.mc_sequences)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view (lists, not tuples), as written into snapshot manifests.
        ``ekfac`` only when on: a run without it writes the manifests it wrote before the
        option existed."""
        out = asdict(self)
        if not out["ekfac"]:
            del out["ekfac"]
        return out


def _named_arguments_only(init):
    """``KFACConfig.__init__`` that names a misspelt argument and the closest ones, in one line
    (a ``TypeError``, as Python's own for an unknown keyword), before the dataclass's."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        known = [f.name for f in fields(KFACConfig)]
        for key in kwargs:
            if key not in known:
                hint = (did_you_mean(key, known)
                        or "the arguments are listed in docs/configuration.md")
                raise TypeError(f"KFACConfig: {key!r} is not an argument: {hint}")
        init(self, *args, **kwargs)
    return __init__


KFACConfig.__init__ = _named_arguments_only(KFACConfig.__init__)


def unknown_preset_error(preset: Any) -> KFACConfigError:
    """The error for a ``preset`` that is no `LayerPreset`: the presets, and the closest ones
    to a misspelt name (``'last-layer'``: did you mean ``'last_layer'``?)."""
    presets = tuple(p.value for p in LayerPreset)
    hint = did_you_mean(preset, presets, repr) if isinstance(preset, str) else None
    return KFACConfigError(f"KFACConfig.preset={preset!r} is not allowed: must be None or one "
                           f"of {presets}" + (f"; {hint}" if hint else ""))


def _check_range(name: str, value: Any, allowed: str, ok) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if bad or not math.isfinite(value) or not ok(value):
        raise KFACConfigError(f"KFACConfig.{name}={value!r} is out of range: must be {allowed}")


def mc_full_batch(spec: int | float | str) -> bool:
    """``mc_sequences`` asks for the whole micro-batch (``"all"`` or the fraction ``1.0``)."""
    return spec == "all" or (isinstance(spec, float) and spec >= 1.0)


def _check_answer_tokens(value: Any) -> None:
    if value is None:
        return
    allowed = ("must be None or a list of two or more distinct answer options, each a token id "
               "(an int >= 0) or a non-empty string of one token (e.g. [' A', ' B', ' C', ' D'])")
    ok = isinstance(value, (list, tuple)) and len(value) >= 2 and all(
        (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
        or (isinstance(v, str) and v != "") for v in value)
    if ok and len(set(value)) != len(value):
        ok, allowed = False, "repeats an option: " + allowed
    if not ok:
        raise KFACConfigError(f"KFACConfig.answer_tokens={value!r} is not allowed: {allowed}")


def _check_mc_sequences(value: Any) -> None:
    ok = (value == "all" if isinstance(value, str) else
          not isinstance(value, bool) and (
              (isinstance(value, int) and value >= 1)
              or (isinstance(value, float) and math.isfinite(value) and 0.0 < value <= 1.0)))
    if not ok:
        raise KFACConfigError(
            f"KFACConfig.mc_sequences={value!r} is not allowed: must be a positive int "
            "(sequences per micro-batch), a fraction in (0, 1], or 'all'")
