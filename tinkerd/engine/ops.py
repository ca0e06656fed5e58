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
    SampleOp,
    SaveWeightsOp,
    UnloadModelOp,
)

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine


def run(engine: "Engine", op: EngineOp) -> object:
    if isinstance(op, ForwardBackwardOp):
        return training.forward_backward(engine, op)
    if isinstance(op, OptimStepOp):
        return training.optim_step(engine, op)
    if isinstance(op, CreateModelOp):
        return training.create_model(engine, op)
    if isinstance(op, SaveWeightsOp):
        return training.save_weights(engine, op)
    if isinstance(op, ExportWeightsOp):
        return export.export_weights(engine, op)
    if isinstance(op, LoadWeightsOp):
        return training.load_weights(engine, op)
    if isinstance(op, UnloadModelOp):
        return training.unload_model(engine, op)
    if isinstance(op, SampleOp):
        return sample.run_sample(engine, op)
    raise TypeError(f"unknown engine op {type(op).__name__}")
