"""Start `tinkerd serve` as a real subprocess and stop it by its own PID."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tinkerd.config import ServerConfig
from tinkerd.control.store.db import Store
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.tables import FutureRow

API_KEY = "tml-tinkerd-test"

# The models directory start_server links a new data dir's `models/` to (tests/conftest.py sets it
# for the test session). Without it every server builds its tiny models again: for each, ~86 MB of
# random init and safetensors, the same bytes every time, and ~17% of a start on this machine
# (8.7 of 52 s at load 21); CI starts ~30 such servers. tests/e2e/test_faults.py did this by hand.
_shared_models_dir: Path | None = None


def share_models(models_dir: Path | None) -> None:
    global _shared_models_dir
    _shared_models_dir = models_dir


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    data_dir: Path
    lines: list[str] = field(default_factory=list)
    # The environment the server got beyond ours ($TINKERD_DB_URL for a PostgreSQL-backed one): the
    # `tinkerd keys/accounts/usage` commands a test runs beside it need it to find its store.
    env: dict = field(default_factory=dict)

    def cli_env(self) -> dict:
        return {**os.environ, **self.env}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def server_store(data_dir: Path, db_url: str | None = None) -> Iterator[Store]:
    """The store a server at `data_dir` (or `db_url`) keeps, opened beside it, for tests that read
    what the server recorded: through the store and its repositories, so the same test reads a
    PostgreSQL-backed server too, never the SQLite file's SQL."""
    store = Store.open(ServerConfig(data_dir=Path(data_dir), db_url=db_url))
    try:
        yield store
    finally:
        store.engine.dispose()


def logged_ops(data_dir: Path, target: str | None = None, request_type: str | None = None,
               status: str | None = None, db_url: str | None = None) -> list[FutureRow]:
    """The op log's rows (control/store/futures.py: FutureRepository.of) of a server's data dir (or
    `db_url`: a PostgreSQL-backed server's, ServerProcess.env["TINKERD_DB_URL"])."""
    with server_store(data_dir, db_url) as store:
        return FutureRepository(store).of(target, request_type, status)


def start_server(data_dir: Path, base_models: list[str], extra_args: list[str] = (), timeout_s: float = 300,
                 env: dict | None = None, api_key: str | None = API_KEY, launcher: list[str] = (),
                 log_level: str = "WARNING", own_models: bool = False) -> ServerProcess:
    """`launcher`: a command the server command line is appended to (one that execs it, so the PID
    is the server's). `own_models`: build the models into the data dir instead of linking the shared
    ones (for a server of other code, whose models may differ)."""
    models = Path(data_dir) / "models"
    if _shared_models_dir is not None and not own_models and not models.exists() and not models.is_symlink():
        models.parent.mkdir(parents=True, exist_ok=True)
        models.symlink_to(_shared_models_dir, target_is_directory=True)
    cmd = [*launcher, sys.executable, "-m", "tinkerd.cli.main", "--log-level", log_level, "serve", "--port", "0",
           "--data-dir", str(data_dir), *(["--api-key", api_key] if api_key else []), *extra_args]
    for m in base_models:
        cmd += ["--base-model", m]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    lines: list[str] = []
    ready = threading.Event()
    url_box: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("tinkerd ready at "):
                url_box.append(line.split()[3])
            elif url_box and "export TINKER_BASE_URL" in line:  # the ready line's second half
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("tinkerd serve did not start:\n" + "".join(lines[-50:]))
    return ServerProcess(proc, url_box[0], data_dir, lines, dict(env or {}))
