"""Faults the chaos and disk-full tests do not cover, each ending as an uninterrupted run would:
the same losses and sampled tokens for everything acknowledged, every accepted request_id answering
its result, and `tinkerd fsck` clean.

- the engine SIGKILLed inside a checkpoint write (save_state);
- the whole server (its process group, engine included) SIGKILLed inside save_state, and during a
  sample, then restarted on the same port while the SDK keeps polling;
- the SQLite file locked by another process (BEGIN EXCLUSIVE) mid-loop: new work gets a 503 with
  Retry-After, accepted work completes after the lock goes, no restart;
- the SQLite file made read-only mid-way through a pipelined loop (strace fails its writes with
  EROFS, see below): the same, and readyz says `storage not writable` the whole time.

A kill "inside a write" is made exact by watching the filesystem, not by a hook in the server: as
soon as the save's temp directory (engine/checkpoints.py: `.<name>.tmp-*`) appears, the engine is
SIGSTOPped, frozen mid-write; the test checks that the temp directory is there and the real name is
not, then SIGKILLs. The scenario is small (tiny model, rank 8, 6 steps) so that each test takes
~15-40 s on 2 cores.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import pytest
import tinker
from tinker import types

from tests.chaos import TINY, assert_nothing_stranded, engine_pid, recoveries
from tests.serverproc import API_KEY, ServerProcess, start_server
from tinkerd.cli.main import main as tinkerd_main
from tinkerd.engine.checkpoints import read_adapter

ARGS = ["--threads", "1"]
STEPS = 6
SAVE_AFTER = 3  # steps before the save_state and the sample
_rng = random.Random(11)
DATA = [[types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
         for toks in ([_rng.randrange(1, 5000) for _ in range(_rng.randrange(8, 24))] for _ in range(2))]
        for _ in range(STEPS)]
PROMPT = types.ModelInput.from_ints([11, 22, 33, 44, 55])
# Long enough (~1 s of decode on the tiny model) that a kill 0.3 s after the sample is accepted
# lands while it is decoding.
SAMPLE = types.SamplingParams(max_tokens=160, temperature=1.0, seed=5)


@dataclass
class Outcome:
    losses: list[float]
    tokens: list[int]
    saved: str
    model_id: str


def _step(tc, i: int) -> float:
    fb = tc.forward_backward(DATA[i], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return fb.result().metrics["loss:sum"]


def scenario(url: str, before_save: Callable | None = None, before_sample: Callable | None = None) -> Outcome:
    """Train, save_state, sample from the current weights, train on. The hooks start a fault."""
    tc = tinker.ServiceClient(base_url=url, api_key=API_KEY).create_lora_training_client(
        base_model=TINY, rank=8, seed=11).result()
    losses = [_step(tc, i) for i in range(SAVE_AFTER)]
    if before_save:
        before_save(tc)
    saved = tc.save_state("mid").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    if before_sample:
        before_sample(tc)
    tokens = list(sampler.sample(PROMPT, 1, SAMPLE).result().sequences[0].tokens)
    losses += [_step(tc, i) for i in range(SAVE_AFTER, STEPS)]
    return Outcome(losses, tokens, saved, tc.model_id)


def _data_dir(tmp_path: Path, models_dir: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    # The converted tiny model is shared, not rebuilt per test (~86 MB, seconds of CPU).
    (data / "models").symlink_to(models_dir, target_is_directory=True)
    return data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, models_dir) -> Outcome:
    data = _data_dir(tmp_path_factory.mktemp("ref"), models_dir)
    srv = start_server(data, [TINY], ARGS)
    try:
        return scenario(srv.url)
    finally:
        srv.stop()


# -- the checks every test ends with -------------------------------------------------------------


def _assert_same(result: Outcome, reference: Outcome, data: Path) -> None:
    assert result.losses == reference.losses  # bit-identical: nothing acknowledged was lost or run twice
    assert result.tokens == reference.tokens
    run, seg, name = result.saved[len("tinker://"):].split("/")
    assert read_adapter(data / "checkpoints" / run / seg / name).step == SAVE_AFTER


def _fsck(data: Path, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = tinkerd_main(["fsck", "--data-dir", str(data), *extra])
    return rc, capsys.readouterr().out


# -- freezing the engine inside a write ----------------------------------------------------------


def _freeze_in_write(server_pid: int, parent: Path, name: str, timeout_s: float = 60) -> tuple[int, Path]:
    """SIGSTOP the engine while `parent/.<name>.tmp-*` exists and `parent/<name>` does not: frozen
    between mkdtemp and the rename, i.e. inside the write."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tmps = list(parent.glob(f".{name}.tmp-*")) if parent.is_dir() else []
        if tmps:
            pid = engine_pid(server_pid)
            os.kill(pid, signal.SIGSTOP)
            still = [t for t in tmps if t.exists()]
            assert still and not (parent / name).exists(), "the write finished before the engine was stopped"
            return pid, still[0]
        time.sleep(0.001)  # a rank-8 save of the tiny model (~15 MB, 4 fsyncs) takes tens of ms
    raise AssertionError(f"no .{name}.tmp-* appeared in {parent}")


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # surfaced by the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_gone(pid: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:  # a zombie child of a SIGKILLed server is reaped by init; /proc/<pid>/stat says Z until then
            if open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.02)


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_sigkilled_inside_a_checkpoint_write(reference, tmp_path, models_dir, capsys):
    """Exercises the engine-crash recovery path (control/crashes.py: EngineCrashes.recover): the in-flight save_state,
    never stored, is re-queued and written again; the frozen write's temp dir is swept before the
    rebuild (control/debris.py), so fsck finds nothing. Without the temp-then-rename write the kill
    would leave a half checkpoint under its real name (read_adapter would fail on it)."""
    data = _data_dir(tmp_path, models_dir)
    srv = start_server(data, [TINY], ARGS)
    box: dict = {}

    def kill_inside_save(tc) -> None:
        parent = data / "checkpoints" / tc.model_id / "weights"

        def run():
            pid, tmp = _freeze_in_write(srv.proc.pid, parent, "mid")
            box["tmp"] = tmp
            os.kill(pid, signal.SIGKILL)
        box["thread"] = _in_thread(run)[0]

    try:
        t0 = time.monotonic()
        result = scenario(srv.url, before_save=kill_inside_save)
        box["thread"].join()
        box["seconds"] = time.monotonic() - t0
        assert len(recoveries(srv.lines)) == 1
        ids = assert_nothing_stranded(srv.url, data)
    finally:
        srv.stop()
    _assert_same(result, reference, data)
    assert not box["tmp"].exists()  # the killed write's temp dir: swept after the engine restart
    rc, out = _fsck(data, capsys)
    assert rc == 0 and "clean" in out, out
    print(f"engine kill inside save_state: {box['seconds']:.1f} s loop, {ids} futures all retrieved, "
          f"recovery {recoveries(srv.lines)}")


