"""retrieve_futures: one long poll per sampling-session client for all of its finished requests.

The SDK (0.38, `sample_use_retrieve_futures`) runs one poller per (sampling session, clone) instead
of one retrieve_future long poll per in-flight sample; a sample's future waits for the poller to
report its request, then fetches the payload with one retrieve_future.

What a poll reports is read from the futures table, not kept in memory, so it survives a server
restart and needs no per-client state:
- a clone's requests are the session's Sample futures whose seq_id is in its block
  [clone * 1e9, (clone + 1) * 1e9) (the SDK numbers a clone's requests there);
- reported: finished (complete or failed), not yet fetched (retrieved_at unset: once its payload
  was fetched its waiter is gone), and completed after the cursor;
- the cursor is the newest reported completed_at in microseconds since the epoch. Results are
  stored by the one engine worker, each with its own utcnow() taken after the previous commit, so
  completion times only grow and a completion never lands at or before a cursor already handed
  out (a wall clock stepped backwards could break that; nothing here assumes more).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from tinkerd.control.store.db import Store
from tinkerd.control.store.futures import FutureRepository

CLONE_BLOCK = 1_000_000_000
# Completions per answer; the rest come with the next poll (the cursor stops at the last one sent).
MAX_COMPLETIONS = 1000
_EPOCH = datetime(1970, 1, 1)


@dataclass
class Completion:
    request_id: str
    finished: bool  # False: failed
    payload_bytes: int | None


def cursor_of(at: datetime) -> int:
    return (at - _EPOCH) // timedelta(microseconds=1)


# The largest cursor that is a time (datetime's year 9999); a larger one is a client's error.
MAX_CURSOR = cursor_of(datetime(9999, 12, 31))


def completions(store: Store, target: str, clone: int, cursor: int) -> tuple[list[Completion], int]:
    """What `clone` of sampling session `target` has not heard yet after `cursor`, and the next cursor."""
    since = _EPOCH + timedelta(microseconds=cursor)
    rows = FutureRepository(store).unheard_samples(target, clone * CLONE_BLOCK, (clone + 1) * CLONE_BLOCK, since,
                                                   MAX_COMPLETIONS)
    out = [Completion(r.request_id, r.status == "complete", len(r.result) if r.result is not None else None)
           for r in rows]
    return out, (cursor_of(rows[-1].completed_at) if rows else cursor)
