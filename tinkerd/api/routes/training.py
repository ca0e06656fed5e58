"""Training endpoints: create_model, get_info, forward_backward, optim_step, save/load weights."""

from __future__ import annotations

import hashlib
import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker import types as t

from tinkerd.api import codec, hpcai, limits
from tinkerd.api.deps import (AppState, Prepared, account, authenticate, future_response, load_json, name_taken, parse,
                              read_body, state, submit)
from tinkerd.control.control import Work
from tinkerd.control.copies import is_copy_run, trainable_config
from tinkerd.control.custom_losses import CustomLosses
from tinkerd.control.oplog import CreateSampler, OpRecord, OpType, Payer, RegisterCheckpoint
from tinkerd.control.records import TrainingRun
from tinkerd.control.ids import TinkerPath, check_name, check_ttl
from tinkerd.errors import UserError
from tinkerd.images import refuse_text_placeholders
from tinkerd.types import (
    AdamParams,
    CreateModelOp,
    ForwardBackwardOp,
    LoadWeightsOp,
    LoraSpec,
    OptimStepOp,
    SaveWeightsOp,
    StableReinforceConfig,
    base_model_of,
    long_context_id,
)

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])


def _lora_spec(st: AppState, cfg: dict) -> LoraSpec:
    return LoraSpec(
        rank=int(cfg["rank"]),
        alpha=float(cfg.get("alpha", st.config.lora_alpha)),
        seed=cfg.get("seed"),
        train_attn=bool(cfg.get("train_attn", True)),
        train_mlp=bool(cfg.get("train_mlp", True)),
        train_unembed=bool(cfg.get("train_unembed", True)),
    )


def _payer(st: AppState, run: TrainingRun, account_id: str | None) -> Payer:
    """Training ops are billed to the run's owner (the caller, who must own it)."""
    owner = account_id if account_id is not None else st.runs.sessions.account_of(run.session_id)
    return Payer(owner, run.session_id, run.base_model)


def _accepted(op_type: OpType, op, st: AppState, run: TrainingRun, account_id: str | None, **record) -> Work:
    """The op as the log keeps it (control/oplog.py); control does its bookkeeping when it succeeds.
    An op naming only a model_id is given its run's base model here, which the EngineRouter routes by."""
    if getattr(op, "base_model", None) == "":
        op.base_model = base_model_of(run.base_model)
    return Work.of(OpRecord(op_type, op, _payer(st, run, account_id), **record))


def _trainable(st: AppState, model_id: str, account_id: str | None) -> TrainingRun:
    """The caller's run, refused when copy_weights made it: it holds copies, no adapter to train."""
    run = st.runs.training_runs.owned_run(model_id, account_id)
    if is_copy_run(run):
        raise UserError(f"training run {model_id} holds copied weights and cannot be trained on; "
                        "load them with create_training_client_from_state")
    return run


def _refuse_text_placeholders(st: AppState, run: TrainingRun, op: ForwardBackwardOp) -> None:
    """A VLM's image placeholder id in a datum's text is a 400 here, naming the datum and position,
    rather than the engine's failed future (engine/model/vision.py)."""
    try:
        vision = st.served_model(run.base_model).vision
    except UserError:  # a base model not served now: the engine reports that, as for any op of the run
        return
    for i, d in enumerate(op.data):
        refuse_text_placeholders(d.tokens, d.images, vision, f"datum {i}")


# `completed`: a complete op of a data directory written before the op log (api/legacy.py) is being
# converted to its record. It ran under the rules of its day, and the adapter's state is a function
# of it, so the bounds added since (api/limits.py) are not applied to it, nor the non-finite guard.
# (Ops in the op log are never prepared again: recovery replays their records as accepted.)


