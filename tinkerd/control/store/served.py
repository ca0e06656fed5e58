"""The models the engine driver serves, shared with api replicas that have no engine (docs/deployment.md)."""

from __future__ import annotations

import dataclasses

from sqlalchemy import delete, select

from tinkerd.control.clock import utcnow
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import ServedModelRow
from tinkerd.types import ServedModel


class ServedModelRepository:
    def __init__(self, store: Store):
        self.store = store

    def publish(self, models: list[ServedModel], worker_id: str) -> None:
        """Replace the table's models with the driver's, in one transaction: a replica never reads half."""
        now = utcnow()
        with self.store.write() as s:
            s.execute(delete(ServedModelRow))
            for m in models:
                s.add(ServedModelRow(name=m.name, model=dataclasses.asdict(m), worker_id=worker_id, updated_at=now))

    def all(self) -> list[ServedModel]:
        rows = self.store.query(select(ServedModelRow).order_by(ServedModelRow.name))
        return [ServedModel(**{**r.model, "loss_fns": tuple(r.model.get("loss_fns", ()))}) for r in rows]
