"""OpenAI-compatible inference: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

A request becomes an ordinary tinker `SampleRequest` body and goes through `prepare_asample` and
`Control.submit` exactly as `/api/v1/asample` does: the same ownership check (another account's
checkpoint is a 404), the same continuous-batching sampler, queue lane, quotas and metering, and
the same write-ahead log entry (so recovery can rebuild it like any sample). The handler then waits
on the future and renders the stored SampleResponse as OpenAI choices.

Streaming (`stream: true`) answers in OpenAI's server-sent-event chunk format, one chunk per token
as the engine decodes it, ending with `data: [DONE]` (api/openai_stream.py).

Auth: `Authorization: Bearer <tinker API key>` (what the `openai` client sends), or `X-API-Key`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from datetime import timezone

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tinkerd.api import codec, hpcai
from tinkerd.api import openai_schema as schema
from tinkerd.api import openai_text as text
from tinkerd.api.openai_stream import LiveStream
from tinkerd.api.deps import AppState, load_json, read_body, state
from tinkerd.api.results import wire_result
from tinkerd.api.routes.sampling import prepare_asample
from tinkerd.errors import AuthError, NotFoundError, ServerError, TinkerdError, UserError


def authenticate(request: Request) -> None:
    header = request.headers.get("authorization", "")
    key = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key")
    accounts = state(request).accounts
    source = request.client.host if request.client else "unknown"
    if not key:
        accounts.auth_failed(None, source)
        raise AuthError("missing API key: send Authorization: Bearer <tinker API key>")
    account_id = accounts.verify(key)
    if account_id is None:
        accounts.auth_failed(key, source)
        raise AuthError("invalid or revoked API key")
    request.state.account_id = account_id


router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(e: TinkerdError) -> JSONResponse:
    """app.py's error handlers answer /v1 paths with this."""
    return schema.error_response(e.status_code, e.message, getattr(e, "param", None), getattr(e, "code", None),
                                 headers=getattr(e, "headers", None))


@router.get("/models")
async def list_models(request: Request) -> dict:
    st = state(request)
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "tinkerd"} for name in sorted(st.served)]
    rows, _ = st.runs.checkpoints.list_checkpoints(checkpoint_type="sampler", limit=1000, account_id=request.state.account_id)
    bases = st.runs.training_runs.base_models({r.model_id for r in rows})
    data += [{"id": r.tinker_path, "object": "model", "owned_by": "user", "root": bases.get(r.model_id),
              "created": int(r.created_at.replace(tzinfo=timezone.utc).timestamp())} for r in rows]
    return {"object": "list", "data": data}


def _resolve(st: AppState, model: str, account_id: str) -> str:
    """The base model of `model` (a served name or a tinker:// sampler path the caller may read)."""
    if model.startswith(("tinker://", hpcai.SCHEME)):
        path = hpcai.parse_path(model)
        if path.segment not in ("sampler_weights", "weights"):
            raise schema.OpenAIError(f"cannot sample from {model}: use a sampler_weights path", "model")
        ckpt = st.runs.checkpoints.owned_checkpoint(path, account_id, public_ok=True)  # another account's: NotFoundError
        return st.runs.training_runs.run(ckpt.model_id).base_model
    if model not in st.served:
        raise NotFoundError(f"the model {model!r} does not exist; served: {sorted(st.served)}")
    return model


def _sample_body(req: schema._Request, model: str, prompt: list[int], st: AppState) -> bytes:
    """The tinker SampleRequest equivalent to an OpenAI request (prepare_asample validates it)."""
    stops = req.stop_strings()
    params = {
        "max_tokens": req.token_limit() or st.config.max_sample_tokens_default,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": -1 if req.top_k is None else req.top_k,
        "seed": req.seed,
        # OpenAI's stop never disables EOS; tinker's `stop: []` would, so no stops is None.
        "stop": stops or None,
    }
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "sampling_params": params,
            "num_samples": req.n, "topk_sample_logprobs": req.topk() or 0}
    body["model_path" if model.startswith(("tinker://", hpcai.SCHEME)) else "base_model"] = model
    return json.dumps(body).encode()


async def _sample(st: AppState, body: bytes, account_id: str) -> list[text.Sequence]:
    def accept() -> str:  # validation reads the store, submit writes it: off the event loop
        prepared = prepare_asample(st, body, account_id)
        return st.control.submit(prepared.request_type, prepared.target, prepared.seq_id, body, prepared.work,
                                 account_id=account_id).request_id

    return await _outcome(st, await asyncio.to_thread(accept))


async def _outcome(st: AppState, request_id: str) -> list[text.Sequence]:
    """The request's sequences once it is done; its error (a UserError is a 400) if it failed."""
    while True:  # each wait is one long-poll hold; a queued or quota-paused request keeps waiting
        row = await st.control.retrieve(request_id, st.config.retrieve_future_timeout_s)
        if row is None:
            raise ServerError("the request's record disappeared")
        if row.status != "pending":
            break
    if row.status == "failed":
        if row.error_category == "user":
            raise UserError(row.error or "the request failed")
        raise ServerError(row.error or "the request failed")
    # As retrieve_future would answer it: the SampleResponse protobuf (api/results.py, api/codec.py).
    payload, media_type = await asyncio.to_thread(wire_result, row.request_type, row.result, row.result_media_type,
                                                  row.body)
    if media_type != codec.PROTO_MEDIA_TYPE:
        raise ServerError(f"cannot read a stored sample result of type {media_type!r}")
    return text.decode_sample_response(payload)