def prepare_create_model(st: AppState, body: bytes, account_id: str | None = None, completed: bool = False) -> Prepared:
    req = parse(t.CreateModelRequest, body)
    if not completed:
        limits.integer(req.model_seq_id, "model_seq_id")
        if req.lora_config is not None:
            limits.integer(req.lora_config.seed, "lora_config.seed", limits.INT64_MIN, limits.INT64_MAX)
    served = st.served_model(req.base_model)
    if req.lora_config is None:
        raise UserError("only LoRA training is supported: send a lora_config")
    if req.optimizer_config.type != "adamw":
        raise UserError(f"optimizer {req.optimizer_config.type!r} is not supported; use adamw")
    if not 1 <= req.lora_config.rank <= st.config.max_lora_rank:
        raise UserError(f"LoRA rank must be between 1 and {st.config.max_lora_rank}, got {req.lora_config.rank}")
    lora_config = req.lora_config.model_dump() | {"alpha": st.config.lora_alpha}
    if lora_config.get("seed") is None:
        # A fixed seed per run: recovery re-creates the adapter from its log and must get the same
        # initial weights, and distinct runs still start from distinct ones.
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        lora_config["seed"] = int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:8], "big") >> 1
    run, _ = st.runs.training_runs.create_run(req.session_id, req.model_seq_id, req.base_model, lora_config, req.user_metadata,
                                account_id)
    # The run keeps the name as asked (a long-context id included: get_info and its samplers report
    # it, and its limit applies to them); the engine gets the base.
    op = CreateModelOp(model_id=run.model_id, base_model=served.name, lora=_lora_spec(st, run.lora_config))
    work = _accepted(OpType.CREATE_MODEL, op, st, run, account_id, reply={"model_id": run.model_id})
    return Prepared("CreateModel", run.model_id, 0, work)


@router.post("/get_info")
def get_info(request: Request, body: bytes = Depends(read_body)) -> dict:
    st = state(request)
    req = parse(t.GetInfoRequest, body)
    run = st.runs.training_runs.owned_run(req.model_id, account(request))
    served = st.served_model(run.base_model)
    return {
        "type": "get_info",
        "model_id": run.model_id,
        "model_data": {"arch": served.arch, "model_name": run.base_model, "tokenizer_id": served.tokenizer_id},
        "is_lora": True,
        "lora_rank": run.lora_rank,
        "model_name": run.base_model,
        "optimizer_config": {"type": "adamw"},
    }


def prepare_forward_backward(st: AppState, body: bytes, account_id: str | None = None,
                             completed: bool = False, sequenced: bool = True) -> Prepared:
    """`sequenced=False`: a body transcoded from hpcai's JSON (api/hpcai.py), which has no seq_id (a
    protobuf reads an absent one as 0): the op runs in arrival order on its model."""
    def vision_of(model_id: str):
        served = st.served_model(_trainable(st, model_id, account_id).base_model)
        return served.name, served.vision

    op = codec.decode_forward_backward(body, vision_of, st.image_limits())
    run = _trainable(st, op.model_id, account_id)
    if not completed:
        _refuse_text_placeholders(st, run, op)
    seq_id = codec.forward_backward_seq_id(body)[1] if sequenced else None
    if not completed and seq_id is not None:
        limits.seq_id(seq_id)
    op.allow_non_finite = st.config.allow_non_finite or completed
    if not completed and long_context_id(run.base_model) is not None:  # the engine checks the base's own limit
        limits.datum_lengths(op.data, st.served_model(run.base_model).max_context_length)
    if op.loss_fn == "stable_reinforce":
        # Refused here (a 400) rather than as a failed future: the config, then the provenance
        # against what the sampler recorded, which becomes the datums' sampler_logprobs (kept in
        # the op's record, so a replay needs no recorded sequence).
        StableReinforceConfig.parse(op.loss_fn_config)
        if st.records is None:
            raise UserError("stable_reinforce needs recorded sequences, which this server does not keep")
        st.records.resolve(op, run.session_id, completed=completed)
    if op.loss_fn == "custom":  # a loss uploaded with create_custom_loss, carried on the op as data
        op.custom_loss = CustomLosses(st.control.store).resolve(op.loss_fn_config, run.session_id)
    kind = OpType.FORWARD if op.forward_only else OpType.FORWARD_BACKWARD
    return Prepared(kind.value, op.model_id, seq_id, _accepted(kind, op, st, run, account_id))


