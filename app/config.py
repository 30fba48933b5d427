"""The one typed config tree. A job YAML plus `--set a.b=value` overrides → `JobConfig`.

Unknown keys are rejected everywhere, units live in the field names, and every
error is one line naming the key at fault (`ConfigError`), raised before Ray starts.
Credentials never live here: S3 uses the standard AWS chain and `AWS_ENDPOINT_URL`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from app.batch import BatchPlan


class ConfigError(ValueError):
    """A config problem, reported as one line naming the key or file at fault."""


def split_location(uri: str) -> tuple[str, tuple[str, ...]]:
    """A storage URI as (scheme, path components), as `app.storage.resolve` reads it: s3://bucket/key
    → ("s3", (bucket, *key parts)); file:// URIs and plain paths → ("file", absolute path parts), a
    relative path taken from the current directory. Comparing components (not strings) keeps
    `data` and `data2` apart and ignores trailing and doubled slashes."""
    uri = uri.strip()
    if uri.startswith("s3://"):
        return "s3", tuple(part for part in uri[len("s3://"):].split("/") if part)
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return "file", PurePosixPath(os.path.abspath(os.path.expanduser(path))).parts


def check_location(uri: str) -> str:
    """A prefix that can hold a tree of objects: a bucket (and key) or a directory below the
    filesystem root. Raises ValueError naming the URI."""
    if not uri.strip():
        raise ValueError("empty (give s3://bucket/prefix or a directory)")
    scheme, parts = split_location(uri)
    if scheme == "s3" and not uri.strip()[len("s3://"):].split("/", 1)[0]:
        raise ValueError(f"{uri!r} names no bucket (give s3://bucket/prefix)")
    rest = uri.strip()[len("file://"):] if uri.strip().startswith("file://") else uri.strip()
    if scheme == "file" and (len(parts) <= 1 or os.path.normpath(rest) in (".", "..")):
        # "/" would put runs at /<name> and "." wherever the command happens to run.
        raise ValueError(f"{uri!r} is the filesystem root or a bare current/parent directory "
                         f"(give s3://bucket/prefix or a directory of its own)")
    return uri


HUB_SCHEME = "hf://"
_HUB_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_hub_id(uri: str) -> str:
    """`hf://ORG/NAME[@REVISION]`: the syntax of a hub id, checked where the config is read so
    that every command (`eft config` too) refuses a bad one before any work. Pure: the same rule
    as app.hub.parse_hub_uri, which the config cannot import (it reaches storage). Raises
    ValueError naming the URI."""
    repo, at, revision = uri[len(HUB_SCHEME):].partition("@")
    parts = repo.strip("/").split("/")
    if len(parts) != 2 or not all(_HUB_NAME_PART.fullmatch(p) for p in parts) or (at and not revision):
        raise ValueError(f"{uri} is not a hub id (hf://ORG/NAME or hf://ORG/NAME@REVISION)")
    return uri


def locations_overlap(a: str, b: str) -> bool:
    """True when one URI's tree holds the other's (or they are the same)."""
    (scheme_a, parts_a), (scheme_b, parts_b) = split_location(a), split_location(b)
    shorter = min(len(parts_a), len(parts_b))
    return scheme_a == scheme_b and parts_a[:shorter] == parts_b[:shorter]


class _Strict(BaseModel):
    # Each field's docstring is its description: what `eft config --reference` prints.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(_Strict):
    """The base model."""

    uri: str
    """Hugging Face model dir: `s3://bucket/prefix`, `file://` or a local path (config.json, safetensors
    weights, tokenizer files); or a hub id, `hf://ORG/NAME[@REVISION]` (branch, tag or commit sha;
    default `main`), which the driver resolves to a commit sha and mirrors once to `mirror_uri`
    (docs/hub.md)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Storage dtype of the base weights. `auto`: bf16 for a LoRA base on GPU, fp32 otherwise (CPU has
    no fast bf16 matmul, and the tests want exact fp32)."""
    mirror_uri: Optional[str] = None
    """Where `hf://` models are mirrored, as `<mirror_uri>/<org>/<name>/<sha>/`; default
    `<storage.root_uri>/../models-mirror` (beside the runs, in the same bucket)."""
    allow_pickle_weights: bool = False
    """Mirror and load a hub repo that has only pickled weights (`.bin`, `.pt`). Loading a pickle runs
    the code it holds: leave off unless the repo is trusted."""

    @field_validator("uri")
    @classmethod
    def _a_hub_id(cls, uri: str) -> str:
        return check_hub_id(uri) if uri.startswith(HUB_SCHEME) else uri


class LoraConfig(_Strict):
    """LoRA adapters (PEFT). Leave the section out (or set it to null) for a full fine-tune."""

    r: int = Field(16, gt=0)
    """Adapter rank."""
    alpha: float = Field(32.0, gt=0)
    """Adapter scale numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input; its masks are keyed on (seed, step, row), the same at every
    world size."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Modules to adapt, by PEFT's rule for a list: each name matches a module whose dotted name is it
    or ends in `.<name>` (no regexes). Preflight checks each against the model's modules."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, targets: list[str]) -> list[str]:
        if not targets:
            raise ValueError("empty: name the modules LoRA adapts (e.g. [q_proj, v_proj]), or set lora: null "
                             "for a full fine-tune")
        if any(not t.strip() for t in targets):
            raise ValueError(f"{targets}: a module name is empty")
        return targets

    quantize_base: Optional[Literal["nf4"]] = None
    """QLoRA: hold the frozen base's decoder linears in 4-bit NF4 (torchao); the adapters train on top
    in the compute dtype. Checkpoints and exports hold the adapters only."""
    fsdp_adapters: Literal["replicated", "sharded"] = "replicated"
    """Under FSDP2: `replicated` keeps the adapters whole on every rank and all-reduces their gradients
    once per optimizer step, while the frozen base stays sharded (no per-micro-batch gathers of
    hundreds of small tensors); `sharded` shards them with their block, for adapters too big to hold
    whole on each GPU (16 bytes a parameter with AdamW). DDP ignores it."""


