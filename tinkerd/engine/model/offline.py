"""Known offline sources of real models (placeholder: filled in by the SmolLM2 loader work)."""

from __future__ import annotations

OFFLINE_SOURCES: dict[str, object] = {}


def resolve(name, models_dir, build_once):
    return None
