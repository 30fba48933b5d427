"""Memory per GPU for a job, per strategy and world size, and the parallelism it implies.

`estimate_memory` predicts one worker's peak bytes from the model's config.json and the job:
parameter counts come from the model built on the meta device (with PEFT's own matcher, so LoRA
counts are exact), the rest from the Llama-style decoder block (Llama, Mistral, Qwen2: RMSNorm,
rotary attention, gated MLP) as transformers implements it. Components, per worker:

* parameters, in their storage dtype (app.model.build.resolve_precision; NF4 for the base's
  linears under lora.quantize_base), sharded 1/world by FSDP2, replicated by DDP;
* gradients and AdamW's two moments, for trainable parameters, sharded or replicated likewise;
* the optimizer step's temporary (foreach AdamW on GPU copies all moments once);
* FSDP2's unsharded parameters (the root's embeddings and head stay gathered through forward and
  backward; two blocks at a time, the current and the prefetched one, plus the block's unsharded
  gradients for reduce-scatter) or DDP's gradient buckets (a flat copy of every gradient);
* activations saved for backward, per micro-batch of seq_len tokens, counted tensor by tensor
  from the block's ops; with activation checkpointing, each block's input, plus one block's
  worth while backward recomputes it (after the loss phase, so the two do not add up);
* the loss phase: `full` holds three fp32 [tokens, vocab] buffers at once in its backward (the
  logits' fp32 copy or log-softmax, its gradient, and the gradient being formed); `chunked` one
  fp32 [loss_chunk_tokens, vocab] buffer (plus the bf16 logits on GPU); `liger` its own chunk;
* buffers (rotary tables) and, on GPU, a fixed CUDA context and communicator overhead.

The peak is when they coexist: at the start of backward (activations + loss phase) or at the
end of it (all gradients), or at the optimizer step (gradients + moments + temporary); the
components do not all peak together, so `total_bytes` is less than their sum.
bench/plan_accuracy.py checks the prediction against measured peaks.
"""

from __future__ import annotations

import dataclasses

import functools
import json
import math
from dataclasses import asdict, dataclass
from typing import Optional

from app.config import JobConfig

GIB = 2**30
# The prediction lands within -5%..+12% of measured CPU peaks (bench/results/plan_accuracy.md),
# mostly above; the CUDA caching allocator reserves a few percent more than it hands out (block
# rounding, fragmentation). 10% of the GPU kept free covers an under-prediction of that size plus
# the allocator, without ruling out DDP where a replicated model fits with room to spare.
DEFAULT_HEADROOM = 0.10
# Outside PyTorch's allocator: the CUDA context, cuBLAS/NCCL workspaces and communicator buffers.
CUDA_CONTEXT_BYTES = 1 * GIB
# The GPU planned against when scaling.gpu_memory_gib is unset: the `base` overlay's p4d.24xlarge
# (A100-40GB), the smallest of the 8-GPU training nodes, so a plan that fits it fits the others.
DEFAULT_NODE_TYPE = "p4d.24xlarge"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """One worker's memory, in bytes, for one strategy at one world size. Components are each
    one's own size; `total_bytes` is the predicted peak (they do not all coexist)."""
    parallelism: str
    world: int
    parameters: int
    gradients: int
    optimizer_state: int
    optimizer_step: int
    sharding: int  # FSDP2 unsharded params + reduce-scatter grads, or DDP buckets (+ autocast casts)
    activations: int
    loss: int
    buffers: int
    cuda_context: int
    total_bytes: int
    peak_phase: str  # "backward start", "backward end" or "optimizer step"

    @property
    def allocated_bytes(self) -> int:
        """The peak as torch.cuda.max_memory_allocated counts it (no context)."""
        return self.total_bytes - self.cuda_context

    def to_dict(self) -> dict:
        return {**asdict(self), "allocated_bytes": self.allocated_bytes}


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one kind: (shape, bytes per element) each."""
    shapes: tuple

    def bytes(self, world: int = 1) -> int:
        """Bytes one rank holds with dim 0 split `world` ways, padded as FSDP2 pads."""
        return int(sum(math.ceil(s[0] / world) * math.prod(s[1:]) * b if s else b for s, b in self.shapes))

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s, _ in self.shapes)

    @property
    def largest(self) -> int:
        return max((math.prod(s) * b for s, b in self.shapes), default=0)


@dataclass(frozen=True)
class ModelLayout:
    """What the plan needs of the model: its parameters by kind, and the block's dimensions."""
    frozen: ParamGroup
    trainable: ParamGroup
    root: ParamGroup  # outside the decoder blocks (embeddings, final norm, head): FSDP2's root unit
    block: ParamGroup  # one decoder block, all its parameters
    block_trainable: ParamGroup
    buffer_bytes: int
    hidden: int
    layers: int
    heads: int
    kv_dim: int
    head_dim: int
    intermediate: int
    vocab: int
    head_trainable: bool
    adapted: dict  # module suffix (q_proj, ...) → in_features, for the LoRA-adapted linears
    norm_weights_trainable: bool