async def _tokenizer(st: AppState, base_model: str) -> text.TextTokenizer:
    if st.tokenizers is None:
        raise ServerError("this server has no tokenizers wired for the OpenAI endpoints")
    base_model = st.served_model(base_model).name  # a run's long-context id shares its base's tokenizer
    return await asyncio.to_thread(st.tokenizers, base_model)  # the first load reads files for ~1-2 s


async def _body(request: Request) -> object:
    return load_json(await read_body(request))


@router.post("/chat/completions")
async def chat_completions(request: Request):
    st = state(request)
    req = schema.parse(schema.ChatCompletionRequest, await _body(request))
    base = _resolve(st, req.model, request.state.account_id)
    tok = await _tokenizer(st, base)
    prompt = await asyncio.to_thread(tok.chat, req.chat())
    if req.stream:
        return await _stream(st, "chat", req, tok, [prompt], request.state.account_id)
    seqs = await _sample(st, _sample_body(req, req.model, prompt, st), request.state.account_id)
    return await _answer(st, "chat", req, tok, [(prompt, seqs)])


@router.post("/completions")
async def completions(request: Request):
    st = state(request)
    req = schema.parse(schema.CompletionRequest, await _body(request))
    base = _resolve(st, req.model, request.state.account_id)
    tok = await _tokenizer(st, base)
    prompts = [p if isinstance(p, list) else await asyncio.to_thread(tok.encode, p) for p in req.prompts()]
    if req.stream:
        return await _stream(st, "text", req, tok, prompts, request.state.account_id)
    # Every prompt is its own sample request; they queue together and share decode steps.
    results = await asyncio.gather(*[_sample(st, _sample_body(req, req.model, p, st), request.state.account_id)
                                     for p in prompts])
    return await _answer(st, "text", req, tok, list(zip(prompts, results)))


async def _answer(st: AppState, kind: str, req, tok: text.TextTokenizer,
                  results: list[tuple[list[int], list[text.Sequence]]]):
    stops = req.stop_strings()
    rendered = [text.render(tok, seq, stops) for _, seqs in results for seq in seqs]
    usage = {"prompt_tokens": sum(len(p) for p, _ in results),
             "completion_tokens": sum(len(r.tokens) for r in rendered)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    choices = await asyncio.to_thread(_choices, kind, req, tok, rendered)
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return JSONResponse({**_meta(kind, req), "object": obj, "choices": choices, "usage": usage})


def _meta(kind: str, req) -> dict:
    return {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{time.time_ns():x}", "created": int(time.time()),
            "model": req.model}


async def _stream(st: AppState, kind: str, req, tok: text.TextTokenizer, prompts: list[list[int]], account_id: str):
    """Submit each prompt's request with SampleOp.stream set, one queue subscribed to them all; the
    headers go out with the first event, so an error before any token (a prompt over the context,
    say) is still an ordinary 400, and a queued or quota-paused request holds the call as it does
    unstreamed."""
    bodies = [_sample_body(req, req.model, p, st) for p in prompts]
    # All checked before any runs, in the thread pool (store reads). The submits stay on the loop:
    # each must subscribe in the same loop tick as its submit (control/futures.py).
    prepared = await asyncio.to_thread(lambda: [prepare_asample(st, b, account_id) for b in bodies])
    queue: asyncio.Queue = asyncio.Queue()
    request_ids = []
    for body, p in zip(bodies, prepared):
        # In the logged record too: a driver behind API replicas runs the op as rebuilt from the log
        # (control/claims.py), and streams only what the record says streams.
        op = dataclasses.replace(p.work.op, stream=True)
        record = dataclasses.replace(p.work.record, op=op) if p.work.record is not None else None
        work = dataclasses.replace(p.work, op=op, record=record)
        accepted = st.control.submit(p.request_type, p.target, p.seq_id, body, work, account_id=account_id)
        st.control.hub.subscribe(accepted.request_id, queue)  # same loop tick as submit: nothing is missed
        request_ids.append(accepted.request_id)
    try:
        first = await queue.get()
        if first[1] is None:
            await _outcome(st, first[0])  # raises the failure as an HTTP error
    except BaseException:
        for rid in request_ids:
            st.control.hub.unsubscribe(rid)
        raise
    live = LiveStream(kind, req, tok, prompts, request_ids, _meta(kind, req), lambda rid: _outcome(st, rid))
    return StreamingResponse(live.events(queue, first), media_type="text/event-stream")


def _choices(kind: str, req, tok: text.TextTokenizer, rendered: list[text.Rendered]) -> list[dict]:
    choices = []
    for i, r in enumerate(rendered):
        span = range(len(r.tokens))
        lp = None
        if req.topk() is not None:
            lp = (text.chat_logprobs(tok, r, span, req.return_tokens_as_token_ids) if kind == "chat"
                  else text.completion_logprobs(tok, r, span, req.return_tokens_as_token_ids))
        if kind == "chat":
            choices.append({"index": i, "message": {"role": "assistant", "content": r.text, "refusal": None},
                            "logprobs": lp, "finish_reason": r.finish_reason})
        else:
            choices.append({"index": i, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason})
    return choices
