"""A tiny, real base model for the demo and the tests, built here because no hub is reachable.

A BPE tokenizer trained on a real English corpus that ships with Python (the pydoc topics)
and a random-init Llama, both saved in Hugging Face format and loaded back through the same
`from_pretrained` code that real models use.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Iterable, Optional

SPECIAL = {"bos": "<s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"}


def build_corpus(max_docs: Optional[int] = None, min_chars: int = 200) -> list[str]:
    """Real English prose: the help topics of Python's own documentation, split into paragraphs."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if len(text) >= min_chars:
                docs.append(text)
    return docs[:max_docs] if max_docs else docs


def write_jsonl(records: Iterable[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return path


def build_tiny_tokenizer(texts: list[str], vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"],
        pad_token=SPECIAL["pad"], unk_token=SPECIAL["unk"],
    )


def build_tiny_model(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     intermediate_size: int = 128, max_positions: int = 512, seed: int = 0,
                     initializer_range: float = 0.2):
    """Random init. The init is wider than the usual 0.02: behind a final RMSNorm a frozen
    random head that narrow cannot express a sharp distribution, and adapters on top of it
    would barely move the loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, initializer_range=initializer_range,
    )
    return LlamaForCausalLM(config)


def save_tiny_base(store, uri: str, texts: Optional[list[str]] = None, vocab_size: int = 512,
                   **model_kwargs) -> str:
    """Build tokenizer + model and save both, in HF format, to `uri` (s3:// or local)."""
    texts = texts or build_corpus()
    tokenizer = build_tiny_tokenizer(texts, vocab_size=vocab_size)
    model = build_tiny_model(tokenizer, **model_kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # config.json last: a reader that finds it finds a complete model dir.
        store.upload_dir(tmp, uri, last=("config.json",))
    return uri
