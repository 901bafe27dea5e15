"""The records and text of ``kfac-stream query``: per-token whole-vocabulary uncertainty, the
top-k next tokens, the answer agreement of options; as aligned tables or one JSON document.

Pure functions (no model, no tokenizer): the numbers come from `sampled_predictive`,
`topk_predictive` and a MAP forward, the token strings from a ``decode(id) -> str`` given by
the caller. Records are plain dicts of ints, floats, strings and None (JSON-ready); the tables
are built from the records, so the text and ``--json`` print the same figures.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from .sampled import SampledPredictive

#: Widest token cell (the token's ``repr``; longer ones end in ``…``).
TOKEN_WIDTH = 12

#: No next token (the last position).
NONE = "–"

TOKENS_EXPLAINED = (
    "per position t: input = token t; next = token t+1; p̄ = its predictive probability (mean "
    "over the S posterior samples); log p = mean ± std over the samples of its log-probability; "
    "MAP = its probability under the trained weights; H = entropy of p̄ (total), E[H] = mean "
    "entropy of the samples (aleatoric), MI = H − E[H] (epistemic), in nats; top = the most "
    "probable token under p̄")


def show_token(text: str, width: int = TOKEN_WIDTH) -> str:
    """``repr(text)``, cut to ``width`` characters (ending in ``…``)."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[:width - 1] + "…"


def width(text: str) -> int:
    """Columns ``text`` takes on a terminal (combining marks, as in ``p̄``, take none)."""
    return sum(not unicodedata.combining(c) for c in text)


def pad(text: str, cols: int, left: bool = False) -> str:
    """``text`` padded with spaces to ``cols`` terminal columns (right-aligned by default)."""
    fill = " " * max(0, cols - width(text))
    return text + fill if left else fill + text


def _num(x: float) -> float | None:
    """A float for JSON: None for NaN (no value)."""
    x = float(x)
    return None if math.isnan(x) else x


# -- per-token whole-vocabulary uncertainty ------------------------------------------------------


def token_records(ids: Sequence[int], pred: SampledPredictive, map_probs: Tensor,
                  decode: Callable[[int], str]) -> list[dict]:
    """One record per position ``t`` of one sequence.

    Args:
        ids: The ``T`` token ids of the text.
        pred: `sampled_predictive` of the batch ``[1, T]`` with ``labels="next"``.
        map_probs: ``[T, V]`` (or ``[1, T, V]``): the softmax of the trained model's logits.
        decode: A token id's text.

    Returns:
        ``[{"position", "token_id", "token", "next_id", "next_token", "next_prob",
        "next_logprob_mean", "next_logprob_std", "next_map_prob", "entropy",
        "expected_entropy", "mutual_information", "top_id", "top_token", "top_prob"}]``;
        the ``next_*`` fields are None at the last position (no next token).
    """
    probs = pred.probs.reshape(-1, pred.probs.shape[-1]).double().cpu()  # [T, V]
    map_probs = map_probs.reshape(-1, map_probs.shape[-1]).double().cpu()
    entropy = pred.entropy.reshape(-1).cpu()
    expected = pred.expected_entropy.reshape(-1).cpu()
    mi = pred.mutual_information.reshape(-1).cpu()
    lp_mean = lp_var = None
    if pred.label_logprob_mean is not None and pred.label_logprob_var is not None:
        lp_mean = pred.label_logprob_mean.reshape(-1).cpu()
        lp_var = pred.label_logprob_var.reshape(-1).cpu()
    top_p, top_i = probs.max(-1)
    out = []
    for t, tok in enumerate(ids):
        nxt = int(ids[t + 1]) if t + 1 < len(ids) else None
        rec: dict = {"position": t, "token_id": int(tok), "token": decode(int(tok)),
                     "next_id": nxt, "next_token": None, "next_prob": None,
                     "next_logprob_mean": None, "next_logprob_std": None,
                     "next_map_prob": None}
        if nxt is not None:
            rec.update(next_token=decode(nxt), next_prob=float(probs[t, nxt]),
                       next_map_prob=float(map_probs[t, nxt]))
            if lp_mean is not None and lp_var is not None:
                rec.update(next_logprob_mean=_num(lp_mean[t]),
                           next_logprob_std=_num(lp_var[t].clamp(min=0).sqrt()))
        rec.update(entropy=float(entropy[t]), expected_entropy=float(expected[t]),
                   mutual_information=float(mi[t]), top_id=int(top_i[t]),
                   top_token=decode(int(top_i[t])), top_prob=float(top_p[t]))
        out.append(rec)
    return out


def _f(x: float | None, fmt: str) -> str:
    return NONE if x is None else format(x, fmt)


