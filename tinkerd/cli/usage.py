"""`tinkerd usage`: metered usage per account and token kind, from a data directory's store."""

from __future__ import annotations

from pathlib import Path

from tinkerd.config import ServerConfig


def add_parser(sub) -> None:
    p = sub.add_parser("usage", help="show metered usage (tokens, checkpoints, compute and queue time) per account")
    p.add_argument("--data-dir", type=Path, default=None, help="default: $TINKERD_DATA_DIR or ~/.tinkerd")
    p.add_argument("--account", default=None, help="only this account (by name)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tinkerd.control.accounts import Accounts
    from tinkerd.control.metering import TOKEN_KINDS, Meter, totals
    from tinkerd.control.store.db import Store

    config = ServerConfig(**({"data_dir": args.data_dir.expanduser().resolve()} if args.data_dir else {}))
    store = Store.sqlite(config.db_path)
    accounts = Accounts(store)
    names = {row.account_id: name for row, name in accounts.list_keys()}
    account_id = accounts.account_id(args.account, create=False) if args.account else None
    by_account = totals(Meter(store).rows(account_id))
    if not by_account:
        print("no usage recorded")
    for acct, t in sorted(by_account.items(), key=lambda kv: str(kv[0])):
        cost = sum(config.token_price_usd_per_mtok(k) * t[k] / 1e6 for k in TOKEN_KINDS)
        print(f"account {names.get(acct, acct)} ({acct}): {int(t['ops'])} ops, estimated ${cost:.6f}")
        for k in TOKEN_KINDS:
            print(f"  {k:16s} {int(t[k]):>14d}")
        print(f"  {'checkpoints':16s} {int(t['checkpoints']):>14d}")
        print(f"  {'compute_s':16s} {t['compute_s']:>14.3f}")
        print(f"  {'queue_wait_s':16s} {t['queue_wait_s']:>14.3f}  (not billed)")
    return 0
