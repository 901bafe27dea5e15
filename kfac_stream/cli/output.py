"""What the commands print: their status lines on stderr, and the tables, footers and JSON of a
sequence classifier's query and of ``influence`` (built from records, so the text and
``--json`` say the same)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence


def query_status(message: str) -> None:
    """One line of what ``query`` is doing, on stderr (stdout keeps the table alone)."""
    print(f"kfac-stream query: {message}", file=sys.stderr, flush=True)


#: Widest input cell (the text's ``repr``; longer ones end in ``…``).
TEXT_WIDTH = 60


CLASSES_EXPLAINED = (
    "per input: MAP p = softmax of the trained model's logits; Laplace p = the linearised Laplace "
    "predictive (LaplacePosterior.predictive_probs, the posterior's link); logit = the class "
    "logit's posterior mean ± std; * = the predicted label (the largest Laplace p); H = entropy of "
    "Laplace p in nats; sd = the std of the predicted label's logit")


def _class_summary(r: Mapping) -> str:
    """The line under an input's classes: its label, their probabilities, H and sd."""
    k = r["label_id"]
    map_note = ("" if r["map_label_id"] == k else f", MAP label {r['map_label']!r}")
    return (f"label {r['label']!r} (Laplace p {r['probs'][k]:.4f}, MAP p {r['map_probs'][k]:.4f}"
            f"{map_note}); H = {r['entropy']:.4f} nats; sd = {r['label_logit_std']:.4f}")


def class_table(records: Sequence[Mapping], names: Sequence[str]) -> str:
    """The text of `_class_records`: the explanation line, then per input a line ``input i:
    'text'``, its classes (one row each: name, MAP p, Laplace p, logit mean±std, ``*`` on the
    predicted label; probabilities to 4 decimals, logits to 3) and a `_class_summary` line.
    The class rows of every input share one set of column widths."""
    from ..query.token_table import pad, show_token, width

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


def class_footer(meta: Mapping, inputs: int) -> str:
    """``snapshot … (step …); Arch, C classes; N = …, prior precision τ = …, probit link;
    n inputs; … s``."""
    line = (f"snapshot {meta['snapshot']} (step {meta['step']}); {meta['architecture']}, "
            f"{len(meta['labels'])} classes; N = {meta['num_data']:.0f}, prior precision τ = "
            f"{meta['prior_precision']:.4g} ({meta['prior_source']}), {meta['link']} link "
            f"({meta['link_source']}); {inputs} input{'s' if inputs != 1 else ''}; "
            f"{meta['seconds']:.1f} s")
    heldout = meta.get("heldout")
    return line if heldout is None else f"{line}\n{heldout['verdict']}"


def class_document(meta: Mapping, records: Sequence[Mapping]) -> str:
    """One JSON document: ``meta``'s fields and ``"inputs": records``."""
    import json

    return json.dumps({**meta, "inputs": list(records)}, indent=1, allow_nan=False)


INFLUENCE_EXPLAINED = (
    "score = ∇L(query)ᵀ (F + λI)⁻¹ ∇L(example) over the snapshot's layers (F: its K-FAC "
    "factors; L: the summed loss of the query's completion or label, of the example's labelled "
    "tokens); + helpful: a gradient step on the example lowers the query's loss; - harmful: it "
    "raises it")


def influence_status(message: str) -> None:
    """One line of what ``influence`` is doing, on stderr (stdout keeps the table alone)."""
    print(f"kfac-stream influence: {message}", file=sys.stderr, flush=True)


# -- the output --------------------------------------------------------------------------------


def _influence_query_line(rec: Mapping) -> str:
    from ..query.token_table import show_token

    if "prompt" in rec:
        n = len(rec["completion_tokens"])
        return (f"query {rec['index']}: {show_token(rec['prompt'], TEXT_WIDTH)} -> "
                f"{show_token(rec['completion'], TEXT_WIDTH)} ({n} completion token"
                f"{'s' if n != 1 else ''})")
    return f"query {rec['index']}: {show_token(rec['text'], TEXT_WIDTH)} label {rec['label']!r}"


def influence_table(records: Sequence[Mapping], names: Sequence[str] | None = None) -> str:
    """Per query its line, then its most helpful and most harmful examples (rank, training
    example index, score, text; ``--per-token``: a line of the completion tokens' shares)."""
    from ..query.token_table import pad, show_token, width

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


#: The first line of ``kfac-stream influence --self``'s table.
SELF_INFLUENCE_EXPLAINED = (
    "self-influence = ∇L(example)ᵀ (F + λI)⁻¹ ∇L(example) over the snapshot's layers (F: its "
    "K-FAC factors; L: the example's summed loss); highest first: the examples the rest of the "
    "data explains worst (mislabelled or atypical ones)")


def self_influence_table(records: Sequence[Mapping], names: Sequence[str] | None = None) -> str:
    """The training examples of highest self-influence (rank, example index, score, text and,
    for a classifier, its label)."""
    from ..query.token_table import pad, show_token, width

    heads = ["rank", "example", "self-influence", "text"]
    rows = []
    for r in records:
        text = show_token(r["text"], TEXT_WIDTH)
        if names is not None and "label_id" in r:
            text += f" label {names[r['label_id']]!r}"
        rows.append([str(r["rank"]), str(r["index"]), f"{r['score']:.4e}", text])
    widths = [max(width(h), *(width(row[j]) for row in rows)) for j, h in enumerate(heads)]
    return "\n".join([SELF_INFLUENCE_EXPLAINED] + [
        ("    " + "  ".join(pad(c, w, j == 3) for j, (c, w) in enumerate(zip(cells, widths))))
        .rstrip() for cells in [heads, *rows]])


def influence_footer(meta: Mapping) -> str:
    lam = list(meta["damping_per_layer"].values())
    rule = meta["damping"]
    rule = f"{rule:g}" if isinstance(rule, float) else rule
    n = meta["train_examples"]
    q = len(meta.get("queries_given", ()))
    what = "self-influence" if meta.get("self_influence") else \
        f"{q} quer{'ies' if q != 1 else 'y'}"
    return (f"snapshot {meta['snapshot']} (step {meta['step']}); {n:,} training example"
            f"{'s' if n != 1 else ''} ({meta['train_described']}); damping {rule} (λ "
            f"{min(lam):.3g} … {max(lam):.3g} over {len(lam)} layers); {what}; "
            f"scoring {meta['scoring_seconds']:.1f} s "
            f"({1000 * meta['seconds_per_train_example']:.3g} ms per training example); "
            f"{meta['seconds']:.1f} s")
