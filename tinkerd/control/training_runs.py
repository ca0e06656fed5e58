"""Training runs: creating one (idempotently, per `{session_id}:train:{model_seq_id}`), looking one up
for its owner, and listing them. A run is owned through its session (control/sessions.py)."""

from __future__ import annotations

import time

from tinkerd.control.sessions import Sessions
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.runs import RunRepository, TrainingRun


# A run's last_request_at is written at most this often by one process. Every op touches it (a
# step's forward_backward and optim_step: a read and a commit each, ~1.2 ms of store time per step
# of 1 x 8 tokens), and its readers need no finer grain: idle release after minutes
# (control/residency.py), get_training_run's last_request_time, the console.
TOUCH_EVERY_S = 1.0
_TOUCHED_KEPT = 4096  # beyond it, entries older than TOUCH_EVERY_S are dropped


class TrainingRuns:
    def __init__(self, store: Store, sessions: Sessions):
        self.store = store
        self.sessions = sessions
        self.training_runs = RunRepository(store)
        self._touched: dict[str, float] = {}  # model_id -> monotonic time of this process's last write

    def create_run(self, session_id: str, model_seq_id: int, base_model: str, lora_config: dict,
                   user_metadata: dict | None, account_id: str | None = None) -> tuple[TrainingRun, bool]:
        """The run for `{session_id}:train:{model_seq_id}`; (row, created) — re-sends get the same row."""
        self.sessions.owned_session(session_id, account_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        now = utcnow()
        run = TrainingRun(model_id=model_id, session_id=session_id, base_model=base_model,
                             lora_rank=int(lora_config["rank"]), lora_config=lora_config,
                             user_metadata={str(k): str(v) for k, v in (user_metadata or {}).items()},
                             created_at=now, last_request_at=now)
        created = self.training_runs.add(run)
        return (run if created else self.run(model_id)), created

    def run(self, model_id: str) -> TrainingRun:
        return self.sessions.lookup(self.training_runs.get, model_id, "model_id")

    def owned_run(self, model_id: str, account_id: str | None) -> TrainingRun:
        return self.sessions.lookup(self.training_runs.get, model_id, "model_id", account_id)

    def touch(self, model_id: str) -> None:
        """Note a request to the run (any other target: nothing), unless this process did in the
        last TOUCH_EVERY_S."""
        now = time.monotonic()
        if now - self._touched.get(model_id, -TOUCH_EVERY_S) < TOUCH_EVERY_S:
            return
        if len(self._touched) >= _TOUCHED_KEPT:
            self._touched = {k: t for k, t in self._touched.items() if now - t < TOUCH_EVERY_S}
        self._touched[model_id] = now
        self.training_runs.set(model_id, last_request_at=utcnow())

    def run_count(self, session_id: str) -> int:
        """How many training runs the session has made: the next model_seq_id of an implicit session."""
        return self.training_runs.count_of_session(session_id)

    def list_runs(self, limit: int | None = None, offset: int = 0, account_id: str | None = None,
                  project_id: str | None = None) -> tuple[list[TrainingRun], int]:
        """A page of runs (of one account, or all; of one of its projects), newest first, and how many
        there are in all."""
        return self.training_runs.page(limit, offset, account_id, project_id)

    def base_models(self, model_ids) -> dict[str, str]:
        """model_id -> base model, for the runs among `model_ids` (one query for a page of checkpoints)."""
        return self.training_runs.base_models(model_ids)
