"""`serve --engine thread`: the engine embedded in the server runs every torch call on one thread.

libgomp keeps an OpenMP pool per thread that starts a parallel region; with the model loaded on one
thread and the steps run on another, the two pools outnumbered the cores and every small op paid a
wake-up (2566 against 1879 ms a SmolLM2 step, engine/client.py: InProcessEngineClient.on_one_thread).
"""

from __future__ import annotations

import argparse
import threading

from tests.conftest import TINY_QWEN3
from tinkerd.cli import serve
from tinkerd.engine.engine import Engine
from tinkerd.types import CreateModelOp, LoraSpec, StepBatch


def test_the_thread_engine_builds_and_steps_on_one_thread_of_its_own(engine, models_dir, tmp_path, monkeypatch):
    (tmp_path / "models").symlink_to(models_dir, target_is_directory=True)  # the session's tiny model, built
    seen: list[tuple[str, str]] = []
    load, step = Engine.load_base_model, Engine.step

    def recorded(name, fn):
        def call(self, *args, **kwargs):
            seen.append((name, threading.current_thread().name))
            return fn(self, *args, **kwargs)
        return call

    monkeypatch.setattr(Engine, "load_base_model", recorded("load", load))
    monkeypatch.setattr(Engine, "step", recorded("step", step))
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    config = serve.build_config(parser.parse_args(["serve", "--engine", "thread", "--data-dir", str(tmp_path),
                                                   "--base-model", TINY_QWEN3]))
    client = serve.build_engine_client(config)
    try:
        client.step(StepBatch(run=[("c1", CreateModelOp("embedded-1", TINY_QWEN3, LoraSpec(rank=4, alpha=8.0)))]))
        other = threading.Thread(target=client.step, name="another-caller", args=(
            StepBatch(run=[("c2", CreateModelOp("embedded-2", TINY_QWEN3, LoraSpec(rank=4, alpha=8.0)))]),))
        other.start()
        other.join()
    finally:
        client.close()
    assert [name for name, _ in seen] == ["load", "step", "step"]
    threads = {thread for _, thread in seen}
    assert len(threads) == 1 and threads != {threading.current_thread().name, "another-caller"}
    assert threads.pop().startswith("tinkerd-torch")
