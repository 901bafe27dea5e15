"""`kfac-stream` command line: ``train`` (Hydra app), ``inspect``, ``query`` and ``demo``."""

from __future__ import annotations

import argparse
import os
import sys

from .exceptions import KFACStreamError


def _load_snapshot(path: str):
    from .snapshot.snapshot import Snapshot

    if os.path.isfile(os.path.join(path, "manifest.json")):
        return Snapshot.load(path)
    return Snapshot.latest(path)


def _inspect(args) -> int:
    from .snapshot.layer_table import layer_table

    snap = _load_snapshot(args.path)
    print(layer_table(snap))
    if args.plot:
        from .snapshot.media import plot_spectra

        print(f"spectra: {plot_spectra(snap, args.plot)}")
    return 0


def _decode(tokenizer, token_id: int) -> str:
    if tokenizer is None:  # byte-level ids
        if token_id >= 256:
            return f"<{token_id}>"
        return bytes([token_id]).decode("utf-8", "backslashreplace")
    return tokenizer.decode([token_id])


def _query(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from .query.laplace import LaplacePosterior
    from .query.topk import topk_predictive

    snap = _load_snapshot(args.snapshot)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.eval()
    tokenizer = None
    if not args.byte_level:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    ids = (torch.tensor(list(args.text.encode("utf-8"))) if tokenizer is None
           else torch.tensor(tokenizer(args.text)["input_ids"]))
    tau = args.prior_precision if args.prior_precision == "marglik" else float(args.prior_precision)
    post = LaplacePosterior(model, snap, prior_precision=tau)
    print(f"snapshot {snap.path} (step {snap.step}); N = {post.num_data:.0f}, "
          f"prior precision = {post.prior_precision:.4g}")
    print(f"{'pos':>4} {'input':>8}  top-{args.top_k} next tokens: token  MAP p  mean p ± std")
    for row in topk_predictive(post, ids, k=args.top_k, n_samples=args.samples):
        t = row["position"]
        cells = [f"{_decode(tokenizer, i)!r} {m:.4f} {mu:.4f}±{sd:.4f}" for i, m, mu, sd in zip(
            row["token_ids"], row["map_prob"], row["mean_prob"], row["std_prob"])]
        print(f"{t:>4} {_decode(tokenizer, int(ids[t]))!r:>8}  " + " | ".join(cells))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kfac-stream", description="streaming K-FAC tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="per-layer table of a snapshot (or the newest in a dir)")
    ins.add_argument("path")
    ins.add_argument("--plot", metavar="PNG", help="also draw the eigenvalue spectra")
    q = sub.add_parser("query", help="per-position top-k next tokens with predictive mean/std")
    q.add_argument("--snapshot", required=True, help="snapshot directory (or its parent)")
    q.add_argument("--model", required=True, help="model directory or hub name")
    q.add_argument("--text", required=True)
    q.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    q.add_argument("--byte-level", action="store_true", help="token id = UTF-8 byte (the demo)")
    q.add_argument("--top-k", type=int, default=5)
    q.add_argument("--prior-precision", default="marglik", help="a float or 'marglik'")
    q.add_argument("--samples", type=int, default=2000)
    sub.add_parser("demo", help="kfac-stream train with its offline defaults into out/demo",
                   add_help=False)
    sub.add_parser("train", help="the Hydra training app (kfac_stream.train): "
                   "kfac-stream train key=value ... (--help: Hydra's help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("train", "demo"):  # Hydra parses its own command line
        from .train import cli_main as train_main

        demo = ["hydra.run.dir=out/demo"] if argv[0] == "demo" else []
        sys.argv = [f"kfac-stream {argv[0]}", *demo, *argv[1:]]
        train_main()
        return 0
    args, rest = p.parse_known_args(argv)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return _inspect(args) if args.cmd == "inspect" else _query(args)
    except KFACStreamError as e:
        print(f"kfac-stream: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
