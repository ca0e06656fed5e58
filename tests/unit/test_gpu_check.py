"""benchmarks/gpu_check.py's CPU dry path, so the one check a lent GPU machine runs cannot rot
unseen: its tenant phase once imported a helper training_tenants.py no longer had, and nothing
here noticed until a GPU session's first call failed on it. Runs it with `--shape` (random
weights of the tiny model's config), the path a lent machine takes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import TINY_QWEN3
from tinkerd.engine.model.registry import cache_dir_for

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_its_sft_loop_sampling_and_tenant_phase_on_random_weights(engine, models_dir):
    shape = cache_dir_for(TINY_QWEN3, models_dir)  # built by the engine fixture
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--dtype", "float32", "--shape", str(shape),
         "--threads", "1", "--steps", "1", "--rows", "1", "--tokens", "16", "--samples", "2", "--max-tokens", "4",
         "--tenants", "2", "--tenant-rows", "1", "--tenant-tokens", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # The verdict is the BLAS's (MKL on AMD Zen 5: yes; on an Intel Xeon with AMX: no, at 64 and 512
    # rows), which the engine probes for itself (lora/batched.py keeps_bits): here only that it is given.
    assert any(re.match(r"batched LoRA GEMMs == single GEMMs on cpu float32: (yes|no)", line) for line in lines), out.stdout
    assert any(line.startswith("model=") and "random-weights" in line for line in lines), out.stdout
    train = next(line for line in lines if line.startswith("train: "))
    assert float(train.split()[1]) > 0
    tenants = next(line for line in lines if line.startswith("tenants: "))
    assert "2 clients" in tenants and "engine ms per forward_backward" in tenants
    assert any(line.startswith("peak memory: ") for line in lines)
