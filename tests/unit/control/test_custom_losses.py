"""Stored custom losses (control/custom_losses.py): idempotent on (session, custom_loss_seq_id),
per session, bounded in number, and handed to the engine as the data that was checked."""

from __future__ import annotations

import json

import pytest

from tinkerd import lossgraph
from tinkerd.control.custom_losses import CustomLosses
from tinkerd.control.store.db import Store
from tinkerd.errors import UserError

INPUTS = [("logprobs", 1)]


def graph(method: str = "sum") -> dict:
    return {"format": 1, "nodes": [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
        {"op": "call_method", "name": "total", "target": method, "args": [{"ref": "logprobs"}], "kwargs": {}},
        {"op": "call_function", "name": "neg", "target": "operator.neg", "args": [{"ref": "total"}], "kwargs": {}},
        {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": "neg"}, {"dict": {}}]}],
         "kwargs": {}},
    ]}


@pytest.fixture
def losses(tmp_path) -> CustomLosses:
    return CustomLosses(Store.sqlite(tmp_path / "db.sqlite"))


def test_a_resend_gets_the_same_id_and_a_different_loss_under_it_is_refused(losses):
    loss_id = losses.create("s1", 0, "neg_sum", INPUTS, graph())
    assert loss_id == "s1:loss:0"
    assert losses.create("s1", 0, "neg_sum", INPUTS, graph()) == loss_id
    with pytest.raises(UserError, match="custom_loss_seq_id 0 of session s1 already names a different loss"):
        losses.create("s1", 0, "neg_sum", INPUTS, graph("mean"))
    spec = losses.resolve({"loss_id": loss_id}, "s1")
    assert (spec.name, spec.input_names, spec.input_ranks) == ("neg_sum", ["logprobs"], [1])
    assert json.loads(spec.graph_json) == graph()  # data, as checked


def test_handles_are_per_session_and_the_config_must_name_one(losses):
    loss_id = losses.create("s1", 0, "neg_sum", INPUTS, graph())
    with pytest.raises(UserError, match="was not created by this training run's session"):
        losses.resolve({"loss_id": loss_id}, "s2")
    with pytest.raises(UserError, match="was not created"):
        losses.resolve({"loss_id": "s1:loss:9"}, "s1")
    with pytest.raises(UserError, match=r"needs loss_fn_config\['loss_id'\]"):
        losses.resolve({}, "s1")
    with pytest.raises(UserError, match=r"\['beta'\] are not used by custom"):
        losses.resolve({"loss_id": loss_id, "beta": 0.1}, "s1")


def test_a_refused_graph_stores_nothing_and_a_session_has_a_bound(losses, monkeypatch):
    bad = graph("numpy")
    with pytest.raises(UserError, match="method 'numpy'"):
        losses.create("s1", 0, "neg_sum", INPUTS, bad)
    with pytest.raises(UserError, match="was not created"):
        losses.resolve({"loss_id": "s1:loss:0"}, "s1")
    monkeypatch.setattr(lossgraph, "MAX_LOSSES_PER_SESSION", 2)
    losses.create("s1", 0, "a", INPUTS, graph())
    losses.create("s1", 1, "b", INPUTS, graph())
    with pytest.raises(UserError, match="at most 2 are allowed per session"):
        losses.create("s1", 2, "c", INPUTS, graph())
    assert losses.create("s2", 0, "a", INPUTS, graph()) == "s2:loss:0"  # another session's own bound
