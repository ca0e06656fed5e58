"""One account's runs, sampling activity, queue and quotas, as the console shows them (api/console).

Read-only, and always for one account: every query here filters by it in the database, so a page of
another account's things cannot be built by passing ids. Listings page in SQL (LIMIT/OFFSET with a
COUNT), never in Python, so an account with thousands of runs costs one page's rows per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tinkerd.control.store.db import Store
from tinkerd.control.store.runs import RunRepository, RunState, TrainingRun
from tinkerd.control.store.sampling import SamplingSessionRepository

# A run's status, from its session and the engine's bookkeeping (most telling first):
# unrecoverable (recovery could not rebuild it), finished (its session was closed), released (its
# session went quiet and the engine let its adapter go; its next op rebuilds it), active.
STATUSES = ("unrecoverable", "finished", "released", "active")


@dataclass
class RunSummary:
    model_id: str
    session_id: str
    base_model: str
    lora_rank: int
    created_at: datetime
    last_request_at: datetime
    status: str
    why: str | None = None  # the unrecoverable reason


@dataclass
class SamplerActivity:
    sampling_session_id: str
    model_path: str | None  # the checkpoint it samples; None for an inflight sampler
    created_at: datetime
    requests: int
    prefill_tokens: int
    sampled_tokens: int
    last_at: datetime | None


@dataclass
class QueuedView:
    request_id: str
    request_type: str
    target: str
    seq_id: int | None
    state: str  # running | waiting | paused
    why: str | None


def _status(finished: str | None, released: bool, broken: str | None) -> tuple[str, str | None]:
    if broken is not None:
        return "unrecoverable", broken
    if finished is not None:
        return "finished", None
    return ("released", None) if released else ("active", None)


def run_page(store: Store, account_id: str, limit: int, offset: int) -> tuple[list[RunSummary], int]:
    """A page of the account's runs, newest first, and how many it has: one query for the page
    (runs joined to their session and status rows), one COUNT."""
    states, total = RunRepository(store).states_of_account(account_id, limit, offset)
    return [summary(s) for s in states], total


def summary(state: RunState) -> RunSummary:
    run = state.run
    status, why = _status(state.finished_reason, state.released, state.unrecoverable)
    return RunSummary(run.model_id, run.session_id, run.base_model, run.lora_rank, run.created_at,
                      run.last_request_at, status, why)


def run_summary(store: Store, run: TrainingRun) -> RunSummary:
    """One (already ownership-checked) run's summary."""
    return summary(RunRepository(store).state(run))


def sampling_activity(store: Store, model_id: str, limit: int = 50) -> list[SamplerActivity]:
    """The run's samplers (of a checkpoint of it, or its inflight target), newest first, with their
    sample requests and tokens (metered usage)."""
    return [SamplerActivity(u.session.sampling_session_id, u.session.model_path, u.session.created_at, u.requests,
                            u.prefill_tokens, u.sampled_tokens, u.last_at)
            for u in SamplingSessionRepository(store).use_of_run(model_id, limit)]


# -- the queue and the quotas ------------------------------------------------------------------------


def queue_view(control: Any, account_id: str) -> list[QueuedView]:
    """The account's ops in the engine and waiting, and why each waiting one waits: its quota (the
    reason the SDK's retrieve_future also gets) or its turn (the engine is busy with earlier work:
    capacity)."""
    out = []
    for q in control.running():
        if _payer(q) == account_id:
            out.append(QueuedView(q.request_id, q.request_type, q.target, q.seq_id, "running", None))
    for lane, ops in control.queue.lanes().items():
        ops = sorted(ops, key=lambda q: q.arrival)
        for ahead, q in enumerate(ops):
            if _payer(q) != account_id:
                continue
            reason = control.scheduler.pause_reason(q.request_id)
            if reason is not None:
                out.append(QueuedView(q.request_id, q.request_type, q.target, q.seq_id, "paused", f"quota: {reason}"))
            else:
                why = (f"capacity: waiting its turn in the {lane} lane, {ahead} op{'s' if ahead != 1 else ''} "
                       f"of any account ahead of it") if ahead else f"capacity: next in the {lane} lane"
                out.append(QueuedView(q.request_id, q.request_type, q.target, q.seq_id, "waiting", why))
    return out


def _payer(q: Any) -> str | None:
    billing = getattr(q.op, "billing", None)
    return billing.account_id if billing is not None else None


@dataclass
class QuotaUse:
    name: str
    limit: float | None  # None: unlimited
    used: float
    unit: str


def quota_use(quotas: Any, account_id: str) -> list[QuotaUse]:
    """The account's limits in force (its overrides over the server's defaults) and what it uses."""
    if quotas is None:
        return []
    limits = quotas.limits(account_id)
    return [
        QuotaUse("concurrent training runs", limits.max_concurrent_runs, len(quotas.live_runs(account_id, fresh=True)), "runs"),
        QuotaUse(f"tokens per minute (last {quotas.window_s:g} s)", quotas.budget(limits),
                 quotas.window_tokens(account_id), "tokens"),
    ]
