"""Domain types shared by control/ and engine/: plain dataclasses over numpy, no torch, no HTTP.

The wire layer (api/) converts the SDK's pydantic/protobuf messages into these; the engine consumes
them. Shapes use one alphabet: N targets in a datum, K soft targets per position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tinkerd.errors import UserError


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape: which linears carry LoRA, at what rank and scaling (alpha / rank)."""

    rank: int
    alpha: float
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class AdamParams:
    """The SDK's AdamParams, sent whole with every optim_step."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class ProvenanceSpan:
    """One run of a datum's provenance (the SDK's PromptProvenanceSpan / SampledProvenanceSpan):
    `length` consecutive positions are positions [offset, offset + length) of the prompt
    ("prompt") or of the sampled tokens ("sampled") of the sequence `sequence_id` names."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass
class ImageInput:
    """One image of a model input (an ImageChunk), expanded by the API into `n_tokens` placeholder
    positions (the model's image_token_id) starting at `offset`; the engine turns `data` back into
    pixels with the model's own image processor (engine/model/vision.py)."""

    offset: int
    n_tokens: int
    format: str  # "png" | "jpeg", as sent (and checked against the bytes)
    data: np.ndarray  # uint8, the encoded image as sent
    grid: tuple[int, int, int]  # (t, h, w) patches, as the processor will make them


@dataclass(frozen=True)
class VisionSpec:
    """What the API needs to count a vision-language model's image tokens without the model: its
    placeholder id and the image processor's patching and pixel bounds (preprocessor_config.json)."""

    image_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int


@dataclass
class Datum:
    """One training example: the model input tokens and the loss inputs aligned to them.

    tokens [N] int64; loss_fn_inputs maps a name (target_tokens, weights, advantages, ...) to a
    dense array whose leading dimension is N ([N] or [N, K]).
    """

    tokens: np.ndarray
    loss_fn_inputs: dict[str, np.ndarray]
    # Provenance as sent: runs tiling the input tokens, and runs tiling the targets. Only
    # stable_reinforce reads them; every other loss ignores them (the cookbook attaches them always).
    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None
    # [N] fp32, filled by the server from what it recorded at sampling time (control/stability.py),
    # never from the client: the sampler's log-prob of each target that is a sampled token, NaN at
    # every other position (prompt targets). Set for stable_reinforce only.
    sampler_logprobs: np.ndarray | None = None
    # ImageChunks, in order; their placeholder positions are in `tokens` (vision-language models only).
    images: list[ImageInput] | None = None


@dataclass
class CustomLoss:
    """A loss uploaded with create_custom_loss (loss_fn "custom"), carried on the op as data: the
    torch.fx graph as canonical JSON, checked by lossgraph.py and interpreted by
    engine/losses/custom.py. Never code: nothing in it is evaluated or unpickled."""

    loss_id: str
    name: str
    input_names: list[str]  # logprobs first, then the loss_fn_inputs keys the loss reads
    input_ranks: list[int]  # 0 scalar, 1 [N], 2 [N, K]
    graph_json: str


@dataclass
class ForwardBackwardOp:
    model_id: str
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    # Accumulate a non-finite loss or gradient instead of failing the op (engine/training.py):
    # `--allow-non-finite`, and replay of ops that completed before the guard existed.
    allow_non_finite: bool = False
    # loss_fn "custom": the stored loss named by loss_fn_config["loss_id"] (api resolves it).
    custom_loss: CustomLoss | None = None
    # The base model the op's adapter lives on, so an EngineRouter routes it (control/engines.py);
    # "" in records from before the field: the router then knows the run from its create/load op.
    base_model: str = ""


@dataclass
class ForwardBackwardResult:
    # One dict per datum: output name -> array (logprobs [N] or [N, K]).
    loss_fn_outputs: list[dict[str, np.ndarray]]
    # Keys are `name:reduction` as the SDK's chunk merger requires.
    metrics: dict[str, float]


