"""One-time upgrade of a data directory written before the op log (op schema v1).

Such a directory's futures hold the raw HTTP bodies of their requests (op_version NULL).
On start, before control recovers anything, each one recovery would read is decoded by the same
prepare_* functions that accepted it and rewritten as its OpRecord (control/oplog.py); from then on
recovery needs no API. Complete ops are converted as they ran (without the input bounds added since,
api/limits.py); pending ones never ran and are checked like new requests, as they were before the
op log. A pending op that no longer passes is failed with the reason; a complete one that cannot be
converted stays as it was, and recovery records its run as not rebuildable, naming it.
"""

from __future__ import annotations

import logging

from tinkerd.api.deps import AppState
from tinkerd.api.routes import export, sampling, training
from tinkerd.control import oplog
from tinkerd.control.recovery import STATE_CHANGING
from tinkerd.errors import TinkerdError

log = logging.getLogger(__name__)

PREPARERS = {**training.PREPARERS, **sampling.PREPARERS, **export.PREPARERS}
# The preparers that take `completed`: those of the ops whose completion changed an adapter.
AS_RAN = set(STATE_CHANGING) | {"Forward"}


def convert(st: AppState) -> int:
    """Rewrite the pre-v1 rows recovery reads as op records; returns how many were converted."""
    futures = st.control.futures
    rows = futures.unconverted(STATE_CHANGING)
    converted = 0
    for row in rows:
        prepare = PREPARERS.get(row.request_type)
        try:
            if prepare is None:
                raise KeyError(row.request_type)
            if row.status == "complete" and row.request_type in AS_RAN:
                work = prepare(st, row.body, row.account_id, completed=True).work
            else:
                work = prepare(st, row.body, row.account_id).work
        except (TinkerdError, KeyError) as e:
            why = e.message if isinstance(e, TinkerdError) else (
                f"{row.request_type} requests cannot be resumed after a restart; send it again")
            if row.status == "pending":
                futures.fail(row.request_id, why, getattr(e, "category", "server"))
            log.error("cannot convert %s %s of %s to the op log: %s", row.request_type, row.request_id, row.target, why)
            continue
        futures.set_record(row.request_id, oplog.dumps(work.record), oplog.SCHEMA_VERSION)
        converted += 1
    if converted:
        log.warning("converted %d ops stored before the op log (raw request bodies) to op schema v%d",
                    converted, oplog.SCHEMA_VERSION)
    return converted
