"""`kfac-stream` command line: ``train`` (Hydra app), ``inspect``, ``query``, ``influence``
and ``demo``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .exceptions import KFACStreamError, QueryInputError, did_you_mean
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
    from .snapshot.adequacy import rel_se_verdict, sampling_summary, sampling_warning
    from .snapshot.layer_table import layer_table

    snap = _load_snapshot("path", args.path)
    print(layer_table(snap))
    s = sampling_summary(snap.meta)
    if s["max_rel_se"] == s["max_rel_se"]:  # recorded (not NaN)
        window = (f"; final window: {s['window_sequences']:,} sequences (min_window_sequences="
                  f"{s['min_window_sequences']:,})" if s["window_sequences"] else "")
        print(f"sampling: largest relative standard error of a factor {rel_se_verdict(s)}, "
              f"factor {s['max_rel_se_factor']}, at least {s['min_effective_updates']:.3g} "
              f"effective updates{window}")
    few = sampling_warning("warning", snap.meta)
    if few is not None:
        print(few)
    print(_prior_line(snap))
    if args.plot:
        from .snapshot.media import plot_spectra

        try:
            png = plot_spectra(snap, args.plot)
        except (OSError, ValueError) as e:  # an unwritable path, an unknown image format
            raise QueryInputError(f"--plot={args.plot!r} could not be written ({_first_line(e)}):"
                                  " must be a writable image path such as spectra.png") from None
        print(f"spectra: {png}")
    return 0


def _prior_line(snap) -> str:
    """``inspect``'s line on the prior precision a query of this snapshot uses by default:
    the stored held-out fit's verdict, or the rule without held-out data."""
    from .query.prior_choice import NO_HELDOUT_LINK

    fit = snap.heldout_prior
    if fit is None:
        return ("prior precision: no held-out fit stored; queries use the rule without "
                f"held-out data (tau by marginal likelihood, {NO_HELDOUT_LINK} link)")
    return f"prior precision: {fit.verdict()} (queries use it by default)"


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


def _word_or_number(flag: str, value: str, words: tuple[str, ...], allowed: str
                    ) -> float | str:
    """A flag's value: one of ``words``, or a positive finite number (else a one-line
    `QueryInputError` naming ``allowed``)."""
    if value in words:
        return value
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise QueryInputError(f"{flag}={value!r} is not allowed: must be {allowed}")
    return x


def _prior_precision(value: str, words: tuple[str, ...] = ("marglik",)) -> float | str:
    """``--prior-precision``: one of ``words`` or a positive finite number."""
    return _word_or_number("--prior-precision", value, words,
                           "a positive finite number or " + " or ".join(map(repr, words)))


#: ``query --prior-precision``'s words (`kfac_stream.query.prior_choice`).
QUERY_PRIOR_WORDS = ("auto", "heldout", "marglik")
#: ``query --link``: the links `LaplacePosterior.predictive_probs` takes.
QUERY_LINKS = ("meanfield", "probit", "mc")


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
    if args.max_length is not None and args.max_length < 1:
        raise QueryInputError(f"--max-length={args.max_length} is not allowed: must be a "
                              "positive number of tokens (at most the model's positions)")


def _check_query_args(args, task: str, arch: str) -> float | str:
    """The cheap checks of ``query``'s flags for the model's ``task`` (after `_check_paths`
    and `_check_inputs_given`), before anything loads (filling in the defaults of a causal
    LM's flags); returns ``τ``."""
    if task == CLASSIFIER:
        _check_classifier_args(args, arch)
    else:
        _check_lm_args(args)
    if args.link is not None and args.link not in QUERY_LINKS:
        raise QueryInputError(f"--link={args.link!r} is not allowed: must be one of "
                              f"{', '.join(QUERY_LINKS)} (default: the held-out fit's link when "
                              "one is stored beside the snapshot)")
    return _prior_precision(args.prior_precision, QUERY_PRIOR_WORDS)


def _posterior(args, model, snap, tau):
    """The query's `LaplacePosterior` (``--prior-precision``, ``--link``), its choice said on
    stderr."""
    from .query.laplace import LaplacePosterior

    if tau == "marglik" or (tau == "auto" and snap.heldout_prior is None):
        _status(f"choosing the prior precision by marginal likelihood over {len(snap)} layers "
                "(--prior-precision FLOAT skips it) ...")
    post = LaplacePosterior(model, snap, prior_precision=tau, link=args.link)
    _status(post.describe())
    return post


def _prior_meta(post) -> dict:
    """The JSON fields that say which ``τ`` and link a query used and where they came from,
    with the held-out fit's verdict when one was used."""
    meta = {"num_data": float(post.num_data), "prior_precision": float(post.prior_precision),
            "prior_source": post.prior_source, "link": post.link,
            "link_source": post.link_source}
    if post.heldout is not None:
        meta["heldout"] = {"verdict": post.heldout.verdict(), **post.heldout.to_dict()}
    return meta


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


def _model_task(name: str, adapter: AdapterLocation | None = None,
                supported: str = SUPPORTED) -> tuple[str, str]:
    """``(task, architecture)`` of ``--model`` from its config alone, before any weight loads:
    `CAUSAL_LM` or `CLASSIFIER`; any other task (token classification, multiple choice,
    regression or multi-label heads, question answering, seq2seq...) is refused in one line,
    since loading it as either would add a randomly initialised head and print plausible
    nonsense. A config that does not load or names no architecture: `CAUSAL_LM` (the loader
    then says what is wrong). For a PEFT adapter directory (``adapter``), the base model's
    config. ``supported``: what the refusal says is answered (the command's own line)."""
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
        raise QueryInputError(f"--model={name!r} is a {' / '.join(archs)}: {supported}")
    problem_type, labels = getattr(config, "problem_type", None), config.num_labels
    if problem_type not in (None, "single_label_classification") or labels < 2:
        kind = problem_type or "regression"  # num_labels = 1, problem_type unset: regression
        raise QueryInputError(f"--model={name!r} is a {cls[0]} with problem_type={kind!r} "
                              f"(num_labels={labels}), not a single-label classifier: "
                              f"{supported}")
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


