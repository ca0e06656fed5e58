"""The notifier seam: how a stored result wakes the long-polls waiting for it, and how new work and
cancels reach the engine driver, in one process or across several.

`LocalNotifier` (the embedded default, `tinkerd serve`): the worker thread that stored a result wakes
the waiters of this process's FutureHub directly; submits and cancels act on this process's queue.

`store/listen.py: PgNotifier` (`--role api` / `--role worker` on PostgreSQL, docs/deployment.md):
every process LISTENs on PostgreSQL channels. A result stored by the driver is announced with
NOTIFY, and each replica's listener wakes its own hub's waiters; an api replica's accepted op or
cancel_future is announced to the driver the same way. A notification is a hint, never the data: a
woken waiter reads the store again, and a driver that missed one (the listener reconnecting after a
PostgreSQL restart) still claims the op on its next poll (control/claims.py).
"""

from __future__ import annotations

from typing import Protocol

from tinkerd.control.futures import FutureHub


class Notifier(Protocol):
    def notify(self, request_id: str, target: str | None = None) -> None:
        """From any thread, once the op's outcome is stored: wake its waiters in every process (and
        the `target:<target>` waiters of retrieve_futures)."""
        ...

    def work(self) -> None:
        """Ops were stored for an engine driver to claim (an api replica's submit)."""
        ...

    def cancel(self, request_id: str) -> None:
        """Ask the driver holding `request_id` to stop it (an api replica's cancel_future)."""
        ...

    def start(self) -> None: ...

    def close(self) -> None: ...


class LocalNotifier:
    """One process: the hub is all there is to wake; work and cancels never leave the process."""

    def __init__(self, hub: FutureHub):
        self.hub = hub

    def notify(self, request_id: str, target: str | None = None) -> None:
        self.hub.notify(request_id, target)

    def work(self) -> None:
        pass  # the submitting process queued the op itself

    def cancel(self, request_id: str) -> None:
        raise AssertionError("a process with its own queue cancels there (Control.cancel)")

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass
