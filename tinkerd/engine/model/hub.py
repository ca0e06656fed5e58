"""Whether the Hugging Face hub can be reached from here, and what is cached from it.

On a machine without the hub, huggingface_hub retries every lookup with backoff before giving up or
falling back to its cache: ~23 s where DNS fails at once, 2 minutes and more where it times out.
tinkerd asks once, quickly, and then reads only the cache: a base model named by its hub id loads
from the cache at once or fails at once with what is missing.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse


def host() -> str:
    from huggingface_hub import constants  # honours HF_ENDPOINT

    return urlparse(constants.ENDPOINT).hostname or "huggingface.co"


def unreachable(timeout_s: float = 2.0) -> bool:
    """Whether this machine cannot reach the hub (or is told to stay off it: HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    try:
        socket.create_connection((host(), 443), timeout=timeout_s).close()
        return False
    except OSError:  # no DNS, refused, or timed out
        return True


def cached_snapshot(name: str) -> Path | None:
    """The cached snapshot folder of hub repo `name` (its main revision), or None if nothing is cached."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except (OSError, ValueError):  # not cached, or not a valid repo id
        return None
