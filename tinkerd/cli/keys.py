"""`tinkerd keys`: create, list and revoke API keys in a data directory's store; rotate the secret
that signs its tokens (control/tokens.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from tinkerd.cli.flags import add_store_flags, store_config


def add_parser(sub) -> None:
    p = sub.add_parser("keys", help="manage API keys")
    add_store_flags(p)
    keys = p.add_subparsers(dest="keys_command", required=True)
    c = keys.add_parser("create", help="create a key; it is printed once and only its hash is stored")
    c.add_argument("--name", required=True)
    c.add_argument("--account", default="local", help="the account that owns what this key creates")
    keys.add_parser("list", help="list keys (never the keys themselves)")
    r = keys.add_parser("revoke", help="revoke a key by its id")
    r.add_argument("key_id")
    keys.add_parser("rotate-token-secret",
                    help="replace the secret that signs tokens (SDK JWTs, console sign-ins, trace links): every "
                         "token issued before is refused at once, also by a running server; API keys keep working")
    p.set_defaults(func=run)


def run(args) -> int:
    from tinkerd.control.accounts import Accounts
    from tinkerd.control.store.db import Store

    config = store_config(args)
    if args.keys_command == "rotate-token-secret":
        return _rotate_token_secret(config.data_dir)
    accounts = Accounts(Store.open(config))
    if args.keys_command == "create":
        new = accounts.create_key(args.name, account=args.account)
        print(f"created {new.key_id} for account {new.account}; this is the only time the key is shown:")
        print(f"  export TINKER_API_KEY={new.key}")
    elif args.keys_command == "list":
        for row, account in accounts.list_keys():
            state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
            print(f"{row.key_id}  {account:16s} {row.name:24s} created {row.created_at:%Y-%m-%d %H:%M}  {state}")
    else:
        accounts.revoke(args.key_id)
        print(f"revoked {args.key_id}")
    return 0


def _rotate_token_secret(data_dir: Path) -> int:
    from tinkerd.control.tokens import Tokens

    if not data_dir.is_dir():
        print(f"no data directory at {data_dir}", file=sys.stderr)
        return 2
    path = Tokens.rotate(data_dir)
    print(f"replaced the token signing secret {path}: every token issued before is refused from now on, also by "
          f"a server running on this directory; API keys keep working, and the SDK exchanges its key for a new token")
    return 0
