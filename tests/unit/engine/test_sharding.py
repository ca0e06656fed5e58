"""The rank group's bookkeeping (engine/sharding.py) without starting ranks: how datums split, what
ranks 1..N-1 run of a batch, and the seeds rank 0 draws. The ranks themselves run in
tests/conformance/test_sharding.py."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from tinkerd.cli import serve
from tinkerd.errors import UserError

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
