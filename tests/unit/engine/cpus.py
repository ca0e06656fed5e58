"""Pin engine/cpu.py's column for a test, so both kernel choices are tested on any machine."""

from __future__ import annotations

from tinkerd.engine import cpu

# column: (mkl_avx512, amx) as on that CPU.
COLUMNS = {"amd": (False, False), "intel": (True, True)}


def pin(monkeypatch, column: str) -> None:
    """Make the engine choose its attention kernels as on an AMD EPYC (Zen 5) or an Intel Xeon with AMX."""
    mkl, amx = COLUMNS[column]
    monkeypatch.setattr(cpu, "mkl_avx512", lambda: mkl)
    monkeypatch.setattr(cpu, "amx", lambda: amx)
