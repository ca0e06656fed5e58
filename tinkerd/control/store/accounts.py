"""Accounts, their API keys and their audit log behind repositories (control/accounts.py and
control/audit.py hold the rules; the queries are here)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select

from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import AccountRow, ApiKeyRow, AuditRow


class AccountRepository:
    def __init__(self, store: Store):
        self.store = store

    def get(self, account_id: str) -> AccountRow | None:
        return self.store.get(AccountRow, account_id)

    def by_name(self, name: str) -> AccountRow | None:
        rows = self.store.query(select(AccountRow).where(AccountRow.name == name))
        return rows[0] if rows else None

    def add(self, row: AccountRow) -> bool:
        return self.store.add(row)

    def all(self) -> list[AccountRow]:
        """Every account, by name."""
        return self.store.query(select(AccountRow).order_by(AccountRow.name))

    def set(self, account_id: str, **values) -> None:
        self.store.update(AccountRow, account_id, **values)


class ApiKeyRepository:
    def __init__(self, store: Store):
        self.store = store

    def get(self, key_id: str) -> ApiKeyRow | None:
        return self.store.get(ApiKeyRow, key_id)

    def by_hash(self, key_hash: str) -> ApiKeyRow | None:
        rows = self.store.query(select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash))
        return rows[0] if rows else None

    def add(self, row: ApiKeyRow) -> bool:
        return self.store.add(row)

    def all(self) -> list[ApiKeyRow]:
        """Every key, revoked ones included, oldest first."""
        return self.store.query(select(ApiKeyRow).order_by(ApiKeyRow.created_at))

    def any(self) -> bool:
        return bool(self.store.query(select(ApiKeyRow.key_id).limit(1)))

    def revoke(self, key_id: str, at: datetime) -> None:
        self.store.update(ApiKeyRow, key_id, revoked_at=at)


class AuditRepository:
    def __init__(self, store: Store):
        self.store = store

    def add(self, row: AuditRow) -> None:
        self.store.add(row)

    def add_count(self, audit_id: int, n: int) -> None:
        """Fold `n` more occurrences into an event's row (failed authentications, control/audit.py)."""
        with self.store.write() as s:
            row = s.get(AuditRow, audit_id)
            if row is not None:
                row.count += n

    def of_account(self, account_id: str, start: datetime, end: datetime) -> list[AuditRow]:
        """The account's events in [start, end), oldest first."""
        return self.store.query(select(AuditRow).where(AuditRow.account_id == account_id, AuditRow.at >= start,
                                                       AuditRow.at < end).order_by(AuditRow.at, AuditRow.audit_id))