def _token_ids(args, tokenizer, model, text: str, where: str = "--text",
               keep_end: bool = False) -> list[int]:
    """The ids of one input ``text`` (``where``: ``--text`` or ``--file='f' line n``), checked
    against the model's vocabulary and positions. With ``--max-length N`` a longer input is
    cut to ``N`` tokens (said on stderr): ``keep_end`` (a causal LM, read at its last
    positions) keeps its last ``N``, else (a classifier) the first ``N`` are kept, as a
    tokenizer called with ``truncation=True, max_length=N`` does in training; a tokenizer's
    special tokens (``[CLS] ... [SEP]``, a BOS) stay."""
    source = args.tokenizer or args.model
    n = getattr(args, "max_length", None)
    full = None
    if tokenizer is None:  # --byte-level
        ids = list(text.encode("utf-8"))
        if n is not None and len(ids) > n:
            full, ids = len(ids), ids[-n:] if keep_end else ids[:n]
    else:
        ids = list(tokenizer(text)["input_ids"])
        if n is not None and len(ids) > n:
            side = tokenizer.truncation_side
            tokenizer.truncation_side = "left" if keep_end else "right"
            try:
                full, ids = len(ids), list(tokenizer(text, truncation=True,
                                                     max_length=n)["input_ids"])
            finally:
                tokenizer.truncation_side = side
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
    if limit is not None and n is not None and n > limit:
        raise QueryInputError(f"--max-length={n} is more than the model's {limit} positions: "
                              f"must be at most {limit}")
    if limit is not None and len(ids) > limit:
        side = "last" if keep_end else "first"
        raise QueryInputError(f"{where} is {len(ids)} tokens long: must be at most {limit} "
                              f"tokens (the model's positions); pass --max-length N (at most "
                              f"{limit}) to keep its {side} N tokens")
    if full is not None:
        _status(f"{where}: {full} tokens, truncated to its {'last' if keep_end else 'first'} "
                f"{len(ids)} (--max-length {n})")
    return ids


def _encode(args, model, tokenizer=None) -> tuple[object | None, list[int]]:
    """``(tokenizer or None for --byte-level, the ids of --text)``, checked against the model
    (``tokenizer``: one `_tokenizer` already loaded)."""
    if tokenizer is None:
        tokenizer = _tokenizer(args)
    return tokenizer, _token_ids(args, tokenizer, model, args.text, keep_end=True)


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
    """``{"base": ...}`` (the base model of a PEFT adapter directory) and ``{"max_length":
    N}`` (``--max-length``) for the JSON, each only when given."""
    adapter = getattr(args, "adapter", None)
    n = getattr(args, "max_length", None)
    return {**({} if adapter is None else {"base": adapter.base}),
            **({} if n is None else {"max_length": n})}


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
    post = _posterior(args, model, snap, tau)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **_base_meta(args), "text": args.text, "mode": args.mode, **_prior_meta(post),
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
                  f"{post.describe()}")
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
    "predictive (LaplacePosterior.predictive_probs, the posterior's link); logit = the class "
    "logit's posterior mean ± std; * = the predicted label (the largest Laplace p); H = entropy of "
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
    line = (f"snapshot {meta['snapshot']} (step {meta['step']}); {meta['architecture']}, "
            f"{len(meta['labels'])} classes; N = {meta['num_data']:.0f}, prior precision τ = "
            f"{meta['prior_precision']:.4g} ({meta['prior_source']}), {meta['link']} link "
            f"({meta['link_source']}); {inputs} input{'s' if inputs != 1 else ''}; "
            f"{meta['seconds']:.1f} s")
    heldout = meta.get("heldout")
    return line if heldout is None else f"{line}\n{heldout['verdict']}"


def _class_document(meta: Mapping, records: Sequence[Mapping]) -> str:
    """One JSON document: ``meta``'s fields and ``"inputs": records``."""
    import json

    return json.dumps({**meta, "inputs": list(records)}, indent=1, allow_nan=False)


#: Inputs per forward (and per batched backward) of a classifier's query: memory grows with
#: it as ``B · C · d_out · d_A`` per layer.
CLASSIFY_BATCH = 16

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
    posterior's link (`probs_from_gaussian`, as `predictive_probs` gives them)."""
    import torch

    from .query.laplace import probs_from_gaussian

    means, covs = zip(*(post.predictive(b) for b in batches))
    mean, cov = torch.cat(means), torch.cat(covs)
    return mean, cov, probs_from_gaussian(mean, cov, post.link)


