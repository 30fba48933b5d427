"""Documents → (input_ids, labels) → fixed-length packed rows. Pure numpy, no Ray.

A text document becomes `[bos?] + tokens + [eos]` with labels == input_ids. An instruction
document becomes `[bos?] + prompt + response + [eos]` where bos and the prompt are labelled
IGNORE_INDEX, so only the response and its eos are trained on.

The packer concatenates documents in order and cuts `seq_len` rows; a document longer than
a row continues in the next one (never dropped), and the final partial row is padded with
pad ids labelled IGNORE_INDEX. Units that must stay in one row (a preference pair: its chosen
document, then its rejected one) are added whole: a unit that does not fit in what is left of
the current row starts the next one, and the rest of the current row is padding. With packing off (`prepare.packing: false`) every document or unit
starts a row of its own, as TRL's `packing=False` gives each example its own padded sequence;
training then trims the trailing padding of each micro-batch (`app.data.stream.trim_micro_batch`). Everything works on flat int32 arrays plus per-document
lengths, so a whole batch of documents is handled with a few vectorised numpy calls.

Each row also gets `position_ids`: 0, 1, 2, ... restarting at every document start, at the
start of every row (a document continued from the previous row counts again from 0 there: its
earlier tokens are not in this row's context anyway) and at the first padding token (padding
is a segment of its own). A position that does not follow its left neighbour by exactly 1 is a
document start, which is what transformers' packed-sequence detection looks for
(`masking_utils.find_packed_sequence_indices`) to keep attention inside each document.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from app.batch import IGNORE_INDEX
from app.data.formats import Document

TOKEN_DTYPE = np.int32


# -- building examples ----------------------------------------------------------------

def flatten_token_lists(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of token ids → (flat int32 values, int64 lengths)."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    # chain.from_iterable walks the lists in C; a nested generator would run Python code per token.
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=TOKEN_DTYPE, count=int(lengths.sum()))
    return values, lengths


def scatter_segments(dest: np.ndarray, starts: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> None:
    """Copy consecutive segments of `values` (of `lengths`) to dest[starts[i]:starts[i]+lengths[i]]."""
    if not len(values):
        return
    seg_begin = np.cumsum(lengths) - lengths
    within = np.arange(len(values), dtype=np.int64) - np.repeat(seg_begin, lengths)
    dest[np.repeat(starts, lengths) + within] = values


def build_examples_flat(body: np.ndarray, body_lengths: np.ndarray, eos_id: int,
                        bos_id: Optional[int] = None, prompt: Optional[np.ndarray] = None,
                        prompt_lengths: Optional[np.ndarray] = None,
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch of tokenized documents → (input_ids, labels, lengths), flat and in document order.

    `body` holds the trained-on tokens (text, or the response); `prompt` (optional, may have
    zero-length entries) holds masked tokens placed before the body.
    """
    n = len(body_lengths)
    if prompt is None:
        prompt = np.zeros(0, dtype=TOKEN_DTYPE)
        prompt_lengths = np.zeros(n, dtype=np.int64)
    n_bos = 0 if bos_id is None else 1
    lengths = n_bos + prompt_lengths + body_lengths + 1
    ends = np.cumsum(lengths)
    starts = ends - lengths
    ids = np.empty(int(ends[-1]) if n else 0, dtype=TOKEN_DTYPE)
    labels = np.empty_like(ids)
    if n_bos:
        ids[starts] = bos_id
        labels[starts] = bos_id
    scatter_segments(ids, starts + n_bos, prompt, prompt_lengths)
    scatter_segments(labels, starts + n_bos, np.full(len(prompt), IGNORE_INDEX, TOKEN_DTYPE), prompt_lengths)
    body_starts = starts + n_bos + prompt_lengths
    scatter_segments(ids, body_starts, body, body_lengths)
    scatter_segments(labels, body_starts, body, body_lengths)
    ids[ends - 1] = eos_id
    labels[ends - 1] = eos_id
    if n_bos and prompt_lengths.any():
        # bos is context for a prompted example, not something to predict.
        labels[starts[prompt_lengths > 0]] = IGNORE_INDEX
    return ids, labels, lengths


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Body tokens only. A literal "</s>" in raw text stays text: letting data inject special
    tokens would fake document boundaries inside a packed row."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True,
                     return_attention_mask=False)["input_ids"]