def as_config(model_config):
    """A transformers config from a config.json dict (or a config object as is)."""
    if isinstance(model_config, dict):
        from transformers import AutoConfig

        tree = dict(model_config)
        return AutoConfig.for_model(**tree)
    return model_config


@functools.lru_cache(maxsize=16)
def _layout(config_json: str, lora_json: Optional[str], storage_bytes: int, nf4: bool) -> ModelLayout:
    import torch.nn as nn

    from app.config import LoraConfig
    from app.model.architecture import build_meta_base, build_peft_config, decoder_blocks
    from app.model.quantize import nf4_bytes_per_param

    config = as_config(json.loads(config_json))
    model = build_meta_base(config)
    blocks = decoder_blocks(model)
    if lora_json is not None:
        import warnings

        from peft import get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(model, build_peft_config(LoraConfig.model_validate_json(lora_json)))
    # After PEFT: the blocks (adapted in place) now hold their adapters too.
    block_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    base_linear_weights = {id(m.weight) for block in blocks for name, m in block.named_modules()
                           if isinstance(m, nn.Linear) and "lora_" not in name}
    frozen, trainable, root, block0, block0_trainable = [], [], [], [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            # Full fine-tuning trains the stored weights; PEFT keeps adapters in fp32.
            item = (tuple(p.shape), storage_bytes if lora_json is None else 4)
        elif nf4 and id(p) in base_linear_weights:
            item = (tuple(p.shape), nf4_bytes_per_param())
        else:
            item = (tuple(p.shape), storage_bytes)
        (trainable if p.requires_grad else frozen).append(item)
        where = block_of.get(id(p))
        if where is None:
            root.append(item)
        elif where == 0:
            block0.append(item)
            if p.requires_grad:
                block0_trainable.append(item)
    adapted = {name.rsplit(".", 1)[-1]: module.in_features for name, module in blocks[0].named_modules()
               if hasattr(module, "lora_A")}
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head = model.get_output_embeddings()
    return ModelLayout(
        frozen=ParamGroup(tuple(frozen)), trainable=ParamGroup(tuple(trainable)), root=ParamGroup(tuple(root)),
        block=ParamGroup(tuple(block0)), block_trainable=ParamGroup(tuple(block0_trainable)),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        hidden=hidden, layers=config.num_hidden_layers, heads=heads, kv_dim=kv_heads * head_dim, head_dim=head_dim,
        intermediate=getattr(config, "intermediate_size", None) or 4 * hidden, vocab=config.vocab_size,
        head_trainable=head is not None and head.weight.requires_grad, adapted=adapted,
        norm_weights_trainable=lora_json is None,
    )


def load_layout(cfg: JobConfig, model_config) -> ModelLayout:
    config = as_config(model_config)
    precision = plan_precision(cfg)
    lora = cfg.lora.model_dump_json() if cfg.lora is not None else None
    nf4 = cfg.lora is not None and cfg.lora.quantize_base == "nf4"
    return _layout(config.to_json_string(use_diff=False), lora, precision[0], nf4)


def plan_precision(cfg: JobConfig) -> tuple[int, Optional[int]]:
    """(storage bytes, compute bytes or None) as app.model.build.resolve_precision decides them on
    the job's device."""
    import torch

    from app.model.build import resolve_precision

    precision = resolve_precision(cfg, torch.device("cuda" if cfg.scaling.use_gpu else "cpu"))
    storage = DTYPE_BYTES[str(precision.storage_dtype).removeprefix("torch.")]
    compute = None if precision.param_dtype is None else DTYPE_BYTES[str(precision.param_dtype).removeprefix("torch.")]
    return storage, compute


def layer_activation_bytes(m: ModelLayout, cfg: JobConfig, resid: int, mm: int) -> float:
    """Bytes one decoder block saves for backward, per token. `resid`: the residual stream's
    element size; `mm`: the matmuls' (they differ under DDP's autocast over fp32 weights)."""
    h, kv, inter = m.hidden, m.kv_dim, m.intermediate
    full = cfg.lora is None
    adapted = m.adapted

    def saves_input(*names: str) -> bool:
        return full or any(n in adapted for n in names)

    def norm(out_saved: bool) -> float:
        # x upcast to fp32 (saved by pow and mul), rsqrt per token, the normalized x (saved by the
        # weight's mul if the weight trains) and the output (saved by the linears that read it).
        return 4 * h + 4 + (resid * h if m.norm_weights_trainable else 0) + (resid * h if out_saved else 0)

    attention = norm(saves_input("q_proj", "k_proj", "v_proj")) + mm * (2 * h + 2 * kv) + 4 * m.heads
    mlp = norm(saves_input("gate_proj", "up_proj")) + mm * inter * (3 + saves_input("down_proj"))
    lora = 0.0
    for _, n_in in adapted.items():
        lora += mm * cfg.lora.r
        if cfg.lora.dropout > 0:
            lora += n_in * (mm + 1)  # dropout's output (lora_A's input) and its bool mask
    # Autocast casts each linear's fp32 input to bf16 anew; the cast is what the linear saves.
    casts = 5 * h * mm if resid != mm and full else 0
    return attention + mlp + lora + casts


def estimate_memory(cfg: JobConfig, model_config, world: int, parallelism: str) -> MemoryEstimate:
    """One worker's predicted peak for `parallelism` ("fsdp" or "ddp") at `world` workers."""
    if parallelism not in ("fsdp", "ddp"):
        raise ValueError(f"parallelism {parallelism!r}: expected fsdp or ddp")
    m = load_layout(cfg, model_config)
    t = cfg.training
    storage, compute = plan_precision(cfg)
    mm = compute or storage
    # FSDP2 casts every weight to param_dtype, so the stream is in it; DDP's autocast leaves the
    # embedding output and residual adds in the storage dtype.
    resid = mm if parallelism == "fsdp" else storage
    shards = world if parallelism == "fsdp" else 1
    # lora.fsdp_adapters replicated: FSDP2 ignores the adapters, so each rank holds them whole, runs
    # them under autocast, and all-reduces their gradients through one flat bucket per step.
    replicated = parallelism == "fsdp" and cfg.lora is not None and cfg.lora.fsdp_adapters == "replicated"
    trainable_shards = 1 if replicated else shards
    tokens = t.micro_batch_size * cfg.data.seq_len
    on_gpu = cfg.scaling.use_gpu

    parameters = m.frozen.bytes(shards) + m.trainable.bytes(trainable_shards)
    gradients = m.trainable.bytes(trainable_shards)
    optimizer_state = 2 * m.trainable.bytes(trainable_shards)
    # foreach AdamW (GPU) takes sqrt of every second moment at once; the CPU loop, one at a time.
    # Replicated adapters' flat gradient bucket comes just before, never with it.
    optimizer_step = m.trainable.bytes(trainable_shards) if on_gpu else m.trainable.largest
    if replicated and world > 1:
        optimizer_step = max(optimizer_step, m.trainable.bytes())
    if parallelism == "fsdp":
        # Gathered in param_dtype (NF4 weights as NF4); a block's gradients are unsharded in
        # param_dtype, then copied to fp32 (reduce_dtype) for the reduce-scatter.
        def unsharded(group: ParamGroup) -> float:
            return sum(math.prod(s) * (b if b < 1 or not compute else compute) for s, b in group.shapes)

        if replicated:
            # Only the base is gathered; autocast's param_dtype copies of the adapters are saved
            # for backward.
            sharding = (unsharded(m.root) + 2 * (unsharded(m.block) - unsharded(m.block_trainable))
                        + (m.trainable.numel * compute if compute else 0))
        else:
            sharding = (unsharded(m.root) + 2 * unsharded(m.block)
                        + m.block_trainable.numel * (mm + 4 if compute else mm))
    else:
        sharding = m.trainable.bytes()  # the reducer's buckets
        if compute and storage == 4:
            sharding += 2 * m.trainable.numel  # autocast's bf16 copies of fp32 weights, kept for backward

    per_layer = layer_activation_bytes(m, cfg, resid, mm)
    h, inter = m.hidden, m.intermediate
    final_norm = 4 * h + 4 + (resid * h if m.head_trainable else 0)
    # Checkpointed, each block keeps only its input until backward recomputes it, one at a time.
    saved = int(tokens * ((m.layers * resid * h if t.activation_checkpointing else m.layers * per_layer) + final_norm))
    recompute = int(tokens * per_layer) if t.activation_checkpointing else 0
    activations = saved + recompute
    work = int(tokens * (2 * resid * h + 3 * mm * inter))  # one block's gradients in flight
    loss = loss_bytes(cfg, m, tokens, mm, storage, parallelism)
    # The live reference: a no-grad forward of the same model (adapters off) before each
    # micro-batch's own; nothing of it is kept, so it adds one block's working set and one chunk
    # of logits at a time, never a second model.
    live = cfg.reference_mode == "live" or (t.objective == "grpo" and cfg.rl.kl_beta > 0)
    reference = int(tokens * per_layer) + 8 * min(t.loss_chunk_tokens, tokens) * m.vocab if live else 0
    # GRPO's KL reference for a full fine-tune is a frozen copy of the base, sharded as the policy.
    frozen_copy = m.trainable.bytes(shards) if t.objective == "grpo" and cfg.rl.kl_beta > 0 and cfg.lora is None else 0
    buffers = m.buffer_bytes + int(tokens * 2 * m.head_dim * resid) + tokens * 16  # rotary cos/sin, ids, labels
    cuda_context = CUDA_CONTEXT_BYTES if on_gpu else 0

    parameters += frozen_copy
    persistent = parameters + optimizer_state + buffers + cuda_context + (sharding if parallelism == "ddp" else 0)
    in_flight = sharding if parallelism == "fsdp" else 0
    phases = {
        # The loss phase is over before the first block is recomputed.
        "backward start": persistent + in_flight + saved + max(loss, recompute + work),
        "backward end": persistent + in_flight + gradients + work,
        "optimizer step": persistent + gradients + optimizer_step,
    }
    if reference:
        phases["reference forward"] = persistent + in_flight + reference
    if t.objective == "grpo" and cfg.rl.rollout == "colocated":  # actors sample in memory of their own
        phases["rollout"] = persistent + in_flight + rollout_bytes(cfg, m, world, mm)
    peak_phase = max(phases, key=phases.get)
    return MemoryEstimate(parallelism, world, int(parameters), int(gradients), int(optimizer_state),
                          int(optimizer_step), int(sharding), activations, int(loss), int(buffers), cuda_context,
                          int(phases[peak_phase]), peak_phase)


def rollout_bytes(cfg: JobConfig, m: ModelLayout, world: int, mm: int) -> int:
    """GRPO's colocated sampling on one rank: the KV cache of its share of the step's groups
    (ceil(prompts_per_step / world) × group_size rows) over a whole row (prompt + completion fit
    data.seq_len), the prefill's hidden states, and the last position's logits with the softmax,
    top-p and CDF copies beside them. No activations: it runs without grad."""
    rl = cfg.rl
    rows = math.ceil(rl.prompts_per_step / world) * rl.group_size
    kv_cache = 2 * m.layers * m.kv_dim * rows * cfg.data.seq_len * mm
    prefill = rows * cfg.data.seq_len * (m.hidden * mm * 4 + m.intermediate * mm * 3)
    logits = rows * m.vocab * (4 * 4 + 8)
    return int(kv_cache + prefill + logits)


def loss_bytes(cfg: JobConfig, m: ModelLayout, tokens: int, mm: int, storage: int, parallelism: str) -> int:
    """The loss phase's peak beyond the saved activations, including the head's gradient when the
    head trains (it forms right there, while the activations are all still held)."""
    t = cfg.training
    vocab = m.vocab
    head_grad = m.hidden * vocab * (mm if parallelism == "fsdp" else storage) if m.head_trainable else 0
    if t.loss == "full":
        # Backward of log-softmax: its output, the incoming gradient and the outgoing one, fp32.
        return 12 * tokens * vocab + head_grad
    if t.loss == "chunked" or t.objective != "sft":
        chunk = min(t.loss_chunk_tokens, tokens)
        # One chunk's fp32 logits, reused in place for log-sum-exp and their gradient, plus the
        # logits in the compute dtype when it is narrower (bf16 matmul, then upcast); the hidden
        # states' gradient is formed during forward and held until backward. The preference
        # objectives' per-token log-probs (any training.loss but full) compute each chunk again in
        # backward, with its log-softmax beside the fp32 logits: one more fp32 chunk.
        if t.loss == "full":
            return 12 * tokens * vocab + head_grad
        per_element = 4 + (mm if mm < 4 else 0) + (4 if t.objective != "sft" else 0)
        return per_element * chunk * vocab + tokens * m.hidden * mm + head_grad
    # liger: chunks of about tokens / (vocab / hidden) rows, rounded up to a power of two.
    chunk = min(tokens, 2 ** math.ceil(math.log2(max(math.ceil(tokens / math.ceil(vocab / m.hidden)), 1))))
    return (mm + 4) * chunk * vocab + tokens * m.hidden * mm + head_grad


@dataclass(frozen=True)
class Plan:
    gpu_memory_bytes: Optional[int]
    headroom_fraction: float
    estimates: dict  # (parallelism, world) → MemoryEstimate
    choice: str
    why: str
    reference: Optional[str] = None  # what the preference objective's reference costs, in words

    @property
    def budget_bytes(self) -> Optional[int]:
        return None if self.gpu_memory_bytes is None else int(self.gpu_memory_bytes * (1 - self.headroom_fraction))

    def fits(self, parallelism: str, world: int) -> Optional[bool]:
        if self.budget_bytes is None:
            return None
        return self.estimates[(parallelism, world)].total_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return {"gpu_memory_bytes": self.gpu_memory_bytes, "headroom_fraction": self.headroom_fraction,
                "budget_bytes": self.budget_bytes, "choice": self.choice, "why": self.why,
                "reference": self.reference,
                "estimates": [{**e.to_dict(), "fits": self.fits(p, w)} for (p, w), e in self.estimates.items()]}


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def build_plan(cfg: JobConfig, model_config, gpu_memory_bytes: Optional[int],
               headroom_fraction: float = DEFAULT_HEADROOM) -> Plan:
    """Both strategies at every world size and what `auto` picks (choose_strategy), with what the
    preference objective's reference costs."""
    plan = choose_strategy(cfg, model_config, gpu_memory_bytes, headroom_fraction)
    return dataclasses.replace(plan, reference=describe_reference(cfg))


def describe_reference(cfg: JobConfig) -> Optional[str]:
    objective, mode = cfg.training.objective, cfg.reference_mode
    if objective == "sft":
        return None
    if objective == "grpo":
        rl = cfg.rl
        if not rl.kl_beta:
            reference = "; no reference (rl.kl_beta 0)"
        elif cfg.lora is not None:
            reference = (f"; rl.kl_beta {rl.kl_beta:g}: one no-grad forward with the adapters disabled per "
                         f"micro-batch (the `reference forward` phase)")
        else:
            reference = (f"; rl.kl_beta {rl.kl_beta:g}: a frozen copy of the base, sharded as the policy (in the "
                         f"parameters' total), one no-grad forward of it per micro-batch (the `reference forward` "
                         f"phase)")
        if rl.rollout == "actors":
            return (f"grpo: rollouts of {rl.prompts_per_step} prompts x {rl.group_size} completions per step on "
                    f"{rl.rollout_actors} rollout actor(s), each holding the whole policy in memory of its own "
                    f"(not in this plan), the workers gathering the trainable weights once per step" + reference)
        return (f"grpo: colocated rollouts of {rl.prompts_per_step} prompts x {rl.group_size} completions per step, "
                f"each rank sampling its share over a KV cache of data.seq_len tokens per row (the `rollout` phase)"
                + reference)
    if mode == "precomputed":
        return ("preference.reference precomputed: `eft prepare` scored the pairs once with the reference model; "
                "training holds one model, so its memory is SFT's at the same shape")
    if mode == "live":
        return ("preference.reference live: one no-grad forward of the model with its adapters disabled per "
                "micro-batch (about a third more compute per step); its working set is the `reference forward` "
                "phase, never a second model")
    return f"training.objective {objective}: no reference model"


def choose_strategy(cfg: JobConfig, model_config, gpu_memory_bytes: Optional[int],
                    headroom_fraction: float = DEFAULT_HEADROOM) -> Plan:
    """Both strategies at every world size in scaling.min..max_workers, and what `auto` picks:
    DDP where the replicated model fits at every size, else FSDP2 (a range crossing the boundary
    runs FSDP2 throughout: the strategy is fixed for the run, across restarts and resizes)."""
    s = cfg.scaling
    worlds = range(s.min_workers, s.max_workers + 1)
    estimates = {(p, w): estimate_memory(cfg, model_config, w, p) for p in ("ddp", "fsdp") for w in worlds}
    if gpu_memory_bytes is None:
        return Plan(None, headroom_fraction, estimates, "fsdp",
                    "CPU workers: no GPU memory to plan against; FSDP2")
    budget = int(gpu_memory_bytes * (1 - headroom_fraction))
    limit = f"{gib(budget)} = {gib(gpu_memory_bytes)} less {headroom_fraction:.0%} headroom"
    ddp_worst = max((estimates[("ddp", w)] for w in worlds), key=lambda e: e.total_bytes)
    fsdp_worst = max((estimates[("fsdp", w)] for w in worlds), key=lambda e: e.total_bytes)
    span = f"{s.min_workers}" if s.min_workers == s.max_workers else f"{s.min_workers}..{s.max_workers}"
    ddp_fit = [w for w in worlds if estimates[("ddp", w)].total_bytes <= budget]
    if len(ddp_fit) == len(worlds):
        return Plan(gpu_memory_bytes, headroom_fraction, estimates, "ddp",
                    f"DDP: a replicated model needs {gib(ddp_worst.total_bytes)} per GPU at {span} workers "
                    f"(<= {limit}); FSDP2 would need {gib(fsdp_worst.total_bytes)}")
    crossing = f"; DDP fits only at {ddp_fit[0]}..{ddp_fit[-1]} workers, so the range runs FSDP2 throughout" \
        if ddp_fit else ""
    fsdp_note = "fits" if fsdp_worst.total_bytes <= budget else "DOES NOT FIT either"
    return Plan(gpu_memory_bytes, headroom_fraction, estimates, "fsdp",
                f"FSDP2: a replicated model needs {gib(ddp_worst.total_bytes)} per GPU at worst in {span} workers "
                f"(> {limit}){crossing}; FSDP2 needs {gib(fsdp_worst.total_bytes)} at worst ({fsdp_note})")


def gpu_memory_of(cfg: JobConfig, node_type: Optional[str] = None) -> tuple[Optional[int], str]:
    """(bytes per GPU, where that number comes from): --node-type, else scaling.gpu_memory_gib,
    else the default node type; None on CPU workers."""
    from app.config import ConfigError
    from app.nodes import NODE_TYPES

    if node_type is not None:
        if node_type not in NODE_TYPES:
            raise ConfigError(f"--node-type: unknown node type {node_type!r} (known: {', '.join(NODE_TYPES)})")
        node = NODE_TYPES[node_type]
        if not node.gpus:
            raise ConfigError(f"--node-type: {node_type} has no GPUs")
        return int(node.gpu_memory_gib * GIB), f"{node_type} ({node.gpu})"
    if not cfg.scaling.use_gpu:
        return None, "CPU workers"
    if cfg.scaling.gpu_memory_gib is not None:
        return int(cfg.scaling.gpu_memory_gib * GIB), "scaling.gpu_memory_gib"
    node = NODE_TYPES[DEFAULT_NODE_TYPE]
    return (int(node.gpu_memory_gib * GIB),
            f"{DEFAULT_NODE_TYPE} ({node.gpu}, the default: scaling.gpu_memory_gib unset)")


def plan_job(cfg: JobConfig, store=None, node_type: Optional[str] = None,
             headroom_fraction: float = DEFAULT_HEADROOM) -> tuple[Plan, str]:
    """The job's plan, reading the model's config.json from storage; and where the GPU size came from."""
    from app.hub import default_mirror_root, is_hub_uri, read_model_file
    from app.model.architecture import load_model_config, parse_model_config
    from app.storage import Store

    if node_type is not None and not cfg.scaling.use_gpu:
        cfg = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"use_gpu": True})})
    memory, source = gpu_memory_of(cfg, node_type)
    hub = is_hub_uri(cfg.model.uri)
    if store is None:
        # A command a person waits on: an unreachable bucket is one line in seconds.
        store = Store.from_config(cfg.storage, interactive=True)
        if not hub:  # a hub id's config.json comes from its mirror, or the hub when there is none yet
            store.check_reachable(cfg.model.uri)
    if hub:
        # The plan needs config.json alone: no mirror is made for it.
        root = cfg.model.mirror_uri or default_mirror_root(cfg.storage.root_uri)
        model_config = parse_model_config(*read_model_file(store, cfg.model.uri, root, "config.json"))
    else:
        model_config = load_model_config(store, cfg.model.uri)
    return build_plan(cfg, model_config, memory, headroom_fraction), source


