"""Dispatch from a domain op to the engine function that runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tinkerd.engine import export, training
from tinkerd.engine.sampler import sample
from tinkerd.types import (
    CreateModelOp,
    EngineOp,
    ExportWeightsOp,
    ForwardBackwardOp,
    LoadWeightsOp,
    OptimStepOp,
    ReleaseAdaptersOp,
    SampleOp,
    SaveWeightsOp,
    UnloadModelOp,
)

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine


_HANDLERS = {
    ForwardBackwardOp: training.forward_backward,
    OptimStepOp: training.optim_step,
    CreateModelOp: training.create_model,
    SaveWeightsOp: training.save_weights,
    ExportWeightsOp: export.export_weights,
    LoadWeightsOp: training.load_weights,
    UnloadModelOp: training.unload_model,
    ReleaseAdaptersOp: training.release_adapters,
    SampleOp: sample.run_sample,
}


def run(engine: "Engine", op: EngineOp) -> object:
    handler = _HANDLERS.get(type(op))
    if handler is None:
        raise TypeError(f"unknown engine op {type(op).__name__}")
    return handler(engine, op)
