"""The server's tokenizers, for the OpenAI-compatible endpoints (api/routes/openai.py), loaded once
per base model with transformers' AutoTokenizer from the files the engine loaded the model from.

Here, not in api/: the api layer may not import transformers (tests/unit/test_layers.py), because
with `--engine process` the server process runs without torch. transformers imports torch when it
can, so it is imported here with torch hidden (the same trick as serve.import_sdk_types_without_torch):
its tokenizers need only the `tokenizers` library, and the server process stays ~300 MB smaller.
"""

from __future__ import annotations

import os
import sys
import threading

from tinkerd.errors import UserError
from tinkerd.types import ServedModel


def _auto_tokenizer():
    if "transformers" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
        # Its import-time "PyTorch was not found" advice is expected here: silenced for the import.
        advice = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
        try:
            import transformers  # noqa: F401
        finally:
            del sys.modules["torch"]
            if advice is None:
                del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
            else:
                os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advice
    from transformers import AutoTokenizer

    return AutoTokenizer


class HFTextTokenizer:
    """api/openai_text.py: TextTokenizer over a Hugging Face tokenizer."""

    def __init__(self, hf):
        self.hf = hf

    def chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise UserError("this model's tokenizer has no chat template: use /v1/completions")
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # a template's raise_exception (e.g. roles out of order) is the caller's
            raise UserError(f"the chat template refused these messages: {e}") from e
        return [int(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id])


class Tokenizers:
    """Callable: base model name -> HFTextTokenizer, loaded on first use (thread-safe)."""

    def __init__(self, served: dict[str, ServedModel]):
        self.served = served
        self._loaded: dict[str, HFTextTokenizer] = {}
        self._lock = threading.Lock()

    def __call__(self, base_model: str) -> HFTextTokenizer:
        with self._lock:
            tok = self._loaded.get(base_model)
            if tok is None:
                model = self.served[base_model]
                tok = HFTextTokenizer(_auto_tokenizer().from_pretrained(model.tokenizer_dir or model.tokenizer_id))
                self._loaded[base_model] = tok
            return tok
