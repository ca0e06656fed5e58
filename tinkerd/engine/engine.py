"""The compute plane: one Engine per process, owning the loaded base models and their adapters.

`Engine.step(batch)` executes what control's scheduler picked for one step (a `StepBatch`): ops
that run to completion (training, checkpoints, adapters), sampling requests that join the decode
batch, and one decode step of every in-flight sampling row. It returns the results that finished
in this step (`StepOutput`), each the op's result object or the TinkerdError that failed it, and
how many sampling rows are still in flight. A bad op fails alone; the loop goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from tinkerd.artifacts import ArtifactStore, LocalArtifactStore
from tinkerd.engine import causal, cotrain, head, rowbits
from tinkerd.engine.lora import packed_head
from tinkerd.engine.lora.experts import ExpertsRouting, wrap_experts
from tinkerd.engine.lora.layers import LoraContext, MultiLoraLinear, wrap_model, targets_for
from tinkerd.engine.lora.pool import AdapterPool
from tinkerd.engine.model.registry import LoadedModel, load_model
from tinkerd.engine.precision import Precision
from tinkerd.engine.recompute import Recompute
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig
from tinkerd.engine.snapshots import SnapshotWriter
from tinkerd.errors import NotFoundError, ServerError, TinkerdError, UserError
from tinkerd.types import EngineOp, Resident, StepBatch, StepOutput

log = logging.getLogger(__name__)


@dataclass
class ModelRuntime:
    """A base model loaded once, wrapped with multi-LoRA layers, and its adapter pool."""

    loaded: LoadedModel
    ctx: LoraContext
    layers: dict[str, MultiLoraLinear]  # the Linears only (the sampler packs these); the pool also holds experts
    pool: AdapterPool
    routing: ExpertsRouting = field(default_factory=ExpertsRouting)  # MoE router counts, off unless asked
    precision: Precision = Precision()  # device and compute dtype (engine/precision.py)
    # Where sampler checkpoints are read from (the engine's store, tinkerd/artifacts.py).
    artifacts: ArtifactStore = field(default_factory=lambda: LocalArtifactStore("/"))
    # engine/rowbits.py's verdicts by torch thread count (odd_rows).
    odd_rows_by_threads: dict[int, frozenset[int] | None] = field(default_factory=dict, repr=False)
    # When a training pass recomputes its layers' activations in the backward (engine/recompute.py).
    recompute: Recompute = field(default_factory=Recompute)

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().out_features

    @property
    def odd_rows(self) -> frozenset[int] | None:
        """Row counts at which this machine's GEMMs give a row of this model other bits than in a big
        batch, at the current thread count, which no GEMM of a shared training pass may have
        (engine/cotrain.py); None: no shared pass here. Probed on first use (engine/rowbits.py)."""
        threads = torch.get_num_threads()
        if threads not in self.odd_rows_by_threads:
            self.odd_rows_by_threads[threads] = rowbits.odd_rows(self)
        return self.odd_rows_by_threads[threads]

    @cached_property
    def tokenizer(self):
        """The base model's tokenizer, loaded on first use (sampling stop strings) and kept."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.loaded.tokenizer_dir)


