"""``kfac-stream influence``'s queries and training examples: read from the flags, a
JSON-lines file, a ``datasets`` directory or the training app's own data, tokenised and checked
against the model."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..exceptions import QueryInputError
from ..query.lengths import too_long
from .data import (
    encode_ids,
    json_lines,
    label_names,
    model_limits,
    parse_label,
    token_text,
    truncated_ids,
)
from .loading import CLASSIFIER, first_line
from .output import influence_status

#: ``--seq-len``'s default: the model's positions, at most this many tokens.
INFLUENCE_MAX_SEQ_LEN = 1024


#: How each kind of ``--train`` is cut into examples (also in the JSON, ``train_rule``).
TRAIN_RULES = {
    "app": "the app's training windows: the run's training documents joined by a blank line, "
           "one token stream cut into windows of model.seq_len tokens, the incomplete tail "
           "dropped (as the run trained)",
    "text": "one example per record: the text cut as tokenizer(text, truncation=True, "
            "max_length=seq_len) cuts it (a Trainer user's preprocessing: the tokenizer's "
            "special tokens kept; --byte-level: its first seq_len bytes); every token labelled",
    "text_windows": "--cut windows: each text tokenised whole (the tokenizer's special tokens, "
                    "as for a query) and cut into consecutive windows of seq_len tokens, a "
                    "shorter last window kept; every token labelled",
    "prompt": "one example per record: the prompt's tokens then the completion's, the loss on "
              "the completion's tokens only",
    "classifier": "one example per record: the text cut as tokenizer(text, truncation=True, "
                  "max_length=seq_len) cuts it (a Trainer user's preprocessing: the tokenizer's "
                  "special tokens kept; --byte-level: its first seq_len bytes) and its label",
    "classifier_window": "--cut windows: one example per record: the first seq_len tokens of "
                         "the text's whole tokenisation (a longer text loses the tokenizer's "
                         "trailing special tokens, such as [SEP]) and its label",
}

#: ``--cut``: how a ``{"text"}`` record longer than ``--seq-len`` becomes examples
#: (`TRAIN_RULES`): ``tokenizer`` (the default) as ``tokenizer(text, truncation=True,
#: max_length=seq_len)`` cuts it, as a Trainer user's preprocessing does; ``windows``: windows
#: of its whole tokenisation (a causal LM's every window, a classifier's first).
CUTS = ("tokenizer", "windows")


# -- queries -----------------------------------------------------------------------------------

@dataclass
class InfluenceQuery:
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
    for n, rec in json_lines("--query-file", args.query_file):
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


def influence_queries(args, task: str, model, tokenizer) -> list[InfluenceQuery]:
    """Each query's ids and labels (a causal LM: prompt then completion, labels -100 on the
    prompt; a classifier: the text and its class index), checked against the model."""
    vocab, limit = model_limits(model)
    out = []
    names = label_names(model.config.id2label, model.config.num_labels) \
        if task == CLASSIFIER else []
    label2id = {str(k): v for k, v in (getattr(model.config, "label2id", None) or {}).items()}
    for spec, where in _query_specs(args, task):
        if task == CLASSIFIER:
            text = spec["text"]
            if not isinstance(text, str) or not text:
                raise QueryInputError(f"{where}: the text must be a non-empty string")
            ids = encode_ids(tokenizer, text)
            label = parse_label(spec["label"], names, label2id, where)
            rec = {"text": text, "label": names[label], "label_id": label}
            q = InfluenceQuery(ids, label, rec)
        else:
            prompt, completion = spec["prompt"], spec["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise QueryInputError(f"{where}: prompt and completion must be strings")
            if not completion:
                raise QueryInputError(f"{where} has an empty completion: a causal LM's query "
                                      "needs the completion whose tokens the loss is taken on "
                                      "(--completion TEXT)")
            p_ids = encode_ids(tokenizer, prompt)
            if not p_ids:
                raise QueryInputError(f"{where}: the prompt has no tokens: the completion's "
                                      "first token is predicted from the prompt (a non-empty "
                                      "--query)")
            c_ids = encode_ids(tokenizer, completion, special=False)
            if not c_ids:
                raise QueryInputError(f"{where}: the completion {completion!r} has no tokens")
            ids = p_ids + c_ids
            labels = [-100] * len(p_ids) + c_ids
            rec = {"prompt": prompt, "completion": completion,
                   "completion_tokens": [{"position": len(p_ids) + i, "token_id": t,
                                          "token": token_text(tokenizer, t)}
                                         for i, t in enumerate(c_ids)]}
            q = InfluenceQuery(ids, labels, rec, list(range(len(p_ids), len(ids))))
        if vocab is not None and max(ids) >= vocab:
            raise QueryInputError(f"{where}: its tokens reach id {max(ids)}, but the model's "
                                  f"vocabulary has {vocab} tokens: pass the model's own "
                                  "tokenizer (--tokenizer DIR, or --byte-level for the demo's)")
        if limit is not None and len(ids) > limit:
            raise QueryInputError(too_long(where, len(ids), limit, "a query is read whole: "
                                           "shorten it"))
        q.record["tokens"] = len(ids)
        out.append(q)
    return out


# -- training examples -------------------------------------------------------------------------

@dataclass
class TrainExample:
    """One training example: ids, labels (per token, or a class index) and where it came
    from (``source``: the record's index, the window's first token)."""

    ids: list[int]
    labels: list[int] | int
    source: dict[str, Any]


@dataclass
class TrainSet:
    examples: list[TrainExample]
    kind: str  # a TRAIN_RULES key
    described: str  # for the footer
    seq_len: int | None
    config: str | None = None  # --train app: the run config read
    cut: str | None = None  # a CUTS entry (None: --train app)


def _default_seq_len(args, model) -> int:
    if args.seq_len is not None:
        return args.seq_len
    _, limit = model_limits(model)
    return min(limit or INFLUENCE_MAX_SEQ_LEN, INFLUENCE_MAX_SEQ_LEN)


def _windows(ids: list[int], seq_len: int) -> Iterator[tuple[int, list[int]]]:
    """``(start, window)``: consecutive windows of ``seq_len`` ids, a shorter last one kept
    when it has a next-token loss (2 ids or more)."""
    for start in range(0, len(ids), seq_len):
        w = ids[start:start + seq_len]
        if len(w) >= 2:
            yield start, w


def app_config_path(args) -> str:
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


def read_app_config(path: str):
    """The ``model`` and ``data`` groups of a run's config, on the app's schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ..app.schema import DataConf, ModelConf

    try:
        loaded = OmegaConf.load(path)
        return OmegaConf.create({
            "model": OmegaConf.merge(OmegaConf.structured(ModelConf), loaded.get("model", {})),
            "data": OmegaConf.merge(OmegaConf.structured(DataConf), loaded.get("data", {}))})
    except (OSError, ValueError, OmegaConfBaseException) as e:
        raise QueryInputError(f"--train app: the run config {path!r} could not be read "
                              f"({first_line(e)}): must be a config the app composed") from None