def _restart_after_group_kill(srv: ServerProcess, data: Path, port: str, frozen_engine: int | None,
                              while_down: Callable | None = None) -> ServerProcess:
    os.killpg(srv.proc.pid, signal.SIGKILL)  # the server and its engine child: a power cut for the process tree
    srv.proc.wait()
    if frozen_engine is not None:
        _wait_gone(frozen_engine)
    if while_down is not None:
        while_down()
    return start_server(data, [TINY], ARGS + ["--port", port], launcher=["setsid"])


@pytest.mark.slow
def test_server_group_sigkilled_inside_save_state(reference, tmp_path, models_dir, capsys):
    """Exercises the write-ahead log and start-up recovery (Control._recover_from_store): the
    save_state was accepted (its FutureRow stored) but never finished; after the restart it is
    re-queued from its stored body and written, and the start's sweep (control/debris.py) removes
    the frozen write's temp dir and a snapshot write's temp dir planted while the server was down,
    leaving the real snapshots recovery starts from. Without the write-ahead row the SDK's poll of
    that request_id would get a 404 after the restart."""
    data = _data_dir(tmp_path, models_dir)
    port = str(_free_port())
    srv = start_server(data, [TINY], ARGS + ["--port", port], launcher=["setsid"])  # its own process group
    box: dict = {"srv": srv}

    def kill_inside_save(tc) -> None:
        def run():
            pid, tmp = _freeze_in_write(srv.proc.pid, data / "checkpoints" / tc.model_id / "weights", "mid")
            box["tmp"] = tmp
            # What a snapshot write killed mid-way leaves (engine/training.py: _snapshot).
            box["planted"] = data / "snapshots" / tc.model_id / ".seq-000000000099.tmp-pl4nt3d0"

            def plant():
                box["planted"].mkdir(parents=True)
                (box["planted"] / "adapter_model.safetensors").write_bytes(b"half")
            t0 = time.monotonic()
            box["srv"] = _restart_after_group_kill(srv, data, port, pid, while_down=plant)
            box["restart_s"] = time.monotonic() - t0
        box["thread"] = _in_thread(run)[0]

    try:
        result = scenario(srv.url, before_save=kill_inside_save)
        box["thread"].join()
        assert box["srv"] is not srv
        ids = assert_nothing_stranded(box["srv"].url, data)
        assert not any("cannot be resumed" in line for line in box["srv"].lines)
    finally:
        box["srv"].stop()
        srv.stop()
    _assert_same(result, reference, data)  # recovery started from a real snapshot: the sweep kept them
    assert not box["tmp"].exists() and not box["planted"].exists()  # swept at the restart
    assert any(p.name.startswith("seq-") for p in box["planted"].parent.iterdir())
    rc, out = _fsck(data, capsys)
    assert rc == 0 and "clean" in out, out
    print(f"server group kill inside save_state: restart {box['restart_s']:.1f} s, {ids} futures all retrieved")