def prepare_optim_step(st: AppState, body: bytes, account_id: str | None = None, completed: bool = False) -> Prepared:
    req = parse(t.OptimStepRequest, body)
    run = _trainable(st, req.model_id, account_id)
    if not isinstance(req.optim_params, t.AdamParams):
        raise UserError(f"optimizer {req.optim_params.type!r} is not supported; send adam_params")
    p = req.optim_params
    if not completed:
        limits.seq_id(req.seq_id)
        limits.adam_params(p)
    op = OptimStepOp(req.model_id, AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm),
                     allow_non_finite=st.config.allow_non_finite or completed)
    return Prepared("OptimStep", req.model_id, req.seq_id, _accepted(OpType.OPTIM_STEP, op, st, run, account_id))


def prepare_save_weights(st: AppState, body: bytes, account_id: str | None = None) -> Prepared:
    req = parse(t.SaveWeightsRequest, body)
    run = _trainable(st, req.model_id, account_id)
    limits.seq_id(req.seq_id)
    if req.path is None and req.seq_id is None:  # the default name would be "step-None"
        raise UserError("save_weights needs a path (a checkpoint name) or a seq_id")
    # path="" is a mistake, not "use the default": check_name refuses it.
    name = check_name(req.path, "path") if req.path is not None else f"step-{req.seq_id}"
    path = TinkerPath(req.model_id, "weights", name)
    ttl = check_ttl(req.ttl_seconds)  # before the op is queued: a bad TTL writes nothing
    if not req.overwrite and name_taken(st, path, "SaveWeights", req.model_id, req.seq_id, account_id):
        raise UserError(f"checkpoint {path} already exists; pass overwrite=True to replace it")
    op = SaveWeightsOp(req.model_id, st.runs.checkpoints.checkpoint_key(path), with_optimizer=True)
    work = _accepted(OpType.SAVE_WEIGHTS, op, st, run, account_id, reply={"path": str(path)},
                     effect=RegisterCheckpoint(str(path), ttl, req.user_metadata))
    return Prepared("SaveWeights", req.model_id, req.seq_id, work)


def prepare_save_weights_for_sampler(st: AppState, body: bytes, account_id: str | None = None) -> Prepared:
    req = parse(t.SaveWeightsForSamplerRequest, body)
    run = _trainable(st, req.model_id, account_id)
    limits.seq_id(req.seq_id)
    limits.integer(req.sampling_session_seq_id, "sampling_session_seq_id")
    inflight = req.kind == "inflight"  # docs/compatibility.md: inflight samplers (control/inflight.py)
    if inflight and (req.path is not None or req.sampling_session_seq_id is None):
        raise UserError("an inflight save_weights_for_sampler publishes the run's shared sampler weights: it takes a "
                        "sampling_session_seq_id and no path (save_weights_and_get_sampling_client(kind='inflight'))")
    if inflight and req.ttl_seconds is not None:
        raise UserError("inflight saves take no ttl_seconds: their weights live as long as the training run's "
                        "inflight samplers")
    if req.path is not None:
        path = TinkerPath(req.model_id, "sampler_weights", check_name(req.path, "path"))
        ttl = check_ttl(req.ttl_seconds)  # before the op is queued: a bad TTL writes nothing
        op = SaveWeightsOp(req.model_id, st.runs.checkpoints.checkpoint_key(path), with_optimizer=False)
        reply, effect = {"path": str(path)}, RegisterCheckpoint(str(path), ttl, req.user_metadata)

    elif req.sampling_session_seq_id is not None:
        # Ephemeral: the sampler is created server-side from these weights; the SDK sends no
        # create_sampling_session and samples through the returned id.
        sid = f"{run.session_id}:sample:{req.sampling_session_seq_id}"
        adapter_dir = st.runs.sampling_sessions.ephemeral_key(sid)
        op = SaveWeightsOp(req.model_id, adapter_dir, with_optimizer=False)

        # Control creates the session when the save succeeded (control/bookkeeping.py), and prunes
        # the session's older ephemeral samplers.
        reply = {"sampling_session_id": sid}
        effect = CreateSampler(run.session_id, req.sampling_session_seq_id, run.base_model, adapter_dir,
                               inflight_of=run.model_id if inflight else None)

    else:
        raise UserError("save_weights_for_sampler needs a path or a sampling_session_seq_id")
    work = _accepted(OpType.SAVE_WEIGHTS_FOR_SAMPLER, op, st, run, account_id, reply=reply, effect=effect)
    return Prepared("SaveWeightsForSampler", req.model_id, req.seq_id, work)


