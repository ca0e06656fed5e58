"""Per-account quotas: concurrent training runs and tokens per minute.

An op over its account's quota is never failed: it stays queued, the scheduler passes over it (and
over the ops behind it in its target's seq_id order) and serves other accounts, and its
retrieve_future answers try_again with queue_state "paused_rate_limit". The SDK re-polls a
try_again forever and only logs a pause after 15 minutes, so a paused client just waits.

Why "paused_rate_limit" and not "paused_capacity" for both limits: the SDK's own default text for a
paused training or model-creation future is "concurrent training clients rate limit hit" for
paused_rate_limit, and "Tinker backend is running short on capacity" for paused_capacity. A quota
is a limit on this account, not a server short of capacity, and the run limit is exactly a
concurrent-training-clients limit.

- Concurrent runs: the account's runs whose creation (create_model, or a create-via-load) has
  completed and that the engine holds. A run leaves the engine when its session ends
  (`ServiceClient.close()` sends sessions/{id}/finish) or stops heart-beating (control/residency.py).
  Two kinds of op bring a run (back) into the engine and wait while the account is at its limit: a
  creation, and any op on a released run (a quiet session that resumes, a closed session's run
  used again). So the limit holds however runs are created, closed and used.
- Tokens per minute: trained + forward + prefill + sampled tokens, over a sliding window
  (`quota_window_s`, 60 s; the budget in it is limit * window / 60). An op is charged its known
  size when it starts (a forward_backward's targets; a sample's prompt plus max_tokens per
  sequence, its most), then its metered count when it completes. It starts only if that fits the
  budget left, or when the account has nothing in the window (so an op bigger than the whole
  budget runs alone instead of waiting forever): over a window the account uses about its budget,
  or one op when a single op is bigger. A failed op keeps its charge: it used the engine.

Limits: ServerConfig defaults, replaced per account by Account values (NULL = default,
0 = unlimited), re-read every few seconds so `tinkerd accounts set-quota` applies to a running
server. The window lives in memory; at start it is seeded from the last window's usage rows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta, timezone
from typing import Any

from tinkerd.config import ServerConfig
from tinkerd.control.metering import TOKEN_KINDS, Usage
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.accounts import AccountRepository
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.usage import UsageRepository
from tinkerd.types import ForwardBackwardOp, SampleOp

# The queue_state of a paused future (the SDK's TryAgainResponse literal).
PAUSED = "paused_rate_limit"
# Request types that bring a run to life when they complete at seq_id 0 (the SDK numbers a run's
# own ops from 1; 0 is its creation, by create_model or by load_weights with a session_id).
_CREATES = ("CreateModel", "LoadWeights")
# How often a paused op is looked at again when no token leaves the window sooner: a run released
# by a session's end, or a limit raised from the CLI, takes effect within this.
RECHECK_S = 1.0
# How long per-account limits read from the store are reused.
LIMITS_TTL_S = 2.0


@dataclass(frozen=True)
class Limits:
    max_concurrent_runs: int | None
    max_tokens_per_minute: int | None


def effective(override: int | None, default: int | None) -> int | None:
    """An account's value over the server default: NULL keeps the default, 0 lifts the limit."""
    if override is None:
        return default
    return None if override == 0 else override


def upfront_tokens(op: Any) -> int:
    """The tokens an op is charged when it starts: all it will use that is known before it runs."""
    if isinstance(op, ForwardBackwardOp):
        return sum(len(d.tokens) for d in op.data)
    if isinstance(op, SampleOp):
        return len(op.prompt) + op.params.max_tokens * op.num_samples
    return 0  # optim_step, save, load, create: no tokens


def used_tokens(usage: Usage) -> int:
    return sum(getattr(usage, kind) for kind in TOKEN_KINDS)


