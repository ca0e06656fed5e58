"""`tinkerd` command line: one subcommand per noun, each in its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from tinkerd.cli import LOG_FORMAT, accounts, fsck, keys, serve, usage
from tinkerd.errors import EngineStartFailed, TinkerdError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinkerd", description="A self-hosted Tinker post-training API server.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    keys.add_parser(sub)
    accounts.add_parser(sub)
    usage.add_parser(sub)
    fsck.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        return args.func(args)
    except EngineStartFailed as e:  # a model that does not load: the engine's own reason
        print(f"tinkerd {args.command}: the engine could not start: {e}", file=sys.stderr)
        return 1
    except TinkerdError as e:  # an unknown account or key, a bad value: a message, not a traceback
        print(f"tinkerd {args.command}: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the server was up (loading, converting): stop, quietly
        print(f"tinkerd {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