def prepare_load_weights(st: AppState, body: bytes, account_id: str | None = None, completed: bool = False) -> Prepared:
    req = parse(t.LoadWeightsRequest, body)
    if not completed:
        limits.seq_id(req.seq_id)
        limits.integer(req.model_seq_id, "model_seq_id")
    path = hpcai.parse_path(req.path)
    if path.segment != "weights":
        raise UserError(f"load_weights needs a training checkpoint (tinker://.../weights/<name>), got {req.path}")
    ckpt = st.runs.checkpoints.owned_checkpoint(path, account_id, public_ok=True)
    source = st.runs.training_runs.run(ckpt.model_id)
    if req.model_id is not None:
        # Legacy in-place load into an existing model, ordered with its other ops.
        run = _trainable(st, req.model_id, account_id)
        if base_model_of(run.base_model) != base_model_of(source.base_model):
            raise UserError(f"checkpoint {path} was trained on {source.base_model}, not {run.base_model}")
        target, seq_id = run.model_id, req.seq_id
    elif req.session_id is not None and req.model_seq_id is not None:
        # Create-via-load: a new model `{session}:train:{n}` whose seq 0 is this load.
        if req.base_model is not None and base_model_of(req.base_model) != base_model_of(source.base_model):
            raise UserError(f"checkpoint {path} was trained on {source.base_model}, not {req.base_model}")
        # Asked with a base_model (a long-context id of the same base, say), the new run has that name.
        name = req.base_model if req.base_model is not None else source.base_model
        if req.base_model is not None:
            st.served_model(name)
        run, _ = st.runs.training_runs.create_run(req.session_id, req.model_seq_id, name, trainable_config(source.lora_config),
                                    req.user_metadata if req.user_metadata is not None else source.user_metadata,
                                    account_id)
        target, seq_id = run.model_id, 0
    else:
        raise UserError("load_weights needs model_id and seq_id, or session_id and model_seq_id")
    rank = int(source.lora_config.get("rank", 0))
    if not completed and rank > st.config.max_lora_rank:  # the engine runs what was accepted, unchecked
        raise UserError(f"checkpoint {path} has LoRA rank {rank}, over this server's limit {st.config.max_lora_rank}")
    op = LoadWeightsOp(target, base_model_of(source.base_model), st.runs.checkpoints.key_of(ckpt),
                       with_optimizer=req.optimizer)
    work = _accepted(OpType.LOAD_WEIGHTS, op, st, run, account_id, reply={"path": str(path), "model_id": target})
    return Prepared("LoadWeights", target, seq_id, work)