def token_table(records: Sequence[Mapping]) -> str:
    """The aligned text table of `token_records` (explanation line, column heads, one row per
    position): probabilities and entropies to 4 decimals, log-probabilities to 3."""
    heads = ["t", "input", "next", "p̄(next)", "log p(next)", "MAP p", "H", "E[H]", "MI", "top",
             "p̄(top)"]
    rows = []
    for r in records:
        lp = NONE
        if r["next_logprob_mean"] is not None:
            lp = f"{r['next_logprob_mean']:.3f}±{r['next_logprob_std']:.3f}"
        rows.append([str(r["position"]), show_token(r["token"]),
                     NONE if r["next_token"] is None else show_token(r["next_token"]),
                     _f(r["next_prob"], ".4f"), lp, _f(r["next_map_prob"], ".4f"),
                     f"{r['entropy']:.4f}", f"{r['expected_entropy']:.4f}",
                     f"{r['mutual_information']:.4f}", show_token(r["top_token"]),
                     f"{r['top_prob']:.4f}"])
    left = {1, 2, 9}  # token columns: left-aligned
    widths = [max(width(h), *(width(row[j]) for row in rows)) for j, h in enumerate(heads)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(pad(c, w, j in left)
                         for j, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([TOKENS_EXPLAINED, line(heads), *(line(row) for row in rows)])


# -- top-k next tokens ---------------------------------------------------------------------------


def topk_records(ids: Sequence[int], rows: Sequence[Mapping],
                 decode: Callable[[int], str]) -> list[dict]:
    """`topk_predictive`'s rows with the tokens: ``[{"position", "token_id", "token", "top":
    [{"token_id", "token", "map_prob", "mean_prob", "std_prob"}]}]``."""
    return [{"position": row["position"], "token_id": int(ids[row["position"]]),
             "token": decode(int(ids[row["position"]])),
             "top": [{"token_id": int(i), "token": decode(int(i)), "map_prob": float(m),
                      "mean_prob": float(mu), "std_prob": float(sd)}
                     for i, m, mu, sd in zip(row["token_ids"], row["map_prob"],
                                             row["mean_prob"], row["std_prob"])]}
            for row in rows]


def topk_table(records: Sequence[Mapping], k: int) -> str:
    """The text of `topk_records`: per position its k next tokens, ``token MAP p mean p±std``."""
    lines = [f"{'pos':>4} {'input':>8}  top-{k} next tokens: token  MAP p  mean p ± std"]
    for r in records:
        cells = [f"{c['token']!r} {c['map_prob']:.4f} {c['mean_prob']:.4f}±{c['std_prob']:.4f}"
                 for c in r["top"]]
        lines.append(f"{r['position']:>4} {r['token']!r:>8}  " + " | ".join(cells))
    return "\n".join(lines)


# -- answer options ------------------------------------------------------------------------------


def answer_record(options: Sequence[str], option_ids: Sequence[int], answers, row: int = 0
                  ) -> dict:
    """Row ``row`` of `answer_distribution`'s result as a record: ``{"options": [{"option",
    "token_id", "prob", "count", "frequency", "map"}], "samples", "majority", "agreement",
    "map_answer", "map_agrees"}`` (answers as option strings)."""
    counts = answers.counts[row].tolist()
    freqs = answers.frequencies[row].tolist()
    probs = answers.probs[row].tolist()
    majority = int(answers.majority[row])
    map_answer = int(answers.map_answer[row])
    return {
        "options": [{"option": o, "token_id": int(i), "prob": float(p), "count": int(c),
                     "frequency": float(f), "map": j == map_answer}
                    for j, (o, i, p, c, f) in enumerate(zip(options, option_ids, probs, counts,
                                                            freqs))],
        "samples": int(answers.sample_answers.shape[0]),
        "majority": options[majority], "agreement": float(answers.agreement[row]),
        "map_answer": options[map_answer], "map_agrees": bool(answers.map_agrees[row])}


def answer_table(record: Mapping, position: int) -> str:
    """The text of `answer_record`: per option its predictive probability and its votes."""
    s = record["samples"]
    lines = [f"answers at the last position (t = {position}): each of the S = {s} posterior "
             "samples votes for its most probable option (votes, share); p̄ = the predictive "
             "probability renormalised over the options; * = the MAP answer"]
    cols = max(len("option"), *(width(show_token(o["option"])) for o in record["options"]))
    vw = max(len("votes"), len(str(s)) * 2 + 1)
    lines.append(f"{pad('option', cols, True)}  {pad('p̄', 6)}  {pad('votes', vw)}  "
                 f"{'share':>6}  MAP")
    for o in record["options"]:
        votes = f"{o['count']}/{s}"
        lines.append(f"{pad(show_token(o['option']), cols, True)}  {o['prob']:>6.4f}  "
                     f"{votes:>{vw}}  {o['frequency']:>6.4f}  "
                     f"{'*' if o['map'] else ''}".rstrip())
    lines.append(f"majority {record['majority']!r} (agreement {record['agreement']:.4f}); MAP "
                 f"answer {record['map_answer']!r} "
                 f"({'agrees' if record['map_agrees'] else 'differs'})")
    return "\n".join(lines)


# -- the whole output ----------------------------------------------------------------------------


def footer(meta: Mapping) -> str:
    """``snapshot … (step …); N = …, prior precision τ = …, S = …, seed …, … s``; when the
    stored held-out fit kept MAP's probabilities (``meta["heldout"]["map_kept"]``), a clause
    saying to read the probabilities from the MAP column before the seconds."""
    what = ("posterior samples" + (", linearised" if meta.get("linearized") else "")
            if meta["mode"] == "tokens" else "draws per position")
    kept = ("; the held-out fit kept MAP's probabilities (the posterior's eval gain was within "
            "noise): read p from the MAP column, the spread across samples for ranking"
            if (meta.get("heldout") or {}).get("map_kept") else "")
    return (f"snapshot {meta['snapshot']} (step {meta['step']}); N = {meta['num_data']:.0f}, "
            f"prior precision τ = {meta['prior_precision']:.4g}, S = {meta['samples']} {what} "
            f"(seed {meta['seed']}){kept}; {meta['seconds']:.1f} s")


def document(meta: Mapping, records: Sequence[Mapping], answers: Mapping | None = None) -> str:
    """One JSON document: ``meta``'s fields, ``"positions": records`` and (with options)
    ``"answers"``."""
    doc = {**meta, "positions": list(records)}
    if answers is not None:
        doc["answers"] = dict(answers)
    return json.dumps(doc, indent=1, allow_nan=False)

