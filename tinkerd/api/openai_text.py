"""From a finished Sample future to OpenAI choices: detokenized text, finish_reason, logprobs, and the
per-token text deltas a live stream sends (TextStream).

The tokenizer is the server's own for the base model (`AppState.tokenizers`, wired by cli/serve.py:
the api layer never imports transformers). Text is decoded without special tokens (an EOS such as
`<|im_end|>` is not content), as vLLM does. OpenAI leaves a matched stop string out of the text,
while tinker's sampler returns the tokens up to and including the one that completed it: the text is
cut at the first stop string, the token list (and its logprobs) is kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from tinker.proto import tinker_public_pb2 as pb


class TextTokenizer(Protocol):
    def chat(self, messages: list[dict]) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    topk: list[list[tuple[int, float]]] | None  # per token, best first; None when not asked


def decode_sample_response(payload: bytes) -> list[Sequence]:
    """The stored protobuf SampleResponse (api/codec.py: encode_sample_response) read back."""
    msg = pb.SampleResponse()
    msg.ParseFromString(payload)
    out = []
    for s in msg.sequences:
        tokens = np.frombuffer(s.tokens, dtype=np.int32).tolist()
        lps = np.frombuffer(s.logprobs, dtype=np.float32).tolist()
        topk = None
        if s.HasField("topk_sampled_logprobs") and s.topk_sampled_logprobs.k:
            t = s.topk_sampled_logprobs
            ids = np.frombuffer(t.token_ids, dtype=np.int32).reshape(t.length, t.k)
            vals = np.frombuffer(t.logprobs, dtype=np.float32).reshape(t.length, t.k)
            # Empty cells are (0, -99999.0) (codec._fill_topk).
            topk = [[(int(i), float(v)) for i, v in zip(r_ids, r_vals) if v > -99999.0] for r_ids, r_vals in zip(ids, vals)]
        out.append(Sequence(tokens, lps, "stop" if s.stop_reason == pb.STOP_REASON_STOP else "length", topk))
    return out


@dataclass
class Rendered:
    text: str
    finish_reason: str
    tokens: list[int]
    logprobs: list[float]
    topk: list[list[tuple[int, float]]] | None


def render(tok: TextTokenizer, seq: Sequence, stops: list[str]) -> Rendered:
    text = tok.decode(seq.tokens)
    finish = seq.stop_reason
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    if cuts:
        text, finish = text[:min(cuts)], "stop"
    return Rendered(text, finish, seq.tokens, seq.logprobs, seq.topk)


class TextStream:
    """One choice's text as its tokens arrive (a live stream): `push` returns the text a token adds.
    The joined deltas plus `rest(final text)` equal `render`'s text: a token that ends inside a
    multi-byte character adds nothing until the character is complete, and text that may be the
    start of a stop string is held until a later token shows it is not (nothing past a stop string
    is ever sent)."""

    def __init__(self, tok: TextTokenizer, stops: list[str]):
        self.tok, self.stops = tok, stops
        self.tokens: list[int] = []
        self.text = ""  # sent so far

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tok.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            text = text[:min(cuts)]
        else:
            text = text[:len(text) - _held(text, self.stops)]
        if len(text) <= len(self.text) or not text.startswith(self.text):
            return ""  # a longer prefix decoded differently: `rest` settles it against the final text
        delta, self.text = text[len(self.text):], text
        return delta

    def rest(self, final_text: str) -> str | None:
        """The final text's part not sent yet; None when what was sent is not its prefix."""
        return final_text[len(self.text):] if final_text.startswith(self.text) else None


def _held(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins some stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def _token_name(tok: TextTokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tok.token_text(token_id)


def chat_logprobs(tok: TextTokenizer, r: Rendered, span: range, as_ids: bool) -> dict:
    """choices[].logprobs of a chat completion for the tokens in `span`."""
    content = []
    for i in span:
        name = _token_name(tok, r.tokens[i], as_ids)
        top = [{"token": (n := _token_name(tok, t, as_ids)), "logprob": lp, "bytes": list(n.encode())}
               for t, lp in (r.topk[i] if r.topk is not None else [])]
        content.append({"token": name, "logprob": r.logprobs[i], "bytes": list(name.encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tok: TextTokenizer, r: Rendered, span: range, as_ids: bool, offset: int = 0) -> dict:
    """choices[].logprobs of a legacy completion: parallel lists, top_logprobs as {token: logprob}."""
    names = [_token_name(tok, r.tokens[i], as_ids) for i in span]
    offsets, at = [], offset
    for name in names:
        offsets.append(at)
        at += len(name)
    top = None
    if r.topk is not None:
        top = [{_token_name(tok, t, as_ids): lp for t, lp in r.topk[i]} for i in span]
    return {"tokens": names, "token_logprobs": [r.logprobs[i] for i in span], "top_logprobs": top,
            "text_offset": offsets}
