"""What control does when an accepted op succeeded in the engine: its bookkeeping and its usage.

Both are functions of the op's stored record (control/oplog.py) and the engine's result, so an op
re-queued after a restart does exactly what it would have done: no closure from the request that
brought it is needed. Runs on the worker thread (control/results.py), where whether a sampler is
still in use is exact.
"""

from __future__ import annotations

from typing import Any, Callable

from tinkerd.control import inflight
from tinkerd.control.metering import Billing, Usage
from tinkerd.control.oplog import CreateSampler, OpRecord, OpType, RegisterCheckpoint
from tinkerd.control.ids import parse_tinker_path
from tinkerd.control.runs import Runs
from tinkerd.errors import ServerError
from tinkerd.types import ForwardBackwardOp, SampleOp

# Op types whose domain result is the engine's own (a ForwardBackwardResult, a SampleResult).
ENGINE_RESULTS = (OpType.FORWARD, OpType.FORWARD_BACKWARD, OpType.SAMPLE)


class Bookkeeper:
    def __init__(self, runs: Runs | None, ephemeral_samplers_kept: int, busy: Callable[[str], bool]):
        self.runs = runs
        self.ephemeral_samplers_kept = ephemeral_samplers_kept
        self.busy = busy

    def outcome(self, record: OpRecord, result: Any) -> Any:
        """Apply the op's effect; returns its domain result (encoded to the wire at retrieve time)."""
        if record.op_type in ENGINE_RESULTS:
            return result
        if record.op_type == OpType.OPTIM_STEP:
            return {"metrics": dict(result or {})}
        out = dict(record.reply)
        effect = record.effect
        if effect is not None and self.runs is None:
            raise ServerError(f"{record.op_type.value} has bookkeeping to do and this control plane has no runs")
        if isinstance(effect, RegisterCheckpoint):
            row = self.runs.checkpoints.register_checkpoint(parse_tinker_path(effect.path), effect.ttl_seconds, effect.user_metadata)
            if record.op_type == OpType.SAVE_WEIGHTS_EXTERNAL:
                out["size_bytes"] = row.size_bytes
        elif isinstance(effect, CreateSampler) and effect.inflight_of is not None:
            inflight.publish(self.runs, effect, self.ephemeral_samplers_kept, self.busy)
        elif isinstance(effect, CreateSampler):
            self.runs.sampling_sessions.create_sampling_session(effect.session_id, effect.sampling_session_seq_id, effect.base_model,
                                              None, effect.adapter_dir, accepted=True)
            # An RL loop writes one of these per step: the session's older ones go.
            self.runs.sampling_sessions.prune_ephemeral_samplers(effect.session_id, self.ephemeral_samplers_kept, self.busy)
        return out


def billing(record: OpRecord) -> Billing | None:
    """The op's Billing, its usage counted from the op and its result; None when nobody pays."""
    if record.payer is None:
        return None
    p = record.payer
    return Billing(p.account_id, p.session_id, p.base_model, lambda result: usage(record, result))


def usage(record: OpRecord, result: Any) -> Usage:
    op = record.op
    if isinstance(op, ForwardBackwardOp):
        n = target_tokens(op)
        return Usage(forward_tokens=n) if op.forward_only else Usage(trained_tokens=n)
    if isinstance(op, SampleOp):
        # Prefill is billed once per request (the prompt is encoded once for all num_samples).
        return Usage(prefill_tokens=len(op.prompt), sampled_tokens=sum(len(s.tokens) for s in result.sequences))
    if isinstance(record.effect, RegisterCheckpoint):  # an ephemeral sampler is no checkpoint
        return Usage(checkpoints=1)
    return Usage()


def target_tokens(op: ForwardBackwardOp) -> int:
    """Target positions of a forward(_backward): what training is billed by."""
    return sum(len(d.loss_fn_inputs["target_tokens"]) if "target_tokens" in d.loss_fn_inputs else len(d.tokens)
               for d in op.data)
