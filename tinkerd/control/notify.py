"""The notifier seam: how a stored result wakes the long-polls waiting for it, and how new work and
cancels reach the engine driver, in one process or across several.

`LocalNotifier` (the embedded default, `tinkerd serve`): the worker thread that stored a result wakes
the waiters of this process's FutureHub directly; submits and cancels act on this process's queue.

`store/listen.py: PgNotifier` (`--role api` / `--role worker` on PostgreSQL, docs/deployment.md):
every process LISTENs on PostgreSQL channels. A result stored by the driver is announced with
NOTIFY, and each replica's listener wakes its own hub's waiters; a streaming request's tokens go
to the replicas the same way, as the driver's engine decodes them; an api replica's accepted op,
cancel_future, unload_model or session end is announced to the driver. A notification is a hint,
never the only copy of the data: a woken waiter reads the store again, a driver that missed one (the
listener reconnecting after a PostgreSQL restart) still claims the op on its next poll
(control/claims.py), and a stream that may have missed tokens finishes from the stored result.
"""

from __future__ import annotations

from typing import Protocol

from tinkerd.control.futures import FutureHub


class Notifier(Protocol):
    def notify(self, request_id: str, target: str | None = None) -> None:
        """From any thread, once the op's outcome is stored: wake its waiters in every process (and
        the `target:<target>` waiters of retrieve_futures)."""
        ...

    def publish(self, request_id: str, deltas: list) -> None:
        """From the driver's worker: a streaming request's new tokens (TokenDelta), for its reader
        in whichever process holds it (control/futures.py: FutureHub.subscribe)."""
        ...

    def work(self) -> None:
        """Ops were stored for an engine driver to claim (an api replica's submit)."""
        ...

    def release(self, model_id: str | None) -> None:
        """Ask the driver to release a run's adapter once idle (an api replica's unload_model), or
        with None to look for runs to release now (a session ended there)."""
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

    def publish(self, request_id: str, deltas: list) -> None:
        self.hub.publish(request_id, deltas)

    def work(self) -> None:
        pass  # the submitting process queued the op itself

    def release(self, model_id: str | None) -> None:
        raise AssertionError("a process with its own engine releases there (Control.release_run)")

    def cancel(self, request_id: str) -> None:
        raise AssertionError("a process with its own queue cancels there (Control.cancel)")

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass
