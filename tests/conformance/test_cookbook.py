"""tinker-cookbook 0.6.1's own trainers against a live tinkerd on the tiny Qwen3 model.

The tiny model's name has no Hugging Face repo, so its tokenizer is registered in-process under that
name (cookbook-compat §4 (a)) and every config passes `renderer_name` explicitly. Recipes without a
base_url flag read TINKER_BASE_URL / TINKER_API_KEY.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
from pathlib import Path

import pytest
import tinker
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.recipes.math_rl import train as math_rl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from transformers import AutoTokenizer

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY
from tinkerd.engine.model.tiny import qwen3_tokenizer_dir

pytestmark = pytest.mark.slow

RENDERER = "qwen3_instruct"  # the Qwen3 chat template without a think block: simplest for a tiny model


@pytest.fixture
def cookbook_env(server, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    tokenizer_utils.register_tokenizer(TINY, lambda: AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()))
    yield server.url
    tokenizer_utils.unregister_tokenizer(TINY)


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


PAIRS = [
    ("What colour is the sky?", "Blue.", "Green."),
    ("Is fire hot?", "Yes, fire is hot.", "No."),
    ("What is two plus two?", "Four.", "Five."),
    ("Name a fruit.", "An apple.", "A chair."),
    ("Say hello.", "Hello!", "Goodbye."),
    ("Which is bigger, 3 or 7?", "7 is bigger.", "3 is bigger."),
    ("What do cows drink?", "Water.", "Milk."),
    ("Is the earth round?", "Yes.", "No, it is flat."),
]


def test_dpo_through_train_dpo_main(cookbook_env, tmp_path):
    """train_dpo runs forward_backward_custom with the DPO loss: the server sees only cross_entropy
    with weights = −dL/dlogprob. The reference is the initial weights, so step 0's loss is ln 2."""
    path = tmp_path / "comparisons.jsonl"
    with path.open("w") as f:
        for prompt, good, bad in PAIRS:
            comparison = {
                "prompt_conversation": [{"role": "user", "content": prompt}],
                "completion_A": [{"role": "assistant", "content": good}],
                "completion_B": [{"role": "assistant", "content": bad}],
            }
            f.write(json.dumps({"comparison": comparison, "label": "A"}) + "\n")
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=TINY, renderer_name=RENDERER, max_length=256, batch_size=4)
    config = train_dpo.Config(
        log_path=str(tmp_path / "log"),
        model_name=TINY,
        recipe_name="tinkerd_conformance_dpo",
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=common, comparison_builder=ComparisonBuilderFromJsonl(train_path=str(path))
        ),
        renderer_name=RENDERER,
        base_url=cookbook_env,
        lora_rank=8,
        learning_rate=5e-4,  # the recipe's 1e-5 is for real models; the tiny one needs larger steps
        lr_schedule="constant",
        dpo_beta=0.5,
        num_epochs=3,  # 2 batches of 4 pairs each: 6 steps
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
        ttl_seconds=None,
    )
    train_dpo.main(config)

    losses = [m["dpo_loss"] for m in _metrics(tmp_path / "log") if "dpo_loss" in m]
    print(f"DPO loss per step: {[round(x, 4) for x in losses]}")
    assert len(losses) == 6
    # Exactly ln 2 up to sampler-vs-trainer numerics: the reference logprobs come from
    # compute_logprobs on a sampling client, the policy's from the training forward.
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)
    assert losses[-1] < 0.3 * math.log(2), losses
    final = json.loads((tmp_path / "log" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["state_path"].startswith("tinker://") and "/weights/" in final["state_path"]


def _math_rl_config(url: str, log_path: Path, loss_fn: str | None, max_steps: int) -> math_rl.CLIConfig:
    """loss_fn None leaves the recipe's default (stable_reinforce in cookbook 0.6.1)."""
    return math_rl.CLIConfig(
        model_name=TINY,
        renderer_name=RENDERER,
        lora_rank=8,
        env="arithmetic",  # fully local: generated sums, graded in-process
        group_size=4,
        groups_per_batch=4,
        learning_rate=1e-4,
        max_tokens=5,
        eval_every=0,
        save_every=0,
        base_url=url,
        log_path=str(log_path),
        behavior_if_log_dir_exists="delete",
        max_steps=max_steps,
        **({"loss_fn": loss_fn} if loss_fn is not None else {}),
    )


def test_math_rl_arithmetic_with_importance_sampling(cookbook_env, tmp_path):
    """rl/train.py end to end: sampling with sequence_ids, datums carrying provenance spans,
    importance_sampling forward_backward, optim_step, sampler snapshots, final checkpoint."""
    log_path = tmp_path / "log"
    asyncio.run(math_rl.cli_main(_math_rl_config(cookbook_env, log_path, "importance_sampling", max_steps=3)))

    steps = [m for m in _metrics(log_path) if "optim/kl_sample_train_v1" in m]
    assert [m["progress/batch"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert m["tokens/trained"] > 0
        # The learner's logprobs (forward_backward output) match the sampler's on the sampled tokens.
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m
    final = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert "/sampler_weights/" in final["sampler_path"]


def test_math_rl_arithmetic_with_its_default_loss_stable_reinforce(cookbook_env, server, tmp_path):
    """The recipe as shipped: its default loss, stable_reinforce, so record_stability_info samplers,
    sequence_ids, provenance on every datum, and the server's recorded sampler log-probs."""
    assert math_rl.CLIConfig(model_name=TINY).loss_fn == "stable_reinforce"
    log_path = tmp_path / "log"
    asyncio.run(math_rl.cli_main(_math_rl_config(cookbook_env, log_path, None, max_steps=2)))

    steps = [m for m in _metrics(log_path) if "optim/kl_sample_train_v1" in m]
    assert [m["progress/batch"] for m in steps] == [0, 1]
    for m in steps:
        assert m["tokens/trained"] > 0
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m
    final = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert "/sampler_weights/" in final["sampler_path"]
    # Every group's sample request was recorded for the run's session (4 groups x 2 steps at least).
    with sqlite3.connect(Path(server.data_dir) / "tinkerd.sqlite") as db:
        sessions = db.execute("SELECT session_id, count(*) FROM recorded_samples GROUP BY session_id").fetchall()
    assert any(n >= 8 for _, n in sessions), sessions


def test_rl_loop_with_its_default_loss_stable_reinforce(cookbook_env, server, tmp_path, monkeypatch):
    """recipes/rl_loop.py as shipped (default loss stable_reinforce: record_stability_info sampler,
    with_sampled_provenance datums, prompt targets padded with 0). Offline stand-ins only for what
    it would download or look up: GSM8K (four rows in its format), the model registry's renderer for
    the tiny model, and the reward (a boxed GSM8K answer the random tiny model never writes, so every
    group would be skipped as all-zero advantages; the length's parity varies within a group)."""
    import datasets
    from tinker_cookbook.recipes import rl_loop

    assert rl_loop.Config().loss_fn == "stable_reinforce"
    rows = {"question": [f"What is {a} + {b}?" for a, b in ((1, 2), (2, 3), (3, 4), (4, 5))],
            "answer": [f"{a} + {b} = {a + b}\n#### {a + b}" for a, b in ((1, 2), (2, 3), (3, 4), (4, 5))]}
    monkeypatch.setattr(rl_loop.datasets, "load_dataset",
                        lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}))
    monkeypatch.setattr(rl_loop.model_info, "get_recommended_renderer_name", lambda _: RENDERER)
    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: float(len(response) % 2))
    log_path = tmp_path / "log"
    rl_loop.main(rl_loop.Config(base_url=cookbook_env, log_path=str(log_path), model_name=TINY, batch_size=2,
                                group_size=4, learning_rate=1e-4, lora_rank=8, save_every=0, max_tokens=6,
                                max_steps=2, ttl_seconds=None))

    steps = _metrics(log_path)
    assert [m["progress/batch"] for m in steps] == [0, 1]
    with sqlite3.connect(Path(server.data_dir) / "tinkerd.sqlite") as db:
        trained = db.execute("SELECT count(*) FROM futures WHERE request_type = 'ForwardBackward' AND status = 'complete' "
                             "AND target IN (SELECT model_id FROM training_runs WHERE session_id IN "
                             "(SELECT session_id FROM recorded_samples))").fetchone()[0]
    assert trained >= 1  # at least one step had a group with unequal rewards and trained on it
