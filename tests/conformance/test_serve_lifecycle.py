"""`tinkerd serve` starts and stops as a terminal user expects: Ctrl-C stops it (and its engine
process) at any moment, start-up included, and a model that cannot load is one clear error line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conformance.conftest import TINY


class Serve:
    """`tinkerd serve` in its own process group, as a terminal runs it: Ctrl-C reaches the group."""

    def __init__(self, tmp_path, *args: str):
        cmd = [sys.executable, "-m", "tinkerd", "serve", "--port", "0", "--data-dir", str(tmp_path / "data"),
               "--api-key", "tml-lifecycle", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_for_engine_child(self, timeout_s: float = 120) -> None:
        """Until the engine child exists and ignores SIGINT (it inherits that from the spawn and keeps
        it in _worker_main): its model is loading from then on. A Ctrl-C inside the spawn itself, the
        ~0.5 s in which the server ignores SIGINT for its child's sake, is a known gap (engine/process.py:
        spawn): the server may miss it and go on starting."""
        deadline = time.monotonic() + timeout_s
        while True:
            for pid in os.listdir("/proc"):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    if ppid != self.proc.pid:
                        continue
                    with open(f"/proc/{pid}/status") as f:
                        ignored = int(next(l for l in f if l.startswith("SigIgn:")).split()[1], 16)
                except (OSError, ValueError, IndexError, StopIteration):
                    continue
                if ignored & (1 << (signal.SIGINT - 1)):
                    return
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"no engine child in {timeout_s} s:\n{self.output()}"
            time.sleep(0.02)

    def wait_for(self, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{self.output()}"
            time.sleep(0.05)

    def ctrl_c(self, timeout_s: float = 30) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout=timeout_s)

    def group_gone(self, timeout_s: float = 10) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False

    def output(self) -> str:
        time.sleep(0.2)  # let the pump read what the process wrote last
        return "".join(self.lines)

    def cleanup(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(*args: str) -> Serve:
        started.append(Serve(tmp_path, *args))
        return started[-1]

    yield start
    for s in started:
        s.cleanup()


def test_ctrl_c_while_the_engine_is_starting_stops_everything_quietly(serve):
    s = serve("--base-model", TINY)
    s.wait_for("starting the engine process")
    s.wait_for_engine_child()
    time.sleep(0.5)  # the engine child is importing torch / building the model
    assert s.ctrl_c() == 130
    out = s.output()
    assert "tinkerd serve: interrupted" in out and "Traceback" not in out, out
    assert s.group_gone(), "the engine process outlived the server"


def test_ctrl_c_when_ready_stops_the_server_and_its_engine(serve):
    s = serve("--base-model", TINY)
    s.wait_for("export TINKER_BASE_URL=")
    assert s.ctrl_c() == 0
    out = s.output()
    assert "tinkerd serve: stopped" in out, out
    assert "Traceback" not in out and " ERROR " not in out, out
    assert s.group_gone(), "the engine process outlived the server"


def test_a_model_that_cannot_load_is_one_error_line(serve):
    s = serve("--base-model", "/no/such/model/dir")
    assert s.proc.wait(timeout=120) == 1
    out = s.output()
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("tinkerd serve: ")]
    assert len(errors) == 1 and "the engine could not start" in errors[0], out
    assert "/no/such/model/dir" in errors[0]
