"""The context length a served model reports (get_server_capabilities, the engine's length checks)
is its text model's max_position_embeddings, also for a vision-language config that nests it."""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3VLConfig

from tinkerd.engine.model.registry import context_length


def test_a_text_config_reports_its_own():
    assert context_length(Qwen3Config(max_position_embeddings=4096)) == 4096


def test_a_vision_language_config_reports_its_text_models():
    # Qwen3-VL (and Qwen3.5) keep it under text_config: read at the top it is absent, and the
    # server reported the 2048 fallback for a model built for 4096.
    cfg = Qwen3VLConfig(text_config={"max_position_embeddings": 4096})
    assert getattr(cfg, "max_position_embeddings", None) is None
    assert context_length(cfg) == 4096

