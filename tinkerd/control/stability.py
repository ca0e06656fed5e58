"""Recorded sequences for StableReinforce: written when a record_stability_info sample finishes,
resolved when a stable_reinforce forward_backward names them through its provenance spans.

The contract (the Tinker docs' StableReinforce and Datum pages, SDK 0.38):
- a sampling request with `record_stability_info` has every sequence it samples recorded; each
  returned sequence carries a `sequence_id` (`{request_id}:{i}`, handed out with the asample
  future: api/routes/sampling.py);
- recorded sequences belong to the session that sampled them: a training request can only name
  sequences sampled in its own session; a sequence of another session (so of any other account)
  answers exactly like one that was never recorded;
- they can be trained on for one day (`recorded_sequence_ttl_s`) after sampling, and each training
  request that names one restarts that day. Expired records lose their payload and are kept as
  tombstones for one more TTL, so the owner hears "expired" rather than "unknown"; then the row goes.

What is recorded is what the loss needs and the checks need, nothing else: the prompt tokens, and
per sequence its sampled tokens and the sampler's log-prob of each (the engine's own numbers, not
the copy the client gets back and may change). About 8 bytes per sampled token plus 4 per prompt
token. Resolution turns the spans into Datum.sampler_logprobs ([N], NaN off sampled tokens) after
checking every claim: spans tile their field, offsets lie inside the named sequence, the tokens the
datum says came from a sequence are that sequence's tokens, and prompt targets carry no advantage.
Every violation is a UserError naming the datum (a 400 before the op is queued).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

import numpy as np

from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.sampling import RecordedSampleRepository
from tinkerd.control.store.tables import RecordedSampleRow
from tinkerd.errors import UserError
from tinkerd.types import (
    Datum,
    ForwardBackwardOp,
    ProvenanceSpan,
    SampleOp,
    SampleResult,
)

log = logging.getLogger(__name__)

# Expired payloads are cleared, and old tombstones deleted, at most this often (on the worker, when a
# new sample is recorded): retention is a day, so a minute of slack costs nothing.
SWEEP_INTERVAL_S = 60.0


class _Recorded:
    """One recorded request, decoded: its prompt and its sequences' tokens and sampler log-probs."""

    def __init__(self, row: RecordedSampleRow):
        self.prompt = np.frombuffer(row.prompt, dtype=np.int32)
        lengths = np.frombuffer(row.lengths, dtype=np.int64)
        tokens = np.frombuffer(row.tokens, dtype=np.int32)
        logprobs = np.frombuffer(row.logprobs, dtype=np.float32)
        cuts = np.cumsum(lengths)[:-1]
        self.tokens = np.split(tokens, cuts)
        self.logprobs = np.split(logprobs, cuts)


