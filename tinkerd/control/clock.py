"""Time as the store keeps it: naive UTC (SQLite has no time zones, and PostgreSQL's `timestamp
without time zone` columns take the same values); the api layer adds the zone on the wire."""

from __future__ import annotations

from datetime import datetime, timezone


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)
