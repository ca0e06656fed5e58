"""EngineClient implementations that live in the engine package (they may import torch)."""

from __future__ import annotations

from tinkerd.engine.engine import Engine
from tinkerd.engine.losses import supported_losses
from tinkerd.types import ServedModel, StepBatch, StepOutput


class InProcessEngineClient:
    """The embedded default: the engine runs on the control plane's worker thread."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def step(self, batch: StepBatch) -> StepOutput:
        return self.engine.step(batch)

    def models(self) -> list[ServedModel]:
        return [
            ServedModel(
                name=rt.name,
                tokenizer_id=rt.loaded.tokenizer_id,
                max_context_length=rt.loaded.max_context_length,
                arch=type(rt.model).__name__,
                loss_fns=tuple(supported_losses()),
                tokenizer_dir=rt.loaded.tokenizer_dir,
                vision=rt.loaded.vision.spec if rt.loaded.vision is not None else None,
            )
            for rt in self.engine.runtimes.values()
        ] + [ServedModel(name=name, tokenizer_id="", max_context_length=0, arch="", unavailable=reason)
             for name, reason in self.engine.refused.items()]

    def close(self) -> None:
        self.engine.close()