class StabilityRecords:
    def __init__(self, store: Store, ttl_s: float = 86400.0, clock=utcnow):
        self.store = store
        self.records = RecordedSampleRepository(store)
        self.ttl = timedelta(seconds=ttl_s)
        self._clock = clock
        self._last_sweep: datetime | None = None
        self._sweep_lock = threading.Lock()

    # -- at sampling time (on the worker, control/results.py, before the future completes) ----------

    def record(self, request_id: str, op: object, result: object) -> None:
        """Record a finished sample made with record_stability_info; any other op is ignored. Safe to
        redo: a re-run after a crash (whose first result nobody saw) overwrites the row."""
        if not isinstance(op, SampleOp) or op.record_for_session is None or not isinstance(result, SampleResult):
            return
        now = self._clock()
        seqs = result.sequences
        row = RecordedSampleRow(
            request_id=request_id,
            session_id=op.record_for_session,
            prompt=np.asarray(op.prompt, dtype=np.int32).tobytes(),
            lengths=np.asarray([len(s.tokens) for s in seqs], dtype=np.int64).tobytes(),
            tokens=np.concatenate([np.asarray(s.tokens, dtype=np.int32) for s in seqs] or [np.zeros(0, np.int32)]).tobytes(),
            logprobs=np.concatenate([np.asarray(s.logprobs, dtype=np.float32) for s in seqs]
                                    or [np.zeros(0, np.float32)]).tobytes(),
            created_at=now,
            expires_at=now + self.ttl,
        )
        self.records.put(row)
        if self._last_sweep is None or now - self._last_sweep > timedelta(seconds=SWEEP_INTERVAL_S):
            self.sweep(now)

    def sweep(self, now: datetime | None = None) -> tuple[int, int]:
        """Clear expired payloads (leaving tombstones) and delete tombstones a TTL old. Returns both counts."""
        now = now or self._clock()
        with self._sweep_lock:
            self._last_sweep = now
            cleared, deleted = self.records.clear_expired(now, now - self.ttl)
        if cleared or deleted:
            log.info("recorded sequences: %d expired, %d forgotten", cleared, deleted)
        return cleared, deleted

    # -- at training time (api/routes/training.py, before the op is queued) --------------------------

    def resolve(self, op: ForwardBackwardOp, session_id: str, completed: bool = False) -> None:
        """Fill every datum's sampler_logprobs from the records its provenance names, checking every
        claim, then restart the named records' day. `completed`: a replay of an op that already ran
        (api/legacy.py); a record it used is accepted while its payload is kept, even if due."""
        now = self._clock()
        cache: dict[str, _Recorded] = {}
        for i, datum in enumerate(op.data):
            datum.sampler_logprobs = self._resolve_datum(i, datum, session_id, now, completed, cache)
        if cache and not completed:
            self.records.extend(list(cache), now + self.ttl)

    def _resolve_datum(self, i: int, datum: Datum, session_id: str, now: datetime, completed: bool,
                       cache: dict[str, _Recorded]) -> np.ndarray:
        spans = datum.loss_fn_input_spans
        if spans is None:
            raise UserError(f"datum {i}: loss_fn stable_reinforce needs provenance on every datum "
                            "(Datum.with_provenance naming the sequence_ids of a record_stability_info sampler)")
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None or np.ndim(targets) != 1:
            raise UserError(f"datum {i}: stable_reinforce needs 1-D target_tokens")
        n = len(targets)
        _check_tiling(i, "loss_fn_input_spans", "target_tokens", spans, n)
        advantages = datum.loss_fn_inputs.get("advantages")
        if advantages is not None and np.shape(advantages) != (n,):
            raise UserError(f"datum {i}: advantages has shape {list(np.shape(advantages))} but target_tokens has [{n}]")
        sampler_logprobs = np.full(n, np.nan, dtype=np.float32)
        pos = 0
        for span in spans:
            rec = self._lookup(i, span.sequence_id, session_id, now, completed, cache)
            rows = slice(pos, pos + span.length)
            if span.kind == "sampled":
                seq_tokens, seq_logprobs = _sequence(rec, i, span)
                if not np.array_equal(np.asarray(targets[rows]), seq_tokens):
                    raise UserError(f"datum {i}: target_tokens[{pos}:{pos + span.length}] are not the tokens sequence "
                                    f"{span.sequence_id!r} sampled at [{span.offset}:{span.offset + span.length}]")
                sampler_logprobs[rows] = seq_logprobs
            else:
                _prompt(rec, i, span)  # in range; prompt targets are not checked: the cookbook's rl_loop pads them with 0
                if advantages is not None and np.any(np.asarray(advantages)[rows] != 0):
                    raise UserError(f"datum {i}: stable_reinforce takes advantages only on sampled tokens, but "
                                    f"advantages[{pos}:{pos + span.length}] (a PromptProvenanceSpan) are not all 0")
            pos += span.length
        if datum.model_input_spans is not None:
            tokens = np.asarray(datum.tokens)
            _check_tiling(i, "model_input_spans", "model_input", datum.model_input_spans, len(tokens))
            pos = 0
            for span in datum.model_input_spans:
                rec = self._lookup(i, span.sequence_id, session_id, now, completed, cache)
                claimed = _sequence(rec, i, span)[0] if span.kind == "sampled" else _prompt(rec, i, span)
                if not np.array_equal(tokens[pos:pos + span.length], claimed):
                    raise UserError(f"datum {i}: model_input[{pos}:{pos + span.length}] are not the {span.kind} tokens "
                                    f"[{span.offset}:{span.offset + span.length}] of sequence {span.sequence_id!r}")
                pos += span.length
        if not np.isfinite(sampler_logprobs).any():
            raise UserError(f"datum {i}: no target is a sampled token (a SampledProvenanceSpan), so stable_reinforce "
                            "has nothing to train on")
        return sampler_logprobs

    def _lookup(self, i: int, sequence_id: str, session_id: str, now: datetime, completed: bool,
                cache: dict[str, _Recorded]) -> tuple[_Recorded, int]:
        request_id, _, index = sequence_id.rpartition(":")
        unknown = UserError(f"datum {i}: sequence_id {sequence_id!r} was not sampled in this session with "
                            "record_stability_info=True (provenance works only within one session)")
        if not index.isdigit():
            raise unknown
        rec = cache.get(request_id)
        if rec is None:
            row = self.records.get(request_id)
            if row is None or row.session_id != session_id:
                raise unknown
            if row.tokens is None or (row.expires_at < now and not completed):
                raise UserError(f"datum {i}: sequence_id {sequence_id!r} has expired: recorded sequences can be "
                                f"trained on for {_duration(self.ttl)} after sampling or their last use")
            rec = cache[request_id] = _Recorded(row)
        if int(index) >= len(rec.tokens):
            raise unknown
        return rec, int(index)


def _sequence(found: tuple[_Recorded, int], i: int, span: ProvenanceSpan) -> tuple[np.ndarray, np.ndarray]:
    rec, index = found
    tokens = rec.tokens[index]
    if span.offset + span.length > len(tokens):
        raise UserError(f"datum {i}: SampledProvenanceSpan [{span.offset}:{span.offset + span.length}] is outside "
                        f"the {len(tokens)} tokens sequence {span.sequence_id!r} sampled")
    rows = slice(span.offset, span.offset + span.length)
    return tokens[rows], rec.logprobs[index][rows]


def _prompt(found: tuple[_Recorded, int], i: int, span: ProvenanceSpan) -> np.ndarray:
    rec, _ = found
    if span.offset + span.length > len(rec.prompt):
        raise UserError(f"datum {i}: PromptProvenanceSpan [{span.offset}:{span.offset + span.length}] is outside "
                        f"the {len(rec.prompt)}-token prompt of sequence {span.sequence_id!r}")
    return rec.prompt[span.offset:span.offset + span.length]


def _check_tiling(i: int, field: str, what: str, spans: list[ProvenanceSpan], n: int) -> None:
    covered = sum(s.length for s in spans)
    if covered != n:
        raise UserError(f"datum {i}: {field} cover {covered} positions but {what} has {n}; the runs must tile it exactly")


def _duration(td: timedelta) -> str:
    s = td.total_seconds()
    return "one day" if s == 86400 else f"{s:g} s"
