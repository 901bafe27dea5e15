"""`kfac-stream` command line: ``train`` (Hydra app), ``inspect``, ``query`` and ``demo``."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .exceptions import KFACStreamError, QueryInputError
from .files import local_path_problem

if TYPE_CHECKING:
    from torch import Tensor

    from .integrations.peft_adapter import AdapterLocation

#: A hub model name (``gpt2``, ``org/name``); anything else that is not a directory is an error.
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _load_snapshot(arg: str, path: str):
    """The snapshot at ``path`` (a snapshot directory, or the newest in a directory of them)."""
    from .snapshot.snapshot import Snapshot

    allowed = ("a snapshot directory (with manifest.json) or a directory of them "
               "(e.g. out/demo/kfac)")
    if not os.path.exists(path):
        raise QueryInputError(f"{arg}={path!r} does not exist: must be {allowed}")
    if not os.path.isdir(path):
        raise QueryInputError(f"{arg}={path!r} is a file: must be {allowed}")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return Snapshot.load(path)
    return Snapshot.latest(path)


def _inspect(args) -> int:
    from .snapshot.adequacy import sampling_summary, sampling_warning
    from .snapshot.layer_table import layer_table

    snap = _load_snapshot("path", args.path)
    print(layer_table(snap))
    s = sampling_summary(snap.meta)
    if s["max_rel_se"] == s["max_rel_se"]:  # recorded (not NaN)
        window = (f"; final window: {s['window_sequences']:,} sequences (min_window_sequences="
                  f"{s['min_window_sequences']:,})" if s["window_sequences"] else "")
        print(f"sampling: largest relative standard error of a factor {s['max_rel_se']:.3g} "
              f"({s['max_rel_se_factor']}), at least {s['min_effective_updates']:.3g} effective "
              f"updates{window}")
    few = sampling_warning("warning", snap.meta)
    if few is not None:
        print(few)
    if args.plot:
        from .snapshot.media import plot_spectra

        try:
            png = plot_spectra(snap, args.plot)
        except (OSError, ValueError) as e:  # an unwritable path, an unknown image format
            raise QueryInputError(f"--plot={args.plot!r} could not be written ({_first_line(e)}):"
                                  " must be a writable image path such as spectra.png") from None
        print(f"spectra: {png}")
    return 0


class _RawByte(str):
    """A byte-level token that is no UTF-8 character by itself (``0x80``-``0xff``): its text is
    ``\\xNN`` and its ``repr`` (what the tables print) ``'\\xNN'``, one backslash, as Python
    writes that byte, not the doubled backslash that ``repr`` gives that text."""

    def __repr__(self) -> str:
        return f"'{self}'"


def _decode(tokenizer, token_id: int) -> str:
    if tokenizer is None:  # byte-level ids
        if token_id >= 256:
            return f"<{token_id}>"
        try:
            return bytes([token_id]).decode("utf-8")
        except UnicodeDecodeError:  # a lead or continuation byte alone
            return _RawByte(f"\\x{token_id:02x}")
    return tokenizer.decode([token_id])


def _first_line(e: BaseException) -> str:
    """``e``'s message, first line (transformers' errors run over several)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _prior_precision(value: str) -> float | str:
    """``--prior-precision``: ``"marglik"`` or a positive finite number."""
    if value == "marglik":
        return value
    try:
        tau = float(value)
    except ValueError:
        tau = math.nan
    if not (math.isfinite(tau) and tau > 0):
        raise QueryInputError(f"--prior-precision={value!r} is not allowed: must be a positive "
                              "finite number or 'marglik'")
    return tau


#: ``--mode``: the per-token whole-vocabulary table, or the top-k next tokens.
MODES = ("tokens", "topk")

#: ``--samples`` by mode: posterior samples for ``tokens`` (one forward-mode pass each of the
#: linearised model, the default; one forward each with ``--weight-samples``), Gaussian draws of
#: the top-k logits per position (cheap) for ``topk``.
DEFAULT_SAMPLES = {"tokens": 32, "topk": 2000}


def _check_paths(args) -> None:
    """``--model`` and ``--tokenizer``: a name that can only be a local path that does not exist
    is refused at once (before the snapshot loads, and before any hub request)."""
    for arg, name, allowed in (
            ("--model", args.model, "must be a model directory written by save_pretrained "
             "(e.g. out/demo/model) or a hub model name"),
            ("--tokenizer", args.tokenizer, "must be a tokenizer directory or a hub name; "
             "pass --byte-level for a byte-level model such as the demo's"),
            ("--base", args.base, "must be the base model's directory (save_pretrained) or hub "
             "name, for a PEFT adapter directory given as --model")):
        problem = None if name is None else local_path_problem(name)
        if problem is not None:
            raise QueryInputError(f"{arg}={name!r} {problem}: {allowed}")


def _check_inputs_given(args) -> None:
    """Exactly one of ``--text`` and ``--file``; ``--text`` non-empty."""
    if args.text is not None and args.file is not None:
        raise QueryInputError("--text and --file are not allowed together: pass exactly one "
                              "(--text TEXT: one input; --file PATH: one input per line, for a "
                              "sequence classifier)")
    if args.text is None and args.file is None:
        raise QueryInputError("one of --text TEXT or --file PATH is required (the input(s) to "
                              "query)")
    if args.file is None and not args.text:
        raise QueryInputError(f"--text={args.text!r} is not allowed: must be a non-empty text "
                              "(the positions to query)")


