"""Start `tinkerd serve` as a real subprocess and stop it by its own PID."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

API_KEY = "tml-tinkerd-test"


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


def start_server(data_dir: Path, base_models: list[str], extra_args: list[str] = (), timeout_s: float = 300,
                 env: dict | None = None, api_key: str | None = API_KEY, launcher: list[str] = (),
                 log_level: str = "WARNING") -> ServerProcess:
    """`launcher`: a command the server command line is appended to (one that execs it, so the PID
    is the server's)."""
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
