"""Recorded sequences (control/stability.py): what a record_stability_info sample leaves, how a
stable_reinforce datum's provenance resolves against it, and every refusal. No engine: samples are
recorded as the worker records them, on an SQLite store in tmp_path, with a fake clock."""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import func, select

from tinkerd.control.stability import StabilityRecords
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import RecordedSampleRow
from tinkerd.errors import UserError
from tinkerd.types import (
    Datum,
    ForwardBackwardOp,
    ProvenanceSpan,
    SampledSequence,
    SampleOp,
    SampleResult,
    SamplingParams,
)

DAY = 86400.0
PROMPT = [11, 12, 13, 14]
SEQS = [([21, 22, 23], [-0.5, -1.5, -2.5]), ([31, 32], [-0.25, -0.75])]


class Clock:
    def __init__(self):
        self.now = datetime(2026, 1, 1)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def records(tmp_path, clock):
    recs = StabilityRecords(Store.sqlite(tmp_path / "t.sqlite"), ttl_s=DAY, clock=clock)
    recs.record("req-a", _sample("sess-1"), _result())
    return recs


def _sample(session: str | None) -> SampleOp:
    return SampleOp("m", None, np.asarray(PROMPT), SamplingParams(max_tokens=3), num_samples=2, record_for_session=session)


def _result() -> SampleResult:
    return SampleResult([SampledSequence(t, lp, "length") for t, lp in SEQS])


def P(seq: str, offset: int, length: int) -> ProvenanceSpan:
    return ProvenanceSpan("prompt", seq, offset, length)


def S(seq: str, offset: int, length: int) -> ProvenanceSpan:
    return ProvenanceSpan("sampled", seq, offset, length)