def choose_parallelism(cfg: JobConfig, store=None) -> tuple[str, str]:
    """(parallelism, why) for `training.parallelism: auto`; an explicit setting stands."""
    if cfg.training.parallelism != "auto":
        return cfg.training.parallelism, "set in the config"
    if not cfg.scaling.use_gpu:
        return "fsdp", "CPU workers: no GPU memory to plan against; FSDP2"
    plan, source = plan_job(cfg, store)
    return plan.choice, f"{plan.why} [GPU memory from {source}]"


def apply_parallelism(cfg: JobConfig, store=None) -> tuple[JobConfig, str]:
    """The config with `auto` replaced by the plan's choice, decided once for the whole worker
    range; and why (the launcher logs it)."""
    parallelism, why = choose_parallelism(cfg, store)
    training = cfg.training.model_copy(update={"parallelism": parallelism})
    return cfg.model_copy(update={"training": training}), why


COLUMNS = {"parameters": "params", "gradients": "grads", "optimizer_state": "adam", "optimizer_step": "step",
           "sharding": "shard", "activations": "acts", "loss": "loss", "buffers": "bufs", "cuda_context": "ctx"}


def shown_worlds(lo: int, hi: int) -> list[int]:
    """The ends of the range and the whole-node sizes (multiples of 8) between them."""
    return sorted({lo, hi} | {w for w in range(lo, hi + 1) if w % 8 == 0})


