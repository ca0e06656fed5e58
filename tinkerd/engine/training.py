"""Training ops on one adapter: create, forward_backward, optim_step, save, load, unload.

Every op validates everything it can before it touches the adapter, and forward_backward computes
its gradients into fresh tensors (torch.autograd.grad) that are added to `.grad` only once the
whole batch succeeded: a failed op leaves weights, grads and optimizer state as they were. A step
whose loss, gradients or update are NaN or inf is such a failed op too (engine/finite.py).

Shapes: B datums (rows), T longest datum, M total real positions, V vocab, H hidden, K soft targets.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tinkerd.engine import checkpoints, finite
from tinkerd.engine.losses import DATUM_INDEX, LossFn, custom, get_loss
from tinkerd.errors import UserError
from tinkerd.types import (
    AdamParams,
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
    for model_id, snapshot_dir in op.models:
        if model_id in engine.model_of:
            rt = engine.runtime_of(model_id)
            if snapshot_dir is not None and not Path(snapshot_dir).is_dir():
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


def _validate_datum(i: int, datum: Datum, loss: LossFn, vocab_size: int, max_context: int) -> dict[str, np.ndarray]:
    """Check one datum; returns its loss inputs converted (target_tokens int64, the rest fp32)."""
    tokens = np.asarray(datum.tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise UserError(f"datum {i}: model_input must be a non-empty 1-D token list, got shape {list(tokens.shape)}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"datum {i}: model_input tokens must be integers, got {tokens.dtype}")
    n = tokens.shape[0]
    if n > max_context:
        raise UserError(f"datum {i}: {n} tokens exceed the model's context length of {max_context}")
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        raise UserError(f"datum {i}: token id {int(tokens[bad][0])} is outside the vocabulary [0, {vocab_size})")

    given = datum.loss_fn_inputs
    missing = [k for k in loss.required_inputs if k not in given]
    if missing:
        raise UserError(f"datum {i}: loss_fn {loss.name} requires loss_fn_inputs {missing}")
    unknown = sorted(set(given) - set(loss.accepted_inputs))
    if unknown:
        accepted = ", ".join(loss.accepted_inputs)
        raise UserError(f"datum {i}: loss_fn_inputs {unknown} are not used by {loss.name} (accepted: {accepted})")
    targets = np.asarray(given["target_tokens"])
    if targets.ndim not in (1, 2) or targets.shape[0] != n or (targets.ndim == 2 and targets.shape[1] == 0):
        raise UserError(
            f"datum {i}: target_tokens has shape {list(targets.shape)}; expected [{n}] or [{n}, K] to match {n} input tokens"
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise UserError(f"datum {i}: target_tokens must be integers, got {targets.dtype}")
    bad = (targets < 0) | (targets >= vocab_size)
    if bad.any():
        token = int(targets[bad][0])
        raise UserError(f"datum {i}: target token id {token} is outside the vocabulary [0, {vocab_size})")

    out = {"target_tokens": targets.astype(np.int64, copy=False)}
    for key, value in given.items():
        if key == "target_tokens":
            continue
        arr = np.asarray(value)
        # Every registered loss aligns its inputs with the targets position by position.
        if arr.shape != targets.shape:
            raise UserError(f"datum {i}: {key} has shape {list(arr.shape)} but target_tokens has {list(targets.shape)}")
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise UserError(f"datum {i}: {key} must be numeric, got {arr.dtype}")
        arr = arr.astype(np.float32, copy=False)
        if not np.isfinite(arr).all():
            raise UserError(f"datum {i}: {key} contains NaN or infinite values")
        out[key] = arr
    if loss.recorded_input is not None:
        # The server's record, resolved from the datum's provenance by control/stability.py; NaN
        # marks the positions that are not sampled tokens, so no finiteness check here.
        recorded = datum.sampler_logprobs
        if recorded is None:
            raise UserError(f"datum {i}: loss_fn {loss.name} needs provenance naming the sampled sequences "
                            "(Datum.with_provenance with sequence_ids from a record_stability_info sampler)")
        recorded = np.asarray(recorded, dtype=np.float32)
        if recorded.shape != (n,) or targets.ndim != 1:
            raise UserError(f"datum {i}: {loss.name} needs 1-D target_tokens of length {n} "
                            f"(got {list(targets.shape)}) covered by recorded log-probs of shape [{n}]")
        out[loss.recorded_input] = recorded
    return out


def _validate(data: list[Datum], rt: "ModelRuntime", loss: LossFn) -> list[dict[str, np.ndarray]]:
    if not data:
        raise UserError("forward_backward needs at least one datum")
    vocab_size, max_context = rt.vocab_size, rt.loaded.max_context_length
    inputs = [_validate_datum(i, d, loss, vocab_size, max_context) for i, d in enumerate(data)]
    # The loss sees all positions concatenated, so every datum must share the trailing target shape.
    trailing = inputs[0]["target_tokens"].shape[1:]
    for i, x in enumerate(inputs):
        if x["target_tokens"].shape[1:] != trailing:
            raise UserError(
                f"datum {i}: target_tokens trailing shape {list(x['target_tokens'].shape[1:])} differs from "
                f"datum 0's {list(trailing)}; one request must use one target shape"
            )
        present = sorted(k for k in x if k in loss.optional_inputs)
        first = sorted(k for k in inputs[0] if k in loss.optional_inputs)
        if present != first:
            raise UserError(
                f"datum {i}: loss_fn_inputs {present} differ from datum 0's {first}; send the same keys on every datum"
            )
    return inputs


# Rows of the [*, V] logits computed at once: 2^22 fp32 cells is 16 MB, small enough to stay in
# cache-sized pieces. Materialising all [M, V] logits instead made the 151k-vocab tiny model spend
# 80% of a step in elementwise passes over 1 GB tensors (measured: 7-9 s vs about 1 s per 1.6k tokens).
_HEAD_CHUNK_CELLS = 1 << 22


def _hidden(rt: "ModelRuntime", input_ids: torch.Tensor, mask: torch.Tensor, images=None) -> torch.Tensor:
    """The decoder's last hidden state at the M real positions of a right-padded batch: [M, H].
    `images`: each row's ImageInputs (a vision-language model), run through the VLM body, which
    puts the tower's features at the placeholder positions (engine/model/vision.py)."""
    if images is not None and any(images):
        extra = rt.loaded.vision.inputs(input_ids, mask, images)
        extra.pop("rope_deltas")
        hidden = rt.model.model(input_ids=input_ids, attention_mask=mask, use_cache=False, **extra).last_hidden_state
        return hidden[mask.bool()]
    decoder = rt.model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state  # [B, T, H]
    return hidden[mask.bool()]  # datum 0's positions first


