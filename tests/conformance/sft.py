"""The supervised step the conformance tests train an adapter with before checking what it serves
(test_openai, test_inflight, test_cookbook_weights): cross_entropy on one text, every target
weighted 1, then Adam."""

from __future__ import annotations

from tinker import types


def next_token_datum(tokens: list[int]) -> types.Datum:
    """Predict tokens[1:] from tokens[:-1], each target weighted 1."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def train_on(tc, tokens: list[int], steps: int, learning_rate: float) -> None:
    """`steps` forward_backward + optim_step pairs on the one text, sent pipelined; returns when the
    last optim_step is done, so what is saved next has every step in it."""
    datum = next_token_datum(tokens)
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy")
        last = tc.optim_step(types.AdamParams(learning_rate=learning_rate))
    last.result()
