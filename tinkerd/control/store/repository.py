"""What the store's repositories of one noun share: frozen dataclasses out, one row per key in.

A repository (runs.py, checkpoints.py, sessions.py, sampling.py, usage.py) names its ORM row class,
its domain dataclass and how a column's value becomes a field's (`fix`: JSON columns copied into a
plain dict or list, so a caller holding the object never shares the row's; SQLite's integer
booleans made bool). get/add/set/delete by primary key come from here; the queries that make each
noun what it is stay in its own module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Generic, TypeVar

from tinkerd.control.store.db import Store

D = TypeVar("D")


def plain_dict(value: Any) -> dict:
    return dict(value or {})


def plain_list(value: Any) -> list:
    return list(value or [])


class Keyed(Generic[D]):
    row: ClassVar[type]
    item: ClassVar[type]
    fix: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    def __init__(self, store: Store):
        self.store = store

    def _item(self, row: Any) -> D | None:
        """The domain object of `row` (None for None): its dataclass's fields read by name."""
        if row is None:
            return None
        values = {f.name: getattr(row, f.name) for f in dataclasses.fields(self.item)}
        return self.item(**{**values, **{name: fn(values[name]) for name, fn in self.fix.items()}})

    def get(self, key: Any) -> D | None:
        return self._item(self.store.get(self.row, key))

    def add(self, item: D) -> bool:
        """False when its key exists."""
        return self.store.add(self.row(**dataclasses.asdict(item)))

    def set(self, key: Any, **values: Any) -> None:
        self.store.update(self.row, key, **values)

    def delete(self, key: Any) -> None:
        self.store.delete(self.row, key)
