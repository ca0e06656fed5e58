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


def losses(tc, data: list[types.Datum], steps: int, learning_rate: float) -> list[float]:
    """`steps` cross_entropy forward_backward + Adam optim_step pairs on `data`, sent pipelined;
    each step's loss:sum."""
    futures = []
    for _ in range(steps):
        futures.append(tc.forward_backward(data, "cross_entropy"))
        tc.optim_step(types.AdamParams(learning_rate=learning_rate))
    return [f.result().metrics["loss:sum"] for f in futures]


def assert_loss_falls_and_resumes_exactly(service_client, tc, data: list[types.Datum], learning_rate: float) -> None:
    """8 steps halve the loss; then save_state, and 3 more steps of a client loaded from it
    (create_training_client_from_state_with_optimizer) give exactly the losses of 3 more on `tc`."""
    first = losses(tc, data, 8, learning_rate)
    assert first[-1] < 0.5 * first[0], first
    path = tc.save_state("k8").result().path
    uninterrupted = losses(tc, data, 3, learning_rate)
    resumed = losses(service_client.create_training_client_from_state_with_optimizer(path).result(), data, 3, learning_rate)
    assert resumed == uninterrupted, (uninterrupted, resumed)
