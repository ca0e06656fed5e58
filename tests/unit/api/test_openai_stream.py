"""api/openai_stream.py with a byte-level fake tokenizer and a hand-fed event queue: tokens become
chunks as they arrive, the stored result closes each choice, and a request re-run after an engine
restart either repeats what was sent (skipped) or ends the stream with an error event."""

from __future__ import annotations

import asyncio
import json

from tests.unit.api.test_openai_text import ByteTokenizer, _seq
from tinkerd.api import openai_schema as schema
from tinkerd.api.openai_stream import LiveStream
from tinkerd.types import TokenDelta


def _run(events: list, final: str) -> list:
    """The SSE payloads of a chat stream fed `events` (each (start, text) of row 0) then the end."""
    req = schema.parse(schema.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                      "stream": True})
    seq = _seq(final)

    async def outcome(rid):
        return [seq]

    async def collect():
        queue: asyncio.Queue = asyncio.Queue()
        for start, piece in events:
            ids = list(piece.encode())
            queue.put_nowait(("r", [TokenDelta(0, start, ids, [-0.5] * len(ids))]))
        queue.put_nowait(("r", None))
        live = LiveStream("chat", req, ByteTokenizer(), [[1, 2]], ["r"], {"id": "c"}, outcome)
        return [json.loads(b[6:]) if b != b"data: [DONE]\n\n" else "DONE"
                async for b in live.events(queue, await queue.get())]

    return asyncio.run(collect())


def _content(out: list) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in out if isinstance(c, dict) and c.get("choices"))


def test_each_token_is_a_chunk_and_the_result_closes_the_choice():
    out = _run([(0, "ab"), (2, "c")], "abc")
    assert [c["choices"][0]["delta"] for c in out[:4]] == [{"role": "assistant", "content": ""}, {"content": "a"},
                                                           {"content": "b"}, {"content": "c"}]
    # The EOS token, not streamed here, comes from the stored result; then finish_reason.
    assert out[-2]["choices"][0]["finish_reason"] == "stop" and out[-1] == "DONE"
    assert _content(out) == "abc"


def test_a_rerun_that_repeats_the_sent_tokens_is_skipped():
    out = _run([(0, "ab"), (0, "abc")], "abc")  # the engine restarted after "ab"; greedy repeats it
    assert _content(out) == "abc" and out[-1] == "DONE"


def test_a_rerun_that_differs_ends_the_stream_with_an_error():
    out = _run([(0, "ab"), (0, "xy")], "xyz")
    assert _content(out) == "ab"
    assert out[-2]["error"]["type"] == "server_error" and "re-run differs" in out[-2]["error"]["message"]
    assert out[-1] == "DONE"
