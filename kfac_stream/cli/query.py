"""``kfac-stream query``: its arguments, their checks, and a causal LM's per-token table (or
top-k next tokens); a sequence classifier's query is `kfac_stream.cli.classify`."""

from __future__ import annotations

import time

from ..exceptions import QueryInputError
from .classify import classify
from .data import decode_token, token_ids
from .loading import (
    CLASSIFIER,
    adapter_of,
    base_meta,
    check_paths,
    load_model,
    load_snapshot,
    load_tokenizer,
    model_shown,
    model_task,
    parse_prior_precision,
    prior_meta,
    query_posterior,
)
from .output import query_status

#: ``query --prior-precision``'s words (`kfac_stream.query.prior_choice`).
QUERY_PRIOR_WORDS = ("auto", "heldout", "marglik")


#: ``query --link``: the links `LaplacePosterior.predictive_probs` takes.
QUERY_LINKS = ("meanfield", "probit", "mc", "map")


#: ``--mode``: the per-token whole-vocabulary table, or the top-k next tokens.
MODES = ("tokens", "topk")


#: ``--samples`` by mode: posterior samples for ``tokens`` (one forward-mode pass each of the
#: linearised model, the default; one forward each with ``--weight-samples``), Gaussian draws of
#: the top-k logits per position (cheap) for ``topk``.
DEFAULT_SAMPLES = {"tokens": 32, "topk": 2000}


def add_query_parser(sub) -> None:
    """The ``query`` sub-command's arguments."""
    q = sub.add_parser(
        "query", help="a causal LM: per-token uncertainty of a text under the posterior (or "
        "its top-k next tokens); a sequence classifier: the MAP and Laplace class "
        "probabilities of each input", description="Query a trained model under the Laplace "
        "posterior of a snapshot. The task comes from the model's config (architectures, "
        "problem_type, num_labels): a causal LM (*ForCausalLM, *LMHeadModel) gets the per-token "
        "table of one --text (or --top-k); a single-label sequence classifier "
        "(*ForSequenceClassification) gets, per input (--text, or --file with one input per "
        "line), the MAP class probabilities, the Laplace predictive's (the held-out fit's link, "
        "MAP's own when the fit kept MAP, else probit), the predicted label, its entropy and "
        "logit std. Other tasks are refused. Without tokenizer files, pass --byte-level or "
        "--tokenizer DIR.")
    q.add_argument("--snapshot", required=True, help="snapshot directory (or its parent)")
    q.add_argument("--model", required=True, help="model directory or hub name (a causal LM "
                   "or a sequence classifier)")
    q.add_argument("--text", help="the input (exactly one of --text and --file)")
    q.add_argument("--file", metavar="PATH", help="sequence classifiers: a UTF-8 file of "
                   "inputs, one per line (blank lines skipped), or a *.jsonl file (the \"text\" "
                   "of each JSON object, e.g. influence's training file), batched with padding")
    q.add_argument("--max-length", type=int, metavar="N", help="cut each input longer than N "
                   "tokens to N, as training truncated (at most the model's positions): a "
                   "causal LM keeps the END of the text (its last N tokens: the next token and "
                   "--options are read at the last position), a sequence classifier its first N "
                   "(as a tokenizer with truncation=True does; special tokens stay); said on "
                   "stderr. Default: no truncation (a longer input is refused)")
    q.add_argument("--tokenizer", help="tokenizer directory (default: --model; it must hold "
                   "tokenizer files, else pass --byte-level)")
    q.add_argument("--base", help="the base model of a PEFT (LoRA) adapter directory given as "
                   "--model (default: the base/ that kfac_stream.gather_model saves beside the "
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
                   f"{', '.join(QUERY_LINKS)} (map: MAP's own softmax; default: the held-out "
                   "fit's when stored, map when that fit kept MAP's probabilities, else probit)")
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
                   "(default: the snapshot's answer tokens, HeldoutConfig.answer_tokens, if any)")
    q.add_argument("--json", action="store_true", help="print one JSON document instead of "
                   "the table")


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
    """The cheap checks of ``query``'s flags for the model's ``task`` (after `check_paths`
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
    return parse_prior_precision(args.prior_precision, QUERY_PRIOR_WORDS)


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


def _encode(args, model, tokenizer=None) -> tuple[object | None, list[int]]:
    """``(tokenizer or None for --byte-level, the ids of --text)``, checked against the model
    (``tokenizer``: one `load_tokenizer` already loaded)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(args)
    return tokenizer, token_ids(args, tokenizer, model, args.text, keep_end=True)


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
            shown = " ".join(repr(decode_token(tokenizer, t)) for t in toks)
            raise QueryInputError(f"--options: {option!r} is {len(toks)} {how} ({shown}): each "
                                  f"option must encode to exactly one token ({hint})")
        if vocab is not None and toks[0] >= vocab:
            raise QueryInputError(f"--options: {option!r} is token id {toks[0]}, but the "
                                  f"model's vocabulary has {vocab} tokens")
        ids.append(toks[0])
    return ids


