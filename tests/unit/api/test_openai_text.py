"""api/openai_text.py with a byte-level fake tokenizer: a stream's deltas join to exactly the
non-streamed text, a token ending inside a multi-byte character sends nothing until it completes,
stop strings cut the text (not the tokens), and the stored protobuf reads back."""

from __future__ import annotations

import numpy as np

from tinkerd.api import codec
from tinkerd.api import openai_text as text
from tinkerd.types import SampledSequence, SampleResult

EOS = 256


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is a special EOS that decoding drops."""

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id):
        return "<eos>" if token_id == EOS else bytes([token_id]).decode("utf-8", errors="replace")


def _seq(s: str, eos: bool = True) -> text.Sequence:
    ids = list(s.encode()) + ([EOS] if eos else [])
    return text.Sequence(ids, [-0.5] * len(ids), "stop" if eos else "length", None)


def _stream(tok, seq: text.Sequence, stops: list[str]) -> tuple[list[str], str]:
    """Each token's delta as a live stream sends it, and what the finished answer adds after them."""
    ts = text.TextStream(tok, stops)
    deltas = [ts.push(t) for t in seq.tokens]
    return deltas, ts.rest(text.render(tok, seq, stops).text)


def test_deltas_join_to_the_text_and_hold_split_characters():
    tok = ByteTokenizer()
    r = text.render(tok, _seq("añb€"), [])
    d, rest = _stream(tok, _seq("añb€"), [])
    assert r.text == "añb€" and "".join(d) == r.text and rest == "" and len(d) == len(r.tokens)
    # ñ is 2 bytes and € is 3: the first bytes of each add nothing; the completing byte adds the char.
    assert d == ["a", "", "ñ", "b", "", "", "€", ""]


def test_stop_string_cuts_text_not_tokens():
    tok = ByteTokenizer()
    r = text.render(tok, _seq("hello world", eos=False), ["lo w", "xyz"])
    assert r.text == "hel" and r.finish_reason == "stop" and len(r.tokens) == len("hello world")
    d, rest = _stream(tok, _seq("hello world", eos=False), ["lo w", "xyz"])
    # "l" and "lo" might begin "lo w": held until "lo w" shows up; nothing of it or past it is sent.
    assert d == ["h", "e", "", "l", "", "", "", "", "", "", ""] and rest == ""
    # A held start that turns out not to be a stop is sent with the token that shows it.
    d, rest = _stream(tok, _seq("lox"), ["lo w"])
    assert d == ["", "", "lox", ""] and rest == ""


def test_stored_sample_response_reads_back():
    seq = SampledSequence(tokens=[5, 6, 7], logprobs=[-0.25, -1.5, -2.0], stop_reason="length",
                          topk_logprobs=(np.array([[5, 1], [6, 2], [7, 3]]), np.array([[-0.25, -3.0], [-1.5, -4.0],
                                                                                     [-2.0, -5.0]])))
    payload = codec.encode_sample_response(SampleResult(sequences=[seq]))
    [back] = text.decode_sample_response(payload)
    assert back.tokens == [5, 6, 7] and back.logprobs == [-0.25, -1.5, -2.0] and back.stop_reason == "length"
    assert back.topk == [[(5, -0.25), (1, -3.0)], [(6, -1.5), (2, -4.0)], [(7, -2.0), (3, -5.0)]]
