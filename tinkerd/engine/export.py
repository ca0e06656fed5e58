"""save_weights_external: the adapter as a plain PEFT directory, optionally age-encrypted.

An export holds exactly what outside tools read (`weights.download` / `build_lora_adapter` /
`build_hf_model` in tinker-cookbook, `peft.PeftModel.from_pretrained`, vLLM `--lora-modules`):

    adapter_model.safetensors  base_model.model.<hf module>.lora_{A,B}.weight, fp32, A [R, in], B [out, R]
    adapter_config.json        r and lora_alpha with lora_alpha / r == the scaling tinkerd trained with

MoE experts are keyed as hosted Tinker keys them (`...mlp.experts.w1|w3|w2`, 3-D lora_A [E, R, in] /
lora_B [E, out, R]), which the cookbook's build_hf_model merges; PEFT cannot load those keys itself.
Qwen3.5's fused `linear_attn.in_proj_qkv` is exported split, as `in_proj_q/k/v` (lora/deltanet.py),
which the cookbook re-fuses when it merges into a released (model_type qwen3_5) checkpoint.
A vision-language model's keys drop its `language_model` segment (`model.language_model.layers.N`
is `model.layers.N`, checkpoints.hosted_name), as hosted Tinker's do; the cookbook's merge and
adapter conversion add it back for a base whose own keys have it (PEFT itself, which matches
module names, loads `build_lora_adapter`'s output onto a VLM, not the export).

The unembedding is keyed `base_model.model.lm_head.*` (PEFT's own name), not hosted Tinker's
`base_model.model.model.unembed_tokens.*`: the cookbook's merge and adapter conversion strip the
prefix and accept `lm_head` as is (they only rename `model.unembed_tokens`), and PEFT loads it
without any conversion. No optimizer state and no tinkerd.json: an export is for other tools.

With `age_encryption_recipients` every file is encrypted in memory and only `<file>.age` reaches the
disk, so plaintext weights are never written (the cookbook downloads a training checkpoint this way,
to a key it generated for that one download).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import pyrage
from safetensors.torch import save as safetensors_bytes

from tinkerd.engine import checkpoints
from tinkerd.errors import UserError
from tinkerd.types import ExportWeightsOp

if TYPE_CHECKING:
    from tinkerd.engine.engine import Engine

log = logging.getLogger(__name__)

AGE_SUFFIX = ".age"
# The SDK documents "at most 10" recipients.
MAX_RECIPIENTS = 10


def parse_recipients(recipients: list[str]) -> list:
    """age recipients from their text forms: native `age1...` X25519 keys or SSH public keys."""
    if len(recipients) > MAX_RECIPIENTS:
        raise UserError(f"at most {MAX_RECIPIENTS} age_encryption_recipients, got {len(recipients)}")
    parsed = []
    for text in recipients:
        key = text.strip() if isinstance(text, str) else ""
        try:
            if key.startswith("age1"):
                parsed.append(pyrage.x25519.Recipient.from_str(key))
            elif key.startswith(("ssh-", "ecdsa-")):
                parsed.append(pyrage.ssh.Recipient.from_str(key))
            else:
                raise ValueError("expected an age1... key or an SSH public key")
        except (ValueError, pyrage.RecipientError) as e:
            raise UserError(f"invalid age encryption recipient {text!r}: {e}") from e
    return parsed


def export_files(tensors: dict, config: dict, recipients: list | None) -> dict[str, bytes]:
    """File name -> content of one export."""
    files = {
        checkpoints.WEIGHTS_FILE: safetensors_bytes(tensors, metadata={"format": "pt"}),
        checkpoints.CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode(),
    }
    if recipients:
        files = {name + AGE_SUFFIX: pyrage.encrypt(data, recipients) for name, data in files.items()}
    return files


def export_weights(engine: "Engine", op: ExportWeightsOp) -> dict[str, int]:
    # Recipients are checked before anything is written: a bad key fails the op with nothing on disk.
    recipients = parse_recipients(op.age_encryption_recipients) if op.age_encryption_recipients else None
    t0 = time.monotonic()
    rt = engine.runtime_of(op.model_id)
    adapter = rt.pool.get(op.model_id)
    config = checkpoints.peft_config(adapter.spec, sorted(adapter.weights), rt.name)
    files = export_files(checkpoints.lora_tensors(adapter), config, recipients)
    size = engine.artifacts.put(op.dir_path, files)
    # The operator's record of what left the server: which run, how big, encrypted or not.
    log.info("exported %s to %s: %.1f MB%s in %.2f s", op.model_id, op.dir_path, size / 1e6,
             f", age-encrypted to {len(recipients)} recipient(s)" if recipients else "", time.monotonic() - t0)
    return {"size_bytes": size}
