"""GRPO-shaped datums for tests: samples of one prompt with importance_sampling's inputs, as the
cookbook builds them (advantage 0 on the prompt's positions, one advantage per sample after it).
No imports beyond numpy, so tests/gpu can use it on a machine whose PEFT does not import."""

from __future__ import annotations

import numpy as np


def samples(rng: np.random.Generator, prompt: np.ndarray, n: int, completion: tuple[int, int],
            vocab: int = 150_000) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """`n` (tokens, loss_fn_inputs) of `prompt` plus a completion of [completion) tokens each."""
    out = []
    for _ in range(n):
        seq = np.concatenate([prompt, rng.integers(0, vocab, int(rng.integers(*completion)) + 1)])
        m = len(seq) - 1
        advantages = np.zeros(m, np.float32)
        advantages[len(prompt) - 1 :] = rng.normal()
        out.append((seq[:-1], {"target_tokens": seq[1:], "logprobs": rng.normal(-3, 1, m).astype(np.float32),
                               "advantages": advantages}))
    return out
