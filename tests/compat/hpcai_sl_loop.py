"""The hpcai client's bundled cookbook recipe `hpcai/cookbook/recipes/sl_loop.py`, run as shipped
against `HPCAI_BASE_URL`, for tests/conformance/test_hpcai.py, in the client's venv.

Patched, only so that it runs offline on the tiny model (its training loop, client calls and
checkpointing are untouched):
- `datasets.load_dataset("HuggingFaceH4/no_robots")` -> ROWS, 16 short conversations in its format;
- `get_tokenizer(model_name)` -> the tiny Qwen3's tokenizer from a local directory (the model name
  has no Hugging Face repo);
- `model_info.get_recommended_renderer_name` -> "qwen3" (the registry does not know the tiny model).
Config: batch 4 (4 steps over the 16 rows), max_length 64, rank 8, save_every 2.

usage: python hpcai_sl_loop.py <base_model> <tokenizer dir> <log dir>
"""

from __future__ import annotations

import sys

import datasets
from hpcai.cookbook.recipes import sl_loop
from transformers import AutoTokenizer

ROWS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
        for a in range(4) for b in range(4)]


def main(base_model: str, tokenizer_dir: str, log_path: str, base_url: str, api_key: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sl_loop.get_tokenizer = lambda name: tokenizer
    sl_loop.model_info.get_recommended_renderer_name = lambda name: "qwen3"
    sl_loop.datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    config = sl_loop.Config(base_url=base_url, api_key=api_key, log_path=log_path, model_name=base_model,
                            batch_size=4, learning_rate=1e-3, max_length=64, lora_rank=8, save_every=2)
    sl_loop.main(config)


if __name__ == "__main__":
    import os

    main(sys.argv[1], sys.argv[2], sys.argv[3], os.environ["HPCAI_BASE_URL"], os.environ["HPCAI_API_KEY"])
