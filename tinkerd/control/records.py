"""The records control's repositories hand the api layer, under the names the api uses for them.

Today they are the store's rows themselves, read in a session that is closed before they are
returned (expire_on_commit=False), so they are plain attribute bags the api only reads. The api
imports these names, never `control.store` (tests/unit/test_layers.py), so that rows can become
dataclasses later without touching the routes.
"""

from tinkerd.control.store.tables import ApiKeyRow as ApiKey
from tinkerd.control.store.tables import CheckpointRow as Checkpoint
from tinkerd.control.store.tables import FutureRow as Future
from tinkerd.control.store.tables import TrainingRunRow as TrainingRun

__all__ = ["ApiKey", "Checkpoint", "Future", "TrainingRun"]
