"""One engine over N rank processes: the base model sharded with FSDP2, datums split across ranks.

`tinkerd serve --engine-ranks N` (docs/sharding.md). The engine process of engine/process.py is
rank 0: it talks to control over its pipe as ever, starts ranks 1..N-1 (`python -m
tinkerd.engine.sharding`, each with its own pipe on stdin), and forms a torch.distributed group with
them (gloo on CPU, NCCL for CUDA tensors). Every rank builds the same Engine, then
`fully_shard`s each decoder layer and the decoder around them, so each rank keeps 1/N of the
decoder's weights and all-gathers one layer at a time while it runs. The LM head and the LoRA
adapters are not sharded (the head is called outside the decoder's forward, chunk by chunk, and
FSDP gathers weights only in a module's own forward).

Each step, rank 0 sends the StepBatch to every other rank and all run `Engine.step` in lockstep:
- forward_backward: each rank runs a contiguous block of the datums (`RankGroup.rows`); the target
  log-probs of all ranks are all-gathered, so every rank computes the loss, its metrics and
  d loss / d logprobs on the whole batch exactly as one rank would, and back-propagates its own
  block; the LoRA gradients are then all-reduced (summed). Any Tinker loss works unchanged, as each
  is a function of the target log-probs alone (engine/training.py).
- LoRA weights and AdamW state are replicated: every rank applies the same summed gradients with
  the same AdamW, so they stay equal without a broadcast. A rank-32 adapter is ~1% of its base
  model, so replicating it costs little and makes save, export and snapshots a plain write of
  rank 0's copy, which only rank 0 does (`follower_batch`).
- Sampling runs on every rank with the same requests; the seeds of unseeded requests are drawn on
  rank 0 before sending, so every rank picks the same tokens and runs the same forwards (each a
  round of all-gathers). The HF body path is used (no packed weights, no fused decode: those read
  the weights outside the layers' forward, where FSDP holds only shards).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import signal
import sys
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from tinkerd.engine.followers import Followers
from tinkerd.errors import Category, UserError
from tinkerd.types import ExportWeightsOp, ReleaseAdaptersOp, SampleOp, SaveWeightsOp, StepBatch

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine
    from tinkerd.engine.process import EngineSpec

log = logging.getLogger(__name__)

# Ops that only write files: rank 0 runs them; the other ranks' copies of the adapter are equal.
_WRITE_ONLY = (SaveWeightsOp, ExportWeightsOp)


class RankGroup:
    """This process's place in the engine's rank group, and the collectives training needs."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank = rank
        self.world = world
        self.device = device

    def shard(self, model: torch.nn.Module) -> None:
        """FSDP2 on each decoder layer, then on the decoder (its embedding and final norm)."""
        from torch.distributed.fsdp import fully_shard

        decoder = model.get_decoder()
        for layer in decoder.layers:
            fully_shard(layer)
        fully_shard(decoder)

    def blocks(self, n: int) -> list[tuple[int, int]]:
        """Each rank's contiguous [start, stop) of n datums; a rank beyond n gets an empty block."""
        bounds = np.linspace(0, n, self.world + 1).round().astype(int) if n >= self.world else np.minimum(
            np.arange(self.world + 1), n)
        return [(int(bounds[r]), int(bounds[r + 1])) for r in range(self.world)]

    def rows(self, n: int) -> tuple[int, int]:
        return self.blocks(n)[self.rank]

    def gather(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's `local` [counts[r], ...] concatenated in rank order, on every rank."""
        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    def reduce(self, params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The sum over ranks of each gradient, in one all-reduce over a flat buffer. A gradient no
        rank has (a layer no token reached, say an unrouted expert) stays None, as on one rank: AdamW
        skips a None gradient but would decay and move a zero one."""
        present = torch.tensor([g is not None for g in grads], dtype=torch.float32, device=self.device)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(params, grads)])
        dist.all_reduce(present)
        dist.all_reduce(flat)
        out, at = [], 0
        for p, seen in zip(params, present.tolist()):
            n = p.numel()
            out.append(flat[at: at + n].view_as(p) if seen else None)
            at += n
        return out


class DataParallel:
    """One forward_backward's split over the ranks: this rank's datums, and its positions in the
    batch's [M] (all datums' real positions, datum 0's first) that the loss sees whole."""

    def __init__(self, group: RankGroup, lengths: list[int]):
        self.group = group
        offsets = np.cumsum([0] + lengths)
        blocks = group.blocks(len(lengths))
        self.block = blocks[group.rank]
        self.counts = [int(offsets[b] - offsets[a]) for a, b in blocks]  # positions per rank
        self.start = int(offsets[self.block[0]])
        self.count = self.counts[group.rank]

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole-batch tensor [M, ...]."""
        return full[self.start: self.start + self.count]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return self.group.gather(local, self.counts)

    def reduce(self, params, grads):
        return self.group.reduce(params, grads)


def seeded(batch: StepBatch) -> StepBatch:
    """The batch with a seed drawn for every admitted sample request that has none, so that every
    rank samples the same tokens (rules.row_generators draws fresh randomness for None)."""
    admit = []
    for ticket, op in batch.admit:
        if isinstance(op, SampleOp) and op.params.seed is None:
            op = dataclasses.replace(op, params=dataclasses.replace(op.params, seed=secrets.randbits(63)))
        admit.append((ticket, op))
    return dataclasses.replace(batch, admit=admit)


def follower_batch(batch: StepBatch) -> StepBatch:
    """What ranks 1..N-1 run of a batch: everything that changes state, nothing that writes files."""
    run = []
    for ticket, op in batch.run:
        if isinstance(op, _WRITE_ONLY):
            continue
        if isinstance(op, ReleaseAdaptersOp):
            op = dataclasses.replace(op, models=[(model_id, None) for model_id, _ in op.models])
        elif getattr(op, "snapshot_dir", None) is not None:
            op = dataclasses.replace(op, snapshot_dir=None)
        run.append((ticket, op))
    return dataclasses.replace(batch, run=run)


def _build_engine(spec: "EngineSpec", group: RankGroup) -> "Engine":
    from tinkerd.engine.engine import Engine
    from tinkerd.engine.sampler.sample import SamplerConfig

    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    config = SamplerConfig(kv_cache_bytes=spec.sample_kv_cache_bytes, pack_weights=False, fused_decode=False)
    engine = Engine(spec.models_dir, spec.max_lora_rank, config, spec.precision, spec.artifacts,
                    spec.activation_memory_bytes)
    engine.group = group
    engine.load_base_models(spec.base_models)
    for rt in engine.runtimes.values():
        group.shard(rt.model)
    return engine


def _init_group(rank: int, world: int, store_path: str, precision) -> RankGroup:
    device = precision.torch_device
    if device.type == "cuda":
        precision.check()
        if torch.cuda.device_count() < world:  # NCCL refuses two ranks on one GPU
            raise UserError(f"--engine-ranks {world} with --device cuda needs {world} GPUs; "
                            f"torch sees {torch.cuda.device_count()} here")
        torch.cuda.set_device(rank)  # "cuda" then means this rank's own device
        device = torch.device("cuda", rank)
    # CPU tensors (the CPU engine's, and these collectives' on a CUDA one) over gloo, CUDA ones over NCCL.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    return RankGroup(rank, world, device)


class RankedEngineClient:
    """Rank 0's EngineClient: each step goes to every rank, and rank 0's results come back."""

    def __init__(self, spec: "EngineSpec", followers: Followers):
        from tinkerd.engine.client import InProcessEngineClient

        self.followers = followers
        try:
            group = _init_group(0, spec.ranks, followers.store, spec.precision)
            self.client = InProcessEngineClient(_build_engine(spec, group))
            dist.barrier()  # every rank built and sharded its engine
        except Exception:
            followers.kill()
            raise
        followers.formed()

    def step(self, batch: StepBatch):
        self.followers.check()
        batch = seeded(batch)
        shared = follower_batch(batch)
        self.followers.send(shared)
        out = self.client.step(batch)
        self.followers.check()  # a rank that died in this step failed its collectives: not a result to report
        local = {ticket for ticket, _ in batch.run} - {ticket for ticket, _ in shared.run}
        if broken := group_breaking(out, local):
            log.error("engine rank 0 failed %s; the ranks' collectives no longer pair: stopping the engine",
                      "; ".join(broken))
            self.followers.kill()
            os._exit(1)
        return out

    def models(self):
        return self.client.models()

    def close(self) -> None:
        self.client.close()
        self.followers.close()


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this rank when rank 0 dies (SIGKILLed by control, say), as Linux's PR_SET_PDEATHSIG
    does; a rank left alone would wait for its pipe with its shard of the model in memory."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # rank 0 died before the prctl
        os._exit(1)


def _follower_main() -> None:
    stdin = sys.stdin.buffer
    rank, spec, store, parent_pid = pickle.load(stdin)
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as rank 0: the server stops the engine itself
    logging.basicConfig(level=spec.log_level, **({"format": spec.log_format} if spec.log_format else {}))
    from tinkerd.engine.malloc import keep_freed_memory

    keep_freed_memory()
    group = _init_group(rank, spec.ranks, store, spec.precision)
    engine = _build_engine(spec, group)
    dist.barrier()
    serve_steps(engine, stdin, rank)


def serve_steps(engine: "Engine", stdin, rank: int) -> None:
    """Run rank 0's batches until its pipe closes. A failure that may have left this rank out of a
    collective (group_breaking) ends this process: rank 0's collective then fails at once (the
    peer is gone), and it stops the engine (Followers.check)."""
    while True:
        try:
            batch = pickle.load(stdin)
        except EOFError:
            return
        out = engine.step(batch)
        if broken := group_breaking(out):
            log.error("engine rank %d failed %s; the ranks' collectives no longer pair: stopping", rank,
                      "; ".join(broken))
            os._exit(1)


def group_breaking(out, local: set[str] = frozenset()) -> list[str]:
    """The results of a step that failed for a reason other than their input, except those of ops
    this rank ran alone (`local`: rank 0's file writes).

    A user error (bad input) is found on every rank alike, before the op's collectives, as the
    ranks hold the same ops and state. Anything else (a bug, memory) may have struck this rank alone
    in the middle of an op, leaving it out of a collective the other ranks wait in, or the next
    op's collective paired with this one's: a hang until gloo's 30-minute timeout, or wrong
    numbers. So the engine restarts whole instead (control rebuilds its runs, and the op, a suspect,
    runs alone next and fails with its cause if it dies again: control/crashes.py)."""
    return [f"{ticket} ({result})" for ticket, result in out.done
            if ticket not in local and isinstance(result, Exception)
            and getattr(result, "category", Category.SERVER) != Category.USER]


if __name__ == "__main__":
    _follower_main()