def _recorded_options(snap, tokenizer, vocab: int | None) -> tuple[list[str], list[int]]:
    """``(texts, ids)`` of the snapshot's answer tokens (``HeldoutConfig.answer_tokens``), the
    options of a query without ``--options``: the texts recorded, else the ids decoded."""
    ids = [int(i) for i in snap.answer_tokens]
    texts = getattr(snap, "answer_texts", None)
    texts = list(texts) if texts else [str(decode_token(tokenizer, i)) for i in ids]
    if vocab is not None and max(ids) >= vocab:
        raise QueryInputError(f"--snapshot={str(snap.path)!r}: its answer tokens {ids} (the "
                              f"options when --options is not given) reach past the model's "
                              f"vocabulary of {vocab} tokens: a snapshot of another model?")
    return texts, ids


def _query_options(args, snap, model, tokenizer) -> tuple[list[int] | None, str | None]:
    """``(option ids, where they came from)`` of a causal LM's query: ``--options``, else (in
    ``--mode tokens``) the snapshot's answer tokens (setting ``args.options`` to their texts),
    else ``(None, None)``."""
    option_ids, options_from = None, None
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if args.options is not None:
        option_ids, options_from = _option_ids(args, tokenizer, vocab), "--options"
    elif args.mode == "tokens" and getattr(snap, "answer_tokens", None):
        args.options, option_ids = _recorded_options(snap, tokenizer, vocab)
        options_from = "snapshot"
        query_status(f"options {' '.join(map(repr, args.options))}: the snapshot's answer tokens "
                     "(HeldoutConfig.answer_tokens; --options overrides them)")
    return option_ids, options_from


def run_query(args) -> int:
    """``kfac-stream query``: the model's task from its config, then a causal LM's per-token
    table (or top-k) or a sequence classifier's class probabilities."""
    t0 = time.perf_counter()
    check_paths(args)
    _check_inputs_given(args)
    args.adapter = adapter_of(args)
    task, arch = model_task(args.model, args.adapter)
    tau = _check_query_args(args, task, arch)
    tokenizer = load_tokenizer(args)
    if task == CLASSIFIER:
        return classify(args, tau, arch, tokenizer, t0)
    return _lm_query(args, tau, tokenizer, t0)


def _lm_query(args, tau, tokenizer, t0: float) -> int:
    """A causal LM's query: the per-token table of ``--text`` and the agreement of its answer
    options, or its top-k next tokens (a table, or ``--json``)."""
    query_status(f"loading snapshot {args.snapshot} ...")
    snap = load_snapshot("--snapshot", args.snapshot)

    import torch

    from ..query import token_table as tt

    query_status(f"snapshot {snap.path}: {len(snap)} layers; loading model {model_shown(args)} ...")
    model = load_model(args.model, adapter=args.adapter)
    tokenizer, ids = _encode(args, model, tokenizer)
    option_ids, options_from = _query_options(args, snap, model, tokenizer)
    post = query_posterior(args, model, snap, tau)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **base_meta(args), "text": args.text, "mode": args.mode, **prior_meta(post),
            "samples": args.samples, "seed": args.seed}
    decode = lambda i: decode_token(tokenizer, i)  # noqa: E731
    answers = None
    if args.mode == "topk":
        from ..query.topk import topk_predictive

        meta["top_k"] = args.top_k
        query_status(f"{len(ids)} positions x top-{args.top_k} next tokens "
                     f"({time.perf_counter() - t0:.1f} s so far) ...")
        rows = topk_predictive(post, torch.tensor(ids), k=args.top_k, n_samples=args.samples,
                               seed=args.seed)
        records = tt.topk_records(ids, rows, decode)
        table = tt.topk_table(records, args.top_k)
    else:
        from ..query.sampled import sampled_predictive

        meta["linearized"] = args.linearized
        query_status(f"{len(ids)} positions x {args.samples} posterior samples"
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
            from ..query.answers import answer_distribution

            query_status(f"answer agreement of {len(option_ids)} options over {args.samples} "
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
        if args.mode == "topk":  # the top-k table opens with the snapshot and its posterior
            print(f"snapshot {snap.path} (step {snap.step}); N = {post.num_data:.0f}, "
                  f"{post.describe()}")
        print(table)
        if answers is not None:
            print()
            print(tt.answer_table(answers, len(ids) - 1))
        print(tt.footer(meta))
    query_status(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