def _classify(args, tau, arch: str, tokenizer, t0: float) -> int:
    """A sequence classifier's query: per input the MAP and Laplace class probabilities, the
    predicted label and its uncertainty (a table, or ``--json``)."""
    texts = _texts(args)
    _status(f"loading snapshot {args.snapshot} ...")
    snap = _load_snapshot("--snapshot", args.snapshot)
    _status(f"snapshot {snap.path}: {len(snap)} layers; loading {arch} {_model_shown(args)} ...")
    model = _load_model(args.model, CLASSIFIER, args.adapter)
    ids = [_token_ids(args, tokenizer, model, text, where) for text, where in texts]
    post = _posterior(args, model, snap, tau)
    _status(f"{len(ids)} input{'s' if len(ids) != 1 else ''} x {model.config.num_labels} "
            f"classes ({time.perf_counter() - t0:.1f} s so far) ...")
    mean, cov, probs = _class_predictive(post, _class_batches(ids, model.config.pad_token_id))
    names = _label_names(model.config.id2label, mean.shape[1])
    records = _class_records([t for t, _ in texts], [len(x) for x in ids], names, mean, cov,
                             probs)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **_base_meta(args), "task": CLASSIFIER, "architecture": arch, "file": args.file,
            **_prior_meta(post), "labels": names,
            "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        print(_class_document(meta, records))
    else:
        print(_class_table(records, names))
        print(_class_footer(meta, len(records)))
    _status(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


# -- `kfac-stream influence`: influence scores of training examples on queries -----
# ``kfac-stream influence``: which training examples made the model say this.
#
# For each query (a causal LM: a prompt and its completion, the loss taken on the completion's
# tokens only; a sequence classifier: a text and its label) the influence score of every training
# example (`kfac_stream.influence_scores`: ``∇L(query)ᵀ (F + λI)⁻¹ ∇L(example)`` over the
# snapshot's layers, positive = helpful), and a table of the top-K most helpful and most harmful
# examples per query (or ``--json`` with everything). docs/influence.md documents the command.
#
# The training data (``--train``), cut into examples as documented in `TRAIN_RULES`:
#
# * ``app``: the training app's own data (`kfac_stream.train.training_documents` and
#   `training_windows`, exactly the windows the run trained on), from the run's composed config
#   (``<run dir>/.hydra/config.yaml``, found beside ``--model`` or ``--snapshot``, or
#   ``--app-config``);
# * a directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict``: its ``train``
#   split), with a text column (``--text-field``, default ``text``), or ``prompt`` and
#   ``completion`` columns; a classifier's also a label column (``--label-field``);
# * a JSON-lines file of such records (``{"text": ...}``, ``{"prompt": ..., "completion": ...}``,
#   a classifier's ``{"text": ..., "label": ...}``).

#: ``--damping``'s rules besides a positive float (`kfac_stream.query.influence.DAMPINGS`).
DAMPING_RULES = ("heuristic", "prior")

#: ``--seq-len``'s default: the model's positions, at most this many tokens.
INFLUENCE_MAX_SEQ_LEN = 1024

#: Training examples per batch (``--batch-size``).
INFLUENCE_BATCH = 16

#: How each kind of ``--train`` is cut into examples (also in the JSON, ``train_rule``).
TRAIN_RULES = {
    "app": "the app's training windows: the run's training documents joined by a blank line, "
           "one token stream cut into windows of model.seq_len tokens, the incomplete tail "
           "dropped (as the run trained)",
    "text": "each text tokenised on its own (the tokenizer's special tokens, as for a query) "
            "and cut into consecutive windows of seq_len tokens, a shorter last window kept; "
            "every token labelled",
    "prompt": "one example per record: the prompt's tokens then the completion's, the loss on "
              "the completion's tokens only",
    "classifier": "one example per record: the text's first seq_len tokens and its label",
}

INFLUENCE_EXPLAINED = (
    "score = ∇L(query)ᵀ (F + λI)⁻¹ ∇L(example) over the snapshot's layers (F: its K-FAC "
    "factors; L: the summed loss of the query's completion or label, of the example's labelled "
    "tokens); + helpful: a gradient step on the example lowers the query's loss; - harmful: it "
    "raises it")


def _influence_status(message: str) -> None:
    """One line of what ``influence`` is doing, on stderr (stdout keeps the table alone)."""
    print(f"kfac-stream influence: {message}", file=sys.stderr, flush=True)


def _influence_parser(sub) -> None:
    """The ``influence`` sub-command's arguments."""
    p = sub.add_parser(
        "influence", help="which training examples made the model say this: influence scores "
        "of training examples on queries, from a snapshot's factors",
        description="Influence scores (kfac_stream.influence_scores) of every training example "
        "on each query: grad L(query)^T (F + damping)^-1 grad L(example) over the snapshot's "
        "layers, positive = the example helps the query (lowers its loss). A causal LM's query "
        "is a prompt and a completion (--query PROMPT --completion TEXT, repeatable, or "
        "--query-file with JSON lines {\"prompt\", \"completion\"}); a sequence classifier's is "
        "a text and its label (--query TEXT --label NAME|ID, or {\"text\", \"label\"} lines). "
        "Prints the top-K most helpful and most harmful training examples per query "
        "(docs/influence.md).")
    p.add_argument("--snapshot", required=True, help="snapshot directory (or its parent)")
    p.add_argument("--model", required=True, help="model directory, PEFT adapter directory or "
                   "hub name (a causal LM or a sequence classifier)")
    p.add_argument("--train", required=True, metavar="DATA", help="the training examples: "
                   "'app' (the training app's data, from the run's .hydra/config.yaml), a "
                   "directory written by datasets' save_to_disk, or a JSON-lines file")
    p.add_argument("--query", action="append", metavar="TEXT", help="a causal LM: the prompt "
                   "(with --completion); a classifier: the text (with --label); repeatable")
    p.add_argument("--completion", action="append", metavar="TEXT", help="causal LMs: the "
                   "completion of the --query before it, whose tokens the loss is taken on")
    p.add_argument("--label", action="append", metavar="NAME|ID", help="classifiers: the label "
                   "of the --query before it (a name of config.id2label or a class index)")
    p.add_argument("--query-file", metavar="FILE", help="JSON lines, one query each: "
                   "{\"prompt\", \"completion\"} (causal LM) or {\"text\", \"label\"}")
    p.add_argument("--top-k", type=int, default=5, help="helpful and harmful examples shown "
                   "per query (default 5)")
    p.add_argument("--damping", default="heuristic", help="heuristic (0.1 x the layer's mean "
                   "eigenvalue, kronfluence's; the default), prior (tau/N, the Laplace "
                   "posterior's) or a positive float")
    p.add_argument("--eigenvalues", choices=("auto", "kfac", "ekfac"), default="auto",
                   help="auto (the default): a layer's EK-FAC corrected eigenvalues where the "
                   "snapshot has them (KFACConfig(ekfac=True)), else K-FAC's; kfac; ekfac")
    p.add_argument("--prior-precision", help="--damping prior: tau, a float or 'marglik' (the "
                   "default)")
    p.add_argument("--per-token", action="store_true", help="causal LMs: also split each "
                   "shown example's score over the completion's tokens")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of "
                   "the table")
    p.add_argument("--batch-size", type=int, default=INFLUENCE_BATCH, help="training examples "
                   f"per forward and backward (default {INFLUENCE_BATCH})")
    p.add_argument("--max-train", type=int, metavar="N", help="score only the first N "
                   "training examples")
    p.add_argument("--seq-len", type=int, help="tokens per training window (JSON lines and "
                   "datasets; default: the model's positions, at most "
                   f"{INFLUENCE_MAX_SEQ_LEN}); --train app uses the run's model.seq_len")
    p.add_argument("--text-field", default="text", help="the text column of --train (default "
                   "text)")
    p.add_argument("--label-field", default="label", help="classifiers: the label column of "
                   "--train (default label)")
    p.add_argument("--app-config", metavar="PATH", help="--train app: the run's composed "
                   "config (a config.yaml, or a run directory holding .hydra/config.yaml); "
                   "default: found beside --model or --snapshot")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--base", help="the base model of a PEFT (LoRA) adapter directory given as "
                   "--model (default: the base/ that kfac_stream.whole_model saves beside it)")
    p.add_argument("--byte-level", action="store_true", help="token id = UTF-8 byte (the demo; "
                   "implied by --train app for the app's byte-level model)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default: cuda when available)")


# -- checks before anything loads --------------------------------------------------------------

def _damping(value: str) -> float | str:
    """``--damping``: one of `DAMPING_RULES` or a positive finite float."""
    return _word_or_number("--damping", value, DAMPING_RULES,
                           "'heuristic', 'prior' or a positive finite number")


def _check_influence_ints(args) -> None:
    for flag, value, low, what in (
            ("--top-k", args.top_k, 1, "training examples shown per query and side"),
            ("--batch-size", args.batch_size, 1, "training examples per batch"),
            ("--max-train", args.max_train, 1, "training examples scored"),
            ("--seq-len", args.seq_len, 2, "tokens per training window")):
        if value is not None and value < low:
            raise QueryInputError(f"{flag}={value} is not allowed: must be an int >= {low} "
                                  f"({what})")