def _check_query_args(args, task: str, arch: str) -> float | str:
    """The cheap checks of ``query``'s flags for the model's ``task`` (after `_check_paths`
    and `_check_inputs_given`), before anything loads (filling in the defaults of a causal
    LM's flags); returns ``τ``."""
    if task == CLASSIFIER:
        _check_classifier_args(args, arch)
    else:
        _check_lm_args(args)
    return _prior_precision(args.prior_precision)


#: The flags of a causal LM's query, ``(flag, argparse dest)``: refused with a classifier.
LM_ONLY_FLAGS = (("--mode", "mode"), ("--top-k", "top_k"), ("--options", "options"),
                 ("--samples", "samples"), ("--weight-samples", "weight_samples"),
                 ("--seed", "seed"))


def _check_classifier_args(args, arch: str) -> None:
    """A sequence classifier's query takes none of a causal LM's flags."""
    for flag, dest in LM_ONLY_FLAGS:
        if getattr(args, dest) not in (None, False):
            raise QueryInputError(
                f"{flag} is not allowed with a sequence classifier ({arch}): it is a flag of a "
                "causal LM's query; a classifier's prints the MAP and Laplace class "
                "probabilities of each input (--text TEXT or --file PATH)")


def _check_lm_args(args) -> None:
    """A causal LM's flags (filling in the defaults that depend on ``--mode``)."""
    if args.file is not None:
        raise QueryInputError(f"--file={args.file!r} is not allowed with a causal LM: it takes "
                              "one --text (--file is for sequence classifiers)")
    if args.mode is None:  # --top-k asks for the top-k table; else the per-token table
        args.mode = "topk" if args.top_k is not None else "tokens"
    if args.seed is None:
        args.seed = 0
    if args.mode == "tokens" and args.top_k is not None:
        raise QueryInputError(f"--top-k={args.top_k} is not allowed with --mode tokens (its "
                              "table shows the top token): must come with --mode topk")
    if args.top_k is None:
        args.top_k = 5
    if args.top_k < 1:
        raise QueryInputError(f"--top-k={args.top_k} is not allowed: must be an int >= 1 (next "
                              "tokens per position)")
    if args.samples is None:
        args.samples = DEFAULT_SAMPLES[args.mode]
    if args.samples < 2:
        what = ("draws per position for the mean and std" if args.mode == "topk" else
                "posterior samples for the predictive and the mean and std")
        raise QueryInputError(f"--samples={args.samples} is not allowed: must be an int >= 2 "
                              f"({what})")
    if args.mode == "topk" and args.weight_samples:
        raise QueryInputError("--weight-samples is not allowed with --mode topk (always the "
                              "linearised predictive): must come with --mode tokens")
    args.linearized = not args.weight_samples
    if args.options is not None:
        if args.mode == "topk":
            raise QueryInputError(f"--options={args.options!r} is not allowed with --mode topk:"
                                  " must come with --mode tokens (the default)")
        if len(args.options) < 2 or len(set(args.options)) != len(args.options) or not all(
                args.options):
            raise QueryInputError(f"--options={args.options!r} is not allowed: must be two or "
                                  "more distinct non-empty answer strings of one token each "
                                  "(e.g. --options ' A' ' B' ' C' ' D')")


#: ``MODEL_ALLOWED``: what ``--model`` must be.
MODEL_ALLOWED = ("a model directory written by save_pretrained (e.g. out/demo/model) or a hub "
                 "model name")


def _check_model_name(name: str) -> None:
    """``--model``: not empty, not a file, a directory or what may be a hub name."""
    if not name:
        raise QueryInputError(f"--model={name!r} is not allowed: must be {MODEL_ALLOWED}")
    if os.path.isfile(name):
        raise QueryInputError(f"--model={name!r} is a file: must be {MODEL_ALLOWED}")
    problem = local_path_problem(name)
    if problem is None and not os.path.isdir(name) and not HUB_NAME.match(name):
        problem = "does not exist"
    if problem is not None:
        raise QueryInputError(f"--model={name!r} {problem}: must be {MODEL_ALLOWED}")


#: The two tasks `kfac-stream query` answers.
CAUSAL_LM, CLASSIFIER = "causal_lm", "sequence_classification"

#: What each task's model is called in messages.
TASK_NAMES = {CAUSAL_LM: "causal LM", CLASSIFIER: "sequence classifier"}


