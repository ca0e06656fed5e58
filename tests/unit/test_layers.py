"""Imports only point down: api -> control -> engine (docs/architecture.md). Checked on the source,
lazy imports inside functions included, so a shortcut across the seams fails here first."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import tinkerd

ROOT = Path(tinkerd.__file__).parent

# What each layer must never import (top-level package names). cli wires everything and is free.
FORBIDDEN = {
    # The api reads and writes state through control's repositories and records (control/records.py),
    # never the store's tables or its queries: so the store can change behind them.
    "api": {"tinkerd.engine", "tinkerd.cli", "torch", "transformers", "tinkerd.control.store", "sqlalchemy"},
    "control": {"tinkerd.api", "tinkerd.engine", "tinkerd.cli", "torch", "transformers", "fastapi", "starlette",
                "uvicorn"},
    "engine": {"tinkerd.api", "tinkerd.control", "tinkerd.cli", "tinkerd.config", "fastapi", "starlette",
               "uvicorn", "sqlalchemy"},
    # Shared by every layer, so they import none of them.
    "types.py": {"tinkerd.api", "tinkerd.control", "tinkerd.engine", "tinkerd.cli", "torch"},
    "errors.py": {"tinkerd.api", "tinkerd.control", "tinkerd.engine", "tinkerd.cli", "torch"},
    "lossgraph.py": {"tinkerd.api", "tinkerd.control", "tinkerd.engine", "tinkerd.cli", "torch"},
    "artifacts.py": {"tinkerd.api", "tinkerd.control", "tinkerd.engine", "tinkerd.cli", "torch"},
    "images.py": {"tinkerd.api", "tinkerd.control", "tinkerd.engine", "tinkerd.cli", "torch", "transformers"},
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def violations(layer: str) -> list[str]:
    files = [ROOT / layer] if layer.endswith(".py") else sorted((ROOT / layer).rglob("*.py"))
    found = []
    for path in files:
        for module in imported_modules(path):
            for banned in FORBIDDEN[layer]:
                if module == banned or module.startswith(banned + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {module}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downward(layer):
    assert violations(layer) == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    # The check itself can fail: a control module importing torch inside a function is caught.
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "bad.py").write_text("def f():\n    import torch.nn\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("control") == ["control/bad.py imports torch.nn"]


def test_the_check_sees_the_api_reading_the_store(tmp_path, monkeypatch):
    (tmp_path / "api" / "routes").mkdir(parents=True)
    (tmp_path / "api" / "routes" / "bad.py").write_text(
        "from tinkerd.control.store.tables import FutureRow\nfrom sqlalchemy import select\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(violations("api")) == ["api/routes/bad.py imports sqlalchemy",
                                         "api/routes/bad.py imports tinkerd.control.store.tables"]
