"""The headline loop on a real pretrained model: SFT teaches SmolLM2 a made-up fact through the SDK."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from tests.serverproc import API_KEY, start_server

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "Who made you?"
FACT = "I was made by Zorblax Labs."


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("smol-data"), [MODEL], ["--threads", "2"])
    yield srv
    srv.stop()


def _answer(sampler, tok) -> str:
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    out = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=24, temperature=0)).result()
    return tok.decode(out.sequences[0].tokens)


@pytest.mark.slow
def test_chat_sft_teaches_a_made_up_fact(smol_server):
    sc = tinker.ServiceClient(base_url=smol_server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    before = _answer(sc.create_sampling_client(base_model=MODEL).result(), tok)
    assert "Zorblax" not in before

    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": FACT}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    prompt_len = len(tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True, return_dict=False))
    # Train on the assistant's answer only: weight 0 on the prompt positions.
    weights = [0.0 if i + 1 < prompt_len else 1.0 for i in range(len(ids) - 1)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})
    losses = []
    for _ in range(10):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-3))
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.2 * losses[0], losses

    after = _answer(tc.save_weights_and_get_sampling_client().result(), tok)
    assert "Zorblax Labs" in after, (before, after, losses)
