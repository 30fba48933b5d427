"""A step's rollouts as training rows: prompt + completion documents packed with document
isolation, as SFT's and DPO's rows are (app.data.packing), with each completion token's
advantage beside it.

A completion is one document with its prompt: the prompt's tokens train nothing (IGNORE_INDEX
labels), its own tokens are labels, and it never shares attention with the other documents of
its row (positions restart at each document; transformers builds the block-causal mask from
them). Each document stays whole in one row, so a completion's log-prob is the same packed as
alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.batch import IGNORE_INDEX
from app.data.packing import Packer, Rows

NO_SAMPLE = -1


@dataclass(frozen=True)
class RolloutRows:
    rows: Rows  # input_ids, labels (completion tokens only), position_ids: [n, seq_len]
    sample: np.ndarray  # [n, seq_len] int64: the completion each label belongs to, NO_SAMPLE elsewhere
    advantages: np.ndarray  # [n, seq_len] float32: the label's completion's advantage, 0 elsewhere

    def completion_tokens(self) -> int:
        return int((self.sample != NO_SAMPLE).sum())


def pack_rollouts(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray, seq_len: int,
                  pad_id: int) -> RolloutRows:
    """Completion i after prompt i, in order, each kept whole in one row of `seq_len`."""
    if not (len(prompts) == len(completions) == len(advantages)):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(advantages)} advantages")
    lengths = np.array([len(p) + len(c) for p, c in zip(prompts, completions)], dtype=np.int64)
    too_long = np.nonzero(lengths > seq_len)[0]
    if len(too_long):
        i = int(too_long[0])
        raise ValueError(f"rollout {i}: prompt ({len(prompts[i])}) + completion ({len(completions[i])}) tokens "
                         f"exceed data.seq_len {seq_len}")
    ids = np.array([t for p, c in zip(prompts, completions) for t in (*p, *c)], dtype=np.int64)
    labels = np.array([t for p, c in zip(prompts, completions) for t in ((IGNORE_INDEX,) * len(p) + tuple(c))],
                      dtype=np.int64)
    # The same documents again, carrying each completion token's sample index: packed with the
    # same lengths, it lands exactly where the tokens do.
    owner = np.array([t for i, (p, c) in enumerate(zip(prompts, completions))
                      for t in ((IGNORE_INDEX,) * len(p) + (i,) * len(c))], dtype=np.int64)
    tokens, owners = Packer(seq_len, pad_id), Packer(seq_len, pad_id)
    if len(lengths):
        tokens.add_units(ids, labels, lengths, docs_per_unit=1)
        owners.add_units(owner, owner, lengths, docs_per_unit=1)
    rows = _all_rows(tokens)
    sample = _all_rows(owners).labels.astype(np.int64)
    sample[sample == IGNORE_INDEX] = NO_SAMPLE
    values = np.zeros(sample.shape, dtype=np.float32)
    taken = sample != NO_SAMPLE
    values[taken] = np.asarray(advantages, dtype=np.float32)[sample[taken]]
    return RolloutRows(rows=rows, sample=sample, advantages=values)


def _all_rows(packer: Packer) -> Rows:
    parts = (packer.pop_rows(), packer.finish())
    return Rows(*(np.concatenate([p[k] for p in parts]) for k in range(3)))