class DataConfig(_Strict):
    """The prepared dataset training reads."""

    uri: str
    """Prepared dataset prefix (it holds manifest.json once committed); neither inside
    `storage.root_uri` nor containing it."""
    seq_len: int = Field(2048, gt=1)
    """Tokens per packed row; at most the model's `max_position_embeddings` (checked by `eft prepare`
    and `eft train`)."""
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    """Documents held out for validation at prepare time, by a hash of their source position."""
    cross_document_attention: bool = False
    """`false`: attention stays inside each packed document (the shards' position_ids restart at every
    document start and transformers builds a block-causal mask from them). `true`: every token of a
    row attends to everything before it, across documents."""

    @field_validator("uri")
    @classmethod
    def _a_prefix(cls, uri: str) -> str:
        return check_location(uri)


class InputSource(_Strict):
    """One source of a mixture (`prepare.inputs`). Unset record keys fall back to the prepare
    section's; the chat template (prepare.chat_template or the tokenizer's) is shared."""

    uri: str
    """Raw JSONL or Parquet file or prefix."""
    weight: float = Field(1.0, gt=0)
    """Relative share of documents in the mixture (any positive numbers; normalised by their sum)."""
    input_format: Optional[Literal["jsonl", "parquet"]] = None
    """As `prepare.input_format`, for this source."""
    format: Optional[Literal["text", "instruction", "chat", "sharegpt"]] = None
    """As `prepare.format`, for this source."""
    text_field: Optional[str] = None
    """As `prepare.text_field`, for this source."""
    prompt_field: Optional[str] = None
    """As `prepare.prompt_field`, for this source."""
    response_field: Optional[str] = None
    """As `prepare.response_field`, for this source."""
    messages_field: Optional[str] = None
    """As `prepare.messages_field`, for this source."""
    conversations_field: Optional[str] = None
    """As `prepare.conversations_field`, for this source."""
    sharegpt_roles: Optional[dict[str, Literal["system", "user", "assistant", "tool"]]] = None
    """As `prepare.sharegpt_roles`, for this source."""
    train_on: Optional[Literal["assistant", "last_assistant", "all"]] = None
    """As `prepare.train_on`, for this source."""
    overlong: Optional[Literal["drop", "truncate", "split"]] = None
    """As `prepare.overlong`, for this source."""


# The keys an `inputs` entry may set for itself (the rest of the prepare section is shared).
SOURCE_KEYS = ("input_format", "format", "text_field", "prompt_field", "response_field", "messages_field",
               "conversations_field", "sharegpt_roles", "train_on", "overlong")


class PrepareConfig(_Strict):
    """`eft prepare`: raw records to packed, tokenized shards at `data.uri`."""

    input_uri: Optional[str] = None
    """Raw JSONL or Parquet file or prefix (one source). Exactly one of `input_uri` and `inputs`."""
    inputs: Optional[list[InputSource]] = None
    """A mixture of several sources, `[{uri, weight, <per-source record keys>}, ...]`. Weights are
    relative proportions of documents (parsed records; over-long drops happen after selection).
    Deterministic under `mix_seed`. Local engine only (`engine: auto` picks it)."""
    mix_replacement: bool = False
    """Without replacement the mixture is the largest one the weights allow (the source that runs out
    first limits it) or exactly `mix_documents`; with replacement it has `mix_documents` documents
    (default: the sum of the sources' documents)."""
    mix_documents: Optional[int] = Field(None, gt=0)
    """Documents in the mixture."""
    mix_seed: int = 0
    """Which documents a mixture picks and how they interleave; independent of `training.seed`."""
    input_format: Literal["jsonl", "parquet"] = "jsonl"
    """Format of the raw files."""
    format: Literal["text", "instruction", "chat", "sharegpt", "preference", "prompts"] = "text"
    """Record format: plain text, prompt/response pairs, OpenAI-style `messages`, ShareGPT
    `conversations`, `preference` pairs (a prompt with a chosen and a rejected completion, as
    strings or as messages: TRL's standard and conversational forms) for the preference objectives,
    or `prompts` for GRPO: eval-set records (`prompt` or `messages`, `answer`, any other fields a
    reward reads), rendered as eval renders them and stored unpacked with a stable prompt id."""
    text_field: str = "text"
    """Field of a `text` record."""
    prompt_field: str = "instruction"
    """Prompt field of an `instruction` or `preference` record (its tokens are not trained); a
    `preference` section without it reads `prompt`."""
    response_field: str = "response"
    """Response field of an `instruction` record."""
    chosen_field: str = "chosen"
    """Chosen completion field of a `preference` record."""
    rejected_field: str = "rejected"
    """Rejected completion field of a `preference` record."""
    messages_field: str = "messages"
    """Field of a `chat` record: a list of `{role, content}` messages."""
    conversations_field: str = "conversations"
    """Field of a `sharegpt` record: a list of `{from, value}` turns."""
    sharegpt_roles: dict[str, Literal["system", "user", "assistant", "tool"]] = Field(
        default_factory=lambda: {"human": "user", "gpt": "assistant", "system": "system"})
    """ShareGPT `from` → role; replaces the default mapping whole."""
    chat_template: Optional[str] = None
    """Jinja chat template file (path or URI) conversations are rendered with; default: the
    tokenizer's. Checked to compile before any record is read."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Which tokens of a conversation are trained: every assistant turn (content and end-of-turn
    marker), only the last one, or every token."""
    overlong: Optional[Literal["drop", "truncate", "split"]] = None
    """A document longer than `data.seq_len`: split it over rows, drop it, or truncate it (whole
    leading turns through the last assistant turn that fits). Default: `split` for text and
    instruction, `drop` for chat, sharegpt and preference (a pair longer than a row is always
    dropped: its two documents share one row)."""
    tokenizer_uri: Optional[str] = None
    """Tokenizer dir; default: `model.uri`."""
    packing: bool = True
    """`true`: documents are packed back to back into `data.seq_len` rows (attention still stays inside
    each document unless `data.cross_document_attention`). `false`: every document (a preference
    pair: both its documents) starts a row of its own and the rest of the row is padding, as TRL's
    `packing=False`; training then cuts each micro-batch after its longest row's last trained token
    (rounded up to a multiple of 8), so the padding costs little compute."""
    rows_per_shard: int = Field(1024, gt=0)
    """Packed rows per Parquet shard."""
    max_bad_records: int = Field(100, ge=0)
    """Records that fail to parse before prepare fails, naming the first ones."""
    tokenize_batch_size: int = Field(256, gt=0)
    """Records tokenized per call."""
    engine: Literal["auto", "local", "ray"] = "auto"
    """Where tokenizing runs. `local`: in this process, a thread per core (the Rust tokenizer releases
    the GIL; no Ray start-up). `ray`: a Ray Data actor pool across the cluster, for corpora that need
    more than one machine. `auto`: local up to `local_max_input_mb` of input files, else ray."""
    local_max_input_mb: float = Field(256.0, ge=0)
    """Input size up to which `engine: auto` picks the local engine."""
    local_threads: Optional[int] = Field(None, gt=0)
    """Local engine threads; default: this process's usable cores."""
    num_tokenizer_actors: int = Field(2, gt=0)
    """Ray engine: tokenizer actors."""
    overwrite: bool = False
    """Replace a dataset already committed at `data.uri` (refused while a run reads it). Without it, a
    prepare of the same recipe (input files, the settings that shape rows, chat template, tokenizer)
    has nothing to do and exits 0, and one of another recipe is refused naming what differs."""

    @model_validator(mode="before")
    @classmethod
    def _prompt_field_of_the_format(cls, data: Any) -> Any:
        """TRL's preference records call the prompt `prompt`: the default for that format."""
        if isinstance(data, dict) and data.get("format") == "preference" and "prompt_field" not in data:
            return {**data, "prompt_field": "prompt"}
        return data

    @model_validator(mode="after")
    def _one_input(self) -> "PrepareConfig":
        """Exactly one of `input_uri` and `inputs`; a mixture is not empty and runs on the local engine."""
        if self.input_uri is not None and self.inputs is not None:
            raise ValueError("set prepare.input_uri or prepare.inputs, not both")
        if self.input_uri is None and self.inputs is None:
            raise ValueError("set prepare.input_uri (one source) or prepare.inputs (a mixture)")
        if self.inputs is not None and not self.inputs:
            raise ValueError("prepare.inputs is empty (list at least one {uri, weight})")
        if self.inputs is not None and self.engine == "ray":
            raise ValueError("prepare.engine ray does not run prepare.inputs mixtures yet (use local or auto)")
        if self.format == "prompts" and self.inputs is not None:
            raise ValueError("prepare.format prompts does not mix sources (use prepare.input_uri)")
        if self.format == "preference":
            if self.inputs is not None:
                raise ValueError("prepare.format preference does not mix sources yet (use prepare.input_uri)")
            if self.overlong not in (None, "drop"):
                raise ValueError(f"prepare.overlong {self.overlong}: a preference pair longer than data.seq_len "
                                 f"is dropped (its two documents share one row); leave overlong unset or drop")
        return self


    def for_source(self, source: InputSource) -> "PrepareConfig":
        """This section as a single-input one for `source`: its URI and its record keys where set."""
        own = {key: getattr(source, key) for key in SOURCE_KEYS if getattr(source, key) is not None}
        return self.model_copy(update={"input_uri": source.uri, "inputs": None, **own})

    @property
    def overlong_mode(self) -> str:
        if self.overlong is not None:
            return self.overlong
        return "split" if self.format in ("text", "instruction") else "drop"


