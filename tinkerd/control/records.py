"""The records control's repositories hand the api layer, under the names the api uses for them.

ApiKey, Checkpoint and TrainingRun are frozen dataclasses of the repositories' (control/store/).
Future is still the store's row itself, read in a session that is closed before they are returned
(expire_on_commit=False), so they are plain attribute bags the api only reads. The api imports
these names, never `control.store` (tests/unit/test_layers.py), so that rows become dataclasses
noun by noun without touching the routes.
"""

from tinkerd.control.store.accounts import ApiKey
from tinkerd.control.store.checkpoints import Checkpoint
from tinkerd.control.store.runs import TrainingRun
from tinkerd.control.store.tables import FutureRow as Future

__all__ = ["ApiKey", "Checkpoint", "Future", "TrainingRun"]