def _app_examples(args, cfg, tokenizer) -> list[TrainExample]:
    from ..app.data import ByteTokenizer
    from ..app.main import training_documents, training_windows

    docs, _ = training_documents(cfg)
    tok = ByteTokenizer() if tokenizer is None else tokenizer
    windows = training_windows(docs, tok, cfg.model.seq_len, args.max_train)
    return [TrainExample(w["input_ids"].tolist(), w["labels"].tolist(),
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
                                  f"save_to_disk ({first_line(e)}): must be 'app', such a "
                                  "directory or a JSON-lines file") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise QueryInputError(f"--train={path!r} is a DatasetDict without a 'train' "
                                      f"split (it has {', '.join(ds)}): save the split to score")
            ds = ds["train"]
        return enumerate(ds), f"the dataset {path}"
    return ((n - 1, rec) for n, rec in json_lines("--train", path)), f"{path}"


def _record_examples(args, task: str, model, tokenizer, seq_len: int
                     ) -> tuple[list[TrainExample], str, str, tuple[int, int]]:
    """The examples of a ``datasets`` directory or JSON-lines file: ``(examples, kind,
    described, (texts longer than seq_len tokens, texts))``, each text cut by ``args.cut``
    (`CUTS`)."""
    records, what = _train_records(args)
    windows = args.cut == "windows"
    longer = texts = 0
    names = label_names(model.config.id2label, model.config.num_labels) \
        if task == CLASSIFIER else []
    label2id = {str(k): v for k, v in (getattr(model.config, "label2id", None) or {}).items()}
    examples: list[TrainExample] = []
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
            if windows:  # the first window of the whole tokenisation
                whole = encode_ids(tokenizer, text)
                ids, n_whole = whole[:seq_len], len(whole)
            else:
                ids, n_whole = truncated_ids(tokenizer, text, seq_len)
            label = parse_label(rec[lf], names, label2id, where)
            examples.append(TrainExample(ids, label, {"record": i}))
            texts, longer = texts + 1, longer + (n_whole > seq_len)
            kind = "classifier_window" if windows else "classifier"
        elif tf in rec:
            text = rec[tf]
            if not isinstance(text, str) or not text.strip():
                continue
            if windows:
                whole = encode_ids(tokenizer, text)
                n_whole = len(whole)
                for start, w in _windows(whole, seq_len):
                    if args.max_train is not None and len(examples) >= args.max_train:
                        break
                    examples.append(TrainExample(w, list(w), {"record": i,
                                                              "first_token": start}))
            else:
                ids, n_whole = truncated_ids(tokenizer, text, seq_len)
                if len(ids) >= 2:  # a next-token loss
                    examples.append(TrainExample(ids, list(ids), {"record": i}))
            texts, longer = texts + 1, longer + (n_whole > seq_len)
            kind = kind or ("text_windows" if windows else "text")
        elif "prompt" in rec and "completion" in rec:
            p_ids = encode_ids(tokenizer, str(rec["prompt"]))
            c_ids = encode_ids(tokenizer, str(rec["completion"]), special=False)
            if not p_ids or not c_ids:
                continue
            ids = p_ids + c_ids
            if len(ids) > seq_len:
                raise QueryInputError(f"{where} is {len(ids)} tokens long (prompt and "
                                      f"completion): must be at most {seq_len} (--seq-len)")
            examples.append(TrainExample(ids, [-100] * len(p_ids) + c_ids, {"record": i}))
            kind = kind or "prompt"
        else:
            raise QueryInputError(f"{where} has no {tf!r} (nor 'prompt' and 'completion'; it "
                                  f"has {', '.join(map(str, rec)) or 'nothing'}): pass "
                                  "--text-field with its text column")
    if kind is None:
        kind = "classifier" if task == CLASSIFIER else "text"
        kind += ("_window" if task == CLASSIFIER else "_windows") if windows else ""
    return examples, kind, what, (longer, texts)


def _say_cut(args, kind: str, seq_len: int, longer: int, texts: int) -> None:
    """One status line on how the texts were cut: always with ``--cut windows`` (not a
    Trainer user's preprocessing), else when a text was longer than ``seq_len`` tokens."""
    tok = f"tokenizer(text, truncation=True, max_length={seq_len})"
    count = f"{longer} of {texts} text{'s' if texts != 1 else ''} longer than {seq_len} tokens"
    if args.cut == "windows" and texts:
        how = ("its first window of the whole tokenisation: a longer text loses the tokenizer's "
               "trailing special tokens" if kind.startswith("classifier") else
               "consecutive windows of the whole tokenisation, tails included")
        influence_status(f"--cut windows: {count}, each cut into {how}; not as {tok} cuts it "
                         "(what a Trainer user's preprocessing trains on; the default --cut "
                         "tokenizer)")
    elif longer:
        influence_status(f"{count} (--seq-len): cut as {tok} cuts them, the tokenizer's special "
                         "tokens kept (--cut windows for windows of the whole tokenisation)")


def load_train_set(args, task: str, model, tokenizer) -> TrainSet:
    if args.train == "app":
        path = args._app_config_path
        cfg = read_app_config(path)
        influence_status(f"--train app: the run's training data from {path} (data.kind="
                         f"{cfg.data.kind}, windows of model.seq_len={cfg.model.seq_len}) ...")
        examples = _app_examples(args, cfg, tokenizer)
        ts = TrainSet(examples, "app", f"windows of {cfg.model.seq_len} tokens of the app's "
                      f"training data, {path}", int(cfg.model.seq_len), path)
    else:
        seq_len = _default_seq_len(args, model)
        examples, kind, what, (longer, texts) = _record_examples(args, task, model, tokenizer,
                                                                 seq_len)
        _say_cut(args, kind, seq_len, longer, texts)
        cut = f"each cut by the tokenizer to at most {seq_len} tokens"
        described = {"text": f"texts of {what}, {cut}",
                     "text_windows": f"windows of up to {seq_len} tokens of {what} (--cut "
                                     "windows)",
                     "prompt": f"prompt-completion records of {what}",
                     "classifier": f"labelled texts of {what}, {cut}",
                     "classifier_window": f"labelled texts of {what}, the first {seq_len} "
                                          "tokens of each whole tokenisation (--cut windows)"
                     }[kind]
        ts = TrainSet(examples, kind, described, seq_len, cut=args.cut)
    if not ts.examples:
        rule = ("windows of model.seq_len tokens" if args.train == "app" else
                "a text of 2 tokens or more, or a prompt and completion" if task != CLASSIFIER
                else "a non-empty text with a label")
        raise QueryInputError(f"--train={args.train!r} yields no training example (each needs "
                              f"{rule}): nothing to score")
    vocab, limit = model_limits(model)
    for i, ex in enumerate(ts.examples):
        if vocab is not None and max(ex.ids) >= vocab:
            raise QueryInputError(f"--train: training example {i} has token id {max(ex.ids)}, "
                                  f"but the model's vocabulary has {vocab} tokens: pass the "
                                  "model's own tokenizer (--tokenizer DIR, or --byte-level)")
        if limit is not None and len(ex.ids) > limit:
            raise QueryInputError(f"--train: training example {i} is {len(ex.ids)} tokens: must "
                                  f"be at most {limit} (the model's positions; --seq-len)")
    return ts
