"""What the engine process died of, as control needs to know it: a fatal signal of its own makes the
ops in flight suspects (control/control.py), a SIGKILL from outside does not. A real engine process."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from tinkerd.engine import process
from tinkerd.engine.process import EngineSpec, ProcessEngineClient
from tinkerd.errors import Category, EngineCrashed, EngineFailure, ServerError
from tinkerd.types import StepBatch

TINY = "tinkerd/tiny-qwen3"


@pytest.fixture(scope="module")
def client(tiny_model_dir, models_dir):  # tiny_model_dir: the model is built on disk first
    c = ProcessEngineClient(EngineSpec(models_dir, (TINY,), 256, 1))
    yield c
    c.close()


def _die_of(client: ProcessEngineClient, sig: int) -> EngineCrashed:
    os.kill(client.pid, sig)
    with pytest.raises(EngineCrashed) as info:
        client.step(StepBatch(decode=True))
    client.restart()
    assert client.step(StepBatch(decode=True)).active_rows == 0  # the new process serves
    return info.value


def test_a_fatal_signal_of_its_own_is_self_inflicted(client):
    for sig in (signal.SIGSEGV, signal.SIGABRT):
        crash = _die_of(client, sig)
        assert crash.self_inflicted and signal.Signals(sig).name in str(crash)


def test_a_sigkill_from_outside_is_not(client):
    crash = _die_of(client, signal.SIGKILL)
    assert not crash.self_inflicted and "exit code -9" in str(crash)


def test_an_unexpected_error_in_the_engine_crosses_the_pipe_as_a_server_error_and_the_engine_serves_on(client):
    """Not a bare RuntimeError: a TinkerdError of category server that names the original."""
    with pytest.raises(EngineFailure) as info:
        client._call("no_such_method")  # the child's loop fails the call (AttributeError), not an op
    assert isinstance(info.value, ServerError) and info.value.category == Category.SERVER
    assert "AttributeError" in info.value.message
    assert client.step(StepBatch(decode=True)).active_rows == 0


def test_the_engine_is_the_oom_killers_first_choice(client):
    with open(f"/proc/{client.pid}/oom_score_adj") as f:
        assert f.read().strip() == "1000"


def test_the_engine_allocates_on_huge_pages(client):
    """The engine process starts with malloc's huge-page tunable (engine/malloc.py), and where the
    kernel offers transparent huge pages on request, its memory does sit on them; the server's
    own environment is left as it was."""
    with open(f"/proc/{client.pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert b"glibc.malloc.hugetlb=1" in env.get(b"GLIBC_TUNABLES", b"")
    assert "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", "")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            offered = "[never]" not in f.read()
    except OSError:
        offered = False
    if offered:
        with open(f"/proc/{client.pid}/smaps_rollup") as f:
            huge_kb = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
        assert huge_kb >= 2048


def test_a_ctrl_c_while_the_engine_is_spawned_stops_start_up_and_spares_the_child(client, monkeypatch):
    """A Ctrl-C in the spawn window used to be ignored (SIGINT was set to SIG_IGN around the start,
    so the child would inherit an ignored signal): `tinkerd serve` went on starting. Blocked
    instead, it reaches this process once the child is recorded, and the child, which inherits the
    block, ignores its own copy and starts."""
    client.kill()
    client._reap()

    @contextlib.contextmanager
    def interrupted():  # the Ctrl-C lands while the child is being spawned
        os.kill(os.getpid(), signal.SIGINT)
        yield

    monkeypatch.setattr(process, "children_use_huge_pages", interrupted)
    # As in a terminal. (A shell starts background jobs with SIGINT ignored, and Python then leaves
    # it ignored, as CI's pytest may be: spawn() hands the interrupt on to whatever handler is there.)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            client.spawn()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert client.pid is not None, "the spawned child is recorded, so the server can stop it"
    os.kill(client.pid, signal.SIGINT)  # the group's copy of the Ctrl-C, early in the child's start
    client.wait_ready()
    assert client.step(StepBatch(decode=True)).active_rows == 0
