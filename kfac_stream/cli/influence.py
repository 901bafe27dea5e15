"""``kfac-stream influence``: its arguments, their checks, the command, and the records of its
top-k most helpful and most harmful training examples per query."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

from ..exceptions import QueryInputError
from .data import collate, decode_ids, label_names
from .influence_data import (
    CUTS,
    INFLUENCE_MAX_SEQ_LEN,
    TRAIN_RULES,
    InfluenceQuery,
    TrainExample,
    TrainSet,
    app_config_path,
    influence_queries,
    load_train_set,
    read_app_config,
)
from .loading import (
    CLASSIFIER,
    SUPPORTED,
    TASK_NAMES,
    adapter_of,
    base_meta,
    check_paths,
    load_model,
    load_snapshot,
    load_tokenizer,
    model_shown,
    model_task,
    parse_prior_precision,
    word_or_number,
)
from .output import (
    influence_footer,
    influence_status,
    influence_table,
    self_influence_table,
)

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
# * ``app``: the training app's own data (`kfac_stream.app.main.training_documents` and
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


#: Training examples per batch (``--batch-size``).
INFLUENCE_BATCH = 16


#: What ``influence`` answers (its refusal of any other model): `SUPPORTED`, for this command.
INFLUENCE_SUPPORTED = SUPPORTED.replace("kfac-stream query answers", "kfac-stream influence "
                                        "answers").replace("LaplacePosterior.predictive gives the "
                                                           "Gaussian of chosen logits",
                                                           "kfac_stream.influence_scores gives "
                                                           "the scores")


def add_influence_parser(sub) -> None:
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
        "(docs/influence.md). --self instead ranks the training examples by their influence on "
        "themselves (grad L(example)^T (F + damping)^-1 grad L(example)): mislabelled and "
        "atypical examples first.")
    p.add_argument("--snapshot", required=True, help="snapshot directory (or its parent)")
    p.add_argument("--self", dest="self_influence", action="store_true", help="no queries: "
                   "rank the training examples by self-influence (highest first: mislabelled "
                   "or atypical examples); --top-k of them shown, --json holds every score")
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
    p.add_argument("--seq-len", type=int, help="the most tokens of a training text (JSON "
                   "lines and datasets; pass the max_length your training's tokenizer call "
                   "used; default: the model's positions, at most "
                   f"{INFLUENCE_MAX_SEQ_LEN}); --train app uses the run's model.seq_len")
    p.add_argument("--cut", choices=CUTS, help="how a training text longer than --seq-len "
                   "tokens is cut (JSON lines and datasets): tokenizer (the default): one "
                   "example per record, as tokenizer(text, truncation=True, "
                   "max_length=SEQ_LEN) cuts it, special tokens kept (a Trainer user's "
                   "preprocessing); windows: windows of SEQ_LEN tokens of its whole "
                   "tokenisation (a causal LM: every window, a shorter last one kept; a "
                   "classifier: the first, without the trailing special tokens); said on "
                   "stderr and in the footer")
    p.add_argument("--text-field", default="text", help="the text column of --train (default "
                   "text)")
    p.add_argument("--label-field", default="label", help="classifiers: the label column of "
                   "--train (default label)")
    p.add_argument("--app-config", metavar="PATH", help="--train app: the run's composed "
                   "config (a config.yaml, or a run directory holding .hydra/config.yaml); "
                   "default: found beside --model or --snapshot")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--base", help="the base model of a PEFT (LoRA) adapter directory given as "
                   "--model (default: the base/ that kfac_stream.gather_model saves beside it)")
    p.add_argument("--byte-level", action="store_true", help="token id = UTF-8 byte (the demo; "
                   "implied by --train app for the app's byte-level model)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default: cuda when available)")


# -- checks before anything loads --------------------------------------------------------------

def _damping(value: str) -> float | str:
    """``--damping``: one of `DAMPING_RULES` or a positive finite float."""
    return word_or_number("--damping", value, DAMPING_RULES,
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
    if args.self_influence:
        given = [f for f, v in (("--query", args.query), ("--completion", args.completion),
                                ("--label", args.label), ("--query-file", args.query_file),
                                ("--per-token", args.per_token)) if v]
        if given:
            raise QueryInputError(f"{given[0]} is not allowed with --self: self-influence "
                                  "scores each training example against itself (no queries)")
    elif args.query_file is not None and (args.query or args.completion or args.label):
        raise QueryInputError("--query-file is not allowed with --query, --completion or "
                              "--label: pass the queries one way")
    if not args.self_influence and args.query_file is None and not args.query:
        raise QueryInputError("one of --query (with --completion for a causal LM, --label for "
                              "a classifier), --query-file FILE or --self is required")
    if args.query_file is not None:
        _check_file("--query-file", args.query_file, "a JSON-lines file of queries")
    if args.train != "app":
        if not args.train:
            raise QueryInputError("--train='' is not allowed: must be 'app', a datasets "
                                  "save_to_disk directory or a JSON-lines file")
        if not os.path.exists(args.train):
            raise QueryInputError(f"--train={args.train!r} does not exist: must be 'app', a "
                                  "datasets save_to_disk directory or a JSON-lines file")
    if args.cut is not None and args.train == "app":
        raise QueryInputError(f"--cut {args.cut} is not allowed with --train app: its examples "
                              "are the windows the run trained on")
    if args.train != "app" and args.cut is None:
        args.cut = "tokenizer"
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


class _Batches:
    """The training batches, in order (a length for the progress bar); when stderr is not a
    terminal a status line at every tenth of them."""

    def __init__(self, examples: Sequence[TrainExample], size: int, pad_id: int, device) -> None:
        self.examples, self.size, self.pad_id, self.device = examples, size, pad_id, device

    def __len__(self) -> int:
        return -(-len(self.examples) // self.size)

    def __iter__(self):
        total, t0 = len(self), time.perf_counter()
        lines = not sys.stderr.isatty()
        marks = {max(1, round(total * k / 10)) for k in range(1, 10)} if lines else set()
        for j in range(total):
            chunk = self.examples[j * self.size:(j + 1) * self.size]
            yield collate(chunk, self.pad_id, self.device)
            if j + 1 in marks:
                done = min((j + 1) * self.size, len(self.examples))
                influence_status(f"scored {done:,} of {len(self.examples):,} training examples "
                                 f"({time.perf_counter() - t0:.1f} s)")


# -- the command -------------------------------------------------------------------------------

def _influence_device(args):
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise QueryInputError("--device=cuda is not allowed here: torch sees no CUDA device "
                              "(--device cpu, or auto)")
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def _check_app_run(args, task: str, arch: str) -> None:
    """``--train app``: the run's config found (``args._app_config_path``), and ``--byte-level``
    set for (or refused with) its model: a causal LM, byte-level when ``model.kind=tiny``."""
    if task == CLASSIFIER:
        raise QueryInputError(f"--train app is not allowed with a sequence classifier "
                              f"({arch}): the app trains causal LMs; pass a datasets "
                              "directory or a JSON-lines file of {\"text\", \"label\"}")
    args._app_config_path = app_config_path(args)
    kind = read_app_config(args._app_config_path).model.kind
    if kind == "tiny" and not args.byte_level:
        if args.tokenizer is not None:
            raise QueryInputError(f"--tokenizer is not allowed with --train app of a "
                                  f"byte-level run ({args._app_config_path}: model.kind="
                                  "tiny): its tokens are UTF-8 bytes")
        args.byte_level = True
        influence_status("--train app: the run's model is byte-level (model.kind=tiny): "
                         "--byte-level")
    elif kind != "tiny" and args.byte_level:
        raise QueryInputError(f"--byte-level is not allowed with --train app of a model "
                              f"with a tokenizer ({args._app_config_path}: model.kind="
                              f"{kind})")


def _influence_posterior(args, model, snap, damping: float | str, tau):
    """``(LaplacePosterior, Influence)`` of the model (on its device) and the snapshot: ``τ``
    (``--damping prior``; else 1.0, unused) and the damping of every layer, refused where it
    is 0 (a zero factor)."""
    from ..query.influence import Influence
    from ..query.laplace import LaplacePosterior
    from ..snapshot.adequacy import width_unused

    if tau == "marglik":
        influence_status(f"choosing the prior precision by marginal likelihood over "
                         f"{len(snap)} layers (--prior-precision FLOAT skips it) ...")
    with width_unused():  # few samples widen a posterior; influence does not use its width
        post = LaplacePosterior(model, snap, prior_precision=1.0 if tau is None else tau)
    inf = Influence(post, damping, args.eigenvalues)
    zero = [n for n, lam in inf.damping.items() if not lam > 0]
    if zero:  # heuristic on a zero factor: (F + 0 I)⁻¹ has no value there
        raise QueryInputError(
            f"--damping {args.damping} is 0 on {len(zero)} layer(s) ({', '.join(zero[:2])}"
            f"{', ...' if len(zero) > 2 else ''}): their factors are zero (no sampled "
            "position carried a gradient there), so the scores would be NaN: pass --damping "
            "prior or a positive --damping FLOAT")
    return post, inf


def run_influence(args) -> int:
    """``kfac-stream influence``."""
    t0 = time.perf_counter()
    check_paths(args)
    _check_influence_ints(args)
    damping = _damping(args.damping)
    _check_influence_args(args)
    args.adapter = adapter_of(args)
    task, arch = model_task(args.model, args.adapter, INFLUENCE_SUPPORTED)
    if task == CLASSIFIER and args.per_token:
        raise QueryInputError("--per-token is not allowed with a sequence classifier: its loss "
                              "has one term per example (the split is over a completion's "
                              "tokens)")
    if args.train == "app":
        _check_app_run(args, task, arch)
    tau = None
    if damping == "prior":
        tau = parse_prior_precision(args.prior_precision or "marglik")
    tokenizer = load_tokenizer(args)
    device = _influence_device(args)
    influence_status(f"loading snapshot {args.snapshot} ...")
    snap = load_snapshot("--snapshot", args.snapshot)
    influence_status(f"snapshot {snap.path}: {len(snap)} layers; loading {TASK_NAMES[task]} "
                     f"{model_shown(args)} ...")
    model = load_model(args.model, task, args.adapter)
    queries = [] if args.self_influence else influence_queries(args, task, model, tokenizer)
    train = load_train_set(args, task, model, tokenizer)
    model.to(device)
    post, inf = _influence_posterior(args, model, snap, damping, tau)
    pad_id = model.config.pad_token_id
    size = args.batch_size
    if task == CLASSIFIER and pad_id is None:
        size = 1  # GPT-2's classifier finds each input's last token by the pad id
    batches = _Batches(train.examples, size, 0 if pad_id is None else pad_id, device)
    what = ("self-influence of" if args.self_influence else
            f"{len(queries)} quer{'ies' if len(queries) != 1 else 'y'} x")
    influence_status(f"{what} {len(train.examples):,} training examples ({len(batches)} "
                     f"batches of {size}) on {device}, damping {args.damping} "
                     f"({time.perf_counter() - t0:.1f} s so far) ...")
    names = (label_names(model.config.id2label, model.config.num_labels)
             if task == CLASSIFIER else None)
    meta = {"snapshot": str(snap.path), "step": snap.step, "model": args.model,
            **base_meta(args), "task": task, "architecture": arch, "train": args.train,
            "train_rule": TRAIN_RULES[train.kind], "train_described": train.described,
            "app_config": train.config, "seq_len": train.seq_len,
            **({} if train.cut is None else {"cut": train.cut}),
            "train_examples": len(train.examples), "damping": damping,
            "damping_per_layer": dict(inf.damping), "layers": list(inf.layers),
            "eigenvalues": args.eigenvalues,
            "ekfac_layers": [n for n, v in inf.corrected.items() if v is not None],
            "top_k": min(args.top_k, len(train.examples)), "device": str(device),
            "batch_size": size}
    if tau is not None:
        meta["prior_precision"] = float(post.prior_precision)
    t1 = time.perf_counter()
    if args.self_influence:
        values = inf.self_scores(batches)
        records = _self_records(values, train, tokenizer, args.top_k, names)
        meta["self_influence"] = True
    else:
        qbatches = [collate([q], 0 if pad_id is None else pad_id, device) for q in queries]
        result = inf.scores(qbatches, batches, per_token=args.per_token)
        records = _influence_records(result, queries, train, tokenizer, args.top_k, names)
        meta.update(per_token=args.per_token, queries_given=[q.record for q in queries])
    scoring = time.perf_counter() - t1
    meta.update({"seconds": round(time.perf_counter() - t0, 3),
                 "scoring_seconds": round(scoring, 3),
                 "seconds_per_train_example": scoring / len(train.examples)})
    _print_influence(args, meta, records, names, values if args.self_influence else None)
    influence_status(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def _print_influence(args, meta: dict, records: list[dict], names, values) -> None:
    """The table and its footer, or ``--json``: the metadata with the records (``--self``:
    ``ranked``, and every example's score in ``scores``; else ``queries``)."""
    if args.json:
        doc = {k: v for k, v in meta.items() if k != "queries_given"}
        if values is not None:
            doc["ranked"], doc["scores"] = records, [float(v) for v in values.tolist()]
        else:
            doc["queries"] = records
        print(json.dumps(doc, indent=1, allow_nan=False))
    elif values is not None:
        print(self_influence_table(records, names))
        print(influence_footer(meta))
    else:
        print(influence_table(records, names))
        print(influence_footer(meta))


def _example_text(tokenizer, ex: TrainExample) -> str:
    return decode_ids(tokenizer, ex.ids)


def _example_record(rank: int, j: int, score: float, train: TrainSet, tokenizer,
                    names=None) -> dict:
    """One listed training example: ``rank``, ``index``, ``score``, ``text``, ``source`` and a
    classifier example's ``label_id`` (and ``label`` with ``names``)."""
    ex = train.examples[j]
    rec = {"rank": rank, "index": j, "score": float(score),
           "text": _example_text(tokenizer, ex), "source": ex.source}
    if not isinstance(ex.labels, list):
        rec["label_id"] = ex.labels
        if names is not None:
            rec["label"] = names[ex.labels]
    return rec


def _influence_side(ranked, values, record, token_rows) -> list[dict]:
    """One side (helpful or harmful) of a query's listing.

    ``record(rank, j, score)`` describes training example ``j``; ``token_rows`` is the
    query's ``[n_completion, N]`` per-token scores, or None.
    """
    out = []
    for rank, (j, s) in enumerate(zip(ranked.tolist(), values.tolist()), 1):
        rec = record(rank, j, s)
        if token_rows is not None:
            rec["token_scores"] = [float(x) for x in token_rows[:, j].tolist()]
        out.append(rec)
    return out


def _self_records(values, train: TrainSet, tokenizer, k: int, names) -> list[dict]:
    """The ``k`` training examples of highest self-influence, highest first."""
    top = values.topk(min(k, len(values)))
    return [_example_record(rank, j, v, train, tokenizer, names) for rank, (j, v) in
            enumerate(zip(top.indices.tolist(), top.values.tolist()), 1)]


def _influence_records(result, queries: Sequence[InfluenceQuery], train: TrainSet, tokenizer,
                       k: int, names) -> list[dict]:
    (hi, hv), (lo, lv) = result.top_k(k)

    def record(rank, j, score):
        return _example_record(rank, j, score, train, tokenizer, names)

    out = []
    for q, query in enumerate(queries):
        rec = {"index": q, **query.record}
        tokens = (None if result.token_scores is None
                  else result.token_scores[q, :len(query.completion)])
        rec["helpful"] = _influence_side(hi[q], hv[q], record, tokens)
        rec["harmful"] = _influence_side(lo[q], lv[q], record, tokens)
        out.append(rec)
    return out
