"""A model converted from an offline source, made loadable by its hub name on this machine.

`get_info` reports a model's `tokenizer_id`, and the SDK's `get_tokenizer()` (like the cookbook's
`tokenizer_utils.get_tokenizer(model_name)`) calls `AutoTokenizer.from_pretrained` on it. The hub
name is the only id a client on another machine can resolve, so that is what tinkerd reports. On
this machine, with no hub, the name resolves through the Hugging Face cache: tinkerd puts the
converted model's small files (config, generation config, tokenizer, chat template: no weights) in
the cache under the hub name, the layout `hf_hub_download` reads, with the revision named after the
source file's sha256. With `HF_HUB_OFFLINE=1` (the ready line adds it where the hub is unreachable)
`from_pretrained(hub name)` then loads them in ~1 s; without it, huggingface_hub retries the hub
for ~2 minutes before falling back to the cache.

Never written over: a cache entry that already exists (the real hub's files, or an earlier alias)
is left as it is. If the hub becomes reachable later, the first online `from_pretrained` fetches the
real files into their own snapshot and moves `refs/main` to it; the alias is then unused.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# Weights stay out: in_hf_cache (offline.py) means "the hub's weights are cached", and tinkerd
# must keep loading its own converted copy rather than an alias of it.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def repo_dir(name: str) -> Path:
    from huggingface_hub import constants  # honours HF_HOME / HF_HUB_CACHE

    return Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}"


def publish(name: str, converted_dir: Path, revision: str) -> bool:
    """Put `converted_dir`'s non-weight files in the HF cache as `name` at `revision` (40 hex
    characters), unless the cache already has an entry for `name`. True when `name` resolves from
    the cache afterwards (ours or one that was there); False when the cache cannot be written."""
    repo = repo_dir(name)
    ref = repo / "refs" / "main"
    if ref.exists():
        return True
    try:
        snapshot = repo / "snapshots" / revision
        if not snapshot.exists():
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tinkerd-", dir=snapshot.parent))
            try:
                for f in Path(converted_dir).iterdir():
                    if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES:
                        shutil.copy2(f, tmp / f.name)
                os.replace(tmp, snapshot)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp_ref = ref.with_name(".main.tmp")
        tmp_ref.write_text(revision)
        os.replace(tmp_ref, ref)  # last: the entry is complete before anything can resolve it
    except OSError as e:
        log.warning("cannot put %s's tokenizer in the Hugging Face cache (%s); get_info reports its "
                    "server-side directory instead of the hub name", name, e)
        return False
    log.info("%s's tokenizer and config are in the Hugging Face cache at %s (for clients on this machine)", name, repo)
    return True
