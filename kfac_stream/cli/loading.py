"""What the commands load, and the checks of the flags that name it: the snapshot, the model
(a causal LM or a sequence classifier; a PEFT adapter on its base model), its tokenizer, the
prior precision and the posterior of a query."""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING

from ..exceptions import QueryInputError
from ..utils.files import local_path_problem
from .output import query_status

if TYPE_CHECKING:

    from ..integrations.peft_adapter import AdapterLocation


#: A hub model name (``gpt2``, ``org/name``); anything else that is not a directory is an error.
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def load_snapshot(arg: str, path: str):
    """The snapshot at ``path`` (a snapshot directory, or the newest in a directory of them)."""
    from ..snapshot.snapshot import Snapshot

    allowed = ("a snapshot directory (with manifest.json) or a directory of them "
               "(e.g. out/demo/kfac)")
    if not os.path.exists(path):
        raise QueryInputError(f"{arg}={path!r} does not exist: must be {allowed}")
    if not os.path.isdir(path):
        raise QueryInputError(f"{arg}={path!r} is a file: must be {allowed}")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return Snapshot.load(path)
    return Snapshot.latest(path)


def first_line(e: BaseException) -> str:
    """``e``'s message, first line (transformers' errors run over several)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def word_or_number(flag: str, value: str, words: tuple[str, ...], allowed: str
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


def parse_prior_precision(value: str, words: tuple[str, ...] = ("marglik",)) -> float | str:
    """``--prior-precision``: one of ``words`` or a positive finite number."""
    return word_or_number("--prior-precision", value, words,
                          "a positive finite number or " + " or ".join(map(repr, words)))


def check_paths(args) -> None:
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


def query_posterior(args, model, snap, tau):
    """The query's `LaplacePosterior` (``--prior-precision``, ``--link``), its choice said on
    stderr."""
    from ..query.laplace import LaplacePosterior

    if tau == "marglik" or (tau == "auto" and snap.heldout_prior is None):
        query_status(f"choosing the prior precision by marginal likelihood over {len(snap)} layers "
                     "(--prior-precision FLOAT skips it) ...")
    post = LaplacePosterior(model, snap, prior_precision=tau, link=args.link)
    query_status(post.describe())
    return post


def prior_meta(post) -> dict:
    """The JSON fields that say which ``τ`` and link a query used and where they came from,
    with the held-out fit's verdict when one was used."""
    meta = {"num_data": float(post.num_data), "prior_precision": float(post.prior_precision),
            "prior_source": post.prior_source, "link": post.link,
            "link_source": post.link_source}
    if post.heldout is not None:
        meta["heldout"] = {"verdict": post.heldout.verdict(), **post.heldout.to_dict()}
    return meta


#: ``MODEL_ALLOWED``: what ``--model`` must be.
MODEL_ALLOWED = ("a model directory written by save_pretrained (e.g. out/demo/model) or a hub "
                 "model name")


def check_model_name(name: str) -> None:
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


def load_model(name: str, task: str = CAUSAL_LM, adapter: AdapterLocation | None = None):
    """``--model``: a causal LM or a sequence classifier (``task``) from a local directory or
    the hub, in float32 and eval mode; refused when its checkpoint lacks weights of the model
    (a head that would be random). With ``adapter`` (``--model`` is a PEFT adapter directory,
    `adapter_of`): its base model loaded so, then the adapter on it
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
                              f"({first_line(e)}): must be {MODEL_ALLOWED}") from None
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


def adapter_of(args) -> AdapterLocation | None:
    """The PEFT adapter and base model of ``--model`` (`peft_adapter.adapter_location`: the
    base ``kfac_stream.gather_model`` saved beside it, else ``--base``'s, else
    ``adapter_config.json``'s ``base_model_name_or_path``), or None for a model directory or
    hub name that is no adapter."""
    from ..integrations.peft_adapter import adapter_location

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
        from ..integrations.peft_adapter import load_adapter

        model = load_adapter(adapter, base)
    except ImportError as e:
        raise QueryInputError(f"--model={name!r} is a PEFT adapter directory: loading it needs "
                              f"peft ({first_line(e)}; pip install 'kfac_stream[peft]')"
                              ) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # adapter of another base
        raise QueryInputError(f"--model={name!r}: its PEFT adapter does not load onto the base "
                              f"model {adapter.base!r} ({adapter.base_from}; {first_line(e)}):"
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


def model_task(name: str, adapter: AdapterLocation | None = None,
               supported: str = SUPPORTED) -> tuple[str, str]:
    """``(task, architecture)`` of ``--model`` from its config alone, before any weight loads:
    `CAUSAL_LM` or `CLASSIFIER`; any other task (token classification, multiple choice,
    regression or multi-label heads, question answering, seq2seq...) is refused in one line,
    since loading it as either would add a randomly initialised head and print plausible
    nonsense. A config that does not load or names no architecture: `CAUSAL_LM` (the loader
    then says what is wrong). For a PEFT adapter directory (``adapter``), the base model's
    config. ``supported``: what the refusal says is answered (the command's own line)."""
    from transformers import AutoConfig

    check_model_name(name)
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


def load_tokenizer(args):
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
                              f"({first_line(e)}): {TOKENIZER_HINT}") from None
    special = len(set(getattr(tokenizer, "all_special_ids", ()) or ()))
    if len(tokenizer) <= special:
        raise QueryInputError(f"{arg}={source!r}: its tokenizer knows only its {special} "
                              f"special token(s), no vocabulary (tokenizer files missing?): "
                              f"{TOKENIZER_HINT}")
    return tokenizer


def model_shown(args) -> str:
    """``--model`` in a status line: with its base model when it is a PEFT adapter."""
    adapter = getattr(args, "adapter", None)
    return args.model if adapter is None else (
        f"{args.model} (PEFT adapter on base model {adapter.base})")


def base_meta(args) -> dict:
    """``{"base": ...}`` (the base model of a PEFT adapter directory) and ``{"max_length":
    N}`` (``--max-length``) for the JSON, each only when given."""
    adapter = getattr(args, "adapter", None)
    n = getattr(args, "max_length", None)
    return {**({} if adapter is None else {"base": adapter.base}),
            **({} if n is None else {"max_length": n})}
