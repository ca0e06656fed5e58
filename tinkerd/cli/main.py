"""`tinkerd` command line: one subcommand per noun, each in its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from tinkerd.cli import keys, serve, usage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinkerd", description="A self-hosted Tinker post-training API server.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    keys.add_parser(sub)
    usage.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
