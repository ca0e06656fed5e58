"""Sampling endpoints: create_sampling_session, samplers/{id}, asample."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker import types as t

from tinkerd.api import hpcai, limits, prompt_scores
from tinkerd.api.deps import AppState, Prepared, account, authenticate, future_response, parse, read_body, state
from tinkerd.artifacts import adapter_key
from tinkerd.control.control import Work
from tinkerd.control.oplog import OpRecord, OpType, Payer
from tinkerd.errors import UserError
from tinkerd.images import ChunkExpander, ImageLimits, refuse_text_placeholders
from tinkerd.types import SampleOp, SamplingParams, base_model_of, long_context_id

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])


@router.post("/create_sampling_session")
def create_sampling_session(request: Request, body: bytes = Depends(read_body)) -> dict:
    st = state(request)
    req = parse(t.CreateSamplingSessionRequest, body)
    limits.integer(req.sampling_session_seq_id, "sampling_session_seq_id")
    if req.model_path is not None:
        path = hpcai.parse_path(req.model_path)
        if path.segment not in ("sampler_weights", "weights"):
            raise UserError(f"cannot sample from {req.model_path}: use a sampler_weights or weights path")
        ckpt = st.runs.checkpoints.owned_checkpoint(path, account(request), public_ok=True)
        base_model = st.runs.training_runs.run(ckpt.model_id).base_model
        if req.base_model is not None and base_model_of(req.base_model) != base_model_of(base_model):
            raise UserError(f"{req.model_path} was trained on {base_model}, not {req.base_model}")
        base_model = req.base_model or base_model  # a long-context id of the same base sets the limit
        adapter_dir = st.runs.checkpoints.key_of(ckpt)
    elif req.base_model is not None:
        base_model, adapter_dir = req.base_model, None
    else:
        raise UserError("create_sampling_session needs a base_model or a model_path")
    st.served_model(base_model)
    row = st.runs.sampling_sessions.create_sampling_session(req.session_id, req.sampling_session_seq_id, base_model, req.model_path,
                                          adapter_dir, account(request))
    return {"sampling_session_id": row.sampling_session_id, "type": "create_sampling_session"}


@router.post("/join_sampling_session")
def join_sampling_session(request: Request, body: bytes = Depends(read_body)) -> dict:
    """A clone id for a new client of an existing sampling session (an unpickled SamplingClient,
    `sample_join_sampling_session`), unique among its clients, so clones never share seq_ids."""
    req = parse(t.JoinSamplingSessionRequest, body)
    counter = state(request).runs.sampling_sessions.join_sampling_session(req.sampling_session_id, account(request))
    return {"type": "join_sampling_session", "client_counter": counter}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request) -> dict:
    row = state(request).runs.sampling_sessions.owned_sampling_session(sampler_id, account(request))
    return {"sampler_id": row.sampling_session_id, "base_model": row.base_model, "model_path": row.model_path}


def _prompt_tokens(prompt: t.ModelInput, served, limits: ImageLimits) -> ChunkExpander:
    """The prompt's tokens, each ImageChunk expanded to its placeholder positions (tinkerd/images.py)."""
    chunks = ChunkExpander(served.name, served.vision, limits)
    for j, chunk in enumerate(prompt.chunks):
        if chunk.type == "encoded_text":
            chunks.text(np.asarray(chunk.tokens, dtype=np.int64))
        elif chunk.type == "image":
            chunks.image(chunk.data, chunk.format, chunk.expected_tokens, f"prompt chunk {j}")
        elif chunk.type == "image_asset_pointer":
            # Never produced by the cookbook; a server reading paths or URLs a client names would be
            # a file-read / fetch primitive for every tenant.
            raise UserError(f"prompt chunk {j}: image_asset_pointer chunks are not supported; send the image's "
                            "bytes in an ImageChunk")
        else:
            raise UserError(f"{chunk.type} prompt chunks are not supported by tinkerd")
    refuse_text_placeholders(chunks.tokens(), chunks.image_inputs(), served.vision, "prompt")
    return chunks


def _sampling_params(st: AppState, p: t.SamplingParams) -> SamplingParams:
    stop = p.stop
    strings: tuple[str, ...] = ()
    token_seqs: tuple[tuple[int, ...], ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif stop is not None:
        items = list(stop)
        if all(isinstance(s, str) for s in items):
            strings = tuple(items)
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in items):
            token_seqs = tuple((s,) for s in items)
        else:
            raise UserError("stop must be a string, a list of strings or a list of token ids")
    return SamplingParams(
        max_tokens=p.max_tokens if p.max_tokens is not None else st.config.max_sample_tokens_default,
        temperature=float(p.temperature),
        top_k=int(p.top_k),
        top_p=float(p.top_p),
        seed=p.seed,
        stop_token_seqs=token_seqs,
        stop_strings=strings,
        # `stop=[]` disables every stop, EOS included; absent keeps EOS.
        stop_at_eos=not (stop is not None and not isinstance(stop, str) and len(list(stop)) == 0),
    )


