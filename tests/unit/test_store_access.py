"""Queries are built only in tinkerd/control/store/ (its repositories, one per noun), and tests read what a server recorded through its store and repositories (tests/serverproc.py:
server_store, logged_ops) or through the public API, never by SQL on its SQLite file: such a read
ties a test to one backend and to today's table layout (issue 18). The files below open SQLite
itself for a reason that is SQLite's own, each named."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "tests/unit/control/test_quotas.py": "the accounts table as it was before quotas",
    "tests/unit/control/test_results.py": "the error type SQLite raises when the disk is full",
    "tests/unit/control/test_fsck.py": "another process holding SQLite's lock",
    "tests/unit/control/test_store_probe.py": "another connection holding SQLite's lock",
    "tests/conformance/test_op_log.py": "the schema of the last pre-op-log commit, before the upgrade",
    "tests/conformance/test_artifact_keys.py": "the rows a commit before artifact keys wrote, read beside its "
                                               "running server without migrating them",
    "tests/e2e/test_faults.py": "the SQLite file locked and made read-only under the server",
    "tests/e2e/test_disk_full.py": "the SQLite file on a full disk (opening the store there migrates)",
}


def test_no_test_reads_the_servers_sqlite_file_outside_the_named_exceptions():
    opened = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                    if re.search(r"\bsqlite3\.connect\(", p.read_text()))
    assert [p for p in opened if p not in ALLOWED] == []


STORE = ROOT / "tinkerd" / "control" / "store"
# Store methods that take a SQLAlchemy statement or hand out a SQLAlchemy session.
_RAW = {"query", "rows", "write"}


def _query_building(path: Path) -> list[str]:
    """Where a module imports SQLAlchemy or hands a statement to the store itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "sqlalchemy" for a in node.names):
            found.append(f"{node.lineno}: import sqlalchemy")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
            found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and node.attr in _RAW and (
                (isinstance(node.value, ast.Name) and node.value.id == "store")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "store")):
            found.append(f"{node.lineno}: store.{node.attr}")
    return found


def test_no_module_outside_the_store_builds_a_query():
    """SQL is the store's business (issue 18): control and api call a repository of the noun
    (control/store/sessions.py, runs.py, checkpoints.py, sampling.py, futures.py, accounts.py,
    usage.py), never select(), update() or a session of their own, so a backend or a table layout
    changes in one place."""
    offenders = {str(p.relative_to(ROOT)): hits for p in sorted((ROOT / "tinkerd").rglob("*.py"))
                 if STORE not in p.parents and (hits := _query_building(p))}
    assert offenders == {}