# Every future-returning training request, by the request type stored with it: the routes use these,
# and so does the one-time conversion of a pre-op-log data directory (api/legacy.py).
PREPARERS = {
    "CreateModel": prepare_create_model,
    "ForwardBackward": prepare_forward_backward,
    "Forward": prepare_forward_backward,
    "OptimStep": prepare_optim_step,
    "SaveWeights": prepare_save_weights,
    "SaveWeightsForSampler": prepare_save_weights_for_sampler,
    "LoadWeights": prepare_load_weights,
}

def _route_for(prepare, translate=None):
    # Bound by a closure, not a default argument: FastAPI exposes every parameter of a route as a
    # request parameter, and `?_prepare=x` once replaced the function with a string (a 500).
    # `translate(st, request, body)`: the hpcai client's request shape to the official one (api/hpcai.py).
    def route(request: Request, body: bytes = Depends(read_body)) -> JSONResponse:
        st = state(request)
        account_id = account(request)
        if translate is not None:
            body = translate(st, request, body)
        return _submit(st, request, prepare(st, body, account_id), body, account_id)

    return route


def _submit(st: AppState, request: Request, prepared: Prepared, body: bytes, account_id: str) -> JSONResponse:
    hpcai.check_ordering(st, prepared.target, prepared.seq_id)
    # Ops without a seq_id have no (target, seq_id) key: hpcai's X-Idempotency-Key dedupes their re-sends.
    key = request.headers.get("x-idempotency-key") if prepared.seq_id is None else None
    return submit(st, prepared, body, account_id, idempotency_key=key)


@router.post("/create_model")
def create_model(request: Request, body: bytes = Depends(read_body)) -> JSONResponse:
    st = state(request)
    account_id = account(request)
    with hpcai.numbering():  # an implicit session's next model number, then its run row
        body = hpcai.create_model_body(st, request, body)
        prepared = prepare_create_model(st, body, account_id)
    return _submit(st, request, prepared, body, account_id)


def _forward_backward(forward_only: bool):
    def route(request: Request, body: bytes = Depends(read_body)) -> JSONResponse:
        st = state(request)
        account_id = account(request)
        if hpcai.is_json_body(request):  # the hpcai client's JSON body: the same op, in arrival order
            prepared = prepare_forward_backward(st, hpcai.forward_backward_protobuf(body, forward_only), account_id,
                                                sequenced=False)
        else:
            if forward_only:
                body = codec.forward_only(body)
            prepared = prepare_forward_backward(st, body, account_id)
        return _submit(st, request, prepared, body, account_id)

    return route


@router.post("/unload_model")
def unload_model(request: Request, body: bytes = Depends(read_body)) -> JSONResponse:
    """hpcai's unload_model: the run's adapter leaves the engine now, as for a session that ended
    (control/residency.py); its next op, if any, rebuilds it exactly. A future, as the client expects."""
    st = state(request)
    body = load_json(body)
    model_id = body.get("model_id") if isinstance(body, dict) else None
    if not isinstance(model_id, str) or not model_id:
        raise UserError("unload_model needs a model_id (a string)")
    run = st.runs.training_runs.owned_run(model_id, account(request))
    st.control.release_run(run.model_id)
    payload = json.dumps({"model_id": run.model_id, "type": "unload_model"}).encode()
    request_id = st.control.complete_now("UnloadModel", run.model_id, payload, "application/json",
                                         account_id=account(request))
    return future_response(request_id, model_id=run.model_id)


router.add_api_route("/forward_backward", _forward_backward(False), methods=["POST"], name="forward_backward")
router.add_api_route("/forward", _forward_backward(True), methods=["POST"], name="forward")
for _path, _prepare, _translate in (
    ("/optim_step", prepare_optim_step, None),
    ("/save_weights", prepare_save_weights, None),
    ("/save_weights_for_sampler", prepare_save_weights_for_sampler, None),
    ("/load_weights", prepare_load_weights, lambda st, request, body: hpcai.load_weights_body(body)),
):
    router.add_api_route(_path, _route_for(_prepare, _translate), methods=["POST"], name=_path.strip("/"))