def prepare_asample(st: AppState, body: bytes, account_id: str | None = None) -> Prepared:
    req = parse(t.SampleRequest, body)
    session_id = None
    if req.sampling_session_id is not None:
        row = st.runs.sampling_sessions.owned_sampling_session(req.sampling_session_id, account_id)
        base_model, adapter_dir, target = row.base_model, adapter_key(row.adapter_dir), row.sampling_session_id
        session_id = row.session_id
    elif req.model_path is not None:
        path = hpcai.parse_path(req.model_path)
        ckpt = st.runs.checkpoints.owned_checkpoint(path, account_id, public_ok=True)
        base_model, adapter_dir, target = st.runs.training_runs.run(ckpt.model_id).base_model, st.runs.checkpoints.key_of(ckpt), str(path)
    elif req.base_model is not None:
        base_model, adapter_dir, target = req.base_model, None, req.base_model
    else:
        raise UserError("asample needs a sampling_session_id, model_path or base_model")
    if req.sampling_session_id is None:
        # A base model or published checkpoint is shared between accounts; the queue target (a FIFO
        # lane, and a quota pause holds its whole lane) and the (target, seq_id) dedupe key are not.
        target = f"{target}#{account_id}"
    served = st.served_model(base_model)
    limits.sample_request(req, served.max_context_length)
    if not 1 <= req.num_samples <= st.config.max_num_samples:
        raise UserError(f"num_samples must be between 1 and {st.config.max_num_samples}, got {req.num_samples}")
    chunks = _prompt_tokens(req.prompt, served, st.image_limits())
    prompt = chunks.tokens()
    params = _sampling_params(st, req.sampling_params)
    if long_context_id(base_model) is not None:  # the engine checks the base's own limit
        limits.sample_context(len(prompt), params.max_tokens, served.max_context_length)
    target_ids, target_csr = (None, None)
    if req.target_prompt_logprobs is not None:
        target_ids, target_csr = prompt_scores.target_ids(req.target_prompt_logprobs, len(prompt))
    limits.integer(req.prompt_alt_tokens_k, "prompt_alt_tokens_k", hi=prompt_scores.MAX_CELLS)
    if req.prompt_logprobs_last_n is not None and not req.prompt_logprobs:
        raise UserError("prompt_logprobs_last_n applies to prompt logprobs: set prompt_logprobs (include_prompt_logprobs)")
    if req.record_stability_info and session_id is None:
        raise UserError("record_stability_info needs a sampling_session_id: recorded sequences belong to the session "
                        "that sampled them")
    op = SampleOp(
        base_model=served.name,
        adapter_path=adapter_dir,
        prompt=prompt,
        params=params,
        num_samples=req.num_samples,
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=int(req.topk_prompt_logprobs),
        prompt_logprobs_last_n=req.prompt_logprobs_last_n,
        topk_sample_logprobs=int(req.topk_sample_logprobs),
        record_for_session=session_id if req.record_stability_info else None,
        target_prompt_ids=target_ids,
        target_prompt_csr=None if target_csr is None else (target_csr.crow, target_csr.col),
        prompt_alt_tokens_k=int(req.prompt_alt_tokens_k),
        images=chunks.image_inputs(),
    )
    payer = Payer(account_id if account_id is not None else (st.runs.sessions.account_of(session_id) if session_id else None),
                  session_id, base_model)
    return Prepared("Sample", target, req.seq_id, Work.of(OpRecord(OpType.SAMPLE, op, payer)))


@router.post("/asample")
def asample(request: Request, body: bytes = Depends(read_body)) -> JSONResponse:
    st = state(request)
    account_id = account(request)
    prepared = prepare_asample(st, body, account_id)
    # hpcai's samples carry no seq_id: its X-Idempotency-Key dedupes their re-sends.
    key = request.headers.get("x-idempotency-key") if prepared.seq_id is None else None
    accepted = st.control.submit(prepared.request_type, prepared.target, prepared.seq_id, body, prepared.work,
                                 account_id=account_id, idempotency_key=key)
    ids = [f"{accepted.request_id}:{i}" for i in range(prepared.work.op.num_samples)]
    return future_response(accepted.request_id, sample_sequence_ids=ids)


PREPARERS = {"Sample": prepare_asample}
