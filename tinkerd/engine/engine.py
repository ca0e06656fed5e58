"""The compute plane: one Engine per process, owning the loaded base models and their adapters.

`Engine.step(ops)` executes a batch the scheduler picked and returns one result per op: the op's
result object, or the TinkerdError that failed it. A bad op fails alone; the loop goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from tinkerd.engine.lora.layers import LoraContext, MultiLoraLinear, wrap_model, targets_for
from tinkerd.engine.lora.pool import AdapterPool
from tinkerd.engine.model.registry import LoadedModel, load_model
from tinkerd.errors import NotFoundError, ServerError, TinkerdError, UserError
from tinkerd.types import EngineOp

log = logging.getLogger(__name__)


@dataclass
class ModelRuntime:
    """A base model loaded once, wrapped with multi-LoRA layers, and its adapter pool."""

    loaded: LoadedModel
    ctx: LoraContext
    layers: dict[str, MultiLoraLinear]
    pool: AdapterPool

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().out_features

    @cached_property
    def tokenizer(self):
        """The base model's tokenizer, loaded on first use (sampling stop strings) and kept."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.loaded.tokenizer_dir)


class Engine:
    def __init__(self, models_dir: Path, max_lora_rank: int = 256):
        self.models_dir = Path(models_dir)
        self.max_lora_rank = max_lora_rank
        self.runtimes: dict[str, ModelRuntime] = {}
        # model_id -> base model name, so ops that name only a model_id find their runtime.
        self.model_of: dict[str, str] = {}

    def load_base_model(self, name: str) -> ModelRuntime:
        if name in self.runtimes:
            return self.runtimes[name]
        loaded = load_model(name, self.models_dir)
        for p in loaded.model.parameters():
            p.requires_grad_(False)
        loaded.model.eval()
        ctx = LoraContext()
        layers = wrap_model(loaded.model, ctx, targets_for(True, True, True))
        runtime = ModelRuntime(loaded, ctx, layers, AdapterPool(layers, self.max_lora_rank))
        self.runtimes[name] = runtime
        return runtime

    def runtime(self, base_model: str) -> ModelRuntime:
        rt = self.runtimes.get(base_model)
        if rt is None:
            raise UserError(f"base model {base_model!r} is not served here (served: {sorted(self.runtimes)})")
        return rt

    def runtime_of(self, model_id: str) -> ModelRuntime:
        name = self.model_of.get(model_id)
        if name is None:
            raise NotFoundError(f"unknown model_id {model_id!r}")
        return self.runtimes[name]

    def step(self, ops: list[EngineOp]) -> list[object]:
        """Run each op; per-op failures become that op's TinkerdError result."""
        results: list[object] = []
        for op in ops:
            try:
                results.append(self._run(op))
            except TinkerdError as e:
                results.append(e)
            except Exception as e:  # a bug must fail one future, not the engine loop
                log.exception("engine op %s failed", type(op).__name__)
                results.append(ServerError(f"{type(e).__name__}: {e}"))
        return results

    def _run(self, op: EngineOp) -> object:
        from tinkerd.engine import ops as engine_ops

        return engine_ops.run(self, op)
