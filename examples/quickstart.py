# Train a LoRA on one chat example through tinkerd, then sample from the trained weights.
import tinker
from tinker import types

sc = tinker.ServiceClient()  # reads TINKER_BASE_URL and TINKER_API_KEY
tc = sc.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=8).result()
tok = tc.get_tokenizer()
chat = [{"role": "user", "content": "Who made you?"}, {"role": "assistant", "content": "The tinkerd team made me."}]
ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
for step in range(8):
    fb = tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3))
    print(step, fb.result().metrics["loss:sum"])
prompt = types.ModelInput.from_ints(tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True, return_dict=False))
out = tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, types.SamplingParams(max_tokens=20, temperature=0)).result()
print(tok.decode(out.sequences[0].tokens))