class TrainingConfig(_Strict):
    """The optimization."""

    global_batch_size: int = Field(8, gt=0)
    """Sequences per optimizer step, at every world size."""
    micro_batch_size: int = Field(1, gt=0)
    """Sequences per forward/backward on one worker."""
    lr: float = Field(2e-4, gt=0)
    """Peak learning rate (AdamW, betas 0.9 / 0.95)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The schedule's floor, as a fraction of `lr`."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup, in optimizer steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, keyed on optimizer steps (a resize does not bend it)."""
    max_steps: Optional[int] = Field(None, gt=0)
    """Optimizer steps to train; exactly one of `max_steps` and `epochs`."""
    epochs: Optional[float] = Field(None, gt=0)
    """Passes over the train rows; exactly one of `max_steps` and `epochs`."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip_norm: Optional[float] = Field(1.0, gt=0)
    """Clip the global gradient norm to this; null: no clipping."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Orders the rows and seeds adapter init and dropout; part of the run's identity."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward instead of keeping them."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: `auto` is bf16 on GPU, fp32 on CPU."""
    parallelism: Literal["auto", "fsdp", "ddp"] = "auto"
    """`auto`: DDP where `eft plan` says a replicated model fits each GPU at every world size in
    `scaling.min_workers..max_workers`, else FSDP2 (the launcher logs the numbers behind the
    choice); FSDP2 on CPU."""
    loss: Literal["chunked", "liger", "full"] = "chunked"
    """`chunked`: cross-entropy over `loss_chunk_tokens` positions at a time from the final hidden
    states, so the full [tokens, vocab] logits never exist at once. `liger`: liger-kernel's fused
    linear cross-entropy (GPU, the `liger` extra). `full`: logits for the whole micro-batch, then
    the loss."""
    loss_chunk_tokens: int = Field(1024, gt=0)
    """Positions per chunk of the chunked loss."""
    compile: bool = False
    """Compile each decoder block with torch.compile (regional compilation, as torchtitan does)."""
    log_every_steps: int = Field(1, gt=0)
    """Logging steps: the loop's only host syncs (plus eval steps)."""
    eval_every_steps: Optional[int] = Field(None, gt=0)
    """Validation loss every this many steps (and at the last); needs a validation split."""
    eval_max_batches: int = Field(8, gt=0)
    """Validation rows per evaluation, in global batches."""
    pad_uneven_batches: bool = False
    """When the global batch does not split evenly at some world size in the scaling range: `false`
    rejects the config; `true` lets workers take floor/ceil(G/W) rows and run label-free padding
    micro-batches so every rank does the same number of forward/backward passes. The gradient is
    unchanged; the padding costs compute."""
    trace_rows: bool = False
    """Record the row_ids of every optimizer step in the run's metrics (one all-gather per logged
    step)."""
    objective: Literal["sft", "dpo", "simpo", "orpo", "grpo"] = "sft"
    """`sft`: next-token loss on the labelled tokens. `dpo`, `simpo`, `orpo`: preference tuning on a
    dataset prepared with `prepare.format: preference` (the `preference` section sets them up); the
    loss is normalized per pair over the global batch. `grpo`: online RL with verifiable rewards on
    a prompt set prepared with `prepare.format: prompts` (the `rl` section sets it up; docs/rl.md);
    the loss is normalized over the global batch's completion tokens."""

    @model_validator(mode="after")
    def _one_length(self) -> "TrainingConfig":
        """Exactly one of `max_steps` and `epochs`."""
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of training.max_steps and training.epochs")
        return self


