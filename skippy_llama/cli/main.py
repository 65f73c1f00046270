"""``skippy-llama`` console entry point: one argparse tree, one subcommand module each."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import SkippyError
from . import batch, kvcache, matrix, package, run, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skippy-llama",
        description=(
            "Paged, tiered KV-prefix cache for llama-cpp-python. "
            "Repeated prompt prefixes are restored instead of prefilled."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run.register(sub)
    kvcache.register(sub)
    package.register(sub)
    serve.register(sub)
    batch.register(sub)
    matrix.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except SkippyError as exc:
        print(f"skippy-llama: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("skippy-llama: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
