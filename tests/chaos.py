"""Shared by the chaos test and benchmarks/recovery.py: an SDK training loop, and an engine killer."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import tinker
from tinker import types

from tests.serverproc import API_KEY, logged_ops

TINY = "tinkerd/tiny-qwen3"


def engine_pid(server_pid: int) -> int | None:
    """The engine process: the server's multiprocessing child (not its resource tracker)."""
    children: list[str] = []
    try:  # a restarted engine is the child of the worker thread, so look at every thread's children
        for tid in os.listdir(f"/proc/{server_pid}/task"):
            children += open(f"/proc/{server_pid}/task/{tid}/children").read().split()
    except OSError:
        return None
    for pid in children:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            return int(pid)
    return None


@dataclass
class LoopResult:
    losses: list[float]
    samples: list[list[int]]
    final_path: str
    model_id: str


def training_loop(url: str, steps: int, sample_every: int = 5, seed: int = 7, base_model: str = TINY,
                  done_steps: list[int] | None = None) -> LoopResult:
    """forward_backward + optim_step each step, pipelined one step ahead, sampling every few steps.
    `done_steps`, when given, gets each step's index once it is sent (a test times a kill by it)."""
    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=seed).result()
    rng = random.Random(seed)
    data = [
        [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
         for toks in ([rng.randrange(1, 5000) for _ in range(rng.randrange(8, 40))] for _ in range(4))]
        for _ in range(steps)
    ]
    losses, samples, pending = [], [], []
    for step in range(steps):
        fb = tc.forward_backward(data[step], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
        pending.append(fb)
        if (step + 1) % sample_every == 0:
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(data[step][0].model_input.to_ints()[:6])
            out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=1.0, seed=step)).result()
            samples.extend(list(s.tokens) for s in out.sequences)
        if done_steps is not None:
            done_steps.append(step)
    losses = [f.result().metrics["loss:sum"] for f in pending]
    path = tc.save_state("final").result().path
    return LoopResult(losses, samples, path, tc.model_id)


@dataclass
class Killer:
    """SIGKILLs the engine process `kills` times at random moments, waiting for each restart."""

    server_pid: int
    kills: int
    # The server's output lines: after each kill, wait for its recovery line before the next one, so
    # every kill lands on a working engine (a kill during start-up is retried, not recovered).
    server_lines: list[str] | None = None
    min_gap_s: float = 0.3
    max_gap_s: float = 1.5
    seed: int = 0
    done: list[float] = field(default_factory=list)  # monotonic time of each kill

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        return t

    def _run(self) -> None:
        rng = random.Random(self.seed)
        last = None
        while len(self.done) < self.kills:
            time.sleep(rng.uniform(self.min_gap_s, self.max_gap_s))
            if self.server_lines is not None and len(recoveries(self.server_lines)) < len(self.done):
                continue
            pid = engine_pid(self.server_pid)
            if pid is None or pid == last:  # restarting: wait for the new engine
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            last = pid
            self.done.append(time.monotonic())


RECOVERY_LINE = re.compile(r"engine recovered in ([\d.]+) s .*replayed (\d+) ops")


def recoveries(server_lines: list[str]) -> list[tuple[float, int]]:
    """(seconds, replayed ops) of each engine recovery the server logged."""
    out = []
    for line in server_lines:
        m = RECOVERY_LINE.search(line)
        if m:
            out.append((float(m.group(1)), int(m.group(2))))
    return out


def assert_nothing_stranded(url: str, data: Path) -> int:
    """Every future in the store is complete and its result retrievable; returns how many there are."""
    rows = logged_ops(data)
    statuses = {r.status for r in rows}
    ids = [r.request_id for r in rows]
    assert statuses == {"complete"}, statuses  # nothing pending, nothing failed
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
        for request_id in ids:
            got = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            assert got.status_code == 200, (request_id, got.text)
    return len(ids)