def _check_influence_args(args) -> None:
    """The queries' flags, before the model's task is known; ``--train`` and the files."""
    if args.query_file is not None and (args.query or args.completion or args.label):
        raise QueryInputError("--query-file is not allowed with --query, --completion or "
                              "--label: pass the queries one way")
    if args.query_file is None and not args.query:
        raise QueryInputError("one of --query (with --completion for a causal LM, --label for "
                              "a classifier) or --query-file FILE is required")
    if args.query_file is not None:
        _check_file("--query-file", args.query_file, "a JSON-lines file of queries")
    if args.train != "app":
        if not args.train:
            raise QueryInputError("--train='' is not allowed: must be 'app', a datasets "
                                  "save_to_disk directory or a JSON-lines file")
        if not os.path.exists(args.train):
            raise QueryInputError(f"--train={args.train!r} does not exist: must be 'app', a "
                                  "datasets save_to_disk directory or a JSON-lines file")
    if args.app_config is not None:
        if args.train != "app":
            raise QueryInputError(f"--app-config is not allowed with --train={args.train!r}: "
                                  "it names the run config of --train app")
        if not os.path.exists(args.app_config):
            raise QueryInputError(f"--app-config={args.app_config!r} does not exist: must be "
                                  "a run's config.yaml or its run directory")
    if args.prior_precision is not None and args.damping != "prior":
        raise QueryInputError("--prior-precision is only used with --damping prior (the "
                              "damping tau/N)")


def _check_file(flag: str, path: str, what: str) -> None:
    if not os.path.exists(path):
        raise QueryInputError(f"{flag}={path!r} does not exist: must be {what}")
    if os.path.isdir(path):
        raise QueryInputError(f"{flag}={path!r} is a directory: must be {what}")


# -- tokens ------------------------------------------------------------------------------------

def _ids(tokenizer, text: str, special: bool = True) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes (``tokenizer`` None: ``--byte-level``), else the
    tokenizer's (with its special tokens when ``special``)."""
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def _decode_ids(tokenizer, ids: Sequence[int]) -> str:
    """The text of ``ids`` (bytes: invalid UTF-8 as U+FFFD)."""
    if tokenizer is None:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")
    return tokenizer.decode(list(ids))


def _token_text(tokenizer, token_id: int) -> str:
    return str(_decode(tokenizer, int(token_id)))


def _model_limits(model) -> tuple[int | None, int | None]:
    """``(vocabulary, positions)`` of the model (None where it does not say)."""
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    cfg = model.config
    limit = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
    return vocab, limit


# -- queries -----------------------------------------------------------------------------------

@dataclass
class _Query:
    """One query: its token ids, labels and what the table shows."""

    ids: list[int]
    labels: list[int] | int
    record: dict[str, Any]
    completion: list[int] = field(default_factory=list)  # positions of the completion's tokens


def _query_specs(args, task: str) -> list[tuple[dict[str, Any], str]]:
    """``[(fields, where)]``: ``{"prompt", "completion"}`` or ``{"text", "label"}`` per query,
    from the flags or ``--query-file``."""
    clf = task == CLASSIFIER
    if args.query_file is None:
        if clf:
            if args.completion:
                raise QueryInputError("--completion is not allowed with a sequence classifier: "
                                      "its query is a text (--query) and its label (--label)")
            if len(args.label or ()) != len(args.query):
                raise QueryInputError(f"{len(args.query)} --query but {len(args.label or ())} "
                                      "--label: a classifier's query needs the label its loss "
                                      "is taken on (--query TEXT --label NAME|ID)")
            return [({"text": t, "label": lab}, f"--query={t!r}")
                    for t, lab in zip(args.query, args.label)]
        if args.label:
            raise QueryInputError("--label is not allowed with a causal LM: its query is a "
                                  "prompt (--query) and a completion (--completion)")
        if len(args.completion or ()) != len(args.query):
            raise QueryInputError(f"{len(args.query)} --query but {len(args.completion or ())} "
                                  "--completion: a causal LM's query is a prompt and the "
                                  "completion whose loss is scored (--query PROMPT --completion "
                                  "TEXT)")
        return [({"prompt": p, "completion": c}, f"--query={p!r}")
                for p, c in zip(args.query, args.completion)]
    keys = ("text", "label") if clf else ("prompt", "completion")
    out = []
    for n, rec in _json_lines("--query-file", args.query_file):
        where = f"--query-file={args.query_file!r} line {n}"
        if not isinstance(rec, dict) or any(k not in rec for k in keys):
            whose = "a sequence classifier's" if clf else "a causal LM's"
            raise QueryInputError(f"{where}: must be a JSON object with {keys[0]!r} and "
                                  f"{keys[1]!r} ({whose} query)")
        out.append(({k: rec[k] for k in keys}, where))
    if not out:
        raise QueryInputError(f"--query-file={args.query_file!r} holds no query: must hold one "
                              "JSON object per line")
    return out


def _json_lines(flag: str, path: str) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of a JSON-lines file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise QueryInputError(f"{flag}={path!r} could not be read ({_first_line(e)}): must be "
                              "a UTF-8 JSON-lines file") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise QueryInputError(f"{flag}={path!r} line {n} is not JSON ({e.msg}): must hold "
                                  "one JSON object per line") from None


def _label_id(value: Any, names: Sequence[str], label2id: Mapping, where: str) -> int:
    """A class index from a label name (``config.id2label``'s, or ``label2id``'s) or an index."""
    n = len(names)
    if isinstance(value, bool) or value is None:
        raise QueryInputError(f"{where}: label {value!r} is not allowed: must be a class name "
                              f"({', '.join(names)}) or an index in [0, {n})")
    if isinstance(value, int):
        if 0 <= value < n:
            return value
        raise QueryInputError(f"{where}: label {value} is out of range: must be a class name "
                              f"({', '.join(names)}) or an index in [0, {n})")
    text = str(value)
    if text in names:
        return names.index(text)
    if text in label2id:
        return int(label2id[text])
    if text.lstrip("-").isdigit():
        return _label_id(int(text), names, label2id, where)
    hint = did_you_mean(text, dict.fromkeys([*names, *label2id]), repr)
    raise QueryInputError(f"{where}: label {text!r} is not one of the model's labels: must be a "
                          f"class name ({', '.join(names)}) or an index in [0, {n})"
                          + (f"; {hint}" if hint else ""))