def tokenize_documents(tokenizer, docs: Sequence[Document]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents → flat (input_ids, labels, lengths), with one tokenizer call per field."""
    return encode_documents(lambda texts: encode_texts(tokenizer, texts), docs, tokenizer.eos_token_id,
                            tokenizer.bos_token_id)


def encode_documents(encode: Callable[[list[str]], list[list[int]]], docs: Sequence[Document], eos_id: int,
                     bos_id: Optional[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokenize_documents with any `encode` that matches encode_texts (e.g. the Rust tokenizer itself)."""
    body, body_len = flatten_token_lists(encode([d.text for d in docs]))
    prompt = prompt_len = None
    prompted = [i for i, d in enumerate(docs) if d.prompt is not None]
    if prompted:
        prompt_lists = [[] for _ in docs]
        for i, ids in zip(prompted, encode([docs[i].prompt for i in prompted])):
            prompt_lists[i] = ids
        prompt, prompt_len = flatten_token_lists(prompt_lists)
    return build_examples_flat(body, body_len, eos_id, bos_id, prompt, prompt_len)


# -- packing --------------------------------------------------------------------------

class Rows(NamedTuple):
    """Packed rows, each [n, seq_len] int32."""
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray


def row_positions(starts: np.ndarray) -> np.ndarray:
    """[n, T] document-start flags → position_ids counting from 0 at each start and at each row start."""
    n, seq_len = starts.shape
    index = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (n, seq_len))
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return (index - last_start).astype(TOKEN_DTYPE)


def place_units(unit_lengths: np.ndarray, seq_len: int, fill: int = 0) -> np.ndarray:
    """The padding before each unit (of `unit_lengths` tokens, each kept whole in one row of
    `seq_len`) when appended after `fill` tokens of a row: where a unit would cross into the next
    row, the current row is padded to its end instead. Sequential (each place depends on the units
    before it), but only scalars: callers place the tokens in one vectorised scatter."""
    pads = np.zeros(len(unit_lengths), dtype=np.int64)
    for i, n in enumerate(np.asarray(unit_lengths).tolist()):
        if fill and fill + n > seq_len:
            pads[i], fill = seq_len - fill, 0
        fill = (fill + n) % seq_len
    return pads


def place_rows_apart(unit_lengths: np.ndarray, seq_len: int, fill: int = 0) -> np.ndarray:
    """The padding before each unit when every unit starts a row of its own (packing off): the rest
    of the row the previous unit ended in. A unit longer than a row (a split document) runs on
    into the next rows."""
    lengths = np.asarray(unit_lengths, dtype=np.int64)
    ends_in_row = np.concatenate([[fill], lengths[:-1] % seq_len]) if len(lengths) else lengths
    return (seq_len - ends_in_row) % seq_len


