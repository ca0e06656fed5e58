"""An older commit of this repository unpacked from its git history, for the upgrade tests that
write a data directory with old code and open it with the new (test_op_log, test_schema_upgrade,
test_artifact_keys), and what those tests ask of the run that crosses the upgrade."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def checkout_of(commit: str, what: str, env_var: str, tmp_path_factory) -> Path:
    """The tree of `commit` (`what` names it in the skip reason), or `$env_var`'s checkout of it
    elsewhere. Skips where the history lacks it (a shallow clone)."""
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    out = tmp_path_factory.mktemp(what.replace(" ", "-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"needs the {what} commit {commit[:7]} in this checkout's git history "
                    f"(a shallow clone lacks it): {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def assert_continues(before: list[float], after: list[float], reference: list[float]) -> None:
    """A run trained on the old version (`before`), then recovered and trained on by the new one
    (`after`), against the old version's uninterrupted run: its own steps to the bit, the new
    version's within fp32 rounding. Within one version recovery is exact (test_op_log's other cases,
    test_chaos); across versions the engine may round differently (docs/op-contract.md: Upgrades)."""
    assert before == reference[: len(before)]
    assert after == pytest.approx(reference[len(before):], rel=1e-5)
