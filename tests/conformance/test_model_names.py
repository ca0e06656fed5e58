"""Model names and limits as the hosted service has them (issue 22 item 6), through the unmodified SDK:
get_server_capabilities' context lengths, the long-context id `<hf id>:peft:<tokens>`, get_info.arch."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.refusals import refused
from tests.conformance.test_op_log import ARGS, _client, _kill, _port, _train
from tests.serverproc import API_KEY, start_server

# The tiny models' config (engine/model/tiny.py: max_position_embeddings=4096), and a variant well under it.
OWN_CONTEXT = 4096
SHORT = 64
VARIANT = f"{TINY}:peft:{SHORT}"
GREEDY_1 = types.SamplingParams(max_tokens=1, temperature=0.0)


def _datum(n: int) -> types.Datum:
    tokens = [(7 * i) % 1000 + 1 for i in range(n)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": tokens[1:] + [0], "weights": [1.0] * n})


def _prompt(n: int) -> types.ModelInput:
    return types.ModelInput.from_ints([(11 * i) % 1000 + 1 for i in range(n)])


def test_capabilities_list_each_model_with_its_context_length(server):
    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    models = {m.model_name: m for m in rest.get_server_capabilities().result().supported_models}
    assert {n: m.max_context_length for n, m in models.items()} == {TINY: OWN_CONTEXT, "tinkerd/tiny-llama": OWN_CONTEXT}
    assert all(m.trainable and m.sampleable for m in models.values())


def test_long_context_id_trains_within_its_limit_and_refuses_past_it(sc):
    tc = sc.create_lora_training_client(base_model=VARIANT, rank=4, seed=3).result()
    info = tc.get_info()
    # The name as asked (the SDK strips the suffix itself for the tokenizer), the base's architecture.
    assert info.model_data.model_name == VARIANT and info.model_name == VARIANT
    assert info.model_data.arch == "Qwen3ForCausalLM"
    assert tc.get_tokenizer() is not None

    # Same base: the variant's adapter computes what the base's does, from the same seed.
    base = sc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    at_limit = [_datum(SHORT)]
    loss = tc.forward(at_limit, "cross_entropy").result().metrics["loss:sum"]
    assert loss == base.forward(at_limit, "cross_entropy").result().metrics["loss:sum"]

    refused(lambda: tc.forward_backward([_datum(SHORT + 1)], "cross_entropy").result(),
            f"{SHORT + 1} tokens exceed the model's context length of {SHORT}")
    # The base itself keeps its own limit.
    base.forward([_datum(SHORT + 1)], "cross_entropy").result()

    # Its sampler (save_weights_and_get_sampling_client carries get_info's model_name) has the limit too.
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert len(sampler.sample(_prompt(SHORT - 1), 1, GREEDY_1).result().sequences[0].tokens) == 1
    refused(lambda: sampler.sample(_prompt(SHORT), 1, GREEDY_1).result(),
            f"prompt ({SHORT} tokens) + max_tokens (1) exceeds the model's context length of {SHORT}")


def test_long_context_id_samples_within_its_limit(sc):
    variant = sc.create_sampling_client(base_model=VARIANT).result()
    base = sc.create_sampling_client(base_model=TINY).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    got = variant.sample(_prompt(SHORT - 4), 1, params).result().sequences[0]
    assert got.tokens == base.sample(_prompt(SHORT - 4), 1, params).result().sequences[0].tokens
    refused(lambda: variant.sample(_prompt(SHORT - 3), 1, params).result(), "context length of 64")
    refused(lambda: variant.sample(_prompt(4), 1, types.SamplingParams(max_tokens=SHORT + 1)).result(),
            "max_tokens must be between 1 and the model's context length of 64")
    base.sample(_prompt(SHORT - 3), 1, params).result()  # the base's limit is its own


@pytest.mark.parametrize("name, words", [
    (f"{TINY}:peft:{OWN_CONTEXT + 1}", ["asks for a context length of 4097", "supports 1 to 4096"]),
    (f"{TINY}:peft:0", ["asks for a context length of 0"]),
    (f"{TINY}:peft:lots", ["malformed", ":peft:<context tokens>"]),
    (f"{TINY}:lora:64", ["malformed"]),
    (f"{TINY}:peft:", ["malformed"]),
    ("tinkerd/no-such-model:peft:64", ["not served here"]),
])
def test_bad_long_context_ids_are_user_errors(sc, name, words):
    refused(lambda: sc.create_lora_training_client(base_model=name, rank=4).result(), *words)
    refused(lambda: sc.create_sampling_client(base_model=name).result().sample(_prompt(3), 1, GREEDY_1).result(),
            *words)


def test_a_variant_at_the_base_limit_is_the_base(sc):
    full = sc.create_sampling_client(base_model=f"{TINY}:peft:{OWN_CONTEXT}").result()
    assert len(full.sample(_prompt(3), 1, GREEDY_1).result().sequences[0].tokens) == 1


def test_a_long_context_run_recovers_exactly_after_a_restart_with_its_limit(tmp_path):
    # The run's name is the long-context id; recovery rebuilds it on the base (control/recovery.py).
    args = ARGS + _port()
    srv = start_server(tmp_path, [TINY], args)
    try:
        sc = _client(srv)
        reference = _train(sc.create_lora_training_client(base_model=TINY, rank=4, seed=9).result(), range(6))
        tc = sc.create_lora_training_client(base_model=VARIANT, rank=4, seed=9).result()
        first = _train(tc, range(3))
        _kill(srv)
        srv = start_server(tmp_path, [TINY], args)
        rest = _train(tc, range(3, 6))  # the same client: its seq_ids go on
        refused(lambda: tc.forward([_datum(SHORT + 1)], "cross_entropy").result(), f"context length of {SHORT}")
    finally:
        srv.stop()
    assert first + rest == reference