# Each preference objective's own defaults for the `preference` keys a config leaves unset (JobConfig
# fills them in, so the config stored with a run shows the values used; a value set in the config
# always wins). Sources:
# - dpo (sigmoid and ipo): β 0.1, the DPO paper's (Rafailov et al. 2023) and TRL's DPOConfig default,
#   which TRL keeps for loss_type ipo (IPO's τ);
# - simpo: β 2.0 and γ 1.0, the SimPO paper's (Meng et al. 2024) recommended β of 2.0-2.5 with
#   γ/β = 0.5 (its repo's gamma_beta_ratio). TRL's CPOConfig keeps 0.1 and 0.5 for SimPO as for CPO,
#   and at β 0.1 the rewards' differences are too small to move: a held-out SimPO loss went 0.972 →
#   0.969 in 40 steps where DPO on the same pairs went 0.693 → 0.459;
# - orpo: λ 0.1, the ORPO paper's (Hong et al. 2024) and TRL's ORPOConfig.beta, which TRL also
#   uses as the reward metrics' scale: β 0.1.
OBJECTIVE_DEFAULTS: dict[str, dict[str, float]] = {
    "dpo": {"beta": 0.1},
    "simpo": {"beta": 2.0, "simpo_gamma": 1.0},
    "orpo": {"beta": 0.1, "orpo_lambda": 0.1},
}


class PreferenceConfig(_Strict):
    """The preference objectives (`training.objective` dpo, simpo or orpo)."""

    beta: Optional[float] = Field(None, gt=0)
    """DPO's β (the KL penalty's inverse temperature; IPO's τ); SimPO's reward scale; the scale of
    the reward metrics for SimPO and ORPO. Default by objective: 0.1 for dpo (the DPO paper's and
    TRL's), 2.0 for simpo (the SimPO paper recommends 2.0-2.5), 0.1 for orpo (TRL's); null for sft."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """DPO's loss: `sigmoid` (the DPO paper) or `ipo` (IPO's squared loss on length-averaged
    log-ratios)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO / SimPO: the probability that a pair's labels are flipped."""
    simpo_gamma: Optional[float] = Field(None, ge=0)
    """SimPO's target reward margin γ. Default for simpo: 1.0 (the SimPO paper's γ/β of 0.5 at β
    2.0)."""
    orpo_lambda: Optional[float] = Field(None, gt=0)
    """ORPO's weight λ of the odds-ratio term next to the SFT loss on the chosen completion. Default
    for orpo: 0.1 (the ORPO paper's and TRL's)."""
    reference: Optional[Literal["precomputed", "live", "none"]] = None
    """Where DPO's reference log-probs come from. `precomputed`: `eft prepare` computes them once
    with the base model (`model.uri`) as a Ray Data batch-inference pass and stores them with the
    dataset, so training holds one model. `live`: the trained model with its LoRA adapters disabled,
    one extra forward per micro-batch (LoRA only). `none`: no reference (SimPO and ORPO). Default:
    `precomputed` for dpo, `none` for simpo and orpo."""
    reference_num_actors: int = Field(1, gt=0)
    """`precomputed`: actors of the Ray Data pass that scores the dataset, each holding the reference
    model (one GPU each when `scaling.use_gpu`)."""
    reference_micro_batch_size: int = Field(4, gt=0)
    """`precomputed`: packed rows per forward of the scoring pass."""

    def reference_for(self, objective: str) -> str:
        if self.reference is not None:
            return self.reference
        return "precomputed" if objective == "dpo" else "none"


class RewardSpec(_Strict):
    """One reward of a weighted sum."""

    reward: str
    """A built-in (`exact_match`, `contains`, `regex`, `math`) or `module:function`."""
    weight: float = 1.0
    """Its weight in the step's reward."""


RL_BUILTIN_REWARDS = ("exact_match", "contains", "regex", "math")