def _head_logprobs(rt: "ModelRuntime", hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logit[target] - logsumexp(logits) for one chunk of rows: [C] or [C, K]."""
    logits = rt.model.get_output_embeddings()(hidden)  # [C, V]
    softcap = getattr(rt.model.config, "final_logit_softcapping", None)
    if softcap:  # Gemma-style models cap logits in their forward; keep parity with it
        logits = torch.tanh(logits / softcap) * softcap
    # bf16 logits are upcast before the logsumexp, as HF's causal-LM loss does (engine/precision.py):
    # summed in bf16 over a 49k vocab it is off by up to ~0.03. A no-op in fp32.
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    if targets.dim() == 1:
        return logits.gather(-1, targets[:, None])[:, 0] - lse
    return logits.gather(-1, targets) - lse[:, None]


def _chunks(rt: "ModelRuntime", m: int) -> list[slice]:
    rows = max(1, _HEAD_CHUNK_CELLS // rt.vocab_size)
    return [slice(i, min(i + rows, m)) for i in range(0, m, rows)]


def _logprobs_and_grads(rt, input_ids, mask, inputs, loss: LossFn, config, params, forward_only: bool, images=None):
    """Target logprobs, the loss, its metrics, and d loss / d params (None when forward_only).

    Every Tinker loss is a function of the target logprobs alone, so the backward splits at them:
    (1) the head runs chunk by chunk without a graph to get logprobs [M]; (2) the loss and its
    gradient g = d loss / d logprobs; (3) each head chunk is recomputed with a graph and
    back-propagated with g, collecting d loss / d hidden and the head's own LoRA grads;
    (4) one backward through the decoder from d loss / d hidden. Peak memory holds one [C, V]
    chunk instead of the [M, V] logits and their gradient; the price is a second head forward.
    """
    targets = inputs["target_tokens"]
    with torch.set_grad_enabled(not forward_only):
        hidden = _hidden(rt, input_ids, mask, images)  # [M, H]
    m = hidden.shape[0]
    with torch.no_grad():
        target_logprobs = torch.cat([_head_logprobs(rt, hidden[c], targets[c]) for c in _chunks(rt, m)])
    if forward_only:
        loss_sum, metrics = loss(target_logprobs, inputs, config)
        return target_logprobs, loss_sum, metrics, None
    lp_leaf = target_logprobs.clone().requires_grad_(True)
    loss_sum, metrics = loss(lp_leaf, inputs, config)
    (g_lp,) = torch.autograd.grad(loss_sum, lp_leaf)
    head_params = [p for p in params if any(p is t for t in _head_lora(rt, params))]
    head_grads: list[torch.Tensor | None] = [None] * len(head_params)
    g_hidden = torch.empty_like(hidden)
    for c in _chunks(rt, m):
        h_c = hidden[c].detach().requires_grad_(True)
        with torch.enable_grad():
            lp_c = _head_logprobs(rt, h_c, targets[c])
        got = torch.autograd.grad(lp_c, [h_c, *head_params], grad_outputs=g_lp[c], allow_unused=True)
        g_hidden[c] = got[0]
        for i, g in enumerate(got[1:]):
            if g is not None:
                head_grads[i] = g if head_grads[i] is None else head_grads[i] + g
    body_params = [p for p in params if not any(p is h for h in head_params)]
    body_grads = torch.autograd.grad(hidden, body_params, grad_outputs=g_hidden, allow_unused=True)
    by_id = {id(p): g for p, g in zip(head_params, head_grads)} | {id(p): g for p, g in zip(body_params, body_grads)}
    return target_logprobs, loss_sum.detach(), metrics, [by_id[id(p)] for p in params]


def _head_lora(rt: "ModelRuntime", params: list[torch.Tensor]) -> list[torch.Tensor]:
    """This adapter's LoRA tensors on the unembedding, if it trains it."""
    head = rt.model.get_output_embeddings()
    lw = getattr(head, "adapters", {}).get(rt.ctx.groups[0].slot) if rt.ctx.groups else None
    return [lw.a, lw.b] if lw is not None else []


def forward_backward(engine: "Engine", op: ForwardBackwardOp) -> ForwardBackwardResult:
    rt = engine.runtime_of(op.model_id)
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
    per_datum = _validate(data, rt, loss)
    images = [d.images for d in op.data]
    if any(images) and rt.loaded.vision is None:
        raise UserError(f"base model {rt.name!r} is a text-only model and takes no images")
    started = time.perf_counter()

    # Pack into one right-padded batch; pad positions are masked out and never reach the loss.
    lengths = [len(d.tokens) for d in op.data]
    batch, width = len(lengths), max(lengths)
    input_ids = torch.zeros(batch, width, dtype=torch.long)  # [B, T]
    mask = torch.zeros(batch, width, dtype=torch.long)  # [B, T]
    for row, d in enumerate(op.data):
        # np.array copies: decoded wire buffers are read-only and torch warns on those.
        input_ids[row, : lengths[row]] = torch.from_numpy(np.array(d.tokens, dtype=np.int64))
        mask[row, : lengths[row]] = 1
    inputs = {k: torch.from_numpy(np.concatenate([x[k] for x in per_datum])) for k in per_datum[0]}  # [M] / [M, K]
    # Which datum each position came from, for losses that aggregate per sequence (gspo).
    inputs[DATUM_INDEX] = torch.repeat_interleave(torch.arange(batch), torch.tensor(lengths))  # [M]
    device = rt.precision.torch_device
    if device.type != "cpu":  # everything the loss sees lives where the model does
        input_ids, mask = input_ids.to(device), mask.to(device)
        inputs = {k: v.to(device) for k, v in inputs.items()}

    params = adapter.parameters()
    rt.ctx.set_single(adapter.slot)
    try:
        # Into fresh tensors first: .grad is touched only after the whole batch succeeded.
        # MoE layers count their routing of the real tokens meanwhile (none for a dense model).
        with rt.routing.counting(mask.flatten().bool()) as routing:
            target_logprobs, loss_sum, metrics, grads = _logprobs_and_grads(
                rt, input_ids, mask, inputs, loss, config, params, op.forward_only, images
            )
        metrics = {**metrics, **routing.metrics()}  # the SDK's e_frac_with_tokens:mean etc.
    finally:
        rt.ctx.clear()

    offsets = np.cumsum([0] + lengths)
    if grads is not None and not op.allow_non_finite:
        # Forward-only passes change nothing, so a NaN loss there is reported as it is.
        def per_datum_loss(i: int) -> torch.Tensor:
            rows = slice(int(offsets[i]), int(offsets[i + 1]))
            if bound is not None:  # a custom loss keeps each datum's own inputs
                return bound.datum_loss(i, target_logprobs[rows])
            alone = {k: v[rows] for k, v in inputs.items()} | {
                DATUM_INDEX: torch.zeros(lengths[i], dtype=torch.long, device=target_logprobs.device)}
            return loss(target_logprobs[rows], alone, config)[0]

        finite.check_forward_backward(adapter, loss_sum, batch, per_datum_loss, params, grads)

    if grads is not None:
        with torch.no_grad():
            for p, g in zip(params, grads):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        adapter.pending_grads += 1

    logprobs = target_logprobs.detach().cpu().numpy().astype(np.float32, copy=False)
    outputs = [{"logprobs": logprobs[offsets[i] : offsets[i + 1]].copy()} for i in range(batch)]
    log.debug(
        "forward_backward model=%s datums=%d tokens=%d forward_only=%s %.1f ms",
        op.model_id, batch, int(offsets[-1]), op.forward_only, 1e3 * (time.perf_counter() - started),
    )
    return ForwardBackwardResult(loss_fn_outputs=outputs, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# optim_step


def _check_adam(p: AdamParams) -> None:
    if not p.learning_rate >= 0:
        raise UserError(f"adam_params.learning_rate must be >= 0, got {p.learning_rate}")
    for name, beta in (("beta1", p.beta1), ("beta2", p.beta2)):
        if not 0 <= beta < 1:
            raise UserError(f"adam_params.{name} must be in [0, 1), got {beta}")
    if not p.eps >= 0:
        raise UserError(f"adam_params.eps must be >= 0, got {p.eps}")
    if not p.weight_decay >= 0:
        raise UserError(f"adam_params.weight_decay must be >= 0, got {p.weight_decay}")
    if not p.grad_clip_norm >= 0:
        raise UserError(f"adam_params.grad_clip_norm must be >= 0 (0 = no clipping), got {p.grad_clip_norm}")


def optim_step(engine: "Engine", op: OptimStepOp) -> dict[str, float]:
    _, adapter = _trainable(engine, op.model_id)
    p = op.adam_params
    _check_adam(p)
    optimizer = adapter.optimizer
    undo = None
    if not op.allow_non_finite:
        finite.check_grads_before_step(adapter)
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
        bad = finite.check_step_result(adapter) if undo is not None else None
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
    optimizer.zero_grad(set_to_none=True)
    adapter.step += 1
    adapter.pending_grads = 0
    if op.snapshot_dir is not None:
        _after_op_snapshot(engine, adapter, op.snapshot_dir)
    return {}


def _snapshot(engine: "Engine", adapter: "Adapter", dir_path: str) -> None:
    """A recovery point: weights, AdamW state and step as of a step, load or release. The two newest
    are kept: this op's result may not be stored yet when the process dies, and then recovery needs
    the one before."""
    target = Path(dir_path)
    checkpoints.save_adapter(adapter, engine.runtime_of(adapter.key).name, target, with_optimizer=True)
    for old in sorted(p for p in target.parent.iterdir() if p.name.startswith("seq-"))[:-2]:
        shutil.rmtree(old, ignore_errors=True)


def _after_op_snapshot(engine: "Engine", adapter: "Adapter", dir_path: str) -> None:
    """A snapshot after an op that already changed the adapter: a failure to write it must not fail
    the op (failed ops are never replayed, so recovery would lose the change); recovery then uses
    the snapshot before it, plus the log."""
    try:
        _snapshot(engine, adapter, dir_path)
    except Exception:
        log.exception("recovery snapshot %s of %s failed", dir_path, adapter.key)


# ---------------------------------------------------------------------------------------------
# save / load


def save_weights(engine: "Engine", op: SaveWeightsOp) -> dict[str, int]:
    rt = engine.runtime_of(op.model_id)
    adapter = rt.pool.get(op.model_id)
    size_bytes = checkpoints.save_adapter(adapter, rt.name, op.dir_path, op.with_optimizer)
    return {"size_bytes": size_bytes}


def _load_in_place(engine: "Engine", op: LoadWeightsOp, files: checkpoints.AdapterFiles) -> None:
    rt, adapter = _trainable(engine, op.model_id)
    if files.base_model != rt.name:
        raise UserError(f"checkpoint was trained on {files.base_model!r}, but model {op.model_id!r} uses {rt.name!r}")
    spec = adapter.spec
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


def _load_as_new(engine: "Engine", op: LoadWeightsOp, files: checkpoints.AdapterFiles) -> None:
    base_model = op.base_model or files.base_model
    if files.base_model != base_model:
        raise UserError(f"checkpoint was trained on {files.base_model!r}, not on {base_model!r}")
    rt = engine.runtime(base_model)
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
    files = checkpoints.read_adapter(op.dir_path)
    if op.with_optimizer and files.optimizer_state is None:
        raise UserError(f"checkpoint at {op.dir_path!r} has no optimizer state (a sampler or exported checkpoint?)")
    if op.model_id in engine.model_of:
        _load_in_place(engine, op, files)
    else:
        _load_as_new(engine, op, files)
    if op.snapshot_dir is not None:
        _after_op_snapshot(engine, engine.runtime_of(op.model_id).pool.get(op.model_id), op.snapshot_dir)
    return {"model_id": op.model_id}