@dataclass
class OptimStepOp:
    model_id: str
    adam_params: AdamParams
    # Apply an update that leaves weights or AdamW state non-finite instead of failing the op.
    allow_non_finite: bool = False
    # Set by control's snapshot policy: after the step, write the adapter with its optimizer state
    # here (and drop older snapshots beside it), so recovery replays only the ops after this one.
    snapshot_dir: str | None = None
    # The base model the op's adapter lives on, so an EngineRouter routes it (control/engines.py);
    # "" in records from before the field: the router then knows the run from its create/load op.
    base_model: str = ""


@dataclass
class CreateModelOp:
    model_id: str
    base_model: str
    lora: LoraSpec


@dataclass
class SaveWeightsOp:
    """Write the adapter to the artifact `dir_path` (a key, tinkerd/artifacts.py); `with_optimizer` for
    training state, False for sampler."""

    model_id: str
    dir_path: str
    with_optimizer: bool
    # The base model the op's adapter lives on, so an EngineRouter routes it (control/engines.py);
    # "" in records from before the field: the router then knows the run from its create/load op.
    base_model: str = ""


@dataclass
class ExportWeightsOp:
    """Write the adapter to `dir_path` as a plain PEFT adapter (save_weights_external); every file
    encrypted to `age_encryption_recipients` (age or SSH public keys) and suffixed `.age` when given."""

    model_id: str
    dir_path: str
    age_encryption_recipients: list[str] | None = None
    # The base model the op's adapter lives on, so an EngineRouter routes it (control/engines.py);
    # "" in records from before the field: the router then knows the run from its create/load op.
    base_model: str = ""


@dataclass
class LoadWeightsOp:
    """Load a saved adapter into `model_id` (creating the slot when it does not exist yet)."""

    model_id: str
    base_model: str
    dir_path: str
    with_optimizer: bool
    # Set by control's snapshot policy: after the load, write the adapter with its optimizer state
    # here, so recovery never needs the loaded checkpoint again (it may be deleted meanwhile).
    snapshot_dir: str | None = None


@dataclass
class UnloadModelOp:
    model_id: str
    # The base model the op's adapter lives on, so an EngineRouter routes it (control/engines.py);
    # "" in records from before the field: the router then knows the run from its create/load op.
    base_model: str = ""


@dataclass
class ReleaseAdaptersOp:
    """Unload the adapters of sessions that stopped heart-beating, freeing their slots and memory.

    Each training adapter is first written with its optimizer state to `snapshot_dir` (when given
    and not written yet): control rebuilds it from there, plus the logged ops after it, on its
    next op. Sampler adapters are only dropped from memory; their files stay and reload on use.
    """

    # (model_id, recovery snapshot directory or None)
    models: list[tuple[str, str | None]] = field(default_factory=list)
    # Sampler adapter keys (checkpoint directories); ones a decoding request holds are kept.
    sampler_paths: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    # Token-id stop sequences and string stops; `stop_at_eos` is False only for `stop=[]`.
    stop_token_seqs: tuple[tuple[int, ...], ...] = ()
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True


@dataclass
class SampleOp:
    """Sample from `base_model`, with the adapter saved at `adapter_path` when given."""

    base_model: str
    adapter_path: str | None
    prompt: np.ndarray  # [P] int64
    params: SamplingParams
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    # Score only the last N prompt positions (earlier ones NaN / empty); None scores them all.
    prompt_logprobs_last_n: int | None = None
    # K > 0: the top-K (id, logprob) of the model's distribution at every sampled position.
    topk_sample_logprobs: int = 0
    # record_stability_info: the session the finished sample is recorded for (control/stability.py),
    # so its sequences can be named by that session's stable_reinforce datums; None records nothing.
    # The engine ignores it.
    record_for_session: str | None = None
    # target_prompt_logprobs: [P-1, K] int64 ids whose logprobs to return (-1: none), row i at
    # prompt position i + 1; and prompt_alt_tokens_k draws per prompt position (sampler/prompt_scores.py).
    target_prompt_ids: np.ndarray | None = None
    # The request's CSR layout of those ids (crow, col), kept for the answer; the engine ignores it.
    target_prompt_csr: tuple[np.ndarray, np.ndarray] | None = None
    prompt_alt_tokens_k: int = 0
    # OpenAI's `stream: true` (api/routes/openai.py): the engine reports this request's new tokens
    # with every step (StepOutput.partial), so they reach the client as they are decoded rather than
    # when the last row ends. Set on the queued op only, never logged: after a server restart no
    # reader is left. It changes nothing the sampler computes.
    stream: bool = False
    # ImageChunks of the prompt, their placeholders in `prompt` (vision-language models only).
    images: list[ImageInput] | None = None