class Engine:
    def __init__(self, models_dir: Path, max_lora_rank: int = 256, sampler_config: SamplerConfig = SamplerConfig(),
                 precision: Precision = Precision(), artifacts: ArtifactStore | None = None,
                 activation_memory_bytes: int | None = None):
        self.models_dir = Path(models_dir)
        # Checkpoints, snapshots and exports, by the keys ops carry (tinkerd/artifacts.py). None: keys
        # are absolute paths (tests and tools that hold an Engine); a server passes its store.
        self.artifacts = artifacts if artifacts is not None else LocalArtifactStore("/")
        # Recovery snapshots after optim_steps are written by a background thread (engine/snapshots.py).
        self.snapshots = SnapshotWriter(self.artifacts)
        self.precision = precision
        self.max_lora_rank = max_lora_rank
        self.sampler_config = sampler_config
        # What a training pass's activations may hold before its layers recompute (engine/recompute.py).
        self.activation_memory_bytes = activation_memory_bytes
        self.runtimes: dict[str, ModelRuntime] = {}
        # Base model name -> its continuous decode batch, created on the first sampling request.
        self.samplers: dict[str, Sampler] = {}
        # model_id -> base model name, so ops that name only a model_id find their runtime.
        self.model_of: dict[str, str] = {}
        # Base models asked for and not loaded -> the reason (a family tinkerd does not serve, a
        # missing directory): reported by name, and the others are served all the same.
        self.refused: dict[str, str] = {}
        # This process's rank group when the engine spans several (engine/sharding.py); None: alone.
        self.group = None

    def load_base_models(self, names) -> None:
        """Load each of `names`; one that fails is logged once and left out, not fatal. Only when
        none of them loads does this raise, with every reason (the server would serve nothing)."""
        for name in names:
            t0 = time.monotonic()
            try:
                self.load_base_model(name)
            except Exception as e:
                reason = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
                if not isinstance(e, TinkerdError):  # a user-facing reason needs no traceback; a bug does
                    log.exception("loading base model %s failed", name)
                log.warning("base model %s is not served: %s", name, reason)
                self.refused[name] = reason
                continue
            log.info("loaded base model %s in %.1f s", name, time.monotonic() - t0)
        if not self.runtimes and self.refused:
            if len(self.refused) == 1:
                raise UserError(next(iter(self.refused.values())))
            raise UserError("no base model could be loaded: " + "; ".join(f"{n}: {r}" for n, r in self.refused.items()))

    def load_base_model(self, name: str) -> ModelRuntime:
        if name in self.runtimes:
            return self.runtimes[name]
        self.precision.check()
        loaded = load_model(name, self.models_dir, self.precision)
        for p in loaded.model.parameters():
            p.requires_grad_(False)
        loaded.model.eval()
        ctx = LoraContext()
        routing = ExpertsRouting()
        # The fused experts first: their own layer (lora/experts.py), not Linears wrap_model finds.
        experts = wrap_experts(loaded.model, ctx, loaded.family.experts_class, routing)
        if loaded.family.experts_class and not experts:
            # E.g. a quantized gpt-oss whose experts transformers swapped for another class: serving
            # it would train no expert LoRA without a word.
            raise UserError(f"base model {name!r} has no {loaded.family.experts_class} module to put expert LoRA on "
                            f"(a quantized checkpoint's experts are not served; load it dequantized)")
        layers = wrap_model(loaded.model, ctx, targets_for(True, True, True))
        packed_head.install(loaded.model, self.precision.device, head.chunk_rows(loaded.model.get_output_embeddings().out_features))
        causal.install(loaded.model)
        pool = AdapterPool({**layers, **experts}, self.max_lora_rank, device=self.precision.torch_device)
        runtime = ModelRuntime(loaded, ctx, layers, pool, routing, self.precision, self.artifacts,
                               recompute=Recompute(self.activation_memory_bytes))
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

    def sampler(self, base_model: str) -> Sampler:
        if base_model not in self.samplers:
            self.samplers[base_model] = Sampler(self.runtime(base_model), self.sampler_config)
        return self.samplers[base_model]

    def run_ops(self, ops: list[EngineOp]) -> list[object]:
        """Run `ops` to completion in one StepBatch; one result (or TinkerdError) per op, in order.
        For tests and tools that hold an Engine; control goes through its EngineClient
        (control/engines.py: run_ops), which takes StepBatch only."""
        tickets = [f"sync-{i}" for i in range(len(ops))]
        done = dict(self.step(StepBatch(run=list(zip(tickets, ops)))).done)
        return [done[t] for t in tickets]

    def step(self, batch: StepBatch) -> StepOutput:
        """One step of what the scheduler picked; returns every result that finished in it."""
        # Adjacent forward_backward ops of several runs go through one pass (engine/cotrain.py).
        done, shared_passes = cotrain.run_ops(self, batch.run, self._guarded)
        for ticket, op in batch.admit:
            error = self._guarded(lambda o: self.sampler(o.base_model).admit(ticket, o), op)
            if error is not None:  # a bad request fails at once and never enters the batch
                done.append((ticket, error))
        for ticket in batch.cancel:  # after admission: a request admitted in this very step can go too
            for sampler in self.samplers.values():
                done.extend(sampler.cancel(ticket))
        if batch.decode:
            for sampler in self.samplers.values():
                done.extend(sampler.step())
        return StepOutput(done, active_rows=sum(s.active_rows for s in self.samplers.values()), resident=self.resident(),
                          partial=[p for s in self.samplers.values() for p in s.take_streamed()],
                          shared_passes=shared_passes, snapshot_s=self.snapshots.take_spent())

    def close(self) -> None:
        """Finish the snapshot write in flight (a clean stop leaves no temp dir to sweep)."""
        self.snapshots.close()

    def resident(self) -> Resident:
        """The adapters held now: training ones counted, sampler ones by key."""
        adapters = [a for rt in self.runtimes.values() for a in rt.pool.adapters.values()]
        return Resident(training=sum(a.trainable for a in adapters),
                        sampler_paths=tuple(a.key for a in adapters if not a.trainable),
                        kv_cache_bytes=sum(s.kv_cache_bytes() for s in self.samplers.values()),
                        kv_cache_budget_bytes=sum(s.kv_budget for s in self.samplers.values()),
                        recomputed_layers=sum(rt.recompute.replayed for rt in self.runtimes.values()))

    def _guarded(self, fn, op: EngineOp) -> object:
        """fn(op), or the error that failed it: a bug must fail one future, not the engine loop."""
        try:
            return fn(op)
        except TinkerdError as e:
            return e
        except Exception as e:
            log.exception("engine op %s failed", type(op).__name__)
            return ServerError(f"{type(e).__name__}: {e}")

    def _run(self, op: EngineOp) -> object:
        from tinkerd.engine import ops as engine_ops

        return engine_ops.run(self, op)