def _pending(data: Path, request_type: str) -> int:
    with sqlite3.connect(data / "tinkerd.sqlite") as db:
        return db.execute("SELECT count(*) FROM futures WHERE request_type = ? AND status = 'pending'",
                          (request_type,)).fetchone()[0]


@pytest.mark.slow
def test_server_group_sigkilled_during_a_sample(reference, tmp_path, models_dir, capsys):
    """Exercises start-up recovery of a sampling op: the sample was accepted and decoding (still
    pending) when the process group died; after the restart it is rebuilt from its stored body and
    runs again with its seed, so the SDK gets the tokens of the uninterrupted run."""
    data = _data_dir(tmp_path, models_dir)
    port = str(_free_port())
    srv = start_server(data, [TINY], ARGS + ["--port", port], launcher=["setsid"])
    box: dict = {"srv": srv}

    def kill_during_sample(tc) -> None:
        def run():
            deadline = time.monotonic() + 60
            while _pending(data, "Sample") == 0:
                assert time.monotonic() < deadline, "the sample was never accepted"
                time.sleep(0.005)
            time.sleep(0.3)  # admitted and decoding: ~1 s of decode for 160 tokens
            box["pending_at_kill"] = _pending(data, "Sample")
            box["srv"] = _restart_after_group_kill(srv, data, port, engine_pid(srv.proc.pid))
        box["thread"] = _in_thread(run)[0]

    try:
        result = scenario(srv.url, before_sample=kill_during_sample)
        box["thread"].join()
        assert box["pending_at_kill"] == 1  # the kill came before the sample finished
        ids = assert_nothing_stranded(box["srv"].url, data)
    finally:
        box["srv"].stop()
        srv.stop()
    _assert_same(result, reference, data)
    rc, out = _fsck(data, capsys)
    assert rc == 0 and "clean" in out, out
    print(f"server group kill during sample: {ids} futures all retrieved")


