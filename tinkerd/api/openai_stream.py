"""A live OpenAI stream (`stream: true`): server-sent-event chunks sent as the engine decodes.

The route submits each prompt's sample request with `SampleOp.stream` set and subscribes one queue
to all of them (control/futures.py: FutureHub.subscribe). The engine reports a streaming request's
new tokens with every step (StepOutput.partial); control publishes them to the queue, then `None`
once the result is stored. Each token becomes a chunk as it arrives (its text delta by
openai_text.TextStream, its logprobs when asked); the stored result then closes each choice: tokens
the stream has not seen (none, normally), the text the stream held back, and `finish_reason`. So the
chunks' text joins to exactly the non-streamed answer's, and the stored result stays the one truth.

An engine restart re-runs the request from its first token (control re-queues it). Tokens the
reader has sent already are skipped when the re-run repeats them (greedy, or a seed); a re-run that
differs from what was sent ends the stream with an error event, as OpenAI's server does mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

from tinkerd.api import openai_schema as schema
from tinkerd.api import openai_text as text
from tinkerd.errors import ServerError, TinkerdError
from tinkerd.types import TokenDelta

log = logging.getLogger(__name__)

# (request_id, the step's deltas) while a request runs; (request_id, None) once its result is stored.
Event = tuple[str, "list[TokenDelta] | None"]


class LiveStream:
    """The chunks of one streamed completion: `n` choices for each of its sample requests."""

    def __init__(self, kind: str, req, tok: text.TextTokenizer, prompts: list[list[int]], request_ids: list[str],
                 meta: dict, outcome: Callable[[str], Awaitable[list[text.Sequence]]]):
        self.kind, self.req, self.tok, self.meta, self.outcome = kind, req, tok, meta, outcome
        self.prompt_tokens = sum(len(p) for p in prompts)
        # The choice index of a request's row 0: requests in prompt order, `n` choices each.
        self.offset = {rid: i * req.n for i, rid in enumerate(request_ids)}
        self.open = set(request_ids)
        self.choices = [text.TextStream(tok, req.stop_strings()) for _ in range(len(request_ids) * req.n)]

    async def events(self, queue: asyncio.Queue, first: Event) -> AsyncIterator[bytes]:
        """The SSE body: `first` (awaited by the route before the headers went out), then the queue's."""
        try:
            async for c in self._chunks(queue, first):
                yield f"data: {json.dumps(c)}\n\n".encode()
        except TinkerdError as e:  # after the 200: the error travels as an event, then the stream ends
            yield f"data: {json.dumps(schema.error_body(e.status_code, e.message))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def _chunks(self, queue: asyncio.Queue, event: Event) -> AsyncIterator[dict]:
        if self.kind == "chat":
            for i in range(len(self.choices)):
                yield self._chunk(i, {"role": "assistant", "content": ""})
        completion_tokens = 0
        while True:
            rid, deltas = event
            if deltas is not None:
                for d in deltas:
                    for c in self._tokens(self.offset[rid] + d.row, d):
                        yield c
            else:
                self.open.discard(rid)
                for j, seq in enumerate(await self.outcome(rid)):  # raises a failed request's error
                    completion_tokens += len(seq.tokens)
                    for c in self._close(self.offset[rid] + j, seq):
                        yield c
                if not self.open:
                    break
            event = await queue.get()
        if self.req.include_usage:
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": self.prompt_tokens + completion_tokens}
            yield {**self.meta, "object": self._object, "choices": [], "usage": usage}

    def _tokens(self, i: int, d: TokenDelta):
        ts = self.choices[i]
        for k, token in enumerate(d.tokens):
            at = d.start + k
            if at < len(ts.tokens):  # a re-run after an engine restart, repeating what was sent
                if ts.tokens[at] != token:
                    raise _diverged()
                continue
            if at > len(ts.tokens):  # never expected: the stored result fills any gap
                return
            topk = None if d.topk is None else list(zip(d.topk[0][k].tolist(), d.topk[1][k].tolist()))
            yield self._token(i, token, d.logprobs[k], topk)

    def _close(self, i: int, seq: text.Sequence):
        """The stored sequence ends choice i: tokens not streamed, held-back text, finish_reason."""
        ts = self.choices[i]
        if seq.tokens[:len(ts.tokens)] != ts.tokens:
            raise _diverged()
        for k in range(len(ts.tokens), len(seq.tokens)):
            yield self._token(i, seq.tokens[k], seq.logprobs[k], seq.topk[k] if seq.topk is not None else None)
        rendered = text.render(self.tok, seq, self.req.stop_strings())
        rest = ts.rest(rendered.text)
        if rest is None:
            log.error("streamed text is not a prefix of the answer: %r vs %r", ts.text, rendered.text)
            raise _diverged()
        if rest:
            yield self._chunk(i, {"content": rest})
        yield self._chunk(i, {}, finish=rendered.finish_reason)

    def _token(self, i: int, token: int, logprob: float, topk: list[tuple[int, float]] | None) -> dict:
        ts = self.choices[i]
        at = len(ts.text)
        delta = ts.push(token)
        lp = None
        if self.req.topk() is not None:
            one = text.Rendered("", "", [token], [logprob], None if topk is None else [topk])
            as_ids = self.req.return_tokens_as_token_ids
            lp = (text.chat_logprobs(self.tok, one, range(1), as_ids) if self.kind == "chat"
                  else text.completion_logprobs(self.tok, one, range(1), as_ids, at))
        return self._chunk(i, {"content": delta}, lp=lp)

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _chunk(self, index: int, payload: dict, finish: str | None = None, lp: dict | None = None) -> dict:
        if self.kind == "chat":
            choice = {"index": index, "delta": payload, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": payload.get("content", ""), "logprobs": lp, "finish_reason": finish}
        return {**self.meta, "object": self._object, "choices": [choice],
                **({"usage": None} if self.req.include_usage else {})}


def _diverged() -> ServerError:
    return ServerError("the engine restarted while this completion was streamed and the re-run differs from the "
                       "tokens already sent (sampling without a seed); send the request again")
