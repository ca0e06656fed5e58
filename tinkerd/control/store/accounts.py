"""Accounts, their API keys and their audit log behind repositories (control/accounts.py and
control/audit.py hold the rules; the queries are here). What they return are frozen dataclasses,
copies of the rows: a caller cannot change one and believe it stored, and nothing of SQLAlchemy
leaves the store."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from tinkerd.control.store.db import Store
from tinkerd.control.store.repository import Keyed
from tinkerd.control.store.tables import AccountRow, ApiKeyRow, AuditRow


@dataclass(frozen=True)
class Account:
    account_id: str
    name: str
    created_at: datetime
    # Quota overrides: None = the server's default, 0 = no limit (control/quotas.py).
    max_concurrent_runs: int | None
    max_tokens_per_minute: int | None


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    key_hash: str  # SHA-256 of the key; the key itself is never stored
    account_id: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class AuditEntry:
    audit_id: int
    at: datetime
    account_id: str | None
    event: str
    details: dict
    count: int


class AccountRepository(Keyed[Account]):
    row, item = AccountRow, Account

    def by_name(self, name: str) -> Account | None:
        rows = self.store.query(select(AccountRow).where(AccountRow.name == name))
        return self._item(rows[0]) if rows else None

    def add(self, account_id: str, name: str, at: datetime) -> bool:
        """A new account without quota overrides; False when the id or the name is taken."""
        return self.store.add(AccountRow(account_id=account_id, name=name, created_at=at))

    def all(self) -> list[Account]:
        """Every account, by name."""
        return [self._item(r) for r in self.store.query(select(AccountRow).order_by(AccountRow.name))]


class ApiKeyRepository(Keyed[ApiKey]):
    row, item = ApiKeyRow, ApiKey

    def by_hash(self, key_hash: str) -> ApiKey | None:
        rows = self.store.query(select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash))
        return self._item(rows[0]) if rows else None

    def all(self) -> list[ApiKey]:
        """Every key, revoked ones included, oldest first."""
        return [self._item(r) for r in self.store.query(select(ApiKeyRow).order_by(ApiKeyRow.created_at))]

    def any(self) -> bool:
        return bool(self.store.query(select(ApiKeyRow.key_id).limit(1)))

    def revoke(self, key_id: str, at: datetime) -> None:
        self.store.update(ApiKeyRow, key_id, revoked_at=at)


class AuditRepository:
    def __init__(self, store: Store):
        self.store = store

    def add(self, at: datetime, account_id: str | None, event: str, details: dict) -> int:
        """Record an event (count 1); its audit_id."""
        row = AuditRow(at=at, account_id=account_id, event=event, details=details, count=1)
        self.store.add(row)
        return row.audit_id

    def add_count(self, audit_id: int, n: int) -> None:
        """Fold `n` more occurrences into an event's row (failed authentications, control/audit.py)."""
        with self.store.write() as s:
            row = s.get(AuditRow, audit_id)
            if row is not None:
                row.count += n

    def of_account(self, account_id: str, start: datetime, end: datetime) -> list[AuditEntry]:
        """The account's events in [start, end), oldest first."""
        rows = self.store.query(select(AuditRow).where(AuditRow.account_id == account_id, AuditRow.at >= start,
                                                       AuditRow.at < end).order_by(AuditRow.at, AuditRow.audit_id))
        return [AuditEntry(r.audit_id, r.at, r.account_id, r.event, r.details, r.count) for r in rows]
