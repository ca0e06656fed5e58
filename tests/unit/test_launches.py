"""benchmarks/launches.py on the tiny Llama, so the count a GPU round's host work is judged by
(docs/architecture.md §8) cannot rot unseen, and what it shows holds: a shared pass of 4 runs
dispatches far fewer ops per run than a run alone, and an optim_step's ops do not grow with the
adapter's tensors (it takes the gradient bound its forward_backward kept)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def rows(foreach: str, models_dir: Path) -> dict[int, list[float]]:
    out = subprocess.run(
        [sys.executable, "benchmarks/launches.py", "--model", "tinkerd/tiny-llama", "--models-dir", str(models_dir),
         "--tokens", "8", "--rank", "8", "--foreach", foreach, "--time", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = {}
    for line in out.stdout.splitlines():
        cells = line.split()
        if len(cells) == 11 and cells[0].isdigit():
            table[int(cells[0])] = [float(c) for c in cells[1:]]
    assert set(table) == {1, 4}, out.stdout
    return table


@pytest.mark.parametrize("foreach", ["on", "off"])
def test_a_shared_pass_of_four_runs_dispatches_under_half_the_ops_per_run(foreach, tmp_path):
    table = rows(foreach, tmp_path)
    solo, four = table[1], table[4]
    assert four[5] < solo[5] / 2  # per-run ops of a whole round (pass + optim_step)
    # Timed rounds: the ratio column is the rounds' ratio, to the rounding of the printed ms (0.05 each)
    # and of the ratio itself (0.005); the tiny model's rounds take a few ms.
    slack = 0.005 + 0.05 * (1 / solo[8] + four[8] / solo[8] ** 2) + 1e-9
    assert solo[9] == 1.0 and four[8] > 0 and four[9] == pytest.approx(four[8] / solo[8], abs=slack)
    tensors = 2 * 7 * 2  # A and B of 7 linears in each of the tiny Llama's 2 layers
    # The optim_step takes the bound on max |grad| its forward_backward kept (engine/finite.py), on
    # either path: no reduction per tensor (one per tensor before, on the CPU's path).
    assert solo[2] < tensors
