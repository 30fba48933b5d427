"""One document at a time: the single-document forms of app/data/packing.py's batched functions.
Only tests call them (prepare and the bench run the batched ones), so they live here."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from app.data.formats import Document
from app.data.packing import build_examples_flat, flatten_token_lists, tokenize_documents


def build_example(body_ids: Sequence[int], eos_id: int, bos_id: Optional[int] = None,
                  prompt_ids: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray]:
    """One document's token ids → (input_ids, labels)."""
    body, body_len = flatten_token_lists([body_ids])
    prompt, prompt_len = flatten_token_lists([prompt_ids]) if prompt_ids is not None else (None, None)
    ids, labels, _ = build_examples_flat(body, body_len, eos_id, bos_id, prompt, prompt_len)
    return ids, labels


def tokenize_document(tokenizer, doc: Document) -> tuple[np.ndarray, np.ndarray]:
    """One document → (input_ids, labels), as `tokenize_documents` gives a batch of them."""
    ids, labels, _ = tokenize_documents(tokenizer, [doc])
    return ids, labels
