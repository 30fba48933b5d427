"""What a model is made of, and what its `config.json` says, checked against the job before any
worker starts.

The driver reads only the config (through the Store), builds the model on the meta device (no
weights, no memory: seconds even for a 70B layout) and lists its module names. So a LoRA target
the model lacks, or a sequence longer than its positions, is one line before Ray starts instead
of a traceback on every worker after the run has written objects.
"""

from __future__ import annotations

import json
import warnings
from typing import TYPE_CHECKING

from app.compat import no_split_module_names
from app.storage import Store, StorageError, join

if TYPE_CHECKING:
    import torch.nn as nn

SHOWN_NAMES = 12


class ModelError(ValueError):
    """The model URI does not hold a loadable model."""


def build_peft_config(lora_cfg):
    """Our LoraConfig → PEFT's. Training and export both build it here, so adapters match."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM",
    )


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names HF lists as never to be split."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = no_split_module_names(inner)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ModelError(f"cannot find decoder blocks to shard in {type(inner).__name__}")
    return blocks


def load_model_config(store: Store, model_uri: str):
    """`<model_uri>/config.json` → a transformers config object; ModelError naming the URI."""
    uri = join(model_uri, "config.json")
    try:
        data = store.read_bytes(uri)
    except StorageError as err:
        raise ModelError(f"{uri}: cannot read the model config ({type(err).__name__})") from None
    return parse_model_config(data, uri)


def parse_model_config(data: bytes, uri: str):
    """The bytes of a config.json (read at `uri`) → a transformers config object; ModelError naming the URI."""
    from transformers import AutoConfig

    try:
        tree = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelError(f"{uri}: cannot read the model config ({type(err).__name__})") from None
    if not isinstance(tree, dict) or "model_type" not in tree:
        raise ModelError(f"{uri}: no model_type (not a Hugging Face model config)")
    try:
        return AutoConfig.for_model(**tree)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelError(f"{uri}: model_type {tree['model_type']!r} is not one transformers knows "
                         f"({type(err).__name__})") from None


def build_meta_base(config):
    """The base model with every parameter and buffer on the meta device."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=True), torch.device("meta"), warnings.catch_warnings():
        # transformers' deprecation notes would precede the one-line error on the user's stderr.
        warnings.simplefilter("ignore", FutureWarning)
        return AutoModelForCausalLM.from_config(config)


def adaptable(module) -> bool:
    """A layer type PEFT's LoRA wraps (what a plain transformers model is built from)."""
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention,
                               Conv1D))


def describe_layers(model) -> str:
    """The distinct last name parts of the layers LoRA can wrap, for an error message."""
    layers = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name and adaptable(module)})
    return ", ".join(layers[:SHOWN_NAMES]) + (", ..." if len(layers) > SHOWN_NAMES else "")


def check_lora_targets(lora_cfg, config, model_uri: str) -> None:
    """Every `lora.target_modules` entry must match a module of the model under PEFT's own rule
    (the name itself or a ".<name>" suffix), and each module it matches must be a layer LoRA can
    wrap (a Linear, not a whole block). Then the model is adapted on the meta device, as each
    worker adapts it, so whatever else PEFT refuses is refused here too."""
    from peft import get_peft_model
    from peft.tuners.tuners_utils import check_target_module_exists

    model = build_meta_base(config)
    modules = [(name, module) for name, module in model.named_modules() if name]
    where = f"the {config.model_type} model at {model_uri}"
    for target in lora_cfg.target_modules:
        one = build_peft_config(lora_cfg.model_copy(update={"target_modules": [target]}))
        matched = [(name, module) for name, module in modules if check_target_module_exists(one, name)]
        if not matched:
            raise ModelError(f"lora.target_modules: {target!r} matches no module of {where} "
                             f"(its layers: {describe_layers(model)})")
        blocks = [(name, module) for name, module in matched if not adaptable(module)]
        if blocks:
            name, module = blocks[0]
            raise ModelError(f"lora.target_modules: {target!r} matches {type(module).__name__} modules (e.g. {name}) "
                             f"of {where}, which LoRA cannot wrap; name their layers (its layers: "
                             f"{describe_layers(model)})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            get_peft_model(model, build_peft_config(lora_cfg))
    except (ValueError, TypeError) as err:
        raise ModelError(f"lora.target_modules {list(lora_cfg.target_modules)}: PEFT cannot adapt {where} "
                         f"({type(err).__name__})") from None


def check_seq_len(seq_len: int, config, model_uri: str) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ModelError(f"data.seq_len {seq_len} exceeds max_position_embeddings {limit} of the model at "
                         f"{model_uri}")
