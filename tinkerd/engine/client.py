"""EngineClient implementations that live in the engine package (they may import torch)."""

from __future__ import annotations

from tinkerd.engine.engine import Engine
from tinkerd.types import ServedModel


class InProcessEngineClient:
    """The embedded default: the engine runs on the control plane's worker thread."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def step(self, ops: list) -> list:
        return self.engine.step(ops)

    def models(self) -> list[ServedModel]:
        return [
            ServedModel(
                name=rt.name,
                tokenizer_dir=rt.loaded.tokenizer_dir,
                max_context_length=rt.loaded.max_context_length,
                arch=type(rt.model).__name__,
            )
            for rt in self.engine.runtimes.values()
        ]

    def close(self) -> None:
        pass
