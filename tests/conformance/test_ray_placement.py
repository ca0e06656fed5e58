"""Ray placement through the official SDK: two base models, each on its own Ray actor of a real
local Ray head, trained and sampled at the same time; one actor SIGKILLed mid-loop. Both loops end
with exactly the losses and samples of uninterrupted runs on the shared server's process engine, and
only the dead actor recovers: the other is neither restarted nor rebuilt."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytest.importorskip("ray")

from tests.chaos import LoopResult, recoveries, training_loop  # noqa: E402
from tests.serverproc import start_server  # noqa: E402

BASES = ("tinkerd/tiny-qwen3", "tinkerd/tiny-llama")
STEPS = 8
SAMPLE_EVERY = 4
VICTIM, SURVIVOR = BASES[1], BASES[0]
# The head and the server agree on Ray's token authentication whatever ~/.ray holds: Ray 2.60 turns it
# on for a cluster when a token file exists there (a `ray.init()` on this machine writes one), and a
# driver left at the default then fails to connect ("InvalidAuthToken").
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head` with 2 CPUs in a temp dir, stopped (its process group, ours) afterwards."""
    temp = tempfile.mkdtemp(prefix="tdray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port),
         "--num-cpus", "2", "--num-gpus", "0", "--temp-dir", temp, "--include-dashboard", "false",
         "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **RAY_ENV})
    try:
        deadline = time.monotonic() + 120
        while True:  # the GCS port answers once the head is up
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the Ray head did not start")
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:  # `ray start --block` outlived a SIGTERM by 30 s here (a 30 s teardown): 5 s, then SIGKILL
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of the group outlived the head
        except ProcessLookupError:
            pass
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _actor_pid(lines: list[str], base: str, after: int = 0) -> int | None:
    pattern = re.compile(rf"engine actor of {re.escape(base)} is ready \(pid (\d+)\)")
    pids = [int(m.group(1)) for line in lines[after:] if (m := pattern.search(line))]
    return pids[-1] if pids else None


def test_two_base_models_on_two_ray_actors_lose_nothing_when_one_is_killed(server, ray_head, tmp_path):
    # Uninterrupted references, on the shared server's process engine (same code, same 2 threads).
    reference = {base: training_loop(server.url, STEPS, SAMPLE_EVERY, base_model=base) for base in BASES}

    srv = start_server(tmp_path, list(BASES), ["--threads", "2", "--ray-address", ray_head], log_level="INFO",
                       env=RAY_ENV)
    try:
        first_pids = {base: _actor_pid(srv.lines, base) for base in BASES}
        assert None not in first_pids.values() and len(set(first_pids.values())) == 2, first_pids
        results: dict[str, LoopResult | BaseException] = {}
        progress: dict[str, list[int]] = {base: [] for base in BASES}

        def loop(base: str) -> None:
            try:
                results[base] = training_loop(srv.url, STEPS, SAMPLE_EVERY, base_model=base, done_steps=progress[base])
            except BaseException as e:  # noqa: BLE001  any client-visible failure fails the test below
                results[base] = e

        threads = [threading.Thread(target=loop, args=(base,)) for base in BASES]
        for t in threads:
            t.start()
        while len(progress[VICTIM]) < 2 and threads[1].is_alive():  # mid-loop: ops of both runs in flight
            time.sleep(0.05)
        os.kill(first_pids[VICTIM], signal.SIGKILL)
        for t in threads:
            t.join(timeout=600)
        for base in BASES:
            assert not isinstance(results[base], BaseException), results[base]
            assert results[base].losses == reference[base].losses, base
            assert results[base].samples == reference[base].samples, base
        assert len(recoveries(srv.lines)) >= 1  # the kill was noticed and recovered from, not missed
        assert _actor_pid(srv.lines, VICTIM) != first_pids[VICTIM]  # Ray restarted it in a new process
        # Only the dead engine recovered: the survivor's actor never restarted (one ready line, same
        # pid), every recovery restarted the victim's engine alone, and its run was never replayed.
        assert sum(f"engine actor of {SURVIVOR} is ready" in line for line in srv.lines) == 1
        restarted = [line for line in srv.lines if "engine recovered in" in line]
        assert restarted and all(line.rstrip().endswith(f"restarted the engine(s) of {VICTIM}") for line in restarted), restarted
        rebuilt = [line for line in srv.lines if re.search(r"rebuilt \d+ adapters from", line)]
        assert any(results[VICTIM].model_id in line for line in rebuilt), rebuilt
        assert not any(results[SURVIVOR].model_id in line for line in rebuilt), rebuilt
    finally:
        srv.stop()