def _load_model(name: str, task: str = CAUSAL_LM, adapter: AdapterLocation | None = None):
    """``--model``: a causal LM or a sequence classifier (``task``) from a local directory or
    the hub, in float32 and eval mode; refused when its checkpoint lacks weights of the model
    (a head that would be random). With ``adapter`` (``--model`` is a PEFT adapter directory,
    `_adapter`): its base model loaded so, then the adapter on it
    (``PeftModel.from_pretrained``), whose module names are those the snapshot tracked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    loader = AutoModelForSequenceClassification if task == CLASSIFIER else AutoModelForCausalLM
    what = TASK_NAMES[task]
    source = name if adapter is None else adapter.base
    shown = (f"--model={name!r}" if adapter is None else
             f"--model={name!r}: its base model {source!r} ({adapter.base_from})")
    try:
        model, info = loader.from_pretrained(source, dtype=torch.float32,
                                             output_loading_info=True)
    except (OSError, ValueError, ImportError) as e:  # no config / weights, another task
        raise QueryInputError(f"{shown} could not be loaded as a {what} "
                              f"({_first_line(e)}): must be {MODEL_ALLOWED}") from None
    missing = sorted(info.get("missing_keys") or ())
    if adapter is not None:  # modules_to_save (a classifier's head): the adapter holds them
        saved = set(adapter.modules_to_save)
        missing = [k for k in missing if not saved.intersection(k.split("."))]
    if missing:  # a head (or more) the checkpoint lacks would answer with random weights
        raise QueryInputError(
            f"{shown}: its checkpoint has no weights for {len(missing)} parameter(s) "
            f"of the {what} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            ": they would be random; save the whole trained model with save_pretrained")
    if adapter is not None:
        model = _with_adapter(name, adapter, model)
    return model.eval()


def _adapter(args) -> AdapterLocation | None:
    """The PEFT adapter and base model of ``--model`` (`peft_adapter.adapter_location`: the
    base ``kfac_stream.whole_model`` saved beside it, else ``--base``'s, else
    ``adapter_config.json``'s ``base_model_name_or_path``), or None for a model directory or
    hub name that is no adapter."""
    from .integrations.peft_adapter import adapter_location

    location = adapter_location(args.model, args.base)
    if location is None and args.base is not None:
        raise QueryInputError(f"--base={args.base!r} is not allowed: --model={args.model!r} is "
                              "no PEFT adapter directory (no adapter_config.json); --base is "
                              "the base model of one")
    return location


def _with_adapter(name: str, adapter: AdapterLocation, base):
    """``PeftModel.from_pretrained(base, adapter dir)`` of ``--model``, in float32."""
    import torch

    try:
        from .integrations.peft_adapter import load_adapter

        model = load_adapter(adapter, base)
    except ImportError as e:
        raise QueryInputError(f"--model={name!r} is a PEFT adapter directory: loading it needs "
                              f"peft ({_first_line(e)}; pip install 'kfac_stream[peft]')"
                              ) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # adapter of another base
        raise QueryInputError(f"--model={name!r}: its PEFT adapter does not load onto the base "
                              f"model {adapter.base!r} ({adapter.base_from}; {_first_line(e)}):"
                              " pass --base with the model the adapter was trained on"
                              ) from None
    return model.to(torch.float32)


#: Endings of ``config.architectures`` names that `kfac-stream query` answers as a causal LM
#: (the next-token head).
CAUSAL_LM_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")

#: The ending of a sequence classifier's architecture (answered when single-label).
CLASSIFIER_ARCHITECTURE = "ForSequenceClassification"

SUPPORTED = ("kfac-stream query answers causal LMs (*ForCausalLM, *LMHeadModel) and "
             "single-label sequence classifiers (*ForSequenceClassification, num_labels >= 2) "
             "only; for other heads LaplacePosterior.predictive gives the Gaussian of chosen "
             "logits in Python (docs/queries.md)")


def _model_task(name: str, adapter: AdapterLocation | None = None) -> tuple[str, str]:
    """``(task, architecture)`` of ``--model`` from its config alone, before any weight loads:
    `CAUSAL_LM` or `CLASSIFIER`; any other task (token classification, multiple choice,
    regression or multi-label heads, question answering, seq2seq...) is refused in one line,
    since loading it as either would add a randomly initialised head and print plausible
    nonsense. A config that does not load or names no architecture: `CAUSAL_LM` (the loader
    then says what is wrong). For a PEFT adapter directory (``adapter``), the base model's
    config."""
    from transformers import AutoConfig

    _check_model_name(name)
    try:
        config = AutoConfig.from_pretrained(name if adapter is None else adapter.base)
    except (OSError, ValueError):
        return CAUSAL_LM, ""  # from_pretrained of the model says what is wrong
    archs = list(getattr(config, "architectures", None) or ())
    if not archs:
        return CAUSAL_LM, ""
    lm = [a for a in archs if a.endswith(CAUSAL_LM_ARCHITECTURES)]
    if lm:
        return CAUSAL_LM, lm[0]
    cls = [a for a in archs if a.endswith(CLASSIFIER_ARCHITECTURE)]
    if not cls:
        raise QueryInputError(f"--model={name!r} is a {' / '.join(archs)}: {SUPPORTED}")
    problem_type, labels = getattr(config, "problem_type", None), config.num_labels
    if problem_type not in (None, "single_label_classification") or labels < 2:
        kind = problem_type or "regression"  # num_labels = 1, problem_type unset: regression
        raise QueryInputError(f"--model={name!r} is a {cls[0]} with problem_type={kind!r} "
                              f"(num_labels={labels}), not a single-label classifier: "
                              f"{SUPPORTED}")
    return CLASSIFIER, cls[0]


#: The files a tokenizer directory holds (at least one of them): without any, AutoTokenizer
#: may still build a tokenizer from the model's config, with no vocabulary (every word [UNK]).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")

TOKENIZER_HINT = ("pass --byte-level for a byte-level model such as the demo's, or --tokenizer "
                  "DIR for the model's tokenizer")


def _has_tokenizer_files(directory: str) -> bool:
    """Whether ``directory`` holds one of `TOKENIZER_FILES` (False for a hub name)."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def _tokenizer(args):
    """The tokenizer of ``--tokenizer`` (default ``--model``), or None with ``--byte-level``.
    A directory without tokenizer files, a tokenizer that does not load or one that knows no
    more than its special tokens is an error (never words silently mapped to [UNK])."""
    if args.byte_level:
        return None
    from transformers import AutoTokenizer

    source = args.tokenizer or args.model
    arg = "--tokenizer" if args.tokenizer else "--model"
    adapter = getattr(args, "adapter", None)
    if source == args.model and adapter is not None and not _has_tokenizer_files(source):
        source, arg = adapter.base, "--base" if args.base else "--model's base model"
    problem = local_path_problem(source)
    if problem is not None:
        raise QueryInputError(f"{arg}={source!r} {problem}: {TOKENIZER_HINT}")
    if os.path.isdir(source) and not _has_tokenizer_files(source):
        raise QueryInputError(f"{arg}={source!r} has no tokenizer files (none of "
                              f"{', '.join(TOKENIZER_FILES[:3])}, ...): {TOKENIZER_HINT}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # each tokenizer class fails in its own way (a missing file,
        # sentencepiece not installed, a vocabulary it cannot read): all are the user's to fix
        raise QueryInputError(f"{arg}={source!r} holds no tokenizer that loads "
                              f"({_first_line(e)}): {TOKENIZER_HINT}") from None
    special = len(set(getattr(tokenizer, "all_special_ids", ()) or ()))
    if len(tokenizer) <= special:
        raise QueryInputError(f"{arg}={source!r}: its tokenizer knows only its {special} "
                              f"special token(s), no vocabulary (tokenizer files missing?): "
                              f"{TOKENIZER_HINT}")
    return tokenizer


def _shown(where: str, text: str) -> str:
    """An input in a message: ``--text='...'``, or ``--file='f' line 3 ('...')``."""
    return f"--text={text!r}" if where == "--text" else f"{where} ({text!r})"


def _token_ids(args, tokenizer, model, text: str, where: str = "--text") -> list[int]:
    """The ids of one input ``text`` (``where``: ``--text`` or ``--file='f' line n``), checked
    against the model's vocabulary and positions."""
    source = args.tokenizer or args.model
    if tokenizer is None:  # --byte-level
        ids = list(text.encode("utf-8"))
    else:
        ids = list(tokenizer(text)["input_ids"])
        if not ids:
            arg = "--tokenizer" if args.tokenizer else "--model"
            raise QueryInputError(f"{arg}={source!r}: its tokenizer turns {_shown(where, text)} "
                                  f"into no tokens (it knows {len(tokenizer)} tokens; no "
                                  f"tokenizer files there?): {TOKENIZER_HINT}")
    emb = model.get_input_embeddings()
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and max(ids) >= vocab:
        what = "UTF-8 bytes (--byte-level)" if args.byte_level else f"the tokenizer of {source!r}"
        raise QueryInputError(f"{_shown(where, text)}: {what} give token id {max(ids)}, but the "
                              f"model's vocabulary has {vocab} tokens: pass the model's own "
                              "tokenizer (--tokenizer DIR, or --byte-level for the demo's model)")
    limit = getattr(model.config, "n_positions", None) or getattr(
        model.config, "max_position_embeddings", None)
    if limit is not None and len(ids) > limit:
        raise QueryInputError(f"{where} is {len(ids)} tokens long: must be at most {limit} "
                              "tokens (the model's positions)")
    return ids


def _encode(args, model, tokenizer=None) -> tuple[object | None, list[int]]:
    """``(tokenizer or None for --byte-level, the ids of --text)``, checked against the model
    (``tokenizer``: one `_tokenizer` already loaded)."""
    if tokenizer is None:
        tokenizer = _tokenizer(args)
    return tokenizer, _token_ids(args, tokenizer, model, args.text)


def _texts(args) -> list[tuple[str, str]]:
    """The inputs ``[(text, where)]``: ``--text``, or each non-blank line of ``--file`` (UTF-8;
    ``where`` names the file and line)."""
    if args.file is None:
        return [(args.text, "--text")]
    path = args.file
    if not os.path.exists(path) or os.path.isdir(path):
        problem = "does not exist" if not os.path.exists(path) else "is a directory"
        raise QueryInputError(f"--file={path!r} {problem}: must be a text file with one input "
                              "per line")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise QueryInputError(f"--file={path!r} could not be read ({_first_line(e)}): must be a "
                              "UTF-8 text file with one input per line") from None
    texts = [(line, f"--file={path!r} line {n}") for n, line in enumerate(lines, 1)
             if line.strip()]
    if not texts:
        raise QueryInputError(f"--file={path!r} holds no input: must be a text file with one "
                              "input per (non-blank) line")
    return texts


def _status(message: str) -> None:
    """One line of what ``query`` is doing, on stderr (stdout keeps the table alone)."""
    print(f"kfac-stream query: {message}", file=sys.stderr, flush=True)


def _option_ids(args, tokenizer, vocab: int | None) -> list[int]:
    """The token id of each ``--options`` string (each must be exactly one token)."""
    ids = []
    for option in args.options:
        if tokenizer is None:
            toks = list(option.encode("utf-8"))
            how, hint = "UTF-8 bytes (--byte-level)", "one ASCII character, e.g. A"
        else:
            toks = list(tokenizer(option, add_special_tokens=False)["input_ids"])
            how, hint = "tokens", "often with a leading space, e.g. ' A'"
        if len(toks) != 1:
            shown = " ".join(repr(_decode(tokenizer, t)) for t in toks)
            raise QueryInputError(f"--options: {option!r} is {len(toks)} {how} ({shown}): each "
                                  f"option must encode to exactly one token ({hint})")
        if vocab is not None and toks[0] >= vocab:
            raise QueryInputError(f"--options: {option!r} is token id {toks[0]}, but the "
                                  f"model's vocabulary has {vocab} tokens")
        ids.append(toks[0])
    return ids


def _recorded_options(snap, tokenizer, vocab: int | None) -> tuple[list[str], list[int]]:
    """``(texts, ids)`` of the snapshot's answer tokens (``KFACConfig.answer_tokens``), the
    options of a query without ``--options``: the texts recorded, else the ids decoded."""
    ids = [int(i) for i in snap.answer_tokens]
    texts = getattr(snap, "answer_texts", None)
    texts = list(texts) if texts else [str(_decode(tokenizer, i)) for i in ids]
    if vocab is not None and max(ids) >= vocab:
        raise QueryInputError(f"--snapshot={str(snap.path)!r}: its answer tokens {ids} (the "
                              f"options when --options is not given) reach past the model's "
                              f"vocabulary of {vocab} tokens: a snapshot of another model?")
    return texts, ids


def _model_shown(args) -> str:
    """``--model`` in a status line: with its base model when it is a PEFT adapter."""
    adapter = getattr(args, "adapter", None)
    return args.model if adapter is None else (
        f"{args.model} (PEFT adapter on base model {adapter.base})")


def _base_meta(args) -> dict:
    """``{"base": ...}`` (the base model of a PEFT adapter directory) for the JSON, or {}."""
    adapter = getattr(args, "adapter", None)
    return {} if adapter is None else {"base": adapter.base}


def _query(args) -> int:
    """``kfac-stream query``: the model's task from its config, then a causal LM's per-token
    table (or top-k) or a sequence classifier's class probabilities."""
    t0 = time.perf_counter()
    _check_paths(args)
    _check_inputs_given(args)
    args.adapter = _adapter(args)
    task, arch = _model_task(args.model, args.adapter)
    tau = _check_query_args(args, task, arch)
    tokenizer = _tokenizer(args)
    if task == CLASSIFIER:
        return _classify(args, tau, arch, tokenizer, t0)
    _status(f"loading snapshot {args.snapshot} ...")
    snap = _load_snapshot("--snapshot", args.snapshot)

    import torch

    from .query import token_table as tt
    from .query.laplace import LaplacePosterior

    _status(f"snapshot {snap.path}: {len(snap)} layers; loading model {_model_shown(args)} ...")
    model = _load_model(args.model, adapter=args.adapter)
    tokenizer, ids = _encode(args, model, tokenizer)
    option_ids, options_from = None, None
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if args.options is not None:
        option_ids, options_from = _option_ids(args, tokenizer, vocab), "--options"
    elif args.mode == "tokens" and getattr(snap, "answer_tokens", None):
        args.options, option_ids = _recorded_options(snap, tokenizer, vocab)
        options_from = "snapshot"
        _status(f"options {' '.join(map(repr, args.options))}: the snapshot's answer tokens "
                "(KFACConfig.answer_tokens; --options overrides them)")
    if tau == "marglik":
        _status(f"choosing the prior precision by marginal likelihood over {len(snap)} layers "
                "(--prior-precision FLOAT skips it) ...")
    post = LaplacePosterior(model, snap, prior_precision=tau)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **_base_meta(args), "text": args.text, "mode": args.mode,
            "num_data": float(post.num_data), "prior_precision": float(post.prior_precision),
            "samples": args.samples, "seed": args.seed}
    decode = lambda i: _decode(tokenizer, i)  # noqa: E731
    answers = None
    if args.mode == "topk":
        from .query.topk import topk_predictive

        meta["top_k"] = args.top_k
        _status(f"{len(ids)} positions x top-{args.top_k} next tokens "
                f"({time.perf_counter() - t0:.1f} s so far) ...")
        rows = topk_predictive(post, torch.tensor(ids), k=args.top_k, n_samples=args.samples,
                               seed=args.seed)
        records = tt.topk_records(ids, rows, decode)
        table = tt.topk_table(records, args.top_k)
    else:
        from .query.sampled import sampled_predictive

        meta["linearized"] = args.linearized
        _status(f"{len(ids)} positions x {args.samples} posterior samples"
                f"{' (linearised)' if args.linearized else ''} "
                f"({time.perf_counter() - t0:.1f} s so far) ...")
        batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids),
                                                                               dtype=torch.long)}
        with torch.no_grad():
            map_probs = torch.softmax(model(**batch).logits[0].double(), -1)
        pred = sampled_predictive(post, batch, n_samples=args.samples, seed=args.seed,
                                  labels="next", linearized=args.linearized)
        records = tt.token_records(ids, pred, map_probs, decode)
        table = tt.token_table(records)
        if option_ids is not None:
            from .query.answers import answer_distribution

            _status(f"answer agreement of {len(option_ids)} options over {args.samples} "
                    "posterior samples ...")
            dist = answer_distribution(post, batch, options=option_ids,
                                       n_samples=args.samples, seed=args.seed,
                                       linearized=args.linearized)
            meta["options"] = list(args.options)
            meta["options_from"] = options_from
            answers = tt.answer_record(args.options, option_ids, dist)
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    if args.json:
        print(tt.document(meta, records, answers))
    else:
        if args.mode == "topk":  # the line that opened the top-k table since issue 15
            print(f"snapshot {snap.path} (step {snap.step}); N = {post.num_data:.0f}, "
                  f"prior precision = {post.prior_precision:.4g}")
        print(table)
        if answers is not None:
            print()
            print(tt.answer_table(answers, len(ids) - 1))
        print(tt.footer(meta))
    _status(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


# -- a sequence classifier's query: per input the MAP class probabilities, the Laplace
# predictive's (from `LaplacePosterior.predictive`: mean [B, C], cov [B, C, C], and
# `probs_from_gaussian`), the predicted label and its uncertainty; records are plain dicts
# (JSON-ready) and the table is built from them, so the text and --json print the same.

#: Widest input cell (the text's ``repr``; longer ones end in ``…``).
TEXT_WIDTH = 60

CLASSES_EXPLAINED = (
    "per input: MAP p = softmax of the trained model's logits; Laplace p = the linearised Laplace "
    "predictive (LaplacePosterior.predictive_probs, mean-field link); logit = the class logit's "
    "posterior mean ± std; * = the predicted label (the largest Laplace p); H = entropy of "
    "Laplace p in nats; sd = the std of the predicted label's logit")


def _label_names(id2label: Mapping | None, num_classes: int) -> list[str]:
    """The ``num_classes`` label names: ``config.id2label``'s when any is not transformers'
    default ``LABEL_i``, else the class indices ``"0"``, ``"1"``, ...; keys may be ints or
    strings (a config read back from JSON)."""
    given = {int(k): str(v) for k, v in (id2label or {}).items()}
    if all(given.get(i, f"LABEL_{i}") == f"LABEL_{i}" for i in range(num_classes)):
        return [str(i) for i in range(num_classes)]
    return [given.get(i, str(i)) for i in range(num_classes)]


def _entropy_nats(p: Tensor) -> Tensor:
    """``[B]`` entropy in nats of the rows of ``p [B, C]`` (``0 log 0 = 0``)."""
    import torch

    return torch.special.entr(p).sum(-1)


def _class_records(texts: Sequence[str], lengths: Sequence[int], names: Sequence[str],
                   mean: Tensor, cov: Tensor, probs: Tensor) -> list[dict]:
    """One record per input.

    Args:
        texts: The ``B`` input texts.
        lengths: Their token counts.
        names: The ``C`` label names (`_label_names`).
        mean: ``[B, C]`` MAP logits (the predictive mean).
        cov: ``[B, C, C]`` the logits' posterior covariance.
        probs: ``[B, C]`` the Laplace predictive probabilities.

    Returns:
        Dicts with ``index``, ``text``, ``tokens``, ``label_id``, ``label`` (the argmax of
        ``probs``), ``map_label_id``, ``map_label``, ``entropy`` (of ``probs``),
        ``map_entropy``, ``label_logit_std``, and per class ``map_probs``, ``probs``,
        ``logit_mean``, ``logit_std``.
    """
    import torch

    mean, cov, probs = (x.detach().double().cpu() for x in (mean, cov, probs))
    map_probs = torch.softmax(mean, -1)  # [B, C]
    std = torch.diagonal(cov, dim1=-2, dim2=-1).clamp(min=0).sqrt()  # [B, C]
    label, map_label = probs.argmax(-1), map_probs.argmax(-1)  # [B]
    entropy, map_entropy = _entropy_nats(probs), _entropy_nats(map_probs)
    out = []
    for b, text in enumerate(texts):
        k, m = int(label[b]), int(map_label[b])
        out.append({"index": b, "text": text, "tokens": int(lengths[b]), "label_id": k,
                    "label": names[k], "map_label_id": m, "map_label": names[m],
                    "entropy": float(entropy[b]), "map_entropy": float(map_entropy[b]),
                    "label_logit_std": float(std[b, k]),
                    "map_probs": map_probs[b].tolist(), "probs": probs[b].tolist(),
                    "logit_mean": mean[b].tolist(), "logit_std": std[b].tolist()})
    return out


def _class_summary(r: Mapping) -> str:
    """The line under an input's classes: its label, their probabilities, H and sd."""
    k = r["label_id"]
    map_note = ("" if r["map_label_id"] == k else f", MAP label {r['map_label']!r}")
    return (f"label {r['label']!r} (Laplace p {r['probs'][k]:.4f}, MAP p {r['map_probs'][k]:.4f}"
            f"{map_note}); H = {r['entropy']:.4f} nats; sd = {r['label_logit_std']:.4f}")


def _class_table(records: Sequence[Mapping], names: Sequence[str]) -> str:
    """The text of `_class_records`: the explanation line, then per input a line ``input i:
    'text'``, its classes (one row each: name, MAP p, Laplace p, logit mean±std, ``*`` on the
    predicted label; probabilities to 4 decimals, logits to 3) and a `_class_summary` line.
    The class rows of every input share one set of column widths."""
    from .query.token_table import pad, show_token, width

    heads = ["class", "MAP p", "Laplace p", "logit"]
    rows = {(r["index"], c): [name, f"{r['map_probs'][c]:.4f}", f"{r['probs'][c]:.4f}",
                              f"{r['logit_mean'][c]:.3f}±{r['logit_std'][c]:.3f}"]
            for r in records for c, name in enumerate(names)}
    widths = [max(width(h), *(width(row[j]) for row in rows.values()))
              for j, h in enumerate(heads)]

    def line(cells: Sequence[str], mark: str = "") -> str:
        return ("  " + "  ".join(pad(c, w, j == 0) for j, (c, w) in
                                 enumerate(zip(cells, widths))) + mark).rstrip()

    out = [CLASSES_EXPLAINED]
    for r in records:
        out += [f"input {r['index']}: {show_token(r['text'], TEXT_WIDTH)}", line(heads)]
        out += [line(rows[r["index"], c], "  *" if c == r["label_id"] else "")
                for c in range(len(names))]
        out.append("  " + _class_summary(r))
    return "\n".join(out)


def _class_footer(meta: Mapping, inputs: int) -> str:
    """``snapshot … (step …); Arch, C classes; N = …, prior precision τ = …, meanfield link;
    n inputs; … s``."""
    return (f"snapshot {meta['snapshot']} (step {meta['step']}); {meta['architecture']}, "
            f"{len(meta['labels'])} classes; N = {meta['num_data']:.0f}, prior precision τ = "
            f"{meta['prior_precision']:.4g}, {meta['link']} link; {inputs} "
            f"input{'s' if inputs != 1 else ''}; {meta['seconds']:.1f} s")


def _class_document(meta: Mapping, records: Sequence[Mapping]) -> str:
    """One JSON document: ``meta``'s fields and ``"inputs": records``."""
    import json

    return json.dumps({**meta, "inputs": list(records)}, indent=1, allow_nan=False)


#: Inputs per forward (and per batched backward) of a classifier's query: memory grows with
#: it as ``B · C · d_out · d_A`` per layer.
CLASSIFY_BATCH = 16

#: A classifier's link from the logits' Gaussian to probabilities: `predictive_probs`'s default.
CLASSIFY_LINK = "meanfield"


def _class_batches(ids: list[list[int]], pad_id: int | None) -> list[dict]:
    """The inputs' batches: ``{"input_ids", "attention_mask"}``, each ``[B, T]``, up to
    `CLASSIFY_BATCH` inputs right-padded with the model's ``pad_token_id`` (mask 0); one
    input per batch when the model has none (GPT-2's classifier finds each input's last token
    by it and refuses a batch of several without it)."""
    import torch

    size = 1 if pad_id is None else CLASSIFY_BATCH
    batches = []
    for start in range(0, len(ids), size):
        chunk = ids[start:start + size]
        T = max(len(x) for x in chunk)
        input_ids = torch.full((len(chunk), T), 0 if pad_id is None else pad_id,
                               dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, x in enumerate(chunk):
            input_ids[b, :len(x)] = torch.tensor(x)
            mask[b, :len(x)] = 1
        batches.append({"input_ids": input_ids, "attention_mask": mask})
    return batches


def _class_predictive(post, batches: list[dict]) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean [B, C], cov [B, C, C], probs [B, C])`` over every input: the linearised
    predictive of all classes (`LaplacePosterior.predictive`) and its probabilities by the
    documented default link (`probs_from_gaussian`, as `predictive_probs` gives them)."""
    import torch

    from .query.laplace import probs_from_gaussian

    means, covs = zip(*(post.predictive(b) for b in batches))
    mean, cov = torch.cat(means), torch.cat(covs)
    return mean, cov, probs_from_gaussian(mean, cov, CLASSIFY_LINK)


def _classify(args, tau, arch: str, tokenizer, t0: float) -> int:
    """A sequence classifier's query: per input the MAP and Laplace class probabilities, the
    predicted label and its uncertainty (a table, or ``--json``)."""
    from .query.laplace import LaplacePosterior

    texts = _texts(args)
    _status(f"loading snapshot {args.snapshot} ...")
    snap = _load_snapshot("--snapshot", args.snapshot)
    _status(f"snapshot {snap.path}: {len(snap)} layers; loading {arch} {_model_shown(args)} ...")
    model = _load_model(args.model, CLASSIFIER, args.adapter)
    ids = [_token_ids(args, tokenizer, model, text, where) for text, where in texts]
    if tau == "marglik":
        _status(f"choosing the prior precision by marginal likelihood over {len(snap)} layers "
                "(--prior-precision FLOAT skips it) ...")
    post = LaplacePosterior(model, snap, prior_precision=tau)
    _status(f"{len(ids)} input{'s' if len(ids) != 1 else ''} x {model.config.num_labels} "
            f"classes ({time.perf_counter() - t0:.1f} s so far) ...")
    mean, cov, probs = _class_predictive(post, _class_batches(ids, model.config.pad_token_id))
    names = _label_names(model.config.id2label, mean.shape[1])
    records = _class_records([t for t, _ in texts], [len(x) for x in ids], names, mean, cov,
                             probs)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **_base_meta(args), "task": CLASSIFIER, "architecture": arch, "file": args.file,
            "num_data": float(post.num_data), "prior_precision": float(post.prior_precision),
            "link": CLASSIFY_LINK, "labels": names,
            "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(_class_document(meta, records))
    else:
        print(_class_table(records, names))
        print(_class_footer(meta, len(records)))
    _status(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kfac-stream", description="streaming K-FAC tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="per-layer table of a snapshot (or the newest in a dir)")
    ins.add_argument("path")
    ins.add_argument("--plot", metavar="PNG", help="also draw the eigenvalue spectra")
    q = sub.add_parser(
        "query", help="a causal LM: per-token uncertainty of a text under the posterior (or "
        "its top-k next tokens); a sequence classifier: the MAP and Laplace class "
        "probabilities of each input", description="Query a trained model under the Laplace "
        "posterior of a snapshot. The task comes from the model's config (architectures, "
        "problem_type, num_labels): a causal LM (*ForCausalLM, *LMHeadModel) gets the per-token "
        "table of one --text (or --top-k); a single-label sequence classifier "
        "(*ForSequenceClassification) gets, per input (--text, or --file with one input per "
        "line), the MAP class probabilities, the Laplace predictive's (mean-field link), the "
        "predicted label, its entropy and logit std. Other tasks are refused. Without "
        "tokenizer files, pass --byte-level or --tokenizer DIR.")
    q.add_argument("--snapshot", required=True, help="snapshot directory (or its parent)")
    q.add_argument("--model", required=True, help="model directory or hub name (a causal LM "
                   "or a sequence classifier)")
    q.add_argument("--text", help="the input (exactly one of --text and --file)")
    q.add_argument("--file", metavar="PATH", help="sequence classifiers: a UTF-8 file of "
                   "inputs, one per line (blank lines skipped), batched with padding")
    q.add_argument("--tokenizer", help="tokenizer directory (default: --model; it must hold "
                   "tokenizer files, else pass --byte-level)")
    q.add_argument("--base", help="the base model of a PEFT (LoRA) adapter directory given as "
                   "--model (default: the base/ that kfac_stream.whole_model saves beside the "
                   "adapter, else adapter_config.json's base_model_name_or_path)")
    q.add_argument("--byte-level", action="store_true", help="token id = UTF-8 byte (the demo)")
    q.add_argument("--mode", choices=MODES, help="causal LMs: tokens: per position the next "
                   "token's predictive probability, entropy, aleatoric and epistemic parts over "
                   "the whole vocabulary, from posterior samples; topk: the top-k next "
                   "tokens with mean p +- std (default: topk if --top-k is given, else tokens)")
    q.add_argument("--top-k", type=int, help="causal LMs: next tokens per position (--mode "
                   "topk; default 5)")
    q.add_argument("--prior-precision", default="marglik", help="a float or 'marglik'")
    q.add_argument("--samples", type=int, help="causal LMs: posterior samples (--mode tokens, "
                   f"default {DEFAULT_SAMPLES['tokens']}) or draws per position (--mode topk, "
                   f"default {DEFAULT_SAMPLES['topk']})")
    q.add_argument("--seed", type=int, help="causal LMs: seed of the samples (default 0)")
    q.add_argument("--weight-samples", action="store_true", help="causal LMs, --mode tokens: "
                   "evaluate the network at the posterior samples theta_s instead of the "
                   "linearised model f* + J(theta_s - theta*) (the default; the network at "
                   "theta_s is often far flatter than the trained model: docs/queries.md)")
    q.add_argument("--options", nargs="+", metavar="OPTION", help="causal LMs: answer options, "
                   "one token each (e.g. ' A' ' B' ' C' ' D'): also print which one each "
                   "posterior sample picks at the last position, and their agreement "
                   "(default: the snapshot's answer tokens, KFACConfig.answer_tokens, if any)")
    q.add_argument("--json", action="store_true", help="print one JSON document instead of "
                   "the table")
    sub.add_parser("demo", help="kfac-stream train with its offline defaults into out/demo "
                   "(= kfac-stream train --config-name demo)", add_help=False)
    sub.add_parser("train", help="the Hydra training app (kfac_stream.train): "
                   "kfac-stream train [-cd DIR] [-cn NAME] key=value ... (configs shipped in "
                   "conf/; --help: Hydra's help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("train", "demo"):  # Hydra parses its own command line
        from .train import cli_main as train_main

        # demo: the shipped conf/demo.yaml (config.yaml into out/demo), as a
        # leading flag, so the user's own flags and overrides follow in any order Hydra accepts
        demo = ["--config-name", "demo"] if argv[0] == "demo" else []
        sys.argv = [f"kfac-stream {argv[0]}", *demo, *argv[1:]]
        train_main()
        return 0
    args, rest = p.parse_known_args(argv)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return _inspect(args) if args.cmd == "inspect" else _query(args)
    except KFACStreamError as e:  # a user error: one line, no traceback (exit code 2)
        print(f"kfac-stream {args.cmd}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