class RlConfig(_Strict):
    """GRPO (`training.objective: grpo`): what a step samples, how it is rewarded and the loss.
    TRL's and verl's names for each key are in docs/rl.md."""

    reward: Optional[str] = None
    """One reward: a built-in (`exact_match`, `contains` and `regex` score as eval does, with
    `normalize` and `answer_regex`; `math`: answer equivalence by math-verify) or `module:function`
    called as `(prompt, completion, answer, record) -> float`, importable on the workers. Exactly one
    of `reward` and `rewards`."""
    rewards: Optional[list[RewardSpec]] = None
    """Several rewards summed by weight, e.g. correctness plus format: `[{reward, weight}]`."""
    normalize: bool = True
    """The built-in metric rewards compare after stripping, case-folding and collapsing whitespace."""
    answer_regex: Optional[str] = None
    """The `regex` reward: the regex that extracts the answer (its first group, or the whole match)."""
    max_reward_errors: int = Field(0, ge=0)
    """Reward calls that may raise (each leaves its group out of the step, never scored 0) before
    the run stops in one line naming the reward and the record."""
    prompts_per_step: int = Field(8, gt=0)
    """Prompts per optimizer step, at every world size (the same prompts: the seeded order)."""
    group_size: int = Field(4, ge=2)
    """Completions sampled per prompt; advantages are relative to the group."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens whose probability reaches this."""
    max_new_tokens: int = Field(64, gt=0)
    """A completion stops at the chat template's end of turn, EOS, or this many tokens (truncated)."""
    rollout: Literal["colocated", "actors"] = "colocated"
    """`colocated`: each training worker samples its share of the prompts with the current policy,
    in process (no weights move). `actors`: a pool of `rollout_actors` Ray actors samples them with
    the policy published after each step (transformers on each actor; docs/rl.md)."""
    rollout_actors: int = Field(0, ge=0)
    """`rollout: actors`: the pool's size. The completions are the same at any size (seeded per
    completion)."""
    rollout_cpus_per_actor: float = Field(1.0, gt=0)
    """`rollout: actors`: CPUs each actor reserves (and one GPU each when `scaling.use_gpu`)."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """The ratio's lower clip, 1 − clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """The ratio's upper clip, 1 + clip_high (DAPO's clip-higher: 0.28)."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the k3 estimate of KL(policy ‖ reference); the reference is the base: the model with
    its LoRA adapters disabled, or for a full fine-tune a frozen copy (sharded like the policy).
    0: no reference forward."""
    scale_rewards: Literal["group", "none"] = "group"
    """Advantages are reward − group mean, divided by the group's std (`group`) or not (`none`,
    Dr. GRPO)."""
    filter_zero_std: bool = False
    """Leave groups whose completions all got the same reward out of the step and its denominator
    (they are counted either way, as `frac_zero_std`)."""
    mask_truncated: bool = False
    """Completions cut at `max_new_tokens` get no loss (DAPO's overlong filtering)."""
    updates_per_batch: int = Field(1, ge=1, le=1)
    """Optimizer steps per batch of rollouts. 1: on-policy (the ratio is 1 and the old log-probs are
    the trainer's own forward); more is not built yet."""

    @model_validator(mode="after")
    def _one_reward(self) -> "RlConfig":
        """Exactly one of `reward` and `rewards`; `regex` has its regex; actors have a pool."""
        if self.reward is not None and self.rewards is not None:
            raise ValueError("set rl.reward or rl.rewards, not both")
        if self.rewards is not None and not self.rewards:
            raise ValueError("rl.rewards is empty (list at least one {reward, weight})")
        for name in self.reward_names():
            if name not in RL_BUILTIN_REWARDS and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", name):
                raise ValueError(f"rl reward {name!r}: not a built-in ({', '.join(RL_BUILTIN_REWARDS)}) nor "
                                 f"module:function")
            if name == "regex" and not self.answer_regex:
                raise ValueError("rl reward regex needs rl.answer_regex (the regex that extracts the answer)")
        if self.answer_regex is not None:
            try:
                re.compile(self.answer_regex)
            except re.error as err:
                raise ValueError(f"rl.answer_regex {self.answer_regex!r} is not a valid regex ({err})") from None
        if self.rollout == "actors":
            if self.rollout_actors == 0:
                raise ValueError("rl.rollout actors needs rl.rollout_actors >= 1")
        return self

    def reward_names(self) -> list[str]:
        return [self.reward] if self.reward is not None else [r.reward for r in self.rewards or []]

    def weighted_rewards(self) -> list[tuple[str, float]]:
        if self.reward is not None:
            return [(self.reward, 1.0)]
        return [(r.reward, r.weight) for r in self.rewards or []]


EVAL_METRICS = ("exact_match", "contains", "regex", "acc", "acc_norm")
GENERATION_METRICS = ("exact_match", "contains", "regex")
CHOICE_METRICS = ("acc", "acc_norm")


SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
DEFAULT_SET = "default"
HARNESS_DIR = "harness"  # <run>/eval/<label>/harness/: lm-eval's results, never a set's name
# The keys a named set may set for itself; the rest (the engine, the pool) are the eval section's.
SET_KEYS = ("uri", "metric", "normalize", "answer_regex", "batch_size", "max_new_tokens", "temperature", "seed",
            "max_bad_records")


class EvalSetConfig(_Strict):
    """One named set of `eval.sets`. A key left out takes the `eval` section's value, so shared
    decoding settings are written once."""

    uri: str
    """The set's JSONL or Parquet file (or a prefix of them), as `eval.uri`."""
    metric: Optional[Literal["exact_match", "contains", "regex", "acc", "acc_norm"]] = None
    """As `eval.metric`, for this set."""
    normalize: Optional[bool] = None
    """As `eval.normalize`, for this set."""
    answer_regex: Optional[str] = None
    """As `eval.answer_regex`, for this set."""
    batch_size: Optional[int] = Field(None, gt=0)
    """As `eval.batch_size`, for this set."""
    max_new_tokens: Optional[int] = Field(None, gt=0)
    """As `eval.max_new_tokens`, for this set."""
    temperature: Optional[float] = Field(None, ge=0)
    """As `eval.temperature`, for this set."""
    seed: Optional[int] = Field(None, ge=0)
    """As `eval.seed`, for this set."""
    max_bad_records: Optional[int] = Field(None, ge=0)
    """As `eval.max_bad_records`, for this set."""


class HarnessConfig(_Strict):
    """lm-evaluation-harness tasks (the `eft[harness]` extra), scored by eft's own model on the
    eval actor pool; results in `<run>/eval/<label>/harness/` as lm-eval writes them."""

    tasks: list[str] = Field(min_length=1)
    """lm-eval task (or group) names, e.g. `arc_easy`, `hellaswag`, `gsm8k`, or tasks of `include_path`."""
    num_fewshot: Optional[int] = Field(None, ge=0)
    """Few-shot examples per prompt; default each task's own."""
    limit: Optional[int] = Field(None, gt=0)
    """Score only the first N documents of each task (a quick look, not a benchmark number)."""
    include_path: Optional[str] = None
    """A local directory of task YAMLs (lm-eval's `--include_path`); a task's data may be local files
    (`dataset_path: json` with `dataset_kwargs.data_files`)."""
    apply_chat_template: bool = False
    """Render each request through the model's chat template with eft's own chat rendering (what
    training and serving use), as lm-eval's `--apply_chat_template` does; off by default, as the
    tasks' published numbers are."""
    batch_size: int = Field(8, gt=0)
    """Requests per forward or generation batch on an actor."""
    max_length: Optional[int] = Field(None, gt=0)
    """Context length in tokens: longer requests keep their last tokens, as lm-eval's HF model does.
    Default: the model's own (its config's `max_position_embeddings`, ...), by lm-eval's rule."""
    max_gen_toks: int = Field(256, gt=0)
    """`generate_until` requests stop here unless the task sets its own."""
    seed: int = Field(0, ge=0)
    """lm-eval's random, numpy and few-shot sampling seeds."""


class EvalConfig(_Strict):
    """`eft eval` and evaluation on checkpoints while training: task scores, not a loss. One set
    (`uri`), named sets (`sets`), lm-evaluation-harness tasks (`harness`), or any of them together."""

    uri: Optional[str] = None
    """The eval set named `default` (shorthand for `sets: {default: {uri: ...}}`): a JSONL or Parquet
    file (or a prefix of them, read in name order). Generation records hold `prompt` (a string) or
    `messages` (a conversation to answer) and `answer` (a string or a list of accepted strings);
    multiple-choice records hold `prompt` or `messages`, `choices` (strings) and `answer` (the right
    choice's index). Prompts render exactly as training rendered them (docs/eval.md)."""
    sets: dict[str, EvalSetConfig] = Field(default_factory=dict)
    """Named eval sets, each scored into `<run>/eval/<label>/<name>/`; their unset keys take this
    section's values. Names: letters, digits, `_` and `-`."""
    harness: Optional[HarnessConfig] = None
    """lm-evaluation-harness tasks `eft eval` scores besides the sets (not during training)."""
    metric: Optional[Literal["exact_match", "contains", "regex", "acc", "acc_norm"]] = None
    """`exact_match`, `contains` or `regex` for a generation set; `acc` or `acc_norm` (log-likelihood
    per character) for a multiple-choice set. Default: `exact_match` or `acc`, by the records."""
    normalize: bool = True
    """Compare after stripping, case-folding and collapsing whitespace (prediction and answer)."""
    answer_regex: Optional[str] = None
    """`metric: regex`: a Python regex that extracts the answer from the generation (its first group,
    or the whole match without groups) before the exact-match comparison."""
    num_actors: int = Field(1, gt=0)
    """Ray Data actors scoring the sets and harness requests, each holding the model once (one GPU
    each when `scaling.use_gpu`). The predictions are the same at any number."""
    cpus_per_actor: float = Field(1.0, gt=0)
    """CPUs each actor (and the evaluation task during training) reserves."""
    batch_size: int = Field(8, gt=0)
    """Prompts per generation batch (left-padded), or multiple-choice records per forward batch."""
    max_new_tokens: int = Field(64, gt=0)
    """Generation stops here, at the chat template's end-of-turn token or at the model's EOS."""
    temperature: float = Field(0.0, ge=0)
    """0: greedy (reproducible bit for bit). Above 0: sampling, seeded by `seed` and the batch."""
    seed: int = Field(0, ge=0)
    """Seeds sampling (temperature > 0) and the bootstrap of the score's 95% interval."""
    max_bad_records: int = Field(10, ge=0)
    """Records that cannot be scored (no prompt, an answer index out of range, ...) are skipped
    and counted, each named with its line; more than this many is a one-line error."""
    every_checkpoints: int = Field(0, ge=0)
    """While training: score every Nth periodic checkpoint (and the last) in a Ray task of its own,
    through Ray Train's validation hook, off the steps' path; 0 = off. Each set's score lands in the
    run's metrics as `eval_<set>_<metric>` at the checkpoint's step. Under torchrun (no Ray) rank 0
    scores it in its own process between steps, and the other ranks wait for it."""
    every_checkpoints_sets: Optional[list[str]] = None
    """While training: the sets scored on checkpoints; default all of them."""
    timeout_s: Optional[float] = Field(None, gt=0)
    """While training: give up on one checkpoint's evaluation after this long (a warning)."""
    engine: Literal["auto", "transformers", "vllm"] = "auto"
    """`transformers` generate (CPU or GPU); `vllm` through `ray.data.llm` (GPU, the `eft[vllm]`
    extra); `auto`: vllm on GPU workers when it is installed, else transformers."""

    @model_validator(mode="after")
    def _sets(self) -> "EvalConfig":
        """Something to score; set names that are unique and can name a directory; every set's regex
        settings hold; `every_checkpoints_sets` names sets that exist."""
        for name in self.sets:
            if not SET_NAME.match(name) or name == HARNESS_DIR:
                raise ValueError(f"eval.sets.{name}: a set name is letters, digits, _ and - (at most 64), "
                                 f"and not {HARNESS_DIR!r}")
        if self.uri is not None and DEFAULT_SET in self.sets:
            raise ValueError(f"eval.sets.{DEFAULT_SET}: the set name {DEFAULT_SET} is used twice (eval.uri is the "
                             f"set named {DEFAULT_SET}): drop eval.uri or rename the set")
        if self.uri is None and not self.sets and self.harness is None:
            raise ValueError("eval: nothing to score (set eval.uri, eval.sets or eval.harness)")
        for name, spec in self.named_sets().items():
            where = "eval" if name == DEFAULT_SET and self.uri is not None else f"eval.sets.{name}"
            if spec.metric == "regex" and not spec.answer_regex:
                raise ValueError(f"{where}.metric regex needs {where}.answer_regex (the regex that extracts the answer)")
            if spec.answer_regex is not None:
                try:
                    re.compile(spec.answer_regex)
                except re.error as err:
                    raise ValueError(f"{where}.answer_regex {spec.answer_regex!r} is not a valid regex ({err})") from None
        for name in self.every_checkpoints_sets or []:
            if name not in self.named_sets():
                raise ValueError(f"eval.every_checkpoints_sets: {name!r} is not a set (sets: "
                                 f"{', '.join(self.named_sets()) or 'none'})")
        if self.every_checkpoints and not self.checkpoint_sets():
            raise ValueError("eval.every_checkpoints: no set to score on checkpoints (set eval.uri or eval.sets; "
                             "the harness runs in eft eval only)")
        return self

    def named_sets(self) -> dict[str, "EvalConfig"]:
        """Every set by name, each as an EvalConfig of its own (its keys over this section's), so
        one set's scoring reads `uri`, `metric`, ... as a single-set config always did."""
        specs = {DEFAULT_SET: EvalSetConfig(uri=self.uri)} if self.uri is not None else {}
        specs.update(self.sets)
        out = {}
        for name, spec in specs.items():
            update = {k: v for k, v in spec.model_dump(include=set(SET_KEYS)).items() if v is not None}
            one = self.model_copy(update={**update, "sets": {}, "harness": None})
            one._key = "eval" if name == DEFAULT_SET and self.uri is not None else f"eval.sets.{name}"
            out[name] = one
        return out

    def checkpoint_sets(self) -> list[str]:
        """The sets scored on checkpoints while training."""
        names = list(self.named_sets())
        return names if self.every_checkpoints_sets is None else [n for n in names if n in self.every_checkpoints_sets]

    _key: str = PrivateAttr("eval")


class ServeConfig(_Strict):
    """Serving the run's export on a cluster: `eft manifests CONFIG --serve` renders a KubeRay
    RayService running Ray Serve LLM (vLLM on GPU workers), the same application as `serve.yaml`,
    and an equivalent `vllm serve` command line (docs/serving.md). `eft serve` on one machine takes
    its own flags."""

    min_replicas: int = Field(1, ge=1)
    """Model replicas kept when idle; each holds `tensor_parallel_size` GPUs."""
    max_replicas: int = Field(4, ge=1)
    """Replicas Serve's autoscaler adds under load; the GPU worker group grows to hold them."""
    target_ongoing_requests: int = Field(16, gt=0)
    """Requests in flight per replica that the autoscaler aims for: above it, it adds replicas."""
    tensor_parallel_size: Optional[int] = Field(None, gt=0)
    """GPUs per replica. Default: the fewest (a power of two, within one node) that hold the weights
    in half their memory, leaving the other half to vLLM's KV cache."""
    max_model_len: Optional[int] = Field(None, gt=0)
    """The longest prompt plus answer a request may have, in tokens; default the model's own."""
    adapter: bool = False
    """Serve the base plus the run's LoRA adapters, which Serve LLM loads on demand from
    `<run>/adapters/<checkpoint>/` (clients ask for `<name>-base:<checkpoint>`), instead of the
    merged model. Needs a `lora` section."""
    max_adapters_per_replica: int = Field(16, gt=0)
    """With `adapter`: how many adapters one replica holds at once (the least recently used goes)."""

    @model_validator(mode="after")
    def _replicas(self) -> "ServeConfig":
        """`min_replicas` <= `max_replicas`."""
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"serve.min_replicas ({self.min_replicas}) > serve.max_replicas ({self.max_replicas})")
        return self