class Quotas:
    def __init__(self, store: Store, config: ServerConfig):
        self.store = store
        self.defaults = Limits(config.max_concurrent_runs, config.max_tokens_per_minute)
        self.window_s = config.quota_window_s
        self._lock = threading.Lock()
        # account_id -> request_id -> (time.time() of the charge, tokens): the window's charges.
        self._charges: dict[str, dict[str, tuple[float, int]]] = {}
        self._limits: dict[str, Limits] = {}
        self._names: dict[str, str] = {}
        self._limits_read_at = float("-inf")
        # account_id -> its live runs, for one scheduling pass (see new_pass).
        self._live: dict[str, set[str]] = {}
        # model_id -> whether it is released, for one scheduling pass (see _released).
        self._unloaded: dict[str, bool] = {}
        self._seed()

    # -- limits ----------------------------------------------------------------------------------

    def limits(self, account_id: str) -> Limits:
        now = time.monotonic()
        if now - self._limits_read_at > LIMITS_TTL_S:
            rows = AccountRepository(self.store).all()
            self._limits = {r.account_id: Limits(effective(r.max_concurrent_runs, self.defaults.max_concurrent_runs),
                                                 effective(r.max_tokens_per_minute, self.defaults.max_tokens_per_minute))
                            for r in rows}
            self._names = {r.account_id: r.name for r in rows}
            self._limits_read_at = now
        return self._limits.get(account_id, self.defaults)

    def budget(self, limits: Limits) -> float | None:
        """Tokens the account may use in one window."""
        if limits.max_tokens_per_minute is None:
            return None
        return limits.max_tokens_per_minute * self.window_s / 60.0

    # -- the scheduler's questions ---------------------------------------------------------------

    def new_pass(self) -> None:
        """The scheduler starts a new decision: live and released runs are read afresh."""
        self._live.clear()
        self._unloaded.clear()

    def pause_reason(self, request_type: str, target: str, seq_id: int | None, work: Any,
                     fresh: bool = False) -> str | None:
        """Why this op must wait now, or None when it may start. `fresh`: read live runs from the
        store, not from this scheduling pass (for a caller outside the scheduler)."""
        billing = getattr(work, "billing", None)
        account_id = billing.account_id if billing is not None else None
        if account_id is None:  # internal ops answer to no quota
            return None
        limits = self.limits(account_id)
        name = self._names.get(account_id, account_id)
        if limits.max_concurrent_runs is not None and (
            (request_type in _CREATES and seq_id == 0) or (not isinstance(work.op, SampleOp) and self._released(target))
        ):
            live = self.live_runs(account_id, fresh)
            if target not in live and len(live) >= limits.max_concurrent_runs:
                return (f"account {name} has {len(live)} of {limits.max_concurrent_runs} concurrent training runs; "
                        f"this one starts when one of them is released (its session ends)")
        budget = self.budget(limits)
        if budget is not None:
            need = upfront_tokens(work.op)
            if need:
                used = self.window_tokens(account_id)
                if used > 0 and used + need > budget:
                    return (f"account {name} is over its {limits.max_tokens_per_minute} tokens per minute: "
                            f"{used} used in the last {self.window_s:g} s, this op needs {need}")
        return None

    def started(self, request_id: str, work: Any) -> None:
        """The op was handed to the engine: charge what it is known to use."""
        billing = getattr(work, "billing", None)
        need = upfront_tokens(work.op)
        if billing is not None and billing.account_id is not None and need:
            self._charge(billing.account_id, request_id, need)

    def recheck_s(self) -> float:
        """How long the scheduler may sleep while every queued op is paused."""
        now = time.time()
        with self._lock:
            first = min((t for charges in self._charges.values() for t, _ in charges.values()), default=None)
        if first is None:
            return RECHECK_S
        return min(RECHECK_S, max(first + self.window_s - now, 0.01))

    # -- metering's report -----------------------------------------------------------------------

    def on_usage(self, request_id: str, account_id: str | None, usage: Usage) -> None:
        """A completed op's metered tokens replace its charge at start (Meter calls this)."""
        if account_id is None:
            return
        self._charge(account_id, request_id, used_tokens(usage))

    # -- state -----------------------------------------------------------------------------------

    def window_tokens(self, account_id: str) -> int:
        with self._lock:
            charges = self._charges.get(account_id)
            if not charges:
                return 0
            self._expire(charges)
            return sum(n for _, n in charges.values())

    def _charge(self, account_id: str, request_id: str, tokens: int) -> None:
        """Set (tokens > 0) or drop a request's charge. Charges that left the window are dropped here
        too: without a token limit nothing else reads the window, and it would only grow."""
        with self._lock:
            charges = self._charges.setdefault(account_id, {})
            if tokens:
                charges[request_id] = (time.time(), tokens)
            else:
                charges.pop(request_id, None)
            self._expire(charges)

    def _expire(self, charges: dict[str, tuple[float, int]]) -> None:
        cutoff = time.time() - self.window_s
        for rid in [rid for rid, (t, _) in charges.items() if t <= cutoff]:
            del charges[rid]

    def _released(self, model_id: str) -> bool:
        """Whether the engine released this run (its next op rebuilds it); memoised for one pass."""
        if model_id not in self._unloaded:
            self._unloaded[model_id] = RunRepository(self.store).is_unloaded(model_id)
        return self._unloaded[model_id]

    def live_runs(self, account_id: str, fresh: bool = False) -> set[str]:
        """model_ids of the account's runs that count against its concurrent-run limit."""
        live = None if fresh else self._live.get(account_id)
        if live is None:
            live = RunRepository(self.store).live_of_account(account_id, _CREATES)
            if not fresh:
                self._live[account_id] = live
        return live

    def _seed(self) -> None:
        """Start with the last window's metered usage, so a restart does not reset the budgets."""
        since = utcnow() - timedelta(seconds=self.window_s)
        for row in UsageRepository(self.store).of_accounts_after(since):
            n = sum(getattr(row, kind) or 0 for kind in TOKEN_KINDS)
            if n:
                t = row.completed_at.replace(tzinfo=timezone.utc).timestamp()
                self._charges.setdefault(row.account_id, {})[row.request_id] = (t, n)
