"""Metered usage behind a repository (control/metering.py, quotas.py and costs.py hold the rules;
the queries are here). Records go in and come out as frozen UsageRecords, never rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select

from tinkerd.control.store.repository import Keyed
from tinkerd.control.store.tables import UsageRow


@dataclass(frozen=True)
class UsageRecord:
    """What one completed operation consumed (UsageRow's columns): raw quantities, priced when read."""

    request_id: str
    account_id: str | None
    session_id: str | None
    target: str
    base_model: str | None
    request_type: str
    prefill_tokens: int
    sampled_tokens: int
    trained_tokens: int
    forward_tokens: int
    checkpoints: int
    queue_wait_s: float
    compute_s: float
    completed_at: datetime


class UsageRepository(Keyed[UsageRecord]):
    """`add` returns False for a re-run after recovery: the first record (same request_id) stays."""

    row, item = UsageRow, UsageRecord

    def rows(self, account_id: str | None = None, start: datetime | None = None,
             end: datetime | None = None) -> list[UsageRecord]:
        """Records completed in [start, end) (either bound optional), of one account or all, oldest first."""
        stmt = select(UsageRow).order_by(UsageRow.completed_at)
        if account_id is not None:
            stmt = stmt.where(UsageRow.account_id == account_id)
        if start is not None:
            stmt = stmt.where(UsageRow.completed_at >= start)
        if end is not None:
            stmt = stmt.where(UsageRow.completed_at < end)
        return [self._item(r) for r in self.store.query(stmt)]

    def of_accounts_after(self, since: datetime) -> list[UsageRecord]:
        """Records of any account (not internal ops) completed after `since`."""
        return [self._item(r) for r in self.store.query(
            select(UsageRow).where(UsageRow.completed_at > since, UsageRow.account_id.is_not(None)))]

    def sums_by_target(self, account_id: str, start: datetime, end: datetime,
                       kinds: tuple[str, ...]) -> list[tuple[str, int, list[int]]]:
        """(target, checkpoints, [sum of each of `kinds`]) of the account's records in [start, end),
        summed in SQL, one per target."""
        sums = [func.coalesce(func.sum(getattr(UsageRow, k)), 0) for k in kinds]
        stmt = (select(UsageRow.target, func.coalesce(func.sum(UsageRow.checkpoints), 0), *sums)
                .where(UsageRow.account_id == account_id, UsageRow.completed_at >= start, UsageRow.completed_at < end)
                .group_by(UsageRow.target))
        return [(target, int(checkpoints), [int(n) for n in tokens]) for target, checkpoints, *tokens in self.store.rows(stmt)]