def _datum(seq="req-a:0", index=0, advantage=1.0, targets=None, tokens=None) -> Datum:
    """As the cookbook builds one: input = prompt + sampled[:-1], targets = prompt[1:] + sampled."""
    sampled = SEQS[index][0]
    full = PROMPT + sampled
    return Datum(
        tokens=np.asarray(tokens if tokens is not None else full[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(targets if targets is not None else full[1:]),
                        "advantages": np.asarray([0.0] * 3 + [advantage] * len(sampled), np.float32)},
        model_input_spans=[P(seq, 0, 4), S(seq, 0, len(sampled) - 1)],
        loss_fn_input_spans=[P(seq, 1, 3), S(seq, 0, len(sampled))],
    )


def _resolve(records, *data, session="sess-1", completed=False) -> ForwardBackwardOp:
    op = ForwardBackwardOp("sess-1:train:0", list(data), "stable_reinforce")
    records.resolve(op, session, completed=completed)
    return op


def test_a_datum_resolves_to_the_recorded_sampler_logprobs(records):
    op = _resolve(records, _datum(), _datum("req-a:1", index=1, advantage=-1.0))
    nan = np.nan
    np.testing.assert_array_equal(op.data[0].sampler_logprobs, np.float32([nan, nan, nan, -0.5, -1.5, -2.5]))
    np.testing.assert_array_equal(op.data[1].sampler_logprobs, np.float32([nan, nan, nan, -0.25, -0.75]))


def test_a_sample_without_record_stability_info_records_nothing(records, tmp_path):
    records.record("req-b", _sample(None), _result())
    with pytest.raises(UserError, match="datum 0: sequence_id 'req-b:0' was not sampled in this session"):
        _resolve(records, _datum("req-b:0"))


@pytest.mark.parametrize("seq", ["req-zzz:0", "req-a:2", "req-a:x", "req-a", ""])
def test_unknown_sequence_ids_are_refused_naming_the_datum(records, seq):
    with pytest.raises(UserError, match=f"datum 1: sequence_id '{seq}' was not sampled in this session"):
        _resolve(records, _datum(), _datum(seq))


def test_another_sessions_sequence_answers_like_an_unknown_one(records):
    with pytest.raises(UserError, match="datum 0: sequence_id 'req-a:0' was not sampled in this session") as e:
        _resolve(records, _datum(), session="sess-2")
    assert "expired" not in str(e.value)


def test_a_datum_without_provenance_is_refused(records):
    d = _datum()
    d.model_input_spans = d.loss_fn_input_spans = None
    with pytest.raises(UserError, match="datum 1: loss_fn stable_reinforce needs provenance on every datum"):
        _resolve(records, _datum(), d)


def test_claims_that_do_not_match_the_record_are_refused(records):
    cases = {
        "loss_fn_input_spans cover 5 positions but target_tokens has 6": dict(
            loss_fn_input_spans=[P("req-a:0", 1, 3), S("req-a:0", 0, 2)]),
        "model_input_spans cover 4 positions but model_input has 6": dict(model_input_spans=[P("req-a:0", 0, 4)]),
        r"SampledProvenanceSpan \[1:4\] is outside the 3 tokens": dict(
            loss_fn_input_spans=[P("req-a:0", 0, 3), S("req-a:0", 1, 3)]),
        r"PromptProvenanceSpan \[2:5\] is outside the 4-token prompt": dict(
            loss_fn_input_spans=[P("req-a:0", 2, 3), S("req-a:0", 0, 3)]),
    }
    for message, fields in cases.items():
        d = _datum()
        for k, v in fields.items():
            setattr(d, k, v)
        with pytest.raises(UserError, match=f"datum 0: {message}"):
            _resolve(records, d)
    with pytest.raises(UserError, match=r"datum 0: target_tokens\[3:6\] are not the tokens sequence 'req-a:0' sampled"):
        _resolve(records, _datum(targets=[12, 13, 14, 21, 22, 99]))
    with pytest.raises(UserError, match=r"datum 0: model_input\[0:4\] are not the prompt tokens"):
        _resolve(records, _datum(tokens=[11, 12, 13, 15, 21, 22]))
    with pytest.raises(UserError, match=r"advantages\[0:3\] \(a PromptProvenanceSpan\) are not all 0"):
        d = _datum()
        d.loss_fn_inputs["advantages"][1] = 0.5
        _resolve(records, d)
    # A datum whose targets are all prompt has nothing to train on.
    d = _datum()
    d.tokens, d.loss_fn_inputs = d.tokens[:3], {"target_tokens": np.asarray(PROMPT[1:]), "advantages": np.zeros(3)}
    d.model_input_spans, d.loss_fn_input_spans = [P("req-a:0", 0, 3)], [P("req-a:0", 1, 3)]
    with pytest.raises(UserError, match="datum 0: no target is a sampled token"):
        _resolve(records, d)


def test_prompt_targets_padded_with_zeros_are_accepted(records):
    """The cookbook's rl_loop sends target 0 at prompt positions: those targets carry no loss."""
    op = _resolve(records, _datum(targets=[0, 0, 0, 21, 22, 23]))
    assert np.isnan(op.data[0].sampler_logprobs[:3]).all()


def test_records_expire_a_day_after_their_last_use_then_are_forgotten(records, clock):
    clock.advance(DAY - 10)
    _resolve(records, _datum())  # a use restarts the day
    clock.advance(DAY - 10)
    _resolve(records, _datum("req-a:1", index=1))  # 2 days after sampling: still live
    clock.advance(DAY + 1)
    with pytest.raises(UserError, match="datum 0: sequence_id 'req-a:0' has expired.*one day after sampling or their last use"):
        _resolve(records, _datum())
    # A completed op being replayed may still use a record that is due while its payload is kept.
    _resolve(records, _datum(), completed=True)
    assert records.sweep() == (1, 0)  # the payload goes; the tombstone still says "expired"
    with pytest.raises(UserError, match="has expired"):
        _resolve(records, _datum(), completed=True)
    clock.advance(DAY)
    assert records.sweep() == (0, 1)
    with pytest.raises(UserError, match="was not sampled in this session"):
        _resolve(records, _datum())
    n = records.store.query(select(func.count()).select_from(RecordedSampleRow))
    assert n == [0]


def test_a_rerun_after_a_crash_overwrites_its_record(records):
    """A sample re-run after a restart (its first result was never stored) records its new tokens."""
    records.record("req-a", _sample("sess-1"), SampleResult([SampledSequence([41, 42, 43], [-1.0, -1.0, -1.0], "stop"),
                                                              SampledSequence([31, 32], [-0.25, -0.75], "stop")]))
    with pytest.raises(UserError, match="are not the tokens sequence 'req-a:0' sampled"):
        _resolve(records, _datum())
    assert records.store.query(select(func.count()).select_from(RecordedSampleRow)) == [1]
