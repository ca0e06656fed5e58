"""Training ops on one adapter: create, forward_backward, optim_step, save, load, unload.

Every op validates everything it can before it touches the adapter, and forward_backward computes
its gradients into fresh tensors (torch.autograd.grad) that are added to `.grad` only once the
whole batch succeeded: a failed op leaves weights, grads and optimizer state as they were. A step
whose loss, gradients or update are NaN or inf is such a failed op too (engine/finite.py).

Shapes: B datums (rows), T longest datum, M total real positions, V vocab, H hidden, K soft targets.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tinkerd.engine import adam, buckets, checkpoints, datums, finite, prefixes
from tinkerd.engine.head import HeadPass, head_lora
from tinkerd.engine.losses import DATUM_INDEX, LossFn, custom, get_loss
from tinkerd.engine.sharding import DataParallel
from tinkerd.errors import UserError
from tinkerd.types import (
    CreateModelOp,
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoadWeightsOp,
    OptimStepOp,
    ReleaseAdaptersOp,
    SaveWeightsOp,
    UnloadModelOp,
)

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine, ModelRuntime
    from tinkerd.engine.lora.pool import Adapter

log = logging.getLogger(__name__)


def _trainable(engine: "Engine", model_id: str) -> tuple["ModelRuntime", "Adapter"]:
    rt = engine.runtime_of(model_id)
    adapter = rt.pool.get(model_id)
    if not adapter.trainable or adapter.optimizer is None:
        raise UserError(f"model_id {model_id!r} is not a training model")
    return rt, adapter


# ---------------------------------------------------------------------------------------------
# create / unload


def create_model(engine: "Engine", op: CreateModelOp) -> dict:
    rt = engine.runtime(op.base_model)
    if op.model_id in engine.model_of:
        raise UserError(f"model_id {op.model_id!r} already exists")
    rt.pool.create(op.model_id, op.lora, trainable=True)
    engine.model_of[op.model_id] = rt.name
    return {"model_id": op.model_id}


def unload_model(engine: "Engine", op: UnloadModelOp) -> dict:
    rt = engine.runtime_of(op.model_id)
    rt.pool.remove(op.model_id)
    del engine.model_of[op.model_id]
    return {}


def release_adapters(engine: "Engine", op: ReleaseAdaptersOp) -> dict[str, list[str]]:
    """Snapshot, then unload, each training adapter; drop idle sampler adapters. Returns the runs no
    longer loaded (released now, or not here at all) and the sampler keys dropped. An adapter whose
    snapshot cannot be written stays loaded: its state must not be lost."""
    unloaded, samplers = [], []
    engine.snapshots.wait()  # a background write of the very snapshot named here may be in flight
    for model_id, snapshot_dir in op.models:
        if model_id in engine.model_of:
            rt = engine.runtime_of(model_id)
            if snapshot_dir is not None and not engine.artifacts.exists(snapshot_dir):
                try:
                    # Weights and AdamW state equal those right after the op the snapshot is named
                    # after: forward_backward calls since then changed only .grad, which recovery
                    # rebuilds by replaying them.
                    _snapshot(engine, rt.pool.get(model_id), snapshot_dir)
                except Exception:
                    log.exception("not releasing %s: its snapshot could not be written", model_id)
                    continue
            rt.pool.remove(model_id)
            del engine.model_of[model_id]
        unloaded.append(model_id)
    for path in op.sampler_paths:
        if any(rt.pool.evict(path) for rt in engine.runtimes.values()):
            samplers.append(path)
    return {"unloaded": unloaded, "sampler_paths": samplers}


# ---------------------------------------------------------------------------------------------
# forward_backward


def _hidden(rt: "ModelRuntime", input_ids: torch.Tensor, mask: torch.Tensor, images=None, **attention) -> torch.Tensor:
    """The decoder's last hidden state at the M real positions of a right-padded batch: [M, H].
    `images`: each row's ImageInputs (a vision-language model), run through the VLM body, which
    puts the tower's features at the placeholder positions (engine/model/vision.py).
    `attention`: keyword arguments HF hands the attention function (engine/cotrain.py's groups)."""
    if images is not None and any(images):
        extra = rt.loaded.vision.inputs(input_ids, mask, images)
        extra.pop("rope_deltas")
        with rt.recompute.layers(rt, mask.numel()):
            hidden = rt.model.model(input_ids=input_ids, attention_mask=mask, use_cache=False, **extra).last_hidden_state
        return hidden[mask.bool()]
    hidden = _decoder(rt)(input_ids=input_ids, attention_mask=mask, use_cache=False, **attention)  # [B, T, H]
    return hidden[mask.bool()]  # datum 0's positions first


def _decoder(rt: "ModelRuntime"):
    """The text decoder as a training pass calls it: keyword arguments in, last hidden state [B, T, H] out."""
    decoder = rt.model.get_decoder()

    def run(**kwargs) -> torch.Tensor:
        # tinkerd_causal_blocks: causal attention in query blocks on a CPU (engine/causal.py).
        # Each call decides how many of its layers recompute in the backward, for what it and the
        # pass's later calls will hold (engine/recompute.py); a sample's call holds its prompt's
        # cached keys and values too.
        cached = kwargs["attention_mask"].numel() if kwargs.get("cache") is not None else 0
        with rt.recompute.layers(rt, kwargs["input_ids"].numel(), cached):
            return decoder(tinkerd_causal_blocks=True, **kwargs).last_hidden_state

    return run


def _logprobs_and_grads(rt, input_ids, mask, inputs, loss: LossFn, config, params, forward_only: bool, ranks=None,
                        images=None, body=None):
    """Target logprobs, the loss, its metrics, and d loss / d params (None when forward_only).

    Every Tinker loss is a function of the target logprobs alone, so the backward splits at them:
    (1) the head gives the logprobs [M] (engine/head.py: in blocks and tiles, its logits kept or
    recomputed); (2) the loss and its gradient g = d loss / d logprobs; (3) the head's backward
    from g gives d loss / d hidden and the head's own LoRA grads; (4) one backward through the
    decoder from d loss / d hidden.

    With `ranks` (engine/sharding.py: DataParallel) input_ids and mask hold this rank's datums only:
    the logprobs of every rank are gathered before (2), which then runs on the whole batch on every
    rank, and (3)-(4) back-propagate this rank's part of g; the gradients are then summed over ranks.
    """
    targets = inputs["target_tokens"] if ranks is None else ranks.local(inputs["target_tokens"])
    with torch.set_grad_enabled(not forward_only):
        # `body`: the hidden states some other way (own_body: the datums in length buckets, or one
        # row per distinct position with `rows` saying which is whose).
        hidden = _hidden(rt, input_ids, mask, images) if body is None else body(targets)  # [M, H] (or [R, H], rows)
    hidden, rows = hidden if isinstance(hidden, tuple) else (hidden, None)
    m = hidden.shape[0] if ranks is None else ranks.count  # a rank without datums runs one dummy token
    unembed = HeadPass(rt, hidden[:m].detach(), targets if rows is None else targets[rows.first], keep=not forward_only)
    target_logprobs = unembed.logprobs if rows is None else unembed.logprobs[rows.index]
    if ranks is not None:
        target_logprobs = ranks.gather(target_logprobs)
    if forward_only:
        loss_sum, metrics = loss(target_logprobs, inputs, config)
        return target_logprobs, loss_sum, metrics, None
    lp_leaf = target_logprobs.clone().requires_grad_(True)
    loss_sum, metrics = loss(lp_leaf, inputs, config)
    (g_lp,) = torch.autograd.grad(loss_sum, lp_leaf)
    if ranks is not None:
        g_lp = ranks.local(g_lp)
    if rows is not None:  # a shared row's gradient: the sum of its datum positions'
        g_lp = g_lp.new_zeros((m, *g_lp.shape[1:])).index_add_(0, rows.index, g_lp)
    head_params = [p for p in params if any(p is t for t in _head_lora(rt))]
    g_head, head_grads = unembed.backward(g_lp, head_params)
    g_hidden = g_head if m == hidden.shape[0] else torch.cat([g_head, hidden.new_zeros((hidden.shape[0] - m, hidden.shape[1]))])
    body_params = [p for p in params if not any(p is h for h in head_params)]
    # An adapter of the head alone (train_attn and train_mlp off) has nothing in the body to differentiate.
    body_grads = torch.autograd.grad(hidden, body_params, grad_outputs=g_hidden, allow_unused=True) if body_params else []
    by_id = {id(p): g for p, g in zip(head_params, head_grads)} | {id(p): g for p, g in zip(body_params, body_grads)}
    grads = [by_id[id(p)] for p in params]
    if ranks is not None:
        grads = ranks.reduce(params, grads)
    return target_logprobs, loss_sum.detach(), metrics, grads


def _head_lora(rt: "ModelRuntime") -> list[torch.Tensor]:
    """This adapter's LoRA tensors on the unembedding, if it trains it."""
    lora = head_lora(rt)
    return [] if lora is None else [lora[0], lora[1]]


@dataclass
class Prepared:
    """One forward_backward op checked and laid out, nothing run yet (engine/cotrain.py runs several at once)."""

    op: ForwardBackwardOp
    adapter: "Adapter"
    loss: LossFn
    config: object
    bound: object | None  # custom.bind's result for an uploaded loss, which keeps each datum's inputs
    lengths: list[int]
    inputs: dict[str, torch.Tensor]  # [M] / [M, K], on the model's device
    started: float


def prepare_forward_backward(rt: "ModelRuntime", op: ForwardBackwardOp) -> Prepared:
    adapter = rt.pool.get(op.model_id)
    if not op.forward_only and (not adapter.trainable or adapter.optimizer is None):
        raise UserError(f"model_id {op.model_id!r} is not a training model")
    if op.custom_loss is not None:
        # An uploaded loss (custom.py): it checks its own per-datum inputs; the engine reads only
        # the tokens and target_tokens of each datum.
        if not op.data:
            raise UserError("forward_backward needs at least one datum")
        bound = custom.bind(op.custom_loss, op.data)
        loss, data = bound.loss, bound.data
    else:
        bound, loss, data = None, get_loss(op.loss_fn), op.data
    config = loss.resolve_config(op.loss_fn_config)
    per_datum = datums.validate(data, rt, loss)
    if any(d.images for d in op.data) and rt.loaded.vision is None:
        raise UserError(f"base model {rt.name!r} is a text-only model and takes no images")
    lengths = [len(d.tokens) for d in op.data]
    inputs = {k: torch.from_numpy(np.concatenate([x[k] for x in per_datum])) for k in per_datum[0]}  # [M] / [M, K]
    # Which datum each position came from, for losses that aggregate per sequence (gspo).
    inputs[DATUM_INDEX] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [M]
    device = rt.precision.torch_device
    if device.type != "cpu":  # everything the loss sees lives where the model does
        inputs = {k: v.to(device) for k, v in inputs.items()}
    return Prepared(op, adapter, loss, config, bound, lengths, inputs, time.perf_counter())


def padded_tokens(rt: "ModelRuntime", data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor]:
    """One right-padded batch: input_ids and mask [B, T]; pad positions are masked out and never reach the loss.
    No datums (a rank given none, engine/sharding.py): one dummy token keeps it in the FSDP collectives."""
    lengths = [len(d.tokens) for d in data]
    input_ids = torch.zeros(max(len(data), 1), max(lengths, default=1), dtype=torch.long)  # [B, T]
    mask = torch.zeros(max(len(data), 1), max(lengths, default=1), dtype=torch.long)  # [B, T]
    if not data:
        mask[0, 0] = 1
    for row, d in enumerate(data):
        # np.array copies: decoded wire buffers are read-only and torch warns on those.
        input_ids[row, : lengths[row]] = torch.from_numpy(np.array(d.tokens, dtype=np.int64))
        mask[row, : lengths[row]] = 1
    device = rt.precision.torch_device
    return (input_ids.to(device), mask.to(device)) if device.type != "cpu" else (input_ids, mask)


def forward_backward(engine: "Engine", op: ForwardBackwardOp) -> ForwardBackwardResult:
    rt = engine.runtime_of(op.model_id)
    p = prepare_forward_backward(rt, op)
    # With several ranks (engine/sharding.py) this rank's block of datums; the loss sees them all.
    ranks = None if engine.group is None else DataParallel(engine.group, p.lengths)
    mine = op.data if ranks is None else op.data[slice(*ranks.block)]
    body = own_body(rt, mine) if ranks is None else None
    input_ids, mask = padded_tokens(rt, mine) if body is None else (None, None)
    rt.ctx.set_single(p.adapter.slot)
    try:
        # Into fresh tensors first: .grad is touched only after the whole batch succeeded.
        # MoE layers count their routing of the real tokens meanwhile (none for a dense model).
        with rt.routing.counting(None if mask is None else mask.flatten().bool()) as routing:
            target_logprobs, loss_sum, metrics, grads = _logprobs_and_grads(
                rt, input_ids, mask, p.inputs, p.loss, p.config, p.adapter.parameters(), op.forward_only, ranks,
                [d.images for d in mine], body,
            )
        metrics = {**metrics, **routing.metrics()}  # the SDK's e_frac_with_tokens:mean etc.
    finally:
        rt.ctx.clear()
    return finish_forward_backward(p, target_logprobs, loss_sum, metrics, grads)


def own_body(rt: "ModelRuntime", data: list[Datum]):
    """How the decoder runs an op's datums when not as one padded batch, as `body(targets)` for
    _logprobs_and_grads, or None: datums that share their first tokens run them once
    (engine/prefixes.py); else datums of very different lengths run in length buckets
    (engine/buckets.py). Either lays out rows by the op's own datums, so such an op runs alone
    (cotrain.pass_key)."""
    if prefixes.eligible(rt, data) and (shared := prefixes.plan(data)) is not None:
        return lambda targets: prefixes.hidden(rt, data, shared, targets, _decoder(rt))
    if buckets.eligible(rt, data) and (groups := buckets.plan([len(d.tokens) for d in data])) is not None:
        return lambda targets: _bucketed_hidden(rt, data, groups)
    return None


def _bucketed_hidden(rt: "ModelRuntime", data: list[Datum], groups: list[list[int]]) -> torch.Tensor:
    """[M, H] in datum order, the decoder run once per bucket of datums (engine/buckets.py)."""
    pieces: list[torch.Tensor | None] = [None] * len(data)
    with rt.recompute.whole_pass(sum(len(g) * max(len(data[i].tokens) for i in g) for g in groups)):
        for group in groups:
            hidden = _hidden(rt, *padded_tokens(rt, [data[i] for i in group]))  # [M_g, H], the bucket's order
            for i, piece in zip(group, torch.split(hidden, [len(data[i].tokens) for i in group])):
                pieces[i] = piece
    return torch.cat(pieces)


def finish_forward_backward(p: Prepared, target_logprobs, loss_sum, metrics, grads,
                            measured: float | None = None) -> ForwardBackwardResult:
    """Check the pass's numbers, add its gradients to the adapter's .grad, and build the result.
    `measured`: max |g| over `grads`, when taken already (engine/cotrain.py)."""
    op, adapter, inputs, lengths = p.op, p.adapter, p.inputs, p.lengths
    batch, params = len(lengths), adapter.parameters()
    offsets = np.cumsum([0] + lengths)
    largest = None  # max |g| of this batch's gradients, once checked
    if grads is not None and not op.allow_non_finite:
        # Forward-only passes change nothing, so a NaN loss there is reported as it is.
        def per_datum_loss(i: int) -> torch.Tensor:
            rows = slice(int(offsets[i]), int(offsets[i + 1]))
            if p.bound is not None:  # a custom loss keeps each datum's own inputs
                return p.bound.datum_loss(i, target_logprobs[rows])
            alone = {k: v[rows] for k, v in inputs.items()} | {
                DATUM_INDEX: torch.zeros(lengths[i], dtype=torch.long, device=target_logprobs.device)}
            return p.loss(target_logprobs[rows], alone, p.config)[0]

        largest = finite.check_forward_backward(adapter, loss_sum, batch, per_datum_loss, params, grads, measured)

    if grads is not None:
        with torch.no_grad():
            for param, g in zip(params, grads):
                if g is not None:
                    adam.add_grad(param, g)
        finite.note_grad_bound(adapter, adapter.pending_grads, largest)
        adapter.pending_grads += 1

    logprobs = target_logprobs.detach().cpu().numpy().astype(np.float32, copy=False)
    outputs = [{"logprobs": logprobs[offsets[i] : offsets[i + 1]].copy()} for i in range(batch)]
    log.debug(
        "forward_backward model=%s datums=%d tokens=%d forward_only=%s %.1f ms",
        op.model_id, batch, int(offsets[-1]), op.forward_only, 1e3 * (time.perf_counter() - p.started),
    )
    return ForwardBackwardResult(loss_fn_outputs=outputs, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# optim_step


def optim_step(engine: "Engine", op: OptimStepOp) -> dict[str, float]:
    _, adapter = _trainable(engine, op.model_id)
    p = op.adam_params
    adam.check_params(p)
    optimizer = adapter.optimizer
    # Bounds are kept again only by a step that succeeds (proven or checked); after a refused one,
    # the next step measures anew.
    held = adapter.extra.pop(finite.BOUNDS, None)
    undo = bounds = None
    if not op.allow_non_finite:
        largest_grad = finite.check_grads_before_step(adapter)
        bounds = finite.proven_step(adapter, held, largest_grad, p)
        if bounds is None:
            undo = finite.StepUndo(adapter)  # before the hyperparameters below are set
    # The SDK sends AdamParams whole with every step (schedules live client-side), so each step
    # overwrites the group's hyperparameters rather than keeping the ones of creation time.
    for group in optimizer.param_groups:
        group["lr"] = p.learning_rate
        group["betas"] = (p.beta1, p.beta2)
        group["eps"] = p.eps
        group["weight_decay"] = p.weight_decay
    try:
        if p.grad_clip_norm > 0:
            # Canonical order, so a run restored from a checkpoint sums the same norms in the same order.
            grads = [t for t in checkpoints.canonical_params(adapter) if t.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, p.grad_clip_norm, foreach=True)
        optimizer.step()
        bad = None
        if undo is not None:
            bounds, bad = finite.check_step_result(adapter)
    except RuntimeError as e:
        # AdamW fails part-way, after the moments moved, when a scalar does not fit fp32: learning_rate
        # 1e39 as a step size ("value cannot be converted to type float without overflow").
        if undo is not None:
            undo.restore()
        if "overflow" not in str(e):
            raise
        outcome = ("was not applied and the adapter is unchanged" if undo is not None else
                   "stopped part-way (with --allow-non-finite no copy is kept to restore)")
        raise UserError(f"the update overflows fp32 (learning_rate={p.learning_rate:g}: {e}); the optim_step "
                        f"{outcome}") from e
    if bad is not None:
        undo.restore()
        raise UserError(
            f"the update would make {bad[0]} {bad[1]} (learning_rate={p.learning_rate:g}, eps={p.eps:g}, "
            f"weight_decay={p.weight_decay:g}); the optim_step was not applied and the adapter's weights, "
            f"gradients and optimizer state are unchanged {finite.OPT_OUT}"
        )
    if bounds is not None:
        adapter.extra[finite.BOUNDS] = bounds
    optimizer.zero_grad(set_to_none=True)
    adapter.step += 1
    adapter.pending_grads = 0
    adapter.extra.pop(finite.GRAD_BOUND, None)
    if op.snapshot_dir is not None:
        _after_op_snapshot(engine, adapter, op.snapshot_dir, background=True)
    return {}


def _snapshot(engine: "Engine", adapter: "Adapter", key: str) -> None:
    """A recovery point (artifact `key`, `.../<model_id>/seq-<n>`): weights, AdamW state and step as
    of a load or release, on disk before this returns (engine/snapshots.py says why these two)."""
    engine.snapshots.write_now(key, adapter, engine.runtime_of(adapter.key).name)


def _after_op_snapshot(engine: "Engine", adapter: "Adapter", dir_path: str, background: bool = False) -> None:
    """A snapshot after an op that already changed the adapter: a failure to write it must not fail
    the op (failed ops are never replayed, so recovery would lose the change); recovery then uses
    the snapshot before it, plus the log. `background`: only the copy is taken now, the write runs
    beside the next ops (after an optim_step: engine/snapshots.py)."""
    try:
        if background:
            engine.snapshots.write_later(dir_path, adapter, engine.runtime_of(adapter.key).name)
        else:
            _snapshot(engine, adapter, dir_path)
    except Exception:
        log.exception("recovery snapshot %s of %s failed", dir_path, adapter.key)


# ---------------------------------------------------------------------------------------------
# save / load


def save_weights(engine: "Engine", op: SaveWeightsOp) -> dict[str, int]:
    rt = engine.runtime_of(op.model_id)
    adapter = rt.pool.get(op.model_id)
    size_bytes = checkpoints.save_adapter_to(engine.artifacts, op.dir_path, adapter, rt.name, op.with_optimizer)
    return {"size_bytes": size_bytes}


def _load_in_place(engine: "Engine", op: LoadWeightsOp, files: checkpoints.AdapterFiles) -> None:
    rt, adapter = _trainable(engine, op.model_id)
    if files.base_model != rt.name:
        raise UserError(f"checkpoint was trained on {files.base_model!r}, but model {op.model_id!r} uses {rt.name!r}")
    spec = adapter.spec
    files.weights = checkpoints.onto_layers(files.weights, rt.pool.layers)
    if (files.spec.rank, files.spec.alpha) != (spec.rank, spec.alpha) or set(files.weights) != set(adapter.weights):
        raise UserError(
            f"checkpoint LoRA config (rank {files.spec.rank}, alpha {files.spec.alpha}, {len(files.weights)} layers) "
            f"does not match model {op.model_id!r} (rank {spec.rank}, alpha {spec.alpha}, {len(adapter.weights)} layers)"
        )
    for name, (a, b) in files.weights.items():
        cur_a, cur_b = adapter.weights[name]
        if a.shape != cur_a.shape or b.shape != cur_b.shape:
            raise UserError(f"checkpoint LoRA shapes for {name} do not fit this base model")
    # Built before any mutation: a state that does not fit fails here with the adapter intact.
    optimizer = checkpoints.new_optimizer(adapter, files.optimizer_state if op.with_optimizer else None)
    with torch.no_grad():
        for name, (a, b) in files.weights.items():
            cur_a, cur_b = adapter.weights[name]
            cur_a.copy_(a)
            cur_b.copy_(b)
            cur_a.grad = None
            cur_b.grad = None
    adapter.optimizer = optimizer
    adapter.step = files.step if op.with_optimizer else 0
    adapter.pending_grads = 0
    adapter.extra.pop(finite.GRAD_BOUND, None)


def _load_as_new(engine: "Engine", op: LoadWeightsOp, files: checkpoints.AdapterFiles) -> None:
    base_model = op.base_model or files.base_model
    if files.base_model != base_model:
        raise UserError(f"checkpoint was trained on {files.base_model!r}, not on {base_model!r}")
    rt = engine.runtime(base_model)
    files.weights = checkpoints.onto_layers(files.weights, rt.pool.layers)
    # Same tensor order as a freshly created adapter, so both behave identically bit for bit.
    weights = {n: files.weights[n] for n in rt.pool.layers if n in files.weights}
    unknown = sorted(set(files.weights) - set(weights))
    if unknown:
        raise UserError(f"checkpoint has LoRA weights for layers {rt.name!r} lacks: {unknown[:3]}")
    if files.spec.rank < 1:  # the upper bound is admission's (api): a recovery snapshot may exceed today's
        raise UserError(f"checkpoint LoRA rank {files.spec.rank} is below 1")
    adapter = rt.pool.create_from_tensors(op.model_id, files.spec, weights, trainable=True)
    try:
        adapter.optimizer = checkpoints.new_optimizer(adapter, files.optimizer_state if op.with_optimizer else None)
    except Exception:
        rt.pool.remove(op.model_id)
        raise
    adapter.step = files.step if op.with_optimizer else 0
    engine.model_of[op.model_id] = rt.name


def load_weights(engine: "Engine", op: LoadWeightsOp) -> dict:
    files = checkpoints.read_adapter_from(engine.artifacts, op.dir_path)
    if op.with_optimizer and files.optimizer_state is None:
        raise UserError(f"checkpoint at {op.dir_path!r} has no optimizer state (a sampler or exported checkpoint?)")
    if op.model_id in engine.model_of:
        _load_in_place(engine, op, files)
    else:
        _load_as_new(engine, op, files)
    if op.snapshot_dir is not None:
        _after_op_snapshot(engine, engine.runtime_of(op.model_id).pool.get(op.model_id), op.snapshot_dir)
    return {"model_id": op.model_id}