class Packer:
    """Concatenate token streams in order and cut them into `seq_len` rows. `packing=False`: every
    document (or unit) starts a row of its own instead, the rest of the row before it padding."""

    def __init__(self, seq_len: int, pad_id: int, packing: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.packing = packing
        self._ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._starts: list[np.ndarray] = []  # True where a document begins
        self._pending = 0

    @property
    def pending_tokens(self) -> int:
        return self._pending

    def add(self, input_ids: np.ndarray, labels: np.ndarray, lengths: Optional[np.ndarray] = None) -> None:
        """Append documents' flat tokens back to back: one document, or several of `lengths`."""
        if len(input_ids) != len(labels):
            raise ValueError(f"input_ids ({len(input_ids)}) and labels ({len(labels)}) differ in length")
        if lengths is None:
            lengths = np.array([len(input_ids)], dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(input_ids):
            raise ValueError(f"document lengths sum to {int(lengths.sum())}, not {len(input_ids)} tokens")
        if not self.packing:
            self._add_placed(input_ids, labels, lengths, 1, place_rows_apart)
        elif len(input_ids):
            starts = np.zeros(len(input_ids), dtype=bool)
            starts[(np.cumsum(lengths) - lengths)[lengths > 0]] = True
            self._ids.append(np.asarray(input_ids, dtype=TOKEN_DTYPE))
            self._labels.append(np.asarray(labels, dtype=TOKEN_DTYPE))
            self._starts.append(starts)
            self._pending += len(input_ids)

    def add_units(self, input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, docs_per_unit: int) -> None:
        """Append units of `docs_per_unit` consecutive documents (of `lengths`), each kept whole in
        one row: where a unit would cross into the next row, the current row is padded instead."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(lengths) % docs_per_unit:
            raise ValueError(f"{len(lengths)} documents do not make whole units of {docs_per_unit}")
        unit_lengths = lengths.reshape(-1, docs_per_unit).sum(axis=1)
        if (unit_lengths > self.seq_len).any():
            raise ValueError(f"a unit of {int(unit_lengths.max())} tokens does not fit a row of {self.seq_len}")
        self._add_placed(input_ids, labels, lengths, docs_per_unit, place_units if self.packing else place_rows_apart)

    def _add_placed(self, input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, docs_per_unit: int,
                    place: Callable[[np.ndarray, int, int], np.ndarray]) -> None:
        """Units of `docs_per_unit` documents, each after the padding `place` gives it."""
        unit_lengths = lengths.reshape(-1, docs_per_unit).sum(axis=1)
        pads = place(unit_lengths, self.seq_len, self._pending % self.seq_len)
        ends = np.cumsum(pads + unit_lengths)
        unit_starts = ends - unit_lengths
        total = int(ends[-1]) if len(ends) else 0
        ids = np.full(total, self.pad_id, dtype=TOKEN_DTYPE)
        out_labels = np.full(total, IGNORE_INDEX, dtype=TOKEN_DTYPE)
        scatter_segments(ids, unit_starts, np.asarray(input_ids, dtype=TOKEN_DTYPE), unit_lengths)
        scatter_segments(out_labels, unit_starts, np.asarray(labels, dtype=TOKEN_DTYPE), unit_lengths)
        starts = np.zeros(total, dtype=bool)
        within = np.cumsum(lengths.reshape(-1, docs_per_unit), axis=1) - lengths.reshape(-1, docs_per_unit)
        doc_starts = (unit_starts[:, None] + within)[lengths.reshape(-1, docs_per_unit) > 0]
        starts[doc_starts] = True
        starts[(unit_starts - pads)[pads > 0]] = True  # the padding is a segment of its own
        if total:
            self._ids.append(ids)
            self._labels.append(out_labels)
            self._starts.append(starts)
            self._pending += total

    def pop_rows(self) -> Rows:
        """Every complete row so far, as [n, seq_len] arrays; the remainder stays pending."""
        n_rows = self._pending // self.seq_len
        if not n_rows:
            return self._empty_rows()
        ids, labels, starts = np.concatenate(self._ids), np.concatenate(self._labels), np.concatenate(self._starts)
        cut = n_rows * self.seq_len
        self._ids, self._labels, self._starts = [ids[cut:]], [labels[cut:]], [starts[cut:]]
        self._pending -= cut
        shape = (n_rows, self.seq_len)
        return Rows(ids[:cut].reshape(shape), labels[:cut].reshape(shape), row_positions(starts[:cut].reshape(shape)))

    def finish(self) -> Rows:
        """The remaining rows, the last one padded (pad id, IGNORE_INDEX label, positions from 0)."""
        full = self.pop_rows()
        if not self._pending:
            return full
        pad = self.seq_len - self._pending
        pad_starts = np.zeros(pad, dtype=bool)
        pad_starts[0] = True
        last_ids = np.concatenate([*self._ids, np.full(pad, self.pad_id, TOKEN_DTYPE)])
        last_labels = np.concatenate([*self._labels, np.full(pad, IGNORE_INDEX, TOKEN_DTYPE)])
        last_starts = np.concatenate([*self._starts, pad_starts])
        self._ids, self._labels, self._starts, self._pending = [], [], [], 0
        return Rows(np.concatenate([full.input_ids, last_ids[None]]),
                    np.concatenate([full.labels, last_labels[None]]),
                    np.concatenate([full.position_ids, row_positions(last_starts[None])]))

    def _empty_rows(self) -> Rows:
        empty = np.zeros((0, self.seq_len), dtype=TOKEN_DTYPE)
        return Rows(empty, empty.copy(), empty.copy())


def pack_examples(examples: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> Rows:
    """All (input_ids, labels) examples (one document each), in order → [n_rows, seq_len]
    input_ids, labels and position_ids."""
    packer = Packer(seq_len, pad_id)
    for ids, labels in examples:
        packer.add(ids, labels)
    parts = (packer.pop_rows(), packer.finish())
    return Rows(*(np.concatenate([p[k] for p in parts]) for k in range(3)))


# -- validation split -----------------------------------------------------------------

def source_key(source: str) -> int:
    """A stable 64-bit key for a source path (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(source.encode()).digest()[:8], "little")


def document_fractions(source_keys: np.ndarray, lines: np.ndarray) -> np.ndarray:
    """A stable pseudo-random number in [0, 1) per (source, line): splitmix64 of both, vectorised."""
    x = np.asarray(source_keys, dtype=np.uint64) + np.asarray(lines, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def validation_mask(source_keys: np.ndarray, lines: np.ndarray, fraction: float) -> np.ndarray:
    """Which documents go to the validation split: those whose stable fraction falls under `fraction`."""
    if fraction <= 0:
        return np.zeros(len(lines), dtype=bool)
    return document_fractions(source_keys, lines) < fraction
