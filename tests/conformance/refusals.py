"""How the conformance tests check a refusal through the SDK: a `user`-category error naming the
problem, either a 400 at submit (tinker.BadRequestError, which the SDK does not retry) or a failed
future (tinker.RequestFailedError)."""

from __future__ import annotations

import pytest
import tinker


def refused(call, *words) -> None:
    """`call()` raises a 400 in the `user` category whose message has every one of `words`."""
    with pytest.raises(tinker.BadRequestError) as info:
        call()
    body = info.value.body if isinstance(info.value.body, dict) else {}
    assert body.get("category") == "user", info.value
    for w in words:
        assert w in str(info.value), info.value


def failed_as_user(future, *words) -> None:
    """`future.result()` fails in the `user` category with every one of `words` in its message."""
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result()
    assert info.value.category == "user", info.value
    for w in words:
        assert w in info.value.message, info.value.message
