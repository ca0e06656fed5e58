"""`tinkerd usage`: metered usage per account and token kind, from a data directory's store.

`--since` / `--until` bound the window: an ISO 8601 time (UTC unless it names a zone; a bare date
is its midnight) or a span back from now (`90m`, `6h`, `7d`). Ops count by when they completed;
checkpoint storage by the GB-hours that fall inside the window.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from tinkerd.cli.flags import add_flags, add_store_flags, store_config
from tinkerd.config import ServerConfig
from tinkerd.errors import UserError

_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
PRICES = {name: info for name, info in ServerConfig.model_fields.items() if name.startswith("price_")}


def add_parser(sub) -> None:
    p = sub.add_parser("usage", help="show metered usage (tokens, checkpoints, storage, compute and queue time) per account")
    add_store_flags(p)
    p.add_argument("--account", default=None, help="only this account (by name)")
    p.add_argument("--since", default=None, help="window start: ISO 8601 (UTC unless zoned) or a span ago: 90m, 6h, 7d")
    p.add_argument("--until", default=None, help="window end (exclusive), same forms (default: now)")
    # The server's --price-* options: the same prices as its billing routes when given the same.
    add_flags(p.add_argument_group("prices (as tinkerd serve's)"), PRICES)
    p.set_defaults(func=run)


def parse_when(flag: str, text: str, now: datetime) -> datetime:
    """A naive-UTC datetime (as the store keeps them) from an ISO time or a span back from `now`."""
    if m := _AGO.match(text.strip()):
        return now - timedelta(**{_UNITS[m.group(2)]: float(m.group(1))})
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected an ISO 8601 time (2026-07-13T09:00:00Z) or a span ago (90m, 6h, 7d)")
    return dt.astimezone(timezone.utc).replace(tzinfo=None) if dt.tzinfo is not None else dt


def run(args) -> int:
    from tinkerd.control.accounts import Accounts
    from tinkerd.control.metering import TOKEN_KINDS, Meter, totals
    from tinkerd.control.storage import StorageLedger, gb_hour_buckets, storage_cost_usd
    from tinkerd.control.store.db import Store, utcnow

    config = store_config(args, PRICES)
    now = utcnow()
    since = parse_when("--since", args.since, now) if args.since else None
    until = parse_when("--until", args.until, now) if args.until else None
    if since is not None and until is not None and until <= since:
        raise UserError(f"--until ({until:%Y-%m-%d %H:%M:%S}) must be after --since ({since:%Y-%m-%d %H:%M:%S})")
    if config.db_url is None and not config.db_path.exists():
        raise UserError(f"no tinkerd data in {config.data_dir} (pass --data-dir)")
    store = Store.open(config)
    accounts = Accounts(store)
    names = {row.account_id: row.name for row in accounts.list_accounts()}
    account_id = accounts.account_id(args.account, create=False) if args.account else None
    by_account = totals(Meter(store).rows(account_id, since, until))
    ledger = StorageLedger(store)
    ledger.sync(now)
    start, end = since or datetime.min, until or now
    gb_hours: dict[str | None, float] = {}
    for b in gb_hour_buckets(ledger.intervals(account_id, start, end), start, end, now):
        gb_hours[b.account_id] = gb_hours.get(b.account_id, 0.0) + b.quantity
    if since is not None or until is not None:
        print(f"usage from {f'{since:%Y-%m-%d %H:%M:%S} UTC' if since else 'the start'} "
              f"to {f'{until:%Y-%m-%d %H:%M:%S} UTC' if until else 'now'}")
    accts = sorted(set(by_account) | set(gb_hours), key=str)
    if not accts:
        print("no usage recorded")
    for acct in accts:
        t = by_account.get(acct) or {k: 0 for k in (*TOKEN_KINDS, "checkpoints", "queue_wait_s", "compute_s", "ops")}
        storage = gb_hours.get(acct, 0.0)
        cost = sum(config.token_price_usd_per_mtok(k) * t[k] / 1e6 for k in TOKEN_KINDS)
        cost += storage_cost_usd(storage, config.price_storage_usd_per_gb_month)
        print(f"account {names.get(acct, acct)} ({acct}): {int(t['ops'])} ops, estimated ${cost:.6f}")
        for k in TOKEN_KINDS:
            print(f"  {k:16s} {int(t[k]):>14d}")
        print(f"  {'checkpoints':16s} {int(t['checkpoints']):>14d}")
        print(f"  {'storage_gb_hours':16s} {storage:>14.9f}")
        print(f"  {'compute_s':16s} {t['compute_s']:>14.3f}")
        print(f"  {'queue_wait_s':16s} {t['queue_wait_s']:>14.3f}  (not billed)")
    return 0