@pytest.mark.slow
def test_store_locked_by_another_process_mid_loop(reference, tmp_path, models_dir, capsys):
    """Exercises the storage-fault path (control/store/db.py -> StorageUnavailable,
    control/results.py): while another process holds the SQLite write lock past the 5 s busy
    timeout, a new request is refused with 503 + Retry-After (without the mapping it was a 500,
    which the SDK does not retry for plain calls), and the accepted op's result is retried until the
    lock goes; no restart. The lock is held until the worker's own write has failed once (~10 s:
    the refused request holds the store's writer lock for its 5 s busy timeout, then the worker
    waits out its own), so the retry path is what brings the op home."""
    data = _data_dir(tmp_path, models_dir)
    srv = start_server(data, [TINY], ARGS)
    try:
        tc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY).create_lora_training_client(
            base_model=TINY, rank=8, seed=11).result()
        losses = [_step(tc, i) for i in range(SAVE_AFTER)]
        engine = engine_pid(srv.proc.pid)
        os.kill(engine, signal.SIGSTOP)  # so the next op is certainly accepted and unfinished when the lock comes
        before = _count(data)
        fb = tc.forward_backward(DATA[SAVE_AFTER], "cross_entropy")
        deadline = time.monotonic() + 30
        while _count(data) == before:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        locker = sqlite3.connect(data / "tinkerd.sqlite", isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")  # WAL: readers go on, every writer waits
        t_lock = time.monotonic()
        with httpx.Client(base_url=srv.url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
            # Before any write has failed (the engine is still stopped, nothing else writes):
            # readyz probes the store itself (Store.write_probe).
            early = http.get("/api/v1/readyz")
            assert early.status_code == 503 and not any("cannot store the" in line for line in srv.lines)
            assert "storage not writable: database is locked" in early.json()["reasons"], early.text
            assert early.json()["storage"]["writable"] is False
            os.kill(engine, signal.SIGCONT)
            refused = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
            refused_after_s = time.monotonic() - t_lock
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "10"
            assert refused.json()["category"] == "server" and "locked" in refused.json()["error"], refused.text
            ready = http.get("/api/v1/readyz").json()
        # The worker's result write queued behind that request on the store's own lock, then waits
        # out its own 5 s busy timeout and fails: hold on until results.py says it is retrying.
        deadline = time.monotonic() + 20
        while not any("cannot store the" in line for line in srv.lines):
            assert time.monotonic() < deadline, "the accepted op's result write never failed"
            time.sleep(0.05)
        assert _pending(data, "ForwardBackward") == 1  # applied by the engine, not stored: still pending
        locker.execute("ROLLBACK")
        locker.close()
        held_s = time.monotonic() - t_lock
        t0 = time.monotonic()
        loss = fb.result().metrics["loss:sum"]
        resumed_s = time.monotonic() - t0
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(loss)
        losses += [_step(tc, i) for i in range(SAVE_AFTER + 1, STEPS)]
        ids = assert_nothing_stranded(srv.url, data)
        assert not recoveries(srv.lines)  # no engine restart, and the server never stopped
    finally:
        srv.stop()
    assert losses == _loop_losses(reference)
    assert "failed attempts; work goes on" in "".join(srv.lines)  # results.py retried the write, then it landed
    rc, out = _fsck(data, capsys)
    assert rc == 0 and "clean" in out, out
    print(f"store locked {held_s:.1f} s: new request refused after {refused_after_s:.1f} s (503), "
          f"readyz {ready.get('status')} {ready.get('reasons')}, accepted op done {resumed_s:.1f} s after release, "
          f"{ids} futures all retrieved")


def _count(data: Path) -> int:
    with sqlite3.connect(data / "tinkerd.sqlite") as db:
        return db.execute("SELECT count(*) FROM futures").fetchone()[0]


def _loop_losses(reference: Outcome) -> list[float]:
    # The lock test trains the same steps without the save and the sample, which change no adapter.
    return reference.losses


# -- the SQLite file made read-only mid-loop -----------------------------------------------------
#
# A read-only remount is refused (EBUSY) while SQLite holds the file open for writing, so the fault
# is injected with ptrace instead: strace attached to the running server fails, with EROFS (what a
# write on a read-only remount gets), every write, sync and open of the SQLite file and its WAL and
# shm files, and nothing else (`-P` picks the syscalls by the path they touch, fds included).
# Stricter than a remount in one way: an open for reading fails too, so a connection the pool opens
# during the fault cannot even read; the pooled ones read on (pread64 is not touched).

STORE_FILES = ("tinkerd.sqlite", "tinkerd.sqlite-wal", "tinkerd.sqlite-shm")
FAULTED = "openat,open,creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,ftruncate,fallocate"
EROFS_S = 10.0  # how long the store stays read-only


def _attach_strace(pid: int, argv: list[str], timeout_s: float = 20) -> subprocess.Popen:
    """strace -f -p pid + argv, returned once every thread of pid is attached; pytest.skip if ptrace
    is not permitted here (no CAP_SYS_PTRACE, Yama ptrace_scope)."""
    tracer = subprocess.Popen(["strace", "-f", "-p", str(pid), *argv], stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    attached = threading.Event()

    def read() -> None:
        for line in tracer.stderr:
            seen.append(line)
            if "attached" in line:  # "Process N attached with K threads", once all are
                attached.set()
    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not attached.wait(0.05):
        if tracer.poll() is not None or time.monotonic() > deadline:
            _detach(tracer)
            text = "".join(seen)
            if "Operation not permitted" in text:
                pytest.skip(f"ptrace not permitted here: {text.strip()}")
            raise AssertionError(f"strace did not attach: {text}")
    tracer.lines = seen  # type: ignore[attr-defined]
    return tracer


def _detach(tracer: subprocess.Popen) -> None:
    if tracer.poll() is None:
        tracer.send_signal(signal.SIGINT)  # strace detaches from every thread and exits; the tracee runs on
        tracer.wait(timeout=30)


@pytest.fixture(scope="module")
def ptrace_allowed():
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (.ci/run installs it)")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        _detach(_attach_strace(sleeper.pid, ["-e", "trace=none", "-o", "/dev/null"]))
    finally:
        sleeper.kill()
        sleeper.wait()


def _refusal(http: httpx.Client) -> httpx.Response:
    return http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})


@pytest.mark.slow
def test_store_read_only_mid_loop(ptrace_allowed, reference, tmp_path, models_dir, capsys):
    """Exercises the storage-fault path for a store that cannot be written at all (EROFS, not a lock
    that a busy timeout waits out): while it lasts, readyz says `storage not writable`, every new
    request is refused with 503 + Retry-After, the pipelined loop's submissions are retried by the
    SDK, and the accepted op's result write is retried (control/results.py) until the store takes
    writes again; then everything lands in order, no restart."""
    data = _data_dir(tmp_path, models_dir)
    srv = start_server(data, [TINY], ARGS)
    stats: dict = {"refused": 0}
    tracer = None
    try:
        tc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY).create_lora_training_client(
            base_model=TINY, rank=8, seed=11).result()
        losses = [_step(tc, i) for i in range(SAVE_AFTER)]
        engine = engine_pid(srv.proc.pid)
        os.kill(engine, signal.SIGSTOP)  # so the next ops are certainly accepted and unfinished when the fault comes
        before = _count(data)
        pending = [tc.forward_backward(DATA[SAVE_AFTER], "cross_entropy")]
        steps = [tc.optim_step(types.AdamParams(learning_rate=1e-2))]
        deadline = time.monotonic() + 30
        while _count(data) < before + 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        paths = [a for f in STORE_FILES for a in ("-P", str(data / f))]
        tracer = _attach_strace(srv.proc.pid, [*paths, "-e", f"trace={FAULTED}", "-e", f"inject={FAULTED}:error=EROFS",
                                               "-o", str(tmp_path / "strace.log")])
        t_fault = time.monotonic()
        os.kill(engine, signal.SIGCONT)

        def rest_of_loop() -> None:  # the SDK loop goes on, pipelined, through the fault
            for i in range(SAVE_AFTER + 1, STEPS):
                pending.append(tc.forward_backward(DATA[i], "cross_entropy"))
                steps.append(tc.optim_step(types.AdamParams(learning_rate=1e-2)))
        loop, box = _in_thread(rest_of_loop)
        with httpx.Client(base_url=srv.url, headers={"X-API-Key": API_KEY}, timeout=60) as http:
            ready = http.get("/api/v1/readyz")
            assert ready.status_code == 503 and "storage not writable" in " ".join(ready.json()["reasons"]), ready.text
            assert ready.json()["storage"]["writable"] is False
            while time.monotonic() - t_fault < EROFS_S:
                got = _refusal(http)
                assert got.status_code == 503, got.text
                assert got.headers["retry-after"] == "10"
                assert got.json()["category"] == "server" and "storage is failing" in got.json()["error"], got.text
                stats["refused"] += 1
                stats.setdefault("message", got.json()["error"])
                time.sleep(0.5)
            deadline = time.monotonic() + 30
            while not any("cannot store the" in line for line in srv.lines):
                assert time.monotonic() < deadline, "the accepted op's result write never failed"
                time.sleep(0.05)
            assert _pending(data, "ForwardBackward") >= 1  # applied by the engine, not stored: still pending
            stats["readyz"] = http.get("/api/v1/readyz").json()["reasons"]
            _detach(tracer)
            t_clear = time.monotonic()
            stats["held_s"] = t_clear - t_fault
            stats["injected"] = sum("(INJECTED)" in line for line in open(tmp_path / "strace.log"))
            while (got := _refusal(http)).status_code != 200:
                assert got.status_code == 503 and time.monotonic() - t_clear < 30, got.text
                time.sleep(0.05)
            stats["first_ok_s"] = time.monotonic() - t_clear
        losses += [f.result().metrics["loss:sum"] for f in pending[:1]]
        stats["accepted_done_s"] = time.monotonic() - t_clear
        loop.join(120)
        assert not loop.is_alive() and "error" not in box, box
        losses += [f.result().metrics["loss:sum"] for f in pending[1:]]
        assert len(losses) == STEPS and all(s.result() is not None for s in steps)
        stats["loop_done_s"] = time.monotonic() - t_clear
        ids = assert_nothing_stranded(srv.url, data)
        assert not recoveries(srv.lines)  # no engine restart, and the server never stopped
    finally:
        if tracer is not None:
            _detach(tracer)
        srv.stop()
    assert losses == _loop_losses(reference)  # every step once, in order: nothing lost or run twice
    assert "failed attempts; work goes on" in "".join(srv.lines)
    rc, out = _fsck(data, capsys)
    assert rc == 0 and "clean" in out, out
    print(f"store read-only {stats['held_s']:.1f} s ({stats['injected']} syscalls failed with EROFS): "
          f"{stats['refused']} new requests refused (503: {stats['message']!r}), readyz {stats['readyz']}; "
          f"first success {stats['first_ok_s']:.2f} s after it cleared, accepted op done "
          f"{stats['accepted_done_s']:.1f} s after, loop done {stats['loop_done_s']:.1f} s after, "
          f"{ids} futures all retrieved, 0 lost")
