"""Dropout seeded per row, so a trajectory does not depend on the world size.

A dropout mask drawn from the global RNG depends on which rank a row lands on and on what came
before it in that rank's micro-batch; after a resize the same step draws other masks. Here every
active `nn.Dropout` (PEFT's `lora_dropout` among them) becomes a `RowDropout` whose mask for batch
row b comes from a generator seeded by (training seed, step, row_id of b, which module): the same
row gets the same mask at every world size, in every micro-batch slot, and again when activation
checkpointing recomputes the forward in backward.

Attention-probability dropout runs inside SDPA's kernel on the global RNG and cannot be seeded
per row: it is switched off, with a warning (see `disable_attention_dropout`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional, Sequence

import torch
import torch.nn as nn

log = logging.getLogger(__name__)

# Model-config keys for dropout on attention probabilities (Llama/Mistral/Qwen/Gemma, GPT-2/Phi, BERT).
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
MASK63 = (1 << 63) - 1
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int, row_id: int, module: int) -> int:
    """A generator seed for one row's mask in one module at one step. Mixed (not summed), so
    neighbouring rows, steps and modules draw unrelated masks."""
    h = 0
    for part in (seed, step, row_id, module):
        h = splitmix64(h ^ (part & MASK64))
    return h & MASK63


class RowSeeds:
    """What the dropout of the current micro-batch is keyed on: set by `rows` around its forward
    and backward, read by every RowDropout of the model."""

    def __init__(self, seed: int):
        self.seed = seed
        self.step: Optional[int] = None
        self.row_ids: Optional[list[int]] = None
        self.modules = 0
        self._generators: dict = {}

    @contextlib.contextmanager
    def rows(self, row_ids: Sequence[int], step: int) -> Iterator[None]:
        """Key the masks of one micro-batch. Backward must run inside too: activation
        checkpointing recomputes the forward there and must draw the same masks."""
        self.row_ids, self.step = [int(r) for r in row_ids], int(step)
        try:
            yield
        finally:
            self.row_ids = self.step = None

    def generator(self, device: torch.device) -> torch.Generator:
        # On the activation's device: a CUDA mask is drawn in place, never copied from the host.
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


class RowDropout(nn.Module):
    """`nn.Dropout` on a batch-first input, with row b's mask seeded by its row_id."""

    def __init__(self, p: float, seeds: RowSeeds, index: int, name: str):
        super().__init__()
        self.p, self.seeds, self.index, self.name = p, seeds, index, name

    def extra_repr(self) -> str:
        return f"p={self.p}, index={self.index}"

    @torch.compiler.disable  # seeds a generator per row: a graph break, not a trace of the loop
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        s = self.seeds
        if s.row_ids is None:
            raise RuntimeError(f"dropout {self.name}: a training forward outside RowSeeds.rows(); "
                               f"its masks would not be keyed on the rows")
        if x.shape[0] != len(s.row_ids):
            raise RuntimeError(f"dropout {self.name}: input batch {tuple(x.shape)} does not match "
                               f"{len(s.row_ids)} rows; row-seeded dropout needs batch-first activations")
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        g = s.generator(x.device)
        for b, row_id in enumerate(s.row_ids):
            g.manual_seed(row_seed(s.seed, s.step, row_id, self.index))
            keep[b].bernoulli_(1 - self.p, generator=g)
        # Autograd keeps only the bool mask for backward, as nn.Dropout does.
        return (x * keep).mul_(1 / (1 - self.p))


def disable_attention_dropout(model: nn.Module) -> list[str]:
    """Zero the attention-probability dropout: in the config, in the attention modules that copy
    it at build time and hand it to SDPA (`attention_dropout` floats), and in the `attn_dropout`
    / `attention_dropout` Dropout modules whose p some models hand to SDPA. Returns what was on."""
    config = getattr(model, "config", None)
    changed = []
    for key in ATTENTION_DROPOUT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and value > 0:
            changed.append(f"{key}={value}")
            setattr(config, key, 0.0)
    for module in model.modules():
        value = getattr(module, "attention_dropout", None)
        if isinstance(value, float) and value > 0:
            module.attention_dropout = 0.0
        for name in ("attn_dropout", "attention_dropout"):
            child = getattr(module, name, None)
            if isinstance(child, nn.Dropout):
                child.p = 0.0
    return changed


def apply_row_dropout(model: nn.Module, seed: int, note: bool = False) -> RowSeeds:
    """Replace every `nn.Dropout` with p > 0 by a RowDropout (in place; before or after FSDP2 /
    DDP, which hold no state for parameterless modules) and switch off attention dropout.
    Returns the RowSeeds the loop keys each micro-batch with."""
    seeds = RowSeeds(seed)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    off = disable_attention_dropout(getattr(inner, "get_base_model", lambda: inner)())
    if off and note:
        log.warning("attention dropout (%s in the model config) is turned off: it runs inside the attention "
                    "kernel on the global RNG, so it cannot be the same at every world size", ", ".join(off))
    # named_modules walks the same tree in the same order on every rank and at every world size,
    # so a module's index, which keeps the masks of different dropouts apart, is stable.
    for name, module in list(inner.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout and child.p > 0:
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, RowDropout(child.p, seeds, seeds.modules, full))
                seeds.modules += 1
    return seeds