def _influence_queries(args, task: str, model, tokenizer) -> list[_Query]:
    """Each query's ids and labels (a causal LM: prompt then completion, labels -100 on the
    prompt; a classifier: the text and its class index), checked against the model."""
    vocab, limit = _model_limits(model)
    out = []
    names = _label_names(model.config.id2label, model.config.num_labels) \
        if task == CLASSIFIER else []
    label2id = {str(k): v for k, v in (getattr(model.config, "label2id", None) or {}).items()}
    for spec, where in _query_specs(args, task):
        if task == CLASSIFIER:
            text = spec["text"]
            if not isinstance(text, str) or not text:
                raise QueryInputError(f"{where}: the text must be a non-empty string")
            ids = _ids(tokenizer, text)
            label = _label_id(spec["label"], names, label2id, where)
            rec = {"text": text, "label": names[label], "label_id": label}
            q = _Query(ids, label, rec)
        else:
            prompt, completion = spec["prompt"], spec["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise QueryInputError(f"{where}: prompt and completion must be strings")
            if not completion:
                raise QueryInputError(f"{where} has an empty completion: a causal LM's query "
                                      "needs the completion whose tokens the loss is taken on "
                                      "(--completion TEXT)")
            p_ids = _ids(tokenizer, prompt)
            if not p_ids:
                raise QueryInputError(f"{where}: the prompt has no tokens: the completion's "
                                      "first token is predicted from the prompt (a non-empty "
                                      "--query)")
            c_ids = _ids(tokenizer, completion, special=False)
            if not c_ids:
                raise QueryInputError(f"{where}: the completion {completion!r} has no tokens")
            ids = p_ids + c_ids
            labels = [-100] * len(p_ids) + c_ids
            rec = {"prompt": prompt, "completion": completion,
                   "completion_tokens": [{"position": len(p_ids) + i, "token_id": t,
                                          "token": _token_text(tokenizer, t)}
                                         for i, t in enumerate(c_ids)]}
            q = _Query(ids, labels, rec, list(range(len(p_ids), len(ids))))
        if vocab is not None and max(ids) >= vocab:
            raise QueryInputError(f"{where}: its tokens reach id {max(ids)}, but the model's "
                                  f"vocabulary has {vocab} tokens: pass the model's own "
                                  "tokenizer (--tokenizer DIR, or --byte-level for the demo's)")
        if limit is not None and len(ids) > limit:
            raise QueryInputError(f"{where} is {len(ids)} tokens long: must be at most {limit} "
                                  "tokens (the model's positions)")
        q.record["tokens"] = len(ids)
        out.append(q)
    return out


# -- training examples -------------------------------------------------------------------------

@dataclass
class _Example:
    """One training example: ids, labels (per token, or a class index) and where it came
    from (``source``: the record's index, the window's first token)."""

    ids: list[int]
    labels: list[int] | int
    source: dict[str, Any]


@dataclass
class _TrainSet:
    examples: list[_Example]
    kind: str  # a TRAIN_RULES key
    described: str  # for the footer
    seq_len: int | None
    config: str | None = None  # --train app: the run config read


def _default_seq_len(args, model) -> int:
    if args.seq_len is not None:
        return args.seq_len
    _, limit = _model_limits(model)
    return min(limit or INFLUENCE_MAX_SEQ_LEN, INFLUENCE_MAX_SEQ_LEN)


def _windows(ids: list[int], seq_len: int) -> Iterator[tuple[int, list[int]]]:
    """``(start, window)``: consecutive windows of ``seq_len`` ids, a shorter last one kept
    when it has a next-token loss (2 ids or more)."""
    for start in range(0, len(ids), seq_len):
        w = ids[start:start + seq_len]
        if len(w) >= 2:
            yield start, w


def _app_config_path(args) -> str:
    """The run's composed config: ``--app-config`` (a file, or a run directory), else
    ``.hydra/config.yaml`` in the directory above ``--model`` or above ``--snapshot`` (the
    app saves ``<run dir>/model`` and ``<run dir>/kfac``)."""
    def in_run(d: str) -> str | None:
        for rel in (os.path.join(".hydra", "config.yaml"), "config.yaml"):
            path = os.path.join(d, rel)
            if os.path.isfile(path):
                return path
        return None

    if args.app_config is not None:
        found = args.app_config if os.path.isfile(args.app_config) else in_run(args.app_config)
        if found is None:
            raise QueryInputError(f"--app-config={args.app_config!r} holds no config.yaml nor "
                                  ".hydra/config.yaml: must be a run's composed config or its "
                                  "run directory")
        return found
    seen = []
    for start in (args.model, args.snapshot):
        d = os.path.abspath(start)
        for _ in range(3):  # model/ or kfac/ or kfac/step-N/ below the run directory
            d = os.path.dirname(d)
            path = os.path.join(d, ".hydra", "config.yaml")
            seen.append(path)
            if os.path.isfile(path):  # relative to the working directory when below it
                rel = os.path.relpath(path)
                return path if rel.startswith(os.pardir) else rel
    raise QueryInputError(f"--train app: no run config found ({seen[0]} and the directories "
                          "above --model and --snapshot hold no .hydra/config.yaml): pass "
                          "--app-config with the run's config.yaml (Hydra writes it to "
                          "<run dir>/.hydra/config.yaml)")


def _app_config(path: str):
    """The ``model`` and ``data`` groups of a run's config, on the app's schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .app.schema import DataConf, ModelConf

    try:
        loaded = OmegaConf.load(path)
        return OmegaConf.create({
            "model": OmegaConf.merge(OmegaConf.structured(ModelConf), loaded.get("model", {})),
            "data": OmegaConf.merge(OmegaConf.structured(DataConf), loaded.get("data", {}))})
    except (OSError, ValueError, OmegaConfBaseException) as e:
        raise QueryInputError(f"--train app: the run config {path!r} could not be read "
                              f"({_first_line(e)}): must be a config the app composed") from None


def _app_examples(args, cfg, tokenizer) -> list[_Example]:
    from .app.data import ByteTokenizer
    from .train import training_documents, training_windows

    docs, _ = training_documents(cfg)
    tok = ByteTokenizer() if tokenizer is None else tokenizer
    windows = training_windows(docs, tok, cfg.model.seq_len, args.max_train)
    return [_Example(w["input_ids"].tolist(), w["labels"].tolist(),
                     {"window": i, "first_token": i * cfg.model.seq_len})
            for i, w in enumerate(windows)]


def _train_records(args) -> tuple[Iterator[tuple[int, Any]], str]:
    """``(records, what)``: ``(index, dict)`` of each record of a ``datasets`` directory or a
    JSON-lines file."""
    path = args.train
    if os.path.isdir(path):
        try:
            import datasets
        except ImportError as e:
            raise QueryInputError(f"--train={path!r} is a directory (a datasets save_to_disk): "
                                  f"reading it needs datasets ({e}; pip install "
                                  "'kfac_stream[app]')") from None
        try:
            ds = datasets.load_from_disk(path)
        except (OSError, ValueError, FileNotFoundError) as e:
            raise QueryInputError(f"--train={path!r} is no dataset saved by datasets' "
                                  f"save_to_disk ({_first_line(e)}): must be 'app', such a "
                                  "directory or a JSON-lines file") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise QueryInputError(f"--train={path!r} is a DatasetDict without a 'train' "
                                      f"split (it has {', '.join(ds)}): save the split to score")
            ds = ds["train"]
        return enumerate(ds), f"the dataset {path}"
    return ((n - 1, rec) for n, rec in _json_lines("--train", path)), f"{path}"


def _record_examples(args, task: str, model, tokenizer, seq_len: int
                     ) -> tuple[list[_Example], str, str]:
    """The examples of a ``datasets`` directory or JSON-lines file: ``(examples, kind,
    described)``."""
    records, what = _train_records(args)
    names = _label_names(model.config.id2label, model.config.num_labels) \
        if task == CLASSIFIER else []
    label2id = {str(k): v for k, v in (getattr(model.config, "label2id", None) or {}).items()}
    examples: list[_Example] = []
    kind = None
    tf, lf = args.text_field, args.label_field
    for i, rec in records:
        if args.max_train is not None and len(examples) >= args.max_train:
            break
        where = f"--train={args.train!r} record {i}"
        if not isinstance(rec, Mapping):
            raise QueryInputError(f"{where} is not a JSON object: must hold {tf!r}")
        if task == CLASSIFIER:
            if tf not in rec or lf not in rec:
                raise QueryInputError(f"{where} has no {tf!r} and {lf!r} (it has "
                                      f"{', '.join(map(str, rec)) or 'nothing'}): a classifier's "
                                      "training example is a text and its label (--text-field, "
                                      "--label-field)")
            text = rec[tf]
            if not isinstance(text, str) or not text:
                continue
            ids = _ids(tokenizer, text)[:seq_len]
            label = _label_id(rec[lf], names, label2id, where)
            examples.append(_Example(ids, label, {"record": i}))
            kind = "classifier"
        elif tf in rec:
            text = rec[tf]
            if not isinstance(text, str) or not text.strip():
                continue
            for start, w in _windows(_ids(tokenizer, text), seq_len):
                if args.max_train is not None and len(examples) >= args.max_train:
                    break
                examples.append(_Example(w, list(w), {"record": i, "first_token": start}))
            kind = kind or "text"
        elif "prompt" in rec and "completion" in rec:
            p_ids = _ids(tokenizer, str(rec["prompt"]))
            c_ids = _ids(tokenizer, str(rec["completion"]), special=False)
            if not p_ids or not c_ids:
                continue
            ids = p_ids + c_ids
            if len(ids) > seq_len:
                raise QueryInputError(f"{where} is {len(ids)} tokens long (prompt and "
                                      f"completion): must be at most {seq_len} (--seq-len)")
            examples.append(_Example(ids, [-100] * len(p_ids) + c_ids, {"record": i}))
            kind = kind or "prompt"
        else:
            raise QueryInputError(f"{where} has no {tf!r} (nor 'prompt' and 'completion'; it "
                                  f"has {', '.join(map(str, rec)) or 'nothing'}): pass "
                                  "--text-field with its text column")
    return examples, kind or ("classifier" if task == CLASSIFIER else "text"), what


def _train_set(args, task: str, model, tokenizer) -> _TrainSet:
    if args.train == "app":
        path = args._app_config_path
        cfg = _app_config(path)
        _influence_status(f"--train app: the run's training data from {path} (data.kind="
                          f"{cfg.data.kind}, windows of model.seq_len={cfg.model.seq_len}) ...")
        examples = _app_examples(args, cfg, tokenizer)
        ts = _TrainSet(examples, "app", f"windows of {cfg.model.seq_len} tokens of the app's "
                       f"training data, {path}", int(cfg.model.seq_len), path)
    else:
        seq_len = _default_seq_len(args, model)
        examples, kind, what = _record_examples(args, task, model, tokenizer, seq_len)
        described = {"text": f"windows of up to {seq_len} tokens of {what}",
                     "prompt": f"prompt-completion records of {what}",
                     "classifier": f"labelled texts of {what} (first {seq_len} tokens)"}[kind]
        ts = _TrainSet(examples, kind, described, seq_len)
    if not ts.examples:
        rule = ("windows of model.seq_len tokens" if args.train == "app" else
                "a text of 2 tokens or more, or a prompt and completion" if task != CLASSIFIER
                else "a non-empty text with a label")
        raise QueryInputError(f"--train={args.train!r} yields no training example (each needs "
                              f"{rule}): nothing to score")
    vocab, limit = _model_limits(model)
    for i, ex in enumerate(ts.examples):
        if vocab is not None and max(ex.ids) >= vocab:
            raise QueryInputError(f"--train: training example {i} has token id {max(ex.ids)}, "
                                  f"but the model's vocabulary has {vocab} tokens: pass the "
                                  "model's own tokenizer (--tokenizer DIR, or --byte-level)")
        if limit is not None and len(ex.ids) > limit:
            raise QueryInputError(f"--train: training example {i} is {len(ex.ids)} tokens: must "
                                  f"be at most {limit} (the model's positions; --seq-len)")
    return ts


# -- batches -----------------------------------------------------------------------------------

def _collate(examples: Sequence, pad_id: int, device=None) -> dict:
    """``{"input_ids", "attention_mask", "labels"}`` of examples with ``ids`` and ``labels``
    (per token, or class indices), right-padded with ``pad_id`` (mask 0, label -100)."""
    import torch

    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), T, dtype=torch.long)
    per_token = not isinstance(examples[0].labels, int)
    labels = (torch.full((len(examples), T), -100, dtype=torch.long) if per_token
              else torch.tensor([e.labels for e in examples], dtype=torch.long))
    for b, e in enumerate(examples):
        ids[b, :len(e.ids)] = torch.tensor(e.ids)
        mask[b, :len(e.ids)] = 1
        if per_token:
            labels[b, :len(e.labels)] = torch.tensor(e.labels)
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return out if device is None else {k: v.to(device) for k, v in out.items()}


class _Batches:
    """The training batches, in order (a length for the progress bar); when stderr is not a
    terminal a status line at every tenth of them."""

    def __init__(self, examples: Sequence[_Example], size: int, pad_id: int, device) -> None:
        self.examples, self.size, self.pad_id, self.device = examples, size, pad_id, device

    def __len__(self) -> int:
        return -(-len(self.examples) // self.size)

    def __iter__(self):
        total, t0 = len(self), time.perf_counter()
        lines = not sys.stderr.isatty()
        marks = {max(1, round(total * k / 10)) for k in range(1, 10)} if lines else set()
        for j in range(total):
            chunk = self.examples[j * self.size:(j + 1) * self.size]
            yield _collate(chunk, self.pad_id, self.device)
            if j + 1 in marks:
                done = min((j + 1) * self.size, len(self.examples))
                _influence_status(f"scored {done:,} of {len(self.examples):,} training examples "
                                  f"({time.perf_counter() - t0:.1f} s)")


# -- the output --------------------------------------------------------------------------------

def _example_text(tokenizer, ex: _Example) -> str:
    return _decode_ids(tokenizer, ex.ids)


def _influence_side(scores, ranked, values, train: _TrainSet, tokenizer, token_scores,
                    query: _Query, q: int) -> list[dict]:
    out = []
    for rank, (j, s) in enumerate(zip(ranked.tolist(), values.tolist()), 1):
        ex = train.examples[j]
        rec = {"rank": rank, "index": j, "score": float(s), "text": _example_text(tokenizer, ex),
               "source": ex.source}
        if not isinstance(ex.labels, list):
            rec["label_id"] = ex.labels
        if token_scores is not None:
            n = len(query.completion)
            rec["token_scores"] = [float(x) for x in token_scores[q, :n, j].tolist()]
        out.append(rec)
    return out


def _influence_records(result, queries: Sequence[_Query], train: _TrainSet, tokenizer, k: int
                ) -> list[dict]:
    (hi, hv), (lo, lv) = result.top_k(k)
    out = []
    for q, query in enumerate(queries):
        rec = {"index": q, **query.record}
        rec["helpful"] = _influence_side(result.scores, hi[q], hv[q], train, tokenizer,
                               result.token_scores, query, q)
        rec["harmful"] = _influence_side(result.scores, lo[q], lv[q], train, tokenizer,
                               result.token_scores, query, q)
        out.append(rec)
    return out


def _influence_query_line(rec: Mapping) -> str:
    from .query.token_table import show_token

    if "prompt" in rec:
        n = len(rec["completion_tokens"])
        return (f"query {rec['index']}: {show_token(rec['prompt'], TEXT_WIDTH)} -> "
                f"{show_token(rec['completion'], TEXT_WIDTH)} ({n} completion token"
                f"{'s' if n != 1 else ''})")
    return f"query {rec['index']}: {show_token(rec['text'], TEXT_WIDTH)} label {rec['label']!r}"


def _influence_table(records: Sequence[Mapping], names: Sequence[str] | None = None) -> str:
    """Per query its line, then its most helpful and most harmful examples (rank, training
    example index, score, text; ``--per-token``: a line of the completion tokens' shares)."""
    from .query.token_table import pad, show_token, width

    heads = ["rank", "example", "score", "text"]
    rows = [[str(r["rank"]), str(r["index"]), f"{r['score']:+.4e}",
             show_token(r["text"], TEXT_WIDTH)]
            for rec in records for side in ("helpful", "harmful") for r in rec[side]]
    widths = [max(width(h), *(width(row[j]) for row in rows)) for j, h in enumerate(heads)]

    def line(cells: Sequence[str]) -> str:
        return ("    " + "  ".join(pad(c, w, j == 3) for j, (c, w) in
                                   enumerate(zip(cells, widths)))).rstrip()

    out = [INFLUENCE_EXPLAINED]
    for rec in records:
        out.append(_influence_query_line(rec))
        tokens = [t["token"] for t in rec.get("completion_tokens", ())]
        for side, title in (("helpful", "most helpful"), ("harmful", "most harmful")):
            out += [f"  {title}", line(heads)]
            for r in rec[side]:
                cells = [str(r["rank"]), str(r["index"]), f"{r['score']:+.4e}",
                         show_token(r["text"], TEXT_WIDTH)]
                if names is not None and "label_id" in r:
                    cells[3] += f" label {names[r['label_id']]!r}"
                out.append(line(cells))
                if "token_scores" in r:
                    parts = [f"{show_token(t, 14)} {s:+.3e}" for t, s in
                             zip(tokens, r["token_scores"])]
                    out.append("      per token: " + ", ".join(parts))
    return "\n".join(out)


def _influence_footer(meta: Mapping) -> str:
    lam = list(meta["damping_per_layer"].values())
    rule = meta["damping"]
    rule = f"{rule:g}" if isinstance(rule, float) else rule
    n, q = meta["train_examples"], len(meta["queries_given"])
    return (f"snapshot {meta['snapshot']} (step {meta['step']}); {n:,} training example"
            f"{'s' if n != 1 else ''} ({meta['train_described']}); damping {rule} (λ "
            f"{min(lam):.3g} … {max(lam):.3g} over {len(lam)} layers); {q} quer"
            f"{'ies' if q != 1 else 'y'}; scoring {meta['scoring_seconds']:.1f} s "
            f"({1000 * meta['seconds_per_train_example']:.3g} ms per training example); "
            f"{meta['seconds']:.1f} s")


# -- the command -------------------------------------------------------------------------------

def _influence_device(args):
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise QueryInputError("--device=cuda is not allowed here: torch sees no CUDA device "
                              "(--device cpu, or auto)")
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def _influence(args) -> int:
    """``kfac-stream influence``."""
    t0 = time.perf_counter()
    _check_paths(args)
    _check_influence_ints(args)
    damping = _damping(args.damping)
    _check_influence_args(args)
    args.adapter = _adapter(args)
    supported = SUPPORTED.replace("kfac-stream query answers", "kfac-stream influence "
                                      "answers").replace("LaplacePosterior.predictive gives the "
                                                         "Gaussian of chosen logits",
                                                         "kfac_stream.influence_scores gives "
                                                         "the scores")
    task, arch = _model_task(args.model, args.adapter, supported)
    if task == CLASSIFIER and args.per_token:
        raise QueryInputError("--per-token is not allowed with a sequence classifier: its loss "
                              "has one term per example (the split is over a completion's "
                              "tokens)")
    if args.train == "app":
        if task == CLASSIFIER:
            raise QueryInputError(f"--train app is not allowed with a sequence classifier "
                                  f"({arch}): the app trains causal LMs; pass a datasets "
                                  "directory or a JSON-lines file of {\"text\", \"label\"}")
        args._app_config_path = _app_config_path(args)
        kind = _app_config(args._app_config_path).model.kind
        if kind == "tiny" and not args.byte_level:
            if args.tokenizer is not None:
                raise QueryInputError(f"--tokenizer is not allowed with --train app of a "
                                      f"byte-level run ({args._app_config_path}: model.kind="
                                      "tiny): its tokens are UTF-8 bytes")
            args.byte_level = True
            _influence_status("--train app: the run's model is byte-level (model.kind=tiny): "
                              "--byte-level")
        elif kind != "tiny" and args.byte_level:
            raise QueryInputError(f"--byte-level is not allowed with --train app of a model "
                                  f"with a tokenizer ({args._app_config_path}: model.kind="
                                  f"{kind})")
    tau = None
    if damping == "prior":
        tau = _prior_precision(args.prior_precision or "marglik")
    tokenizer = _tokenizer(args)
    device = _influence_device(args)
    _influence_status(f"loading snapshot {args.snapshot} ...")
    snap = _load_snapshot("--snapshot", args.snapshot)
    _influence_status(f"snapshot {snap.path}: {len(snap)} layers; loading {TASK_NAMES[task]} "
                      f"{_model_shown(args)} ...")
    model = _load_model(args.model, task, args.adapter)
    queries = _influence_queries(args, task, model, tokenizer)
    train = _train_set(args, task, model, tokenizer)

    from .query.influence import Influence
    from .query.laplace import LaplacePosterior

    model.to(device)
    if tau == "marglik":
        _influence_status(f"choosing the prior precision by marginal likelihood over "
                          f"{len(snap)} layers (--prior-precision FLOAT skips it) ...")
    post = LaplacePosterior(model, snap, prior_precision=1.0 if tau is None else tau)
    inf = Influence(post, damping, args.eigenvalues)
    zero = [n for n, lam in inf.damping.items() if not lam > 0]
    if zero:  # heuristic on a zero factor: (F + 0 I)⁻¹ has no value there
        raise QueryInputError(
            f"--damping {args.damping} is 0 on {len(zero)} layer(s) ({', '.join(zero[:2])}"
            f"{', ...' if len(zero) > 2 else ''}): their factors are zero (no sampled "
            "position carried a gradient there), so the scores would be NaN: pass --damping "
            "prior or a positive --damping FLOAT")
    pad_id = model.config.pad_token_id
    size = args.batch_size
    if task == CLASSIFIER and pad_id is None:
        size = 1  # GPT-2's classifier finds each input's last token by the pad id
    qbatches = [_collate([q], 0 if pad_id is None else pad_id, device) for q in queries]
    batches = _Batches(train.examples, size, 0 if pad_id is None else pad_id, device)
    _influence_status(f"{len(queries)} quer{'ies' if len(queries) != 1 else 'y'} x "
                      f"{len(train.examples):,} training examples ({len(batches)} batches of "
                      f"{size}) on {device}, damping {args.damping} "
                      f"({time.perf_counter() - t0:.1f} s so far) ...")
    t1 = time.perf_counter()
    result = inf.scores(qbatches, batches, per_token=args.per_token)
    scoring = time.perf_counter() - t1
    records = _influence_records(result, queries, train, tokenizer, args.top_k)
    names = (_label_names(model.config.id2label, model.config.num_labels)
             if task == CLASSIFIER else None)
    for rec in records:
        for side in ("helpful", "harmful"):
            for r in rec[side]:
                if names is not None and "label_id" in r:
                    r["label"] = names[r["label_id"]]
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **_base_meta(args), "task": task, "architecture": arch, "train": args.train,
            "train_rule": TRAIN_RULES[train.kind], "train_described": train.described,
            "app_config": train.config, "seq_len": train.seq_len,
            "train_examples": len(train.examples), "damping": damping,
            "damping_per_layer": dict(result.damping), "layers": list(result.layers),
            "eigenvalues": args.eigenvalues,
            "ekfac_layers": [n for n, v in inf.corrected.items() if v is not None],
            "top_k": min(args.top_k, len(train.examples)), "per_token": args.per_token,
            "device": str(device), "batch_size": size,
            "queries_given": [q.record for q in queries]}
    if tau is not None:
        meta["prior_precision"] = float(post.prior_precision)
    meta.update({"seconds": round(time.perf_counter() - t0, 3),
                 "scoring_seconds": round(scoring, 3),
                 "seconds_per_train_example": scoring / len(train.examples)})
    if args.json:
        doc = {k: v for k, v in meta.items() if k != "queries_given"}
        doc["queries"] = records
        print(json.dumps(doc, indent=1, allow_nan=False))
    else:
        print(_influence_table(records, names))
        print(_influence_footer(meta))
    _influence_status(f"done in {time.perf_counter() - t0:.1f} s")
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
        "line), the MAP class probabilities, the Laplace predictive's (the held-out fit's link, "
        "or mean-field), the predicted label, its entropy and logit std. Other tasks are "
        "refused. Without tokenizer files, pass --byte-level or --tokenizer DIR.")
    q.add_argument("--snapshot", required=True, help="snapshot directory (or its parent)")
    q.add_argument("--model", required=True, help="model directory or hub name (a causal LM "
                   "or a sequence classifier)")
    q.add_argument("--text", help="the input (exactly one of --text and --file)")
    q.add_argument("--file", metavar="PATH", help="sequence classifiers: a UTF-8 file of "
                   "inputs, one per line (blank lines skipped), batched with padding")
    q.add_argument("--max-length", type=int, metavar="N", help="cut each input longer than N "
                   "tokens to N, as training truncated (at most the model's positions): a "
                   "causal LM keeps the END of the text (its last N tokens: the next token and "
                   "--options are read at the last position), a sequence classifier its first N "
                   "(as a tokenizer with truncation=True does; special tokens stay); said on "
                   "stderr. Default: no truncation (a longer input is refused)")
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
    q.add_argument("--prior-precision", default="auto", help="auto (default: the tau and link "
                   "fitted on the eval set beside the snapshot when stored, else the marginal "
                   "likelihood), heldout (the stored fit; an error without one), marglik, or "
                   "a float")
    q.add_argument("--link", help="the link from the logits' Gaussian to probabilities: "
                   f"{', '.join(QUERY_LINKS)} (default: the held-out fit's when stored, else "
                   "meanfield)")
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
    _influence_parser(sub)
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
        if args.cmd == "influence":
            return _influence(args)
        return _inspect(args) if args.cmd == "inspect" else _query(args)
    except KFACStreamError as e:  # a user error: one line, no traceback (exit code 2)
        print(f"kfac-stream {args.cmd}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
