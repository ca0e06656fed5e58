"""Accounts and API keys: `tml-` keys, stored as SHA-256 hashes, revocable.

Keys carry 256 random bits, so a fast hash is enough: nobody can brute-force a preimage, and a
lookup per request stays at one indexed read.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from tinkerd.control.audit import AuditLog
from tinkerd.control.store.accounts import Account, AccountRepository, ApiKey, ApiKeyRepository
from tinkerd.control.store.db import Store, utcnow
from tinkerd.errors import NotFoundError, UserError

LOCAL_ACCOUNT = "local"
# Per-account quota overrides (control/quotas.py reads them).
QUOTA_COLUMNS = ("max_concurrent_runs", "max_tokens_per_minute")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class NewKey:
    key_id: str
    key: str  # shown once
    account: str


class Accounts:
    def __init__(self, store: Store, audit: AuditLog | None = None):
        self.store = store
        self.accounts = AccountRepository(store)
        self.keys = ApiKeyRepository(store)
        self.audit = audit or AuditLog(store)

    def account_id(self, name: str, create: bool = True) -> str:
        row = self.accounts.by_name(name)
        if row is not None:
            return row.account_id
        if not create:
            raise NotFoundError(f"no account named {name!r}")
        account_id = f"acct-{secrets.token_hex(6)}"
        if not self.accounts.add(account_id, name, utcnow()):
            return self.account_id(name, create=False)  # created concurrently
        return account_id

    def create_key(self, name: str, account: str = LOCAL_ACCOUNT, key: str | None = None) -> NewKey:
        if not name or len(name) > 128:
            raise UserError("a key needs a name of 1-128 characters")
        key = key or f"tml-{secrets.token_urlsafe(32)}"
        if not key.startswith("tml-"):
            raise UserError("API keys must start with 'tml-' (the SDK refuses others)")
        key_id = f"key-{secrets.token_hex(6)}"
        row = ApiKey(key_id=key_id, key_hash=hash_key(key), account_id=self.account_id(account), name=name,
                     created_at=utcnow(), revoked_at=None)
        if not self.keys.add(row):
            raise UserError("that key already exists")
        self.audit.record("api_key_created", row.account_id, key_id=key_id, name=name)
        return NewKey(key_id, key, account)

    def verify(self, key: str) -> str | None:
        """The account of a valid, unrevoked key; None otherwise."""
        row = self.key_row(key)
        return row.account_id if row is not None and row.revoked_at is None else None

    def key_row(self, key: str) -> ApiKey | None:
        """The stored row of a key (revoked or not), found by its hash."""
        return self.keys.by_hash(hash_key(key))

    def key_by_id(self, key_id: str) -> ApiKey | None:
        return self.keys.get(key_id)

    def auth_failed(self, key: str | None, source: str) -> None:
        """Audit a refused key: under its account when it is a revoked key (the owner should see
        it is still in use), under no account otherwise."""
        row = self.key_row(key) if key else None
        if row is not None:
            self.audit.auth_failed(source, row.account_id, "revoked key", row.key_id)
        else:
            self.audit.auth_failed(source, None, "unknown key" if key else "missing key")

    def account_name(self, account_id: str) -> str | None:
        row = self.accounts.get(account_id)
        return row.name if row is not None else None

    def list_keys(self) -> list[tuple[ApiKey, str]]:
        names = {a.account_id: a.name for a in self.accounts.all()}
        return [(k, names.get(k.account_id, "?")) for k in self.keys.all()]

    def revoke(self, key_id: str, via: str = "tinkerd keys revoke") -> None:
        row = self.keys.get(key_id)
        if row is None:
            raise NotFoundError(f"no key {key_id!r}")
        self.keys.revoke(key_id, utcnow())
        self.audit.record("api_key_revoked", row.account_id, key_id=key_id, name=row.name, via=via)

    def has_keys(self) -> bool:
        return self.keys.any()

    def list_accounts(self) -> list[Account]:
        return self.accounts.all()

    def set_quota(self, name: str, **limits: int | None) -> Account:
        """Set an account's quota overrides (Account fields): None = the server's default,
        0 = unlimited, n >= 1 = that limit. Limits not named keep their value."""
        for column, value in limits.items():
            if column not in QUOTA_COLUMNS:
                raise UserError(f"unknown quota {column!r}; quotas: {', '.join(QUOTA_COLUMNS)}")
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise UserError(f"{column} must be a whole number >= 1, 0 for unlimited, or None for the default")
        account_id = self.account_id(name, create=False)
        self.accounts.set(account_id, **limits)
        self.audit.record("account_quota_set", account_id, account=name, **limits)
        return self.accounts.get(account_id)
