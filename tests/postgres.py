"""A real PostgreSQL for the tests: a throwaway cluster (initdb + pg_ctl in a temp dir, on a Unix
socket there, no TCP port to collide on), or the server $TINKERD_TEST_PG_URL names.

initdb refuses to run as root, so as root the cluster belongs to the `postgres` user (Debian's
package creates it) and its commands run through runuser. Each caller gets a fresh database
(`fresh_database`), so tests never see each other's rows. Stopped by the postmaster's PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import pytest


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    # Debian puts the server binaries under /usr/lib/postgresql/<major>/bin, off PATH.
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    return None


class Cluster:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="tinkerd-pg-"))
        self.data = self.dir / "data"
        self.pid: int | None = None
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.dir, "postgres")
        self.dir.chmod(0o755)

    def start(self) -> None:
        initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
        if not initdb or not pg_ctl:
            pytest.fail("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
        subprocess.run([*self._as, initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True)
        # fsync off: a test cluster need not survive an OS crash; a process kill it does survive.
        opts = f"-k {self.dir} -c listen_addresses='' -c fsync=off -c max_connections=200"
        self._ctl = [*self._as, pg_ctl, "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w"]
        subprocess.run([*self._ctl, "start"], check=True, capture_output=True)
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])

    def restart(self) -> None:
        """A fast restart in place (every session aborted, same data and socket): what an operator's
        `systemctl restart postgresql` does to the clients."""
        subprocess.run([*self._ctl, "-m", "fast", "restart"], check=True, capture_output=True)
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])

    def url(self, db: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@/{db}?host={self.dir}"

    def stop(self) -> None:
        if self.pid is not None:
            # SIGINT is PostgreSQL's "fast" shutdown: aborts sessions, then exits cleanly.
            try:
                os.kill(self.pid, signal.SIGINT)
                for _ in range(300):
                    os.kill(self.pid, 0)
                    time.sleep(0.05)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def fresh_database(server_url: str) -> str:
    """A new empty database on the server at `server_url`; its URL."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, query = server_url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")
