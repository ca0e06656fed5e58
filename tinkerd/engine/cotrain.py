"""forward_backward (and forward) of several training runs in one pass over their shared base model.

The scheduler (control/scheduler.py: Scheduler._together) puts compatible ops of different runs next
to each other in a step's `run` list; `run_ops` runs each such stretch as one pass: the runs' datums
are the rows of one right-padded batch, each run's rows routed to its own adapter slot
(LoraContext.groups), so every base linear of the body runs once for all of them. Everything a run
reduces over stays its own:

- its LoRA delta is computed on its rows cut back to its own width (SlotGroup.width), so d loss / d A
  and d loss / d B sum the same positions in the same order as when its op runs alone (uncut, the
  sums would get the padding's zeros interleaved: on MKL's fp32 sgemm that moved no bit in
  test_cotrain, but a BLAS that blocks a reduction by its length would; the cut also spares the
  LoRA matmuls the padding); runs of one shape get those products as one batched GEMM each
  (engine/lora/batched.py), each run's matrix the product its op alone computes;
- the head's log-softmax and the loss run per run, on its slice of the hidden states, in its own
  blocks (engine/head.py: they depend only on its number of rows), and its loss's gradient flows
  back into its slice only; only the head's GEMMs span the runs (HeadPass with `parts`: each tile
  of the [V, H] weight is streamed once for all runs' blocks, not once per run; per extra run of
  8 tokens on SmolLM2, 1 thread, that was 15-20 ms of the ~80 it added to the pass);
- one backward runs through the body for all runs at once: the base weights are frozen, so nothing
  sums across rows there, and each adapter's grads come only from its own rows;
- the layers whose numbers for a row depend on the other rows of their batch run per run, each on
  its rows at its own width (engine/grouped.py): attention (SDPA, or gpt-oss's eager attention with
  sinks), linear attention (Qwen3.5's Gated DeltaNet); and a MoE's routed experts
  (engine/lora/experts.py) take each run's tokens on an expert as their own GEMMs, in the order its
  op alone has them. Each op's routing metrics count its own real tokens.

What a run shares is the number of rows of the body's frozen GEMMs, which changes no bit of a row
there from 4 rows up; MKL's sgemm takes another kernel below 4 rows (measured on SmolLM2's and the
tiny model's shapes, fp32, one thread: 1-3 rows differ from the same rows inside a bigger batch),
so an op of fewer than 4 tokens runs alone. That is this BLAS on this CPU at one thread: before a
model's first shared pass the engine probes its GEMMs' shapes on the machine it runs on, with its
threads (engine/rowbits.py; MKL at 2 threads rounds GEMMs of 5-7 and 9-11 rows another way too),
and ops join a pass only where neither the pass nor any of them alone has a GEMM of such a row count. The body's elementwise ops also span the runs; a
vectorised exp (SiLU's) rounds the last elements of a tensor that fill no whole vector another way,
but a row of the body is [T, features] with the features a multiple of the vector width, so no row
of a run lands there in one batch and not in the other. On fp32 CPU no bit of any run's logprobs, loss or grads
moves (tests/unit/engine/test_cotrain.py pins it against each op run alone, one torch thread);
another BLAS or a GPU kernel that picks its tiling by the batch may round differently.

Each op is validated alone first, so a bad datum fails only its own op (UserError) and the others
run; a failure of the shared pass itself (out of memory, a bug) falls back to running each op alone,
so one op cannot fail its batch-mates. Checks after the pass (engine/finite.py) are per op too.

Which ops go together (`pass_key`): ForwardBackwardOps on one base model of full-attention layers,
with sliding-window or linear-attention ones beside them (dense, or a MoE of `SHARED_MOE`), with
SDPA attention or gpt-oss's eager one, of distinct runs, all forward_backward or all forward.
Other losses, ranks, lengths and datum counts mix freely: the loss runs per run.

Shapes: B rows (datums of all runs), T widest row, M real positions of all runs, H hidden.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from tinkerd.engine import causal, grouped, head, training
from tinkerd.engine.grouped import GROUPED, AttentionGroup
from tinkerd.engine.head import HeadPass, head_lora
from tinkerd.engine.lora.layers import SlotGroup
from tinkerd.engine.step_bounds import magnitudes
from tinkerd.errors import TinkerdError
from tinkerd.types import ForwardBackwardOp

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine, ModelRuntime

log = logging.getLogger(__name__)


# Below this many tokens an op's body GEMMs take another MKL kernel than in a bigger batch (docstring).
MIN_TOKENS = 4
# MoE families whose shared passes keep each op's bits: MultiLoraExperts splits an expert's tokens
# by run. Not Qwen3.5-MoE: its shared expert and that expert's [H -> 1] gate are GEMMs over all runs'
# flattened tokens, which MKL rounds by the row count (tiny model, 102 against 39 rows: the gate off
# by 3e-8, the expert by 1e-10), and with both run per run the first layer's LoRA grads still moved
# in the last bits (cause not found).
SHARED_MOE = frozenset({"qwen3_moe", "gpt_oss"})
# Families whose eager attention a shared pass runs per run (grouped.grouped_attention): gpt-oss's sinks.
SHARED_EAGER = frozenset({"gpt_oss"})
_SHARED_LAYERS = (frozenset({"full_attention"}), frozenset({"full_attention", "sliding_attention"}),
                  frozenset({"full_attention", "linear_attention"}))


def fusable(rt: "ModelRuntime") -> bool:
    """Whether `rt`'s model can run several adapters' training rows in one pass (module docstring)."""
    family = rt.loaded.family
    impl = rt.model.config._attn_implementation
    return (family.layer_types in _SHARED_LAYERS
            and (family.experts_class is None or family.name in SHARED_MOE)
            and (impl in ("sdpa", causal.IMPLEMENTATION) or impl in GROUPED.values() or (impl == "eager" and family.name in SHARED_EAGER)))


def pass_key(engine: "Engine", op: object) -> tuple[str, bool] | None:
    """(base model, forward_only) of an op that may share a pass with others of the same key (of other
    runs); None for one that runs alone (not a forward_backward, a model without shared passes, or
    under MIN_TOKENS tokens)."""
    if not isinstance(op, ForwardBackwardOp) or engine.group is not None:
        return None  # ranks (engine/sharding.py) split each op's datums between them: no shared pass there
    base = engine.model_of.get(op.model_id)
    rt = engine.runtimes.get(base)
    if rt is None or not fusable(rt) or sum(len(d.tokens) for d in op.data) < MIN_TOKENS:
        return None
    if any(d.images for d in op.data):  # the vision-language body runs per op (training._hidden)
        return None
    if training.own_body(rt, op.data) is not None:  # length buckets or shared prefixes: alone
        return None
    return base, op.forward_only


def passes(engine: "Engine", run: Sequence[tuple[str, object]]) -> list[list[tuple[str, object]]]:
    """`run` split into consecutive stretches that go through one pass each (most are one op): ops of
    one key and of distinct runs, side by side in the order the scheduler put them."""
    out: list[list[tuple[str, object]]] = []
    key, taken = None, set()
    for ticket, op in run:
        mine = pass_key(engine, op)
        if (out and mine is not None and mine == key and op.model_id not in taken
                and _rows_share(engine.runtimes[mine[0]], out[-1], op)):
            out[-1].append((ticket, op))
        else:
            out.append([(ticket, op)])
            key, taken = mine, set()
        taken.add(getattr(op, "model_id", None))
    return out


def _rows_share(rt: "ModelRuntime", stretch: list[tuple[str, object]], op: ForwardBackwardOp) -> bool:
    """Whether `op` may join the pass of `stretch`: no GEMM of that pass, and none of its ops' GEMMs
    alone, has a row count at which this machine's BLAS gives a row other bits than in a big batch
    (rt.odd_rows, probed once per model when a second op first could join a pass: engine/rowbits.py).
    The body's GEMMs have datums x widest datum rows, the head's its blocks' (head.gemm_rows)."""
    odd = rt.odd_rows
    if odd is None:
        return False
    ops = [o for _, o in stretch] + [op]
    tokens = [sum(len(d.tokens) for d in o.data) for o in ops]
    rows = [len(o.data) * max(len(d.tokens) for d in o.data) for o in ops]
    rows.append(sum(len(o.data) for o in ops) * max(len(d.tokens) for o in ops for d in o.data))
    rows += head.gemm_rows(tokens) + [n for m in tokens for n in head.gemm_rows([m])]
    return odd.isdisjoint(rows)