@dataclass
class TokenDelta:
    """The tokens one row of a streaming request (SampleOp.stream) generated in one step."""

    row: int  # the sample's index in the request
    # Index of tokens[0] in the row's sequence. A request re-run after an engine restart starts
    # again at 0, so the reader can tell a repeat from new tokens.
    start: int
    tokens: list[int]
    logprobs: list[float]
    # ([n, K] ids, [n, K] logprobs) best-first, when topk_sample_logprobs > 0.
    topk: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    # ([N, K] ids, [N, K] logprobs) best-first for N generated tokens; when topk_sample_logprobs > 0.
    topk_logprobs: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    # [P] with NaN at position 0; present when prompt_logprobs was asked.
    prompt_logprobs: np.ndarray | None = None
    # ([P, K] ids, [P, K] logprobs), row 0 empty; present when topk_prompt_logprobs > 0.
    topk_prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None
    # [P-1, K] float32 logprobs of SampleOp.target_prompt_ids (0.0 where -1); when asked.
    target_prompt_logprobs: np.ndarray | None = None
    # ([P-1, k] int64 ids, [P-1, k] float32 logprobs) of the prompt_alt_tokens_k draws; when asked.
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None
    # Prompt tokens whose prefill came from the sampler's prefix cache (SampleResponse's
    # prompt_cache_hit_tokens, which the cookbook's RL metrics sum).
    prompt_cache_hit_tokens: int = 0


EngineOp = (
    ForwardBackwardOp | OptimStepOp | CreateModelOp | SaveWeightsOp | ExportWeightsOp | LoadWeightsOp | UnloadModelOp
    | ReleaseAdaptersOp | SampleOp
)


@dataclass
class StepBatch:
    """What control hands the engine for one step (picked by control/scheduler.py).

    Each op travels with a ticket (its request_id), so its result can come back in a later step.
    """

    # Ops that run to completion inside this step, in order: training, checkpoints, adapters.
    run: list[tuple[str, EngineOp]] = field(default_factory=list)
    # Sampling requests that join the engine's decode batch; each result comes back when it is done.
    admit: list[tuple[str, SampleOp]] = field(default_factory=list)
    # Advance the in-flight sampling requests: one prefill chunk, then one token per decoding row.
    decode: bool = False
    # Tickets of sampling requests to stop (cancel_future): each leaves the batch before this step's
    # decode and comes back in `done` failed as cancelled; a ticket the engine no longer holds is ignored.
    cancel: list[str] = field(default_factory=list)


@dataclass
class StepOutput:
    """What one engine step returns."""

    # (ticket, result or TinkerdError) of every op that finished in this step: this step's `run`
    # ops, and sampling requests admitted in this or an earlier step.
    done: list[tuple[str, object]]
    # Sampling rows still in the engine (prefilling or decoding): control keeps stepping while > 0.
    active_rows: int
    # The adapters the engine holds after this step, so control releases only what is loaded.
    resident: "Resident | None" = field(default=None, compare=False)
    # (ticket, one TokenDelta per row that generated a token) of streaming requests (SampleOp.stream)
    # in flight in this step, those finishing in it included; empty when no request streams.
    partial: list[tuple[str, list[TokenDelta]]] = field(default_factory=list)
    # Ops per training pass that served several runs at once (engine/cotrain.py), for /metrics.
    shared_passes: list[int] = field(default_factory=list)
    # Engine seconds its recovery snapshots took since its last step (engine/snapshots.py), which
    # control keeps within --snapshot-budget (control/recovery.py). Several engines: the busiest's.
    snapshot_s: float = 0.0


