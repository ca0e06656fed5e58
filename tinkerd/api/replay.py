"""Rebuild an accepted op from its stored wire request, for recovery after a crash or restart.

The same prepare_* functions the routes use decode the body, so a replayed op is exactly the op
that was accepted; ops of kinds that cannot be rebuilt raise KeyError and fail with a clear note.
"""

from __future__ import annotations

from tinkerd.api.deps import AppState
from tinkerd.api.routes import export, sampling, training
from tinkerd.control.control import Work
from tinkerd.control.store.tables import FutureRow

PREPARERS = {**training.PREPARERS, **sampling.PREPARERS, **export.PREPARERS}


def make_rebuild(st: AppState):
    def rebuild(row: FutureRow) -> Work:
        # As the account that submitted it: ownership checks and billing are the original ones.
        return PREPARERS[row.request_type](st, row.body, row.account_id).work

    return rebuild