class CheckpointConfig(_Strict):
    """Sharded checkpoints (DCP) under the run, and when they are taken."""

    save_every_steps: int = Field(100, gt=0)
    """Periodic checkpoint cadence (the last step always saves)."""
    num_to_keep: Optional[int] = Field(3, gt=0)
    """Checkpoints kept; null keeps all."""
    async_upload: bool = True
    """Upload in the background while training goes on (a just-in-time or pre-grow save waits)."""
    on_preemption: bool = True
    """Ask Ray Train every step whether a node of the run is being pre-empted (a cheap barrier); on a
    notice, train on and save a just-in-time checkpoint as late as the deadline allows, then stop
    stepping until the node goes. Under torchrun: on SIGTERM or SIGUSR1 to any rank, save at the
    next step boundary, then every rank stops and exits 0."""
    preemption_margin_s: float = Field(2.0, ge=0)
    """The least time left before a pre-emption deadline once the just-in-time checkpoint is up
    (at least one step's time is kept as well). Raise it where step times jitter by seconds, such
    as workers sharing a few CPU cores: a step slower than the margin can push the save past the
    deadline."""
    before_grow: bool = True
    """Before an elastic run grows (Ray Train restarts the group bigger), save at the next step
    boundary so the grow recomputes no step. Off: the bigger group resumes from the latest periodic
    checkpoint."""
    before_grow_timeout_s: float = Field(120.0, gt=0)
    """How long the pre-grow save may take before the grow goes ahead without it."""
    resume_on_new_data: bool = False
    """Resuming a run on another dataset (another `data.uri`, or the same one prepared anew) is refused
    unless this says to continue on the new data from the checkpoint's step."""


