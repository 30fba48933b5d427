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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.train.batch import BatchPlan


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


def locations_overlap(a: str, b: str) -> bool:
    """True when one URI's tree holds the other's (or they are the same)."""
    (scheme_a, parts_a), (scheme_b, parts_b) = split_location(a), split_location(b)
    shorter = min(len(parts_a), len(parts_b))
    return scheme_a == scheme_b and parts_a[:shorter] == parts_b[:shorter]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    uri: str = Field(description="Hugging Face model dir: s3://bucket/prefix, file:// or a local path")
    # "auto": bf16 on GPU, fp32 on CPU (CPU has no fast bf16 matmul and the tests want exact fp32).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


class LoraConfig(_Strict):
    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # PEFT's rule for a list: each name matches a module whose dotted name is it or ends in ".<name>"
    # (no regexes); preflight checks each one against the model's modules.
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, targets: list[str]) -> list[str]:
        if not targets:
            raise ValueError("empty: name the modules LoRA adapts (e.g. [q_proj, v_proj]), or set lora: null "
                             "for a full fine-tune")
        if any(not t.strip() for t in targets):
            raise ValueError(f"{targets}: a module name is empty")
        return targets

    # QLoRA: the frozen base's linear weights are held in 4-bit NF4 (torchao), the adapters train
    # on top in the compute dtype; checkpoints and exports hold the adapters only.
    quantize_base: Optional[Literal["nf4"]] = None
    # Under FSDP2: replicated keeps the adapters whole on every rank and all-reduces their gradients
    # once per optimizer step, while the frozen base stays sharded (fast: no per-micro-batch gathers
    # of hundreds of small tensors); sharded shards them with their block like the base, for
    # adapters too big to hold whole on each GPU (16 bytes a parameter with AdamW). DDP ignores it.
    fsdp_adapters: Literal["replicated", "sharded"] = "replicated"


class DataConfig(_Strict):
    uri: str = Field(description="prepared dataset prefix (holds manifest.json once committed)")
    seq_len: int = Field(2048, gt=1)
    # Documents held out for validation at prepare time (by a hash of their source position).
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    # false: attention stays inside each packed document (the shards' position_ids restart at every
    # document start and transformers builds a block-causal mask from them). true: every token of a
    # row attends to everything before it, across documents (no position_ids passed).
    cross_document_attention: bool = False

    @field_validator("uri")
    @classmethod
    def _a_prefix(cls, uri: str) -> str:
        return check_location(uri)


class InputSource(_Strict):
    """One source of a mixture (`prepare.inputs`). Unset record keys fall back to the prepare
    section's; the chat template (prepare.chat_template or the tokenizer's) is shared."""
    uri: str = Field(description="raw JSONL or Parquet file or prefix")
    # Relative share of documents in the mixture (any positive numbers; normalised by their sum).
    weight: float = Field(1.0, gt=0)
    input_format: Optional[Literal["jsonl", "parquet"]] = None
    format: Optional[Literal["text", "instruction", "chat", "sharegpt"]] = None
    text_field: Optional[str] = None
    prompt_field: Optional[str] = None
    response_field: Optional[str] = None
    messages_field: Optional[str] = None
    conversations_field: Optional[str] = None
    sharegpt_roles: Optional[dict[str, Literal["system", "user", "assistant", "tool"]]] = None
    train_on: Optional[Literal["assistant", "last_assistant", "all"]] = None
    overlong: Optional[Literal["drop", "truncate", "split"]] = None


# The keys an `inputs` entry may set for itself (the rest of the prepare section is shared).
SOURCE_KEYS = ("input_format", "format", "text_field", "prompt_field", "response_field", "messages_field",
               "conversations_field", "sharegpt_roles", "train_on", "overlong")