def render_plan(cfg: JobConfig, plan: Plan, source: str):
    """A rich Table: one row per strategy and world size, GiB per component (params, grads, AdamW's
    moments, the optimizer step's temporary, FSDP2's unsharded buffers or DDP's buckets,
    activations, loss phase, buffers, CUDA context), the peak, and whether it fits the GPU with
    headroom."""
    from rich.table import Table

    budget = "no GPU" if plan.budget_bytes is None else (
        f"{gib(plan.gpu_memory_bytes)} per GPU from {source}, {plan.headroom_fraction:.0%} headroom: "
        f"{gib(plan.budget_bytes)}")
    table = Table(title=f"{cfg.name}: memory per worker, GiB ({budget})")
    table.add_column("")
    table.add_column("world", justify="right")
    for label in COLUMNS.values():
        table.add_column(label, justify="right")
    table.add_column("peak", justify="right")
    table.add_column("peak at")
    table.add_column("fits")
    for parallelism in ("ddp", "fsdp"):
        for world in shown_worlds(cfg.scaling.min_workers, cfg.scaling.max_workers):
            e = plan.estimates[(parallelism, world)]
            fits = plan.fits(parallelism, world)
            phase = e.peak_phase.replace("backward", "bwd").replace("optimizer", "optim")
            table.add_row("DDP" if parallelism == "ddp" else "FSDP2", str(world),
                          *(f"{getattr(e, c) / GIB:.2f}" for c in COLUMNS), f"{e.total_bytes / GIB:.2f}",
                          phase, "-" if fits is None else ("yes" if fits else "NO"))
    return table
