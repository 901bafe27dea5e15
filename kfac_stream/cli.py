"""`kfac-stream` command line: ``train`` (Hydra app), ``inspect``, ``query`` and ``demo``."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

from .exceptions import KFACStreamError, QueryInputError
from .files import local_path_problem

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


def _check_query_args(args) -> float | str:
    """The cheap checks of ``query``'s arguments, before anything loads (filling in the
    defaults that depend on ``--mode``); returns ``τ``."""
    for arg, name, allowed in (
            ("--model", args.model, "must be a model directory written by save_pretrained "
             "(e.g. out/demo/model) or a hub model name"),
            ("--tokenizer", args.tokenizer, "must be a tokenizer directory or a hub name; "
             "pass --byte-level for a byte-level model such as the demo's")):
        problem = None if name is None else local_path_problem(name)
        if problem is not None:  # before the snapshot loads, and before any hub request
            raise QueryInputError(f"{arg}={name!r} {problem}: {allowed}")
    if args.mode is None:  # --top-k asks for the top-k table; else the per-token table
        args.mode = "topk" if args.top_k is not None else "tokens"
    if not args.text:
        raise QueryInputError(f"--text={args.text!r} is not allowed: must be a non-empty text "
                              "(the positions to query)")
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
    return _prior_precision(args.prior_precision)


def _load_model(name: str):
    """``--model``: a causal LM from a local directory or the hub, in float32 and eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    allowed = ("a model directory written by save_pretrained (e.g. out/demo/model) or a hub "
               "model name")
    if not name:
        raise QueryInputError(f"--model={name!r} is not allowed: must be {allowed}")
    if os.path.isfile(name):
        raise QueryInputError(f"--model={name!r} is a file: must be {allowed}")
    problem = local_path_problem(name)
    if problem is None and not os.path.isdir(name) and not HUB_NAME.match(name):
        problem = "does not exist"
    if problem is not None:
        raise QueryInputError(f"--model={name!r} {problem}: must be {allowed}")
    _refuse_other_tasks(name)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32,
                                                           output_loading_info=True)
    except (OSError, ValueError, ImportError) as e:  # no config / weights, not a causal LM
        raise QueryInputError(f"--model={name!r} could not be loaded as a causal LM "
                              f"({_first_line(e)}): must be {allowed}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # a head (or more) the checkpoint lacks would answer with random weights
        raise QueryInputError(
            f"--model={name!r}: its checkpoint has no weights for {len(missing)} parameter(s) "
            f"of the causal LM ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            ": they would be random; save the whole trained model with save_pretrained")
    return model.eval()


#: Endings of ``config.architectures`` names that `kfac-stream query` answers (a causal LM's
#: next-token head).
CAUSAL_LM_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")


def _refuse_other_tasks(name: str) -> None:
    """One line, before any weight loads, when the checkpoint's config names only
    architectures of another task (a sequence classifier, a seq2seq model): loading it as a
    causal LM would add a randomly initialised head and print plausible nonsense."""
    from transformers import AutoConfig

    try:
        archs = list(getattr(AutoConfig.from_pretrained(name), "architectures", None) or ())
    except (OSError, ValueError):
        return  # from_pretrained below says what is wrong
    if archs and not any(a.endswith(CAUSAL_LM_ARCHITECTURES) for a in archs):
        raise QueryInputError(
            f"--model={name!r} is a {' / '.join(archs)}, not a causal LM: kfac-stream query "
            "answers next-token questions of causal LMs only; for a classifier use "
            "LaplacePosterior(model, snapshot).predictive_probs in Python (docs/queries.md)")


def _encode(args, model) -> tuple[object | None, list[int]]:
    """``(tokenizer or None for --byte-level, the ids of --text)``, checked against the model."""
    hint = ("pass --byte-level for a byte-level model such as the demo's, or --tokenizer DIR "
            "for the model's tokenizer")
    source = args.tokenizer or args.model
    arg = "--tokenizer" if args.tokenizer else "--model"
    tokenizer = None
    if args.byte_level:
        ids = list(args.text.encode("utf-8"))
    else:
        from transformers import AutoTokenizer

        problem = local_path_problem(source)
        if problem is not None:
            raise QueryInputError(f"{arg}={source!r} {problem}: {hint}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as e:  # each tokenizer class fails in its own way (a missing file,
            # sentencepiece not installed, a vocabulary it cannot read): all are the user's to fix
            raise QueryInputError(f"{arg}={source!r} holds no tokenizer that loads "
                                  f"({_first_line(e)}): {hint}") from None
        ids = list(tokenizer(args.text)["input_ids"])
        if not ids:
            raise QueryInputError(f"{arg}={source!r}: its tokenizer turns --text={args.text!r} "
                                  f"into no tokens (it knows {len(tokenizer)} tokens; no "
                                  f"tokenizer files there?): {hint}")
    emb = model.get_input_embeddings()
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and max(ids) >= vocab:
        what = "UTF-8 bytes (--byte-level)" if args.byte_level else f"the tokenizer of {source!r}"
        raise QueryInputError(f"--text={args.text!r}: {what} give token id {max(ids)}, but the "
                              f"model's vocabulary has {vocab} tokens: pass the model's own "
                              "tokenizer (--tokenizer DIR, or --byte-level for the demo's model)")
    limit = getattr(model.config, "n_positions", None) or getattr(
        model.config, "max_position_embeddings", None)
    if limit is not None and len(ids) > limit:
        raise QueryInputError(f"--text is {len(ids)} tokens long: must be at most {limit} tokens "
                              "(the model's positions)")
    return tokenizer, ids


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


def _query(args) -> int:
    tau = _check_query_args(args)
    t0 = time.perf_counter()
    _status(f"loading snapshot {args.snapshot} ...")
    snap = _load_snapshot("--snapshot", args.snapshot)

    import torch

    from .query import token_table as tt
    from .query.laplace import LaplacePosterior

    _status(f"snapshot {snap.path}: {len(snap)} layers; loading model {args.model} ...")
    model = _load_model(args.model)
    tokenizer, ids = _encode(args, model)
    option_ids = None
    if args.options is not None:
        option_ids = _option_ids(args, tokenizer, getattr(model.get_input_embeddings(),
                                                          "num_embeddings", None))
    if tau == "marglik":
        _status(f"choosing the prior precision by marginal likelihood over {len(snap)} layers "
                "(--prior-precision FLOAT skips it) ...")
    post = LaplacePosterior(model, snap, prior_precision=tau)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            "text": args.text, "mode": args.mode, "num_data": float(post.num_data),
            "prior_precision": float(post.prior_precision), "samples": args.samples,
            "seed": args.seed}
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kfac-stream", description="streaming K-FAC tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="per-layer table of a snapshot (or the newest in a dir)")
    ins.add_argument("path")
    ins.add_argument("--plot", metavar="PNG", help="also draw the eigenvalue spectra")
    q = sub.add_parser("query", help="per-token uncertainty of a text under the posterior "
                       "(or its top-k next tokens)")
    q.add_argument("--snapshot", required=True, help="snapshot directory (or its parent)")
    q.add_argument("--model", required=True, help="model directory or hub name")
    q.add_argument("--text", required=True)
    q.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    q.add_argument("--byte-level", action="store_true", help="token id = UTF-8 byte (the demo)")
    q.add_argument("--mode", choices=MODES, help="tokens: per position the next token's "
                   "predictive probability, entropy, aleatoric and epistemic parts over the "
                   "whole vocabulary, from posterior samples; topk: the top-k next "
                   "tokens with mean p +- std (default: topk if --top-k is given, else tokens)")
    q.add_argument("--top-k", type=int, help="next tokens per position (--mode topk; default 5)")
    q.add_argument("--prior-precision", default="marglik", help="a float or 'marglik'")
    q.add_argument("--samples", type=int, help="posterior samples (--mode tokens, default "
                   f"{DEFAULT_SAMPLES['tokens']}) or draws per position (--mode topk, default "
                   f"{DEFAULT_SAMPLES['topk']})")
    q.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    q.add_argument("--weight-samples", action="store_true", help="--mode tokens: evaluate "
                   "the network at the posterior samples theta_s instead of the linearised "
                   "model f* + J(theta_s - theta*) (the default; the network at theta_s is "
                   "often far flatter than the trained model: docs/queries.md)")
    q.add_argument("--options", nargs="+", metavar="OPTION", help="answer options, one token "
                   "each (e.g. ' A' ' B' ' C' ' D'): also print which one each posterior sample "
                   "picks at the last position, and their agreement")
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