class ScalingConfig(_Strict):
    """Workers and what each one needs (Ray Train's ScalingConfig)."""

    min_workers: int = Field(2, gt=0)
    """Fewest workers; below `max_workers` the run is elastic."""
    max_workers: int = Field(2, gt=0)
    """Most workers."""
    use_gpu: bool = False
    """One or more GPUs per worker (NCCL); else CPU workers (gloo)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs Ray reserves per worker."""
    gpus_per_worker: float = Field(1.0, gt=0)
    """GPUs Ray reserves per worker (with `use_gpu`)."""
    gpu_memory_gib: Optional[float] = Field(None, gt=0, le=1024)
    """Memory of each worker's GPU, as CUDA reports it (39.4 for an A100-40GB, 79.2 for an
    H100-80GB): what `eft plan` and `training.parallelism: auto` fit a worker into. Unset: the
    A100-40GB of the `base` overlay's p4d.24xlarge (`eft plan --node-type` names another)."""
    resources_per_worker: dict[str, float] = Field(default_factory=dict)
    """Other Ray resources each worker needs (a node-type label resource, say); CPU and GPU go in the
    two keys above."""
    elastic_resize_monitor_interval_s: float = Field(60.0, gt=0)
    """How often a healthy elastic run checks whether more workers fit (and restarts bigger)."""
    worker_group_start_timeout_s: Optional[float] = Field(None, gt=0)
    """How long a (re)start waits for the requested workers before an elastic run settles for fewer;
    null keeps Ray Train's default (60 s)."""

    @field_validator("resources_per_worker")
    @classmethod
    def _extra_resources_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            # Ray names them CPU and GPU; any case here would be a second, conflicting count.
            if name.upper() in ("CPU", "GPU"):
                raise ValueError(f"{name!r}: set {name.lower()}s per worker with scaling.{name.lower()}s_per_worker, "
                                 f"not here (this map is for other Ray resources)")
            if amount < 0:
                raise ValueError(f"{name!r}: {amount} is negative")
        return resources


class FaultToleranceConfig(_Strict):
    """How many restarts a run may take, and how long a dead driver holds the run."""

    max_failures: int = Field(3, ge=-1)
    """Worker-group restarts on errors; -1: unlimited."""
    max_preemption_failures: int = Field(-1, ge=-1)
    """Restarts after node pre-emption, counted apart from errors (a spot run may be reclaimed many
    times); -1: unlimited."""
    run_lease_ttl_s: float = Field(120.0, ge=5.0)
    """Lifetime of the run lease `<run>/_lease.json` (one driver per run), renewed by the driver
    every quarter of it. A driver that dies holds the run this long at most; a driver paused
    longer loses the run to the next one, and its workers commit nothing more."""


class StorageConfig(_Strict):
    """Where runs live."""

    root_uri: str
    """Runs live under `<root_uri>/<name>/`: a bucket or directory (not empty, `/`, `.` or a bucketless
    `s3://`)."""
    s3_endpoint: Optional[str] = None
    """Normally unset: boto3 and pyarrow read `AWS_ENDPOINT_URL`. Set it to pin an S3-compatible
    store."""
    s3_region: str = "us-east-1"
    """S3 region."""

    @field_validator("root_uri")
    @classmethod
    def _a_prefix(cls, uri: str) -> str:
        return check_location(uri)


