"""The audit log: security-relevant events stored in the database, read per account.

Events are named `<resource>_<action>` like the SDK's AuditLogEntry.event: api_key_created,
api_key_revoked, account_quota_set, checkpoint_published, checkpoint_unpublished, checkpoint_deleted,
checkpoint_copied, auth_failed. Details never hold a key itself, only key ids and names.

Failed authentications are rate-limited on write: a flood of bad keys from one source must not fill
the disk, so each (source, account, minute) gets one row whose `count` grows; later failures in that
minute update it in place. Updates for one row are themselves throttled (FLUSH_S), the remainder
written by the next failure or the next read, so a flood costs about one write per second per source.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta

from tinkerd.control.store.accounts import AuditEntry, AuditRepository
from tinkerd.control.store.db import Store, utcnow

# SDK AdminClient.get_audit_log(event_type=...) -> the event prefixes it selects. tinkerd has no
# projects or teams; its accounts stand in for organizations.
EVENT_TYPES = {
    "all": None,
    "checkpoints": ("checkpoint_",),
    "projects": ("project_",),
    "teams": (),
    "organizations": ("account_", "api_key_", "auth_"),
}
FLUSH_S = 1.0
# Bounds the in-memory fold of failed authentications: past it, the oldest sources are flushed.
MAX_SOURCES = 10_000


class AuditLog:
    def __init__(self, store: Store):
        self.store = store
        self.log = AuditRepository(store)
        self._lock = threading.Lock()
        # (source, account_id, minute) -> [audit_id, unwritten count, last write monotonic]
        self._failures: dict[tuple, list] = {}

    def record(self, event: str, account_id: str | None, **details) -> None:
        self.log.add(utcnow(), account_id, event, details)

    def auth_failed(self, source: str, account_id: str | None, reason: str, key_id: str | None = None) -> None:
        now = utcnow()
        slot = (source, account_id, now.replace(second=0, microsecond=0))
        with self._lock:
            entry = self._failures.get(slot)
            if entry is None:
                self._drop_old(slot[2])
                details = {"source": source, "reason": reason, **({"key_id": key_id} if key_id else {})}
                audit_id = self.log.add(now, account_id, "auth_failed", details)
                self._failures[slot] = [audit_id, 0, time.monotonic()]
                return
            entry[1] += 1
            if time.monotonic() - entry[2] >= FLUSH_S:
                self._flush(entry)

    def _flush(self, entry: list) -> None:
        if entry[1]:
            self.log.add_count(entry[0], entry[1])
        entry[1], entry[2] = 0, time.monotonic()

    def _drop_old(self, minute: datetime) -> None:
        """Write out and forget the folds of earlier minutes (and the oldest, past MAX_SOURCES)."""
        for slot in [s for s in self._failures if s[2] < minute] + list(self._failures)[:max(0, len(self._failures) - MAX_SOURCES)]:
            entry = self._failures.pop(slot, None)
            if entry is not None:
                self._flush(entry)

    def entries(self, account_id: str, start: datetime, end: datetime, event_type: str = "all") -> list[AuditEntry]:
        """The account's events in [start, end), oldest first."""
        with self._lock:
            for entry in self._failures.values():
                self._flush(entry)
        prefixes = EVENT_TYPES[event_type]
        rows = self.log.of_account(account_id, start, end)
        return rows if prefixes is None else [r for r in rows if r.event.startswith(prefixes)]


def day_window(day: datetime) -> tuple[datetime, datetime]:
    start = day.replace(hour=0, minute=0, second=0, microsecond=0)
    return start, start + timedelta(days=1)
