"""The rank group's bookkeeping (engine/sharding.py) without starting ranks: how datums split, what
ranks 1..N-1 run of a batch, and the seeds rank 0 draws. The ranks themselves run in
tests/conformance/test_sharding.py."""

from __future__ import annotations

import argparse
import io
import pickle

import numpy as np
import pytest
import torch

from tinkerd.cli import serve
from tinkerd.errors import ServerError, UserError

from tinkerd.engine.sharding import DataParallel, RankGroup, follower_batch, seeded
from tinkerd.types import (AdamParams, ExportWeightsOp, LoadWeightsOp, OptimStepOp, ReleaseAdaptersOp, SampleOp,
                           SamplingParams, SaveWeightsOp, StepBatch)


def _group(rank: int, world: int) -> RankGroup:
    return RankGroup(rank, world, torch.device("cpu"))


def test_datums_split_in_contiguous_blocks_and_a_rank_may_get_none():
    assert _group(0, 2).blocks(3) == [(0, 2), (2, 3)]
    assert _group(0, 4).blocks(10) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert _group(0, 3).blocks(1) == [(0, 1), (1, 1), (1, 1)]
    for world in (1, 2, 3, 5):
        for n in range(1, 12):
            blocks = _group(0, world).blocks(n)
            assert blocks[0][0] == 0 and blocks[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


def test_each_rank_slices_its_own_positions_of_the_whole_batch():
    lengths = [4, 2, 3]  # datum 0 at positions 0-3, datum 1 at 4-5, datum 2 at 6-8
    full = torch.arange(9)
    first, second = DataParallel(_group(0, 2), lengths), DataParallel(_group(1, 2), lengths)
    assert (first.block, first.counts) == ((0, 2), [6, 3])
    assert first.local(full).tolist() == [0, 1, 2, 3, 4, 5]
    assert second.local(full).tolist() == [6, 7, 8]
    empty = DataParallel(_group(1, 2), [5])
    assert empty.count == 0 and empty.local(torch.arange(5)).numel() == 0


def test_other_ranks_write_nothing_and_change_the_same_state():
    adam = AdamParams()
    batch = StepBatch(run=[
        ("a", OptimStepOp("m", adam, snapshot_dir="/snap/seq-3")),
        ("b", SaveWeightsOp("m", "/ckpt/x", True)),
        ("c", ExportWeightsOp("m", "/ckpt/y")),
        ("d", LoadWeightsOp("n", "base", "/ckpt/x", True, snapshot_dir="/snap/seq-1")),
        ("e", ReleaseAdaptersOp(models=[("m", "/snap/seq-4"), ("n", None)], sampler_paths=["/s"])),
        ("f", OptimStepOp("m", adam)),
    ], decode=True)
    out = follower_batch(batch)
    assert [t for t, _ in out.run] == ["a", "d", "e", "f"]
    assert out.run[0][1].snapshot_dir is None and out.run[1][1].snapshot_dir is None
    assert out.run[1][1].dir_path == "/ckpt/x"  # loads still read
    assert out.run[2][1].models == [("m", None), ("n", None)] and out.run[2][1].sampler_paths == ["/s"]
    assert out.decode
    assert batch.run[0][1].snapshot_dir == "/snap/seq-3"  # rank 0's batch is untouched


def test_unseeded_samples_get_one_seed_that_every_rank_shares():
    prompt = np.arange(3)
    given = SampleOp("base", None, prompt, SamplingParams(max_tokens=2, seed=9))
    free = SampleOp("base", None, prompt, SamplingParams(max_tokens=2))
    out = seeded(StepBatch(admit=[("g", given), ("f", free), ("h", free)]))
    seeds = [op.params.seed for _, op in out.admit]
    assert seeds[0] == 9
    assert seeds[1] is not None and seeds[2] is not None and seeds[1] != seeds[2]
    assert free.params.seed is None  # the queued op itself keeps none
    assert follower_batch(out).admit == out.admit  # the followers get these very seeds


@pytest.mark.parametrize("other", [["--engine", "thread"], ["--ray-address", "local"]])
def test_ranks_need_the_process_engine(other):
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    config = serve.build_config(parser.parse_args(["serve", "--engine-ranks", "3", *other]))
    assert config.engine_ranks == 3
    with pytest.raises(UserError, match="--engine-ranks above 1 needs the process engine"):
        serve.build_engine_client(config)  # refused before anything starts


class _Exited(Exception):
    pass


class _FakeEngine:
    """Answers every op of a batch with `outcome` (a result or an exception)."""

    def __init__(self, outcome):
        self.outcome, self.steps = outcome, 0

    def step(self, batch: StepBatch):
        from tinkerd.types import StepOutput

        self.steps += 1
        return StepOutput([(ticket, self.outcome) for ticket, _ in batch.run], active_rows=0)


def _exit_raises(monkeypatch):
    import tinkerd.engine.sharding as sharding

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(sharding.os, "_exit", exit_)


def _pipe(*batches) -> io.BytesIO:
    buf = io.BytesIO()
    for batch in batches:
        pickle.dump(batch, buf)
    buf.seek(0)
    return buf


OPTIM = StepBatch(run=[("opt-1", OptimStepOp("m", AdamParams(learning_rate=1e-3)))])


@pytest.mark.parametrize("outcome", [{"ok": 1}, UserError("bad datum")], ids=["result", "user_error"])
def test_a_follower_goes_on_after_results_and_user_errors(monkeypatch, outcome):
    from tinkerd.engine.sharding import serve_steps

    _exit_raises(monkeypatch)
    engine = _FakeEngine(outcome)
    serve_steps(engine, _pipe(OPTIM, OPTIM), rank=1)
    assert engine.steps == 2


@pytest.mark.parametrize("outcome", [ServerError("RuntimeError: boom"), MemoryError()], ids=["server_error", "memory"])
def test_a_follower_that_fails_an_op_otherwise_exits_instead_of_leaving_rank_0_in_a_collective(monkeypatch, outcome):
    """What made test_sharding hang: rank 1 failed its forward while rank 0 waited in an all_gather,
    and went on to the next batch; rank 0 waited for gloo's 30-minute timeout."""
    from tinkerd.engine.sharding import serve_steps

    _exit_raises(monkeypatch)
    engine = _FakeEngine(outcome)
    with pytest.raises(_Exited):
        serve_steps(engine, _pipe(OPTIM, OPTIM), rank=1)
    assert engine.steps == 1


class _FakeFollowers:
    def __init__(self):
        self.sent, self.killed = [], False

    def check(self):
        pass

    def send(self, batch):
        self.sent.append(batch)

    def kill(self):
        self.killed = True


def _rank_0(outcome):
    from tinkerd.engine.sharding import RankedEngineClient

    client = RankedEngineClient.__new__(RankedEngineClient)  # no group: its collectives are faked away
    client.followers, client.client = _FakeFollowers(), _FakeEngine(outcome)
    return client


def test_rank_0_stops_the_engine_when_an_op_the_ranks_share_fails_otherwise_than_by_its_input(monkeypatch):
    _exit_raises(monkeypatch)
    assert _rank_0(UserError("bad")).step(OPTIM).done[0][1].message == "bad"
    rank_0 = _rank_0(ServerError("RuntimeError: boom"))
    with pytest.raises(_Exited):
        rank_0.step(OPTIM)
    assert rank_0.followers.killed
    # A file write only rank 0 runs: a failed save (a full disk) breaks no collective.
    save = StepBatch(run=[("save-1", SaveWeightsOp("m", "/nowhere", with_optimizer=False))])
    rank_0 = _rank_0(ServerError("disk full"))
    assert rank_0.step(save).done[0][1].message == "disk full" and not rank_0.followers.killed