class JobConfig(_Strict):
    """One job: a YAML file of these sections. Credentials never live here: S3 uses the standard AWS
    chain and `AWS_ENDPOINT_URL`."""

    name: str
    """The run name: runs live at `<storage.root_uri>/<name>/`, and re-using a name resumes the run
    (another `model.uri`, LoRA shape or alpha, or `training.seed` is refused, naming the keys).
    Letters, digits, `.`, `_` and `-`; for `eft manifests`, a lowercase Kubernetes name of at most 40."""
    model: ModelConfig
    lora: Optional[LoraConfig] = None
    data: DataConfig
    prepare: Optional[PrepareConfig] = None
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    storage: StorageConfig
    eval: Optional[EvalConfig] = None
    rl: Optional[RlConfig] = None
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "JobConfig":
        """`name` is letters, digits, `.`, `_` and `-`; `data.uri` and `storage.root_uri` do not
        overlap; `scaling.gpu_memory_gib` needs `use_gpu`; `min_workers` <= `max_workers`; the global
        batch splits at every world size in the range (or `pad_uneven_batches`); `loss: liger` needs
        GPU workers."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.name):
            raise ValueError(f"name {self.name!r} must be letters, digits, '.', '_' or '-'")
        if locations_overlap(self.data.uri, self.storage.root_uri):
            # Runs and datasets each delete what they own under their prefix; nested, one would
            # delete or list the other's objects.
            raise ValueError(f"data.uri {self.data.uri} and storage.root_uri {self.storage.root_uri} overlap "
                             f"(one holds the other): keep datasets and runs under separate prefixes")
        s, t = self.scaling, self.training
        if s.gpu_memory_gib is not None and not s.use_gpu:
            raise ValueError(f"scaling.gpu_memory_gib {s.gpu_memory_gib:g} is set but scaling.use_gpu is false "
                             f"(CPU workers have no GPU memory to plan against)")
        if s.min_workers > s.max_workers:
            raise ValueError(f"scaling.min_workers ({s.min_workers}) > scaling.max_workers ({s.max_workers})")
        # GRPO's steps are prompts × group, packed on each rank: the global batch does not split.
        for world in range(s.min_workers, s.max_workers + 1) if t.objective != "grpo" else ():
            if problem := BatchPlan(t.global_batch_size, world, t.micro_batch_size).problem(t.pad_uneven_batches):
                raise ValueError(f"{problem} (scaling.max_workers {s.max_workers})" if t.pad_uneven_batches else
                                 f"{problem} (world size {world} is in scaling.min_workers..max_workers; or set "
                                 f"training.pad_uneven_batches: true)")
        if t.loss == "liger" and not s.use_gpu:
            raise ValueError("training.loss liger needs scaling.use_gpu: true (liger-kernel runs on GPU only); "
                             "use training.loss: chunked on CPU")
        if self.serve.adapter and self.lora is None:
            raise ValueError("serve.adapter: true needs a lora section (a full fine-tune exports a merged model only)")
        self._check_rl()
        self._check_preference()
        self._fill_objective_defaults()
        return self

    def _fill_objective_defaults(self) -> None:
        """The `preference` keys left unset take the objective's defaults (OBJECTIVE_DEFAULTS)."""
        for key, value in OBJECTIVE_DEFAULTS.get(self.training.objective, {}).items():
            if getattr(self.preference, key) is None:
                setattr(self.preference, key, value)

    def _check_rl(self) -> None:
        """GRPO has its `rl` section and a prompt set; nothing else has either."""
        objective, fmt = self.training.objective, self.prepare.format if self.prepare is not None else None
        if objective != "grpo":
            if self.rl is not None:
                raise ValueError(f"rl: section set but training.objective is {objective} (set training.objective: "
                                 f"grpo, or remove the section)")
            if fmt == "prompts" and objective != "sft":
                raise ValueError(f"training.objective {objective}: prepare.format prompts is GRPO's prompt set")
            return
        if self.rl is None or not self.rl.reward_names():
            raise ValueError("training.objective grpo needs a reward: set rl.reward (exact_match, contains, regex, "
                             "math or module:function) or rl.rewards")
        if fmt is not None and fmt != "prompts":
            raise ValueError(f"training.objective grpo trains on prompts: set prepare.format: prompts (it is {fmt})")
        if self.training.eval_every_steps:
            raise ValueError("training.eval_every_steps: grpo has no validation loss; score held-out prompts with an "
                             "eval section (eval.every_checkpoints)")
        if self.data.cross_document_attention:
            raise ValueError("training.objective grpo: data.cross_document_attention must stay false (a row packs "
                             "several completions that must not see each other)")
        if self.rl.rollout == "actors" and self.lora is not None and self.lora.quantize_base is not None:
            raise ValueError("rl.rollout actors with lora.quantize_base: the actors would sample from the unquantized "
                             "base, not the policy being trained (use rl.rollout: colocated)")

    def _check_preference(self) -> None:
        """The objective, its reference and the dataset's format agree."""
        objective, reference = self.training.objective, self.preference.reference_for(self.training.objective)
        if objective in ("sft", "grpo"):
            return
        if self.prepare is not None and self.prepare.format != "preference":
            raise ValueError(f"training.objective {objective} trains on pairs: set prepare.format: preference "
                             f"(it is {self.prepare.format})")
        if self.data.cross_document_attention:
            raise ValueError(f"training.objective {objective}: data.cross_document_attention must stay false "
                             f"(a pair's chosen and rejected documents share a row and must not see each other)")
        if objective == "dpo" and reference == "none":
            raise ValueError("preference.reference none: training.objective dpo needs a reference "
                             "(precomputed or live)")
        if objective != "dpo" and reference != "none":
            raise ValueError(f"preference.reference {reference}: training.objective {objective} uses no reference "
                             f"model (leave preference.reference unset)")
        if reference == "live" and self.lora is None:
            raise ValueError("preference.reference live needs a lora section (the reference is the model with "
                             "its adapters disabled); use precomputed for a full fine-tune")

    @property
    def reference_mode(self) -> str:
        """Where the preference objective's reference log-probs come from: precomputed, live or none."""
        return self.preference.reference_for(self.training.objective)

    @property
    def run_uri(self) -> str:
        return self.storage.root_uri.rstrip("/") + "/" + self.name

    @property
    def tokenizer_uri(self) -> str:
        return (self.prepare.tokenizer_uri if self.prepare and self.prepare.tokenizer_uri else None) or self.model.uri


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    parsed = []
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        parsed.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return parsed


def format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    where = f"{source}: {loc}" if loc else source
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{where}: {msg}{more}"


def build_config(tree: dict, source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping. PyYAML keeps the last silently, which
    drops a whole eval set (or any section) written twice under one name without a word."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping (line {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> JobConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        tree = yaml.load(path.read_text(), Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for key, value in parse_overrides(overrides or []):
        _set_path(tree, key, value)
    return build_config(tree, str(path))


def dump_config(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
