"""`tinkerd accounts`: list accounts and set their quotas in a data directory's store.

A running server picks a change up within seconds (control/quotas.py re-reads the limits).
"""

from __future__ import annotations

import argparse

from tinkerd.cli.flags import add_store_flags, store_config


def _limit(text: str) -> int | None:
    """A quota value: a positive number, `unlimited` (stored 0) or `default` (stored NULL)."""
    if text == "default":
        return None
    if text == "unlimited":
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    # At most 2**31 - 1: max_concurrent_runs is a 32-bit column, which PostgreSQL enforces (SQLite does not).
    if not 1 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {2**31 - 1}, 'unlimited' or "
                                         f"'default', got {text!r}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("accounts", help="list accounts and set their quotas")
    add_store_flags(p)
    accounts = p.add_subparsers(dest="accounts_command", required=True)
    accounts.add_parser("list", help="list accounts with their quota overrides")
    q = accounts.add_parser("set-quota", help="set an account's quotas (others keep theirs); ops over a quota wait, never fail")
    q.add_argument("account", help="the account's name (as given to `tinkerd keys create --account`)")
    q.add_argument("--max-concurrent-runs", type=_limit, default=argparse.SUPPRESS, metavar="N|unlimited|default",
                   help="training runs of open sessions; a create over it waits until a session ends")
    q.add_argument("--max-tokens-per-minute", type=_limit, default=argparse.SUPPRESS, metavar="N|unlimited|default",
                   help="trained + forward + prefill + sampled tokens over a sliding minute")
    p.set_defaults(func=run)


def _show(value: int | None) -> str:
    return "default" if value is None else ("unlimited" if value == 0 else str(value))


def run(args) -> int:
    from tinkerd.control.accounts import QUOTA_COLUMNS, Accounts
    from tinkerd.control.store.db import Store

    config = store_config(args)
    accounts = Accounts(Store.open(config))
    if args.accounts_command == "list":
        print(f"{'account':24s} {'id':18s} {'max_concurrent_runs':>20s} {'max_tokens_per_minute':>22s}")
        for row in accounts.list_accounts():
            print(f"{row.name:24s} {row.account_id:18s} {_show(row.max_concurrent_runs):>20s} "
                  f"{_show(row.max_tokens_per_minute):>22s}")
        return 0
    limits = {c: getattr(args, c) for c in QUOTA_COLUMNS if hasattr(args, c)}
    if not limits:
        raise SystemExit("tinkerd accounts set-quota: name at least one of --max-concurrent-runs, --max-tokens-per-minute")
    row = accounts.set_quota(args.account, **limits)
    print(f"account {row.name}: max_concurrent_runs {_show(row.max_concurrent_runs)}, "
          f"max_tokens_per_minute {_show(row.max_tokens_per_minute)}")
    return 0