def run_ops(engine: "Engine", run: Sequence[tuple[str, object]], guarded) -> tuple[list[tuple[str, object]], list[int]]:
    """Every op of a step's `run` list, in order: (ticket, result or TinkerdError), and the number of
    ops of each pass that served several (StepOutput.shared_passes). `guarded(fn, op)` is
    Engine._guarded: fn(op) or the error that failed it."""
    done: list[tuple[str, object]] = []
    shared: list[int] = []
    for stretch in passes(engine, run):
        if len(stretch) == 1:
            ticket, op = stretch[0]
            done.append((ticket, guarded(engine._run, op)))
            continue
        results = forward_backward_together(engine, [op for _, op in stretch], guarded, shared)
        done.extend(zip([t for t, _ in stretch], results))
    return done, shared


def forward_backward_together(engine: "Engine", ops: list[ForwardBackwardOp], guarded, shared: list[int]) -> list[object]:
    """One result (or error) per op, each as if it ran alone; the valid ones share one pass, whose
    size is appended to `shared`."""
    rt = engine.runtime_of(ops[0].model_id)
    results: list[object] = [None] * len(ops)
    ready: list[tuple[int, training.Prepared]] = []
    for i, op in enumerate(ops):
        prepared = guarded(lambda o: training.prepare_forward_backward(rt, o), op)
        if isinstance(prepared, TinkerdError):
            results[i] = prepared
        else:
            ready.append((i, prepared))
    if len(ready) == 1:
        i, _ = ready[0]
        results[i] = guarded(engine._run, ops[i])
    elif ready:
        started = time.perf_counter()
        try:
            outputs = _shared_pass(rt, [p for _, p in ready])
        except Exception:  # noqa: BLE001  one op must not fail its batch-mates: each runs alone instead
            log.exception("a forward_backward pass of %d runs failed; running them one by one", len(ready))
            for i, _ in ready:
                results[i] = guarded(engine._run, ops[i])
            return results
        # Every run's max |g| at once: the batched GEMMs' gradients are slices of shared tensors.
        largest = [None] * len(outputs)  # each run measures its own
        if outputs[0][3] is not None:
            try:
                largest = magnitudes([out[3] for out in outputs])
            except Exception:  # noqa: BLE001  a shortcut only: never worth failing the pass's ops
                log.exception("measuring %d runs' gradients at once failed; each run measures its own", len(outputs))
        for (i, prepared), out, most in zip(ready, outputs, largest):
            results[i] = guarded(lambda _: training.finish_forward_backward(prepared, *out, most), ops[i])
        log.info("forward_backward of %d runs in one pass: %d datums, %d tokens, %.1f ms", len(ready),
                 sum(len(p.lengths) for _, p in ready), sum(sum(p.lengths) for _, p in ready),
                 1e3 * (time.perf_counter() - started))
        shared.append(len(ready))
    return results


