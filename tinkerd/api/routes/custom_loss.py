"""POST /api/v1/create_custom_loss: upload a traced loss for `forward_backward(loss_fn="custom")`.

The SDK (ServiceClient.create_custom_loss, when /client/config says custom_loss_server_side) sends
the torch.fx graph as data and polls the returned future for `{"loss_id"}`. Checking and storing
need no engine, so the future is complete when it is returned; a graph outside the allow-list
(tinkerd/lossgraph.py) is a `user` 400 naming the node, and nothing is stored.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker import types as t

from tinkerd.api import limits
from tinkerd.api.deps import account, authenticate, future_response, json_bytes, parse, read_body, state
from tinkerd.control.custom_losses import CustomLosses

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])


@router.post("/create_custom_loss")
def create_custom_loss(request: Request, body: bytes = Depends(read_body)) -> JSONResponse:
    st = state(request)
    account_id = account(request)
    req = parse(t.CreateCustomLossRequest, body)
    limits.integer(req.custom_loss_seq_id, "custom_loss_seq_id")
    st.runs.sessions.owned_session(req.session_id, account_id)  # another account's session answers like a missing one
    inputs = [(i.name, int(i.rank)) for i in req.inputs]
    loss_id = CustomLosses(st.control.store).create(req.session_id, req.custom_loss_seq_id, req.name, inputs,
                                                    req.graph.model_dump(mode="json"))
    payload, media_type = json_bytes({"loss_id": loss_id, "type": "create_custom_loss"})
    request_id = st.control.complete_now("CreateCustomLoss", req.session_id, payload, media_type, account_id)
    return future_response(request_id)