@dataclass(frozen=True)
class Resident:
    """The adapters an engine holds: reported with every step (a few dozen bytes over the pipe)."""

    training: int  # training adapters, one per loaded run
    sampler_paths: tuple[str, ...]  # sampler adapter keys (checkpoint directories) in the pools
    # The samplers' decode KV caches, allocated and allowed, summed over base models (GET /metrics).
    kv_cache_bytes: int = 0
    kv_cache_budget_bytes: int = 0
    # Decoder layers training passes recomputed in their backward since the engine started (engine/recompute.py).
    recomputed_layers: int = 0


@dataclass(frozen=True)
class ServedModel:
    """What the engine serves: reported by get_server_capabilities and get_info."""

    name: str
    # get_info's tokenizer_id: the hub name where the model has one, else a server-side directory.
    tokenizer_id: str
    max_context_length: int
    arch: str
    # The loss_fn names forward_backward accepts on this model (the engine's loss registry).
    loss_fns: tuple[str, ...] = ()
    # Non-empty: asked for (--base-model) but not loaded, and why; left out of get_server_capabilities,
    # and the reason every request naming it fails with.
    unavailable: str = ""
    # Where the server's own tokenizer files are (a directory or a hub name): the OpenAI endpoints
    # tokenize and detokenize on the server.
    tokenizer_dir: str = ""
    # A vision-language model's image token counting (None: text only, image chunks are refused).
    vision: VisionSpec | None = None


# The hosted service's long-context model ids, `<hf id>:peft:<tokens>` (e.g.
# "openai/gpt-oss-120b:peft:131072" in the cookbook's eval tables): the same base model, served
# with a context limit of <tokens>. The SDK and the cookbook strip everything from the first ':'
# to find the tokenizer and hyperparameters, so the base id itself never holds a ':'.
_LONG_CONTEXT_ID = re.compile(r"(?P<base>[^:]+):peft:(?P<tokens>[0-9]+)")


def long_context_id(name: str) -> tuple[str, int] | None:
    """(base id, context limit) of a `<hf id>:peft:<tokens>` name; None for any other name."""
    m = _LONG_CONTEXT_ID.fullmatch(name)
    return (m["base"], int(m["tokens"])) if m else None


def base_model_of(name: str) -> str:
    """The base model a run or sampler names: `name` less a long-context suffix (the engine serves
    bases only; ops carry this)."""
    parsed = long_context_id(name)
    return parsed[0] if parsed else name


@dataclass(frozen=True)
class StableReinforceConfig:
    """stable_reinforce's loss_fn_config (docs/losses.md): shared so that the API refuses a bad config
    with a 400 before the op is queued and the engine's loss reads the same keys and defaults.

    The policy term keeps a sampled token's importance weight r = exp(lp − q) only while
    ratio_low <= r <= ratio_high (q recorded by the sampler); kl_coeff weights the sampler-to-learner
    KL term.
    """

    kl_coeff: float = 0.0
    ratio_low: float = 0.5
    ratio_high: float = 2.0

    @classmethod
    def parse(cls, config: dict[str, float | str]) -> StableReinforceConfig:
        known = cls.__dataclass_fields__
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise UserError(f"loss_fn_config keys {unknown} are not used by stable_reinforce "
                            f"(accepted: {', '.join(sorted(known))})")
        values = {}
        for key, value in config.items():
            if isinstance(value, str) or not np.isfinite(float(value)):
                raise UserError(f"loss_fn_config[{key!r}] for stable_reinforce must be a finite number, got {value!r}")
            values[key] = float(value)
        parsed = cls(**values)
        if parsed.kl_coeff < 0:
            raise UserError(f"loss_fn_config['kl_coeff'] for stable_reinforce must be >= 0, got {parsed.kl_coeff}")
        if not 0 <= parsed.ratio_low <= 1 <= parsed.ratio_high:
            raise UserError("stable_reinforce needs 0 <= loss_fn_config['ratio_low'] <= 1 <= loss_fn_config['ratio_high'] "
                            f"(importance-ratio bounds around on-policy 1), got {parsed.ratio_low} and {parsed.ratio_high}")
        return parsed