def _shared_head(rt: "ModelRuntime", hidden: torch.Tensor, parts: list[training.Prepared], forward_only: bool):
    """One HeadPass over every run's rows (engine/head.py: each run's blocks share the head's GEMMs),
    or None where the runs' heads run one by one: off the tiled path, or targets of different shapes."""
    loras = [head_lora(rt, p.adapter.slot) for p in parts]
    targets = [p.inputs["target_tokens"] for p in parts]
    if len({t.shape[1:] for t in targets}) > 1 or not head.tiled(rt, loras):
        return None
    return HeadPass(rt, hidden.detach(), torch.cat(targets), keep=not forward_only,
                    parts=[(int(t.shape[0]), lora) for t, lora in zip(targets, loras)])


def _shared_pass(rt: "ModelRuntime", parts: list[training.Prepared]):
    """(target_logprobs, loss_sum, metrics, grads or None) per part: training._logprobs_and_grads
    with the body shared and everything else per part, in the same order as there."""
    forward_only = parts[0].op.forward_only
    data = [d for p in parts for d in p.op.data]
    input_ids, mask = training.padded_tokens(rt, data)  # [B, T]
    groups, row = [], 0
    for p in parts:
        rows = torch.arange(row, row + len(p.lengths))
        groups.append(SlotGroup(p.adapter.slot, rows, total=len(data), width=max(p.lengths)))
        row += len(p.lengths)
    attention = [AttentionGroup(len(p.lengths), g.width, min(p.lengths) < g.width) for g, p in zip(groups, parts)]
    grouped.install(rt)
    rt.ctx.groups, rt.ctx.blocks = groups, True  # run by run, consecutive rows
    # Each op's MoE routing metrics over its own real tokens, as alone (training.forward_backward).
    real = [torch.zeros_like(mask, dtype=torch.bool) for _ in parts]
    for own, g in zip(real, groups):
        own[g.rows] = mask[g.rows].bool()
    try:
        with torch.set_grad_enabled(not forward_only), rt.routing.counting(*(r.flatten() for r in real)) as routing:
            hidden = training._hidden(rt, input_ids, mask, tinkerd_attention_groups=attention)  # [M, H], run by run
    finally:
        rt.ctx.clear()
    offsets = np.cumsum([0] + [sum(p.lengths) for p in parts])
    spans = [slice(int(offsets[k]), int(offsets[k + 1])) for k in range(len(parts))]
    shared = _shared_head(rt, hidden, parts, forward_only)
    out, g_lps = [], []
    g_hidden = None if forward_only or shared is not None else torch.empty_like(hidden)
    head_grads: list[dict[int, torch.Tensor]] = []  # per part: its head LoRA's grads, by tensor
    for k, p in enumerate(parts):
        own = None if shared is not None else _own_head(rt, hidden[spans[k]], p, forward_only)
        lp = shared.logprobs[spans[k]] if own is None else own.logprobs
        if forward_only:
            loss_sum, metrics = p.loss(lp, p.inputs, p.config)
            out.append((lp, loss_sum, {**metrics, **routing.metrics(k)}, None))
            continue
        lp_leaf = lp.clone().requires_grad_(True)
        loss_sum, metrics = p.loss(lp_leaf, p.inputs, p.config)
        (g_lp,) = torch.autograd.grad(loss_sum, lp_leaf)
        out.append((lp, loss_sum.detach(), {**metrics, **routing.metrics(k)}, None))
        if own is None:
            g_lps.append(g_lp)
            continue
        rt.ctx.set_single(p.adapter.slot)  # its head's backward now: one run's kept logits at a time
        try:
            mine = training._head_lora(rt)
            g_hidden[spans[k]], got = own.backward(g_lp, mine)
        finally:
            rt.ctx.clear()
        head_grads.append({id(t): g for t, g in zip(mine, got)})
    if forward_only:
        return out
    if shared is not None:
        g_hidden, per_part = shared.backward_parts(torch.cat(g_lps))
        for p, got in zip(parts, per_part):
            lora = head_lora(rt, p.adapter.slot)
            head_grads.append({} if got is None else {id(lora[0]): got[0], id(lora[1]): got[1]})
    body = [[t for t in p.adapter.parameters() if id(t) not in grads] for p, grads in zip(parts, head_grads)]
    body_params = [t for b in body for t in b]  # none where every run trains only its head
    flat_grads = torch.autograd.grad(hidden, body_params, grad_outputs=g_hidden, allow_unused=True) if body_params else []
    at = 0
    for k, p in enumerate(parts):
        by_id = head_grads[k] | {id(t): g for t, g in zip(body[k], flat_grads[at : at + len(body[k])])}
        at += len(body[k])
        lp, loss_sum, metrics, _ = out[k]
        out[k] = (lp, loss_sum, metrics, [by_id[id(t)] for t in p.adapter.parameters()])
    return out


def _own_head(rt: "ModelRuntime", hidden: torch.Tensor, p: training.Prepared, forward_only: bool) -> HeadPass:
    """One run's head on its own rows: its LoRA, its blocks (engine/head.py)."""
    rt.ctx.set_single(p.adapter.slot)
    try:
        return HeadPass(rt, hidden.detach(), p.inputs["target_tokens"], keep=not forward_only)
    finally:
        rt.ctx.clear()
