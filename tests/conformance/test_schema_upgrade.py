"""A data directory written by a7d511c, the last tinkerd that made its tables with create_all (no
migrations), upgrades on start (control/store/migrations.py: the baseline revision adopts it): the
run it holds, with ops accepted and not yet run when that server was killed, recovers with exact
losses, and its runs and checkpoints are all still there. The old code is unpacked from this
repository's history, as in test_op_log.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from tests.conformance.conftest import TINY
from tests.conformance.test_op_log import ARGS, _client, _kill, _port
from tests.conformance.test_retention import ADAM, _batch, _train
from tests.history import assert_continues, checkout_of
from tests.serverproc import start_server
from tinkerd.config import ServerConfig
from tinkerd.control.store.db import Store
from tinkerd.control.store.migrations import SCRIPTS, current

# The last commit before migrations (TINKERD_PRE_MIGRATIONS_CHECKOUT: a checkout of it elsewhere).
PRE_MIGRATIONS_COMMIT = "a7d511c7da5e525ab4b219e819f0d4539892a9b7"


@pytest.fixture(scope="module")
def old_checkout(tmp_path_factory) -> Path:
    return checkout_of(PRE_MIGRATIONS_COMMIT, "pre-migrations", "TINKERD_PRE_MIGRATIONS_CHECKOUT", tmp_path_factory)


def test_a_data_dir_from_before_migrations_upgrades_and_recovers_exactly(tmp_path, old_checkout):
    assert not (old_checkout / "tinkerd" / "control" / "store" / "migrations.py").exists()
    args = ARGS + _port()
    old = start_server(tmp_path, [TINY], args, launcher=["env", "-C", str(old_checkout)])
    try:
        sc = _client(old)
        reference = _train(sc.create_lora_training_client(base_model=TINY, rank=8, seed=9).result(), range(5))
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=9).result()
        first = _train(tc, range(2))
        saved = tc.save_state("before-upgrade").result().path
        fb = tc.forward_backward(_batch(2), "cross_entropy")  # accepted; may still be pending at the kill
        step = tc.optim_step(ADAM)
        _kill(old)
    finally:
        old.stop()
    new = start_server(tmp_path, [TINY], args)
    try:
        step.result()
        rest = [fb.result().metrics["loss:sum"]] + _train(tc, range(3, 5))
        listing = _client(new).create_rest_client()
        runs = {r.training_run_id for r in listing.list_training_runs(limit=100).result().training_runs}
        assert len(runs) == 2 and tc.model_id in runs
        assert saved in [c.tinker_path for c in listing.list_checkpoints(tc.model_id).result().checkpoints]
    finally:
        new.stop()
    assert_continues(first, rest, reference)
    assert current(Store.open(ServerConfig(data_dir=tmp_path, db_url=None)).engine) == \
        ScriptDirectory(str(SCRIPTS)).get_current_head()