class PrepareConfig(_Strict):
    # Exactly one of input_uri (one source) and inputs (a mixture; see "Mixing datasets" in the README).
    input_uri: Optional[str] = Field(None, description="raw JSONL or Parquet file or prefix")
    # Several sources mixed into one dataset: [{uri, weight, <any of SOURCE_KEYS>}, ...]. Weights are
    # relative proportions of documents (parsed records; over-long drops happen after selection).
    # Without replacement (default) the mixture is the largest one the weights allow (the source that
    # runs out first limits it) or exactly mix_documents; with replacement it has mix_documents
    # documents (default: the sum of the sources' documents). Deterministic under mix_seed, which
    # is independent of training.seed. Local engine only (engine auto picks it).
    inputs: Optional[list[InputSource]] = None
    mix_replacement: bool = False
    mix_documents: Optional[int] = Field(None, gt=0)
    mix_seed: int = 0
    input_format: Literal["jsonl", "parquet"] = "jsonl"
    format: Literal["text", "instruction", "chat", "sharegpt"] = "text"
    text_field: str = "text"
    prompt_field: str = "instruction"
    response_field: str = "response"
    # Conversations (format chat: OpenAI-style {role, content} messages; sharegpt: {from, value}),
    # rendered by the tokenizer's chat template or by `chat_template` (a Jinja file, path or URI).
    messages_field: str = "messages"
    conversations_field: str = "conversations"
    sharegpt_roles: dict[str, Literal["system", "user", "assistant", "tool"]] = Field(
        default_factory=lambda: {"human": "user", "gpt": "assistant", "system": "system"},
        description="ShareGPT `from` → role; replaces the default mapping whole")
    chat_template: Optional[str] = Field(None, description="Jinja chat template file; default: the tokenizer's")
    # Which tokens of a conversation are trained: every assistant turn (content + end-of-turn
    # marker), only the last one, or every token.
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    # A document longer than data.seq_len: split over rows, drop it, or truncate it (whole leading
    # turns through the last assistant turn that fits). Default: split for text and instruction,
    # drop for chat and sharegpt.
    overlong: Optional[Literal["drop", "truncate", "split"]] = None
    tokenizer_uri: Optional[str] = Field(None, description="defaults to model.uri")
    rows_per_shard: int = Field(1024, gt=0)
    max_bad_records: int = Field(100, ge=0)
    tokenize_batch_size: int = Field(256, gt=0)
    # Where tokenizing runs. "local": in this process, on a thread per core (the Rust tokenizer
    # releases the GIL); no Ray start-up, so it wins on inputs one machine tokenizes in seconds to
    # minutes. "ray": a Ray Data actor pool across the cluster, for corpora that need more than one
    # machine. "auto": local up to local_max_input_mb of input files, else ray.
    engine: Literal["auto", "local", "ray"] = "auto"
    local_max_input_mb: float = Field(256.0, ge=0)
    local_threads: Optional[int] = Field(None, gt=0, description="local engine; default: this process's usable cores")
    num_tokenizer_actors: int = Field(2, gt=0)
    overwrite: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "PrepareConfig":
        if self.input_uri is not None and self.inputs is not None:
            raise ValueError("set prepare.input_uri or prepare.inputs, not both")
        if self.input_uri is None and self.inputs is None:
            raise ValueError("set prepare.input_uri (one source) or prepare.inputs (a mixture)")
        if self.inputs is not None and not self.inputs:
            raise ValueError("prepare.inputs is empty (list at least one {uri, weight})")
        if self.inputs is not None and self.engine == "ray":
            raise ValueError("prepare.engine ray does not run prepare.inputs mixtures yet (use local or auto)")
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
    global_batch_size: int = Field(8, gt=0, description="sequences per optimizer step, at every world size")
    micro_batch_size: int = Field(1, gt=0, description="sequences per forward/backward on one worker")
    lr: float = Field(2e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    max_steps: Optional[int] = Field(None, gt=0)
    epochs: Optional[float] = Field(None, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: Optional[float] = Field(1.0, gt=0)
    # numpy and torch both take any seed in 0..2**32-1.
    seed: int = Field(0, ge=0, le=2**32 - 1)
    activation_checkpointing: bool = False
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    # auto: DDP where `eft plan` says a replicated model fits each GPU at every world size in
    # scaling.min..max_workers, else FSDP2 (the launcher logs the numbers behind the choice).
    parallelism: Literal["auto", "fsdp", "ddp"] = "auto"
    # chunked: cross-entropy over chunks of loss_chunk_tokens positions from the final hidden states,
    # so the full [tokens, vocab] logits never exist at once. liger: liger-kernel's fused linear
    # cross-entropy (GPU, the `liger` extra). full: logits for the whole micro-batch, then the loss.
    loss: Literal["chunked", "liger", "full"] = "chunked"
    loss_chunk_tokens: int = Field(1024, gt=0)
    # Compile each decoder block with torch.compile (regional compilation, as torchtitan does).
    compile: bool = False
    log_every_steps: int = Field(1, gt=0)
    eval_every_steps: Optional[int] = Field(None, gt=0)
    eval_max_batches: int = Field(8, gt=0)
    # When G does not split evenly at some world size in scaling.min..max_workers: false rejects
    # the config; true lets workers take floor/ceil(G/W) rows and run label-free padding
    # micro-batches so every rank does the same number of forward/backward passes (FSDP
    # collectives must match). The gradient is unchanged; the padding costs compute.
    pad_uneven_batches: bool = False
    # Record the row_ids of every optimizer step in the run's metrics (one all-gather per logged step).
    trace_rows: bool = False

    @model_validator(mode="after")
    def _one_length(self) -> "TrainingConfig":
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of training.max_steps and training.epochs")
        return self


class CheckpointConfig(_Strict):
    save_every_steps: int = Field(100, gt=0)
    num_to_keep: Optional[int] = Field(3, gt=0)
    async_upload: bool = True
    # Ask Ray Train every step whether a node of the run is being preempted (a cheap barrier);
    # on a notice, train on and save a just-in-time checkpoint as late as the deadline allows,
    # then stop stepping until the node goes (app/train/preemption.py).
    on_preemption: bool = True
    # Before an elastic run grows (Ray Train restarts the group bigger), save at the next step
    # boundary, waiting at most before_grow_timeout_s, so the grow recomputes no step
    # (app/train/grow.py). Off: the bigger group resumes from the latest periodic checkpoint.
    before_grow: bool = True
    before_grow_timeout_s: float = Field(120.0, gt=0)
    # Resuming a run on another dataset (another data.uri, or the same one prepared anew) is
    # refused unless this says to continue on the new data from the checkpoint's step.
    resume_on_new_data: bool = False


class ScalingConfig(_Strict):
    min_workers: int = Field(2, gt=0)
    max_workers: int = Field(2, gt=0)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(1.0, gt=0)
    # Memory of each worker's GPU, as CUDA reports it (e.g. 39.4 for an A100-40GB, 79.2 for an
    # H100-80GB): what `eft plan` and `training.parallelism: auto` fit a worker into. Unset: the
    # A100-40GB of the `base` overlay's p4d.24xlarge (`eft plan --node-type` names another).
    gpu_memory_gib: Optional[float] = Field(None, gt=0, le=1024)
    # Extra Ray resources each worker needs (e.g. a node-type label resource), beside CPU/GPU.
    resources_per_worker: dict[str, float] = Field(default_factory=dict)
    # How often a healthy elastic run checks whether more workers fit (and restarts bigger).
    elastic_resize_monitor_interval_s: float = Field(60.0, gt=0)
    # How long a (re)start waits for the requested workers before an elastic run settles for
    # fewer; None keeps Ray Train's default (60 s).
    worker_group_start_timeout_s: Optional[float] = Field(None, gt=0)

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
    max_failures: int = Field(3, ge=-1, description="worker-group restarts on errors; -1 = unlimited")
    # Pre-emptions are counted apart from real errors: a spot run may be reclaimed many times.
    max_preemption_failures: int = Field(-1, ge=-1, description="restarts after node pre-emption; -1 = unlimited")


class StorageConfig(_Strict):
    root_uri: str = Field(description="runs live under <root_uri>/<name>/")
    # Normally unset: boto3/pyarrow read AWS_ENDPOINT_URL. Set it to pin an S3-compatible store.
    s3_endpoint: Optional[str] = None
    s3_region: str = "us-east-1"

    @field_validator("root_uri")
    @classmethod
    def _a_prefix(cls, uri: str) -> str:
        return check_location(uri)


class JobConfig(_Strict):
    name: str = Field(description="the run name; re-using it resumes the run")
    model: ModelConfig
    lora: Optional[LoraConfig] = None
    data: DataConfig
    prepare: Optional[PrepareConfig] = None
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    storage: StorageConfig

    @model_validator(mode="after")
    def _cross_checks(self) -> "JobConfig":
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
        for world in range(s.min_workers, s.max_workers + 1):
            if problem := BatchPlan(t.global_batch_size, world, t.micro_batch_size).problem(t.pad_uneven_batches):
                raise ValueError(f"{problem} (scaling.max_workers {s.max_workers})" if t.pad_uneven_batches else
                                 f"{problem} (world size {world} is in scaling.min_workers..max_workers; or set "
                                 f"training.pad_uneven_batches: true)")
        if t.loss == "liger" and not s.use_gpu:
            raise ValueError("training.loss liger needs scaling.use_gpu: true (liger-kernel runs on GPU only); "
                             "use training.loss: chunked on CPU")
        return self

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


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> JobConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for key, value in parse_overrides(overrides or []):
        _set_path(tree, key, value)
    return build_config(tree, str(path))


def dump_config(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
