"""Mixing datasets: `prepare.inputs` → one prepared dataset sampled from several sources by weight.

The plan is made before any tokenizing, from a parse-only pass over every source: source i has
n_i documents (records that parse; skipped records are not documents) and weight w_i.
- counts: k_i documents of source i, in proportion to the weights (largest remainder). Without
  replacement the total K is prepare.mix_documents, else the largest mixture the weights allow
  (K = floor(min n_i * W / w_i), W = sum w_i: the source that runs out first limits it). With
  replacement K is prepare.mix_documents, else sum n_i.
- selection: which documents of source i, as a multiplicity per document (0/1 without
  replacement, a multinomial draw with it), from np.random.default_rng([mix_seed, i]).
- order: the K documents interleaved by a seeded permutation of their source labels
  (default_rng([mix_seed, len(inputs)])); each source's documents keep their input order.
Then every source runs the local engine's parse + tokenize with its own record keys (its
`for_source` config), its rows are repeated by multiplicity, and the streams are merged in the
planned order; the driver packs the result as one input. A selected document that prepare.overlong
drops is still counted as selected. Same config + same inputs → the same plan → the same shards.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from typing import Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from app.config import InputSource, JobConfig
from app.data.chat import ChatFormat
from app.data.engines import (
    BATCHES_PER_BLOCK, InputFiles, PrepareError, iter_local_documents, iter_local_tokenized, list_input_files,
    encode_sources, load_chat_format, number_parquet_rows, relative_source,
)
from app.storage import Store, join


class Source(NamedTuple):
    index: int
    spec: InputSource
    cfg: JobConfig  # the job as if `spec` were its single input_uri
    inputs: InputFiles
    chat: Optional[ChatFormat]
    is_file: bool  # spec.uri names one file, not a prefix

    def file_uri(self, relative: str) -> str:
        """A document's source name in a mixture: its file's URI (relative names may clash across sources)."""
        return self.spec.uri if self.is_file else join(self.spec.uri, relative)


def mixture_counts(available: list[int], weights: list[float], replacement: bool,
                   total: Optional[int]) -> list[int]:
    """Documents per source (see the module doc); PrepareError text via ValueError."""
    w = np.asarray(weights, dtype=np.float64)
    n = np.asarray(available, dtype=np.int64)
    share = w / w.sum()
    if total is None:
        total = int(n.sum()) if replacement else int(np.floor(np.min(n / share) + 1e-9))
    quotas = share * total
    counts = np.floor(quotas + 1e-9).astype(np.int64)
    remainder = quotas - counts
    for i in np.argsort(-remainder, kind="stable")[:total - int(counts.sum())]:
        counts[i] += 1
    return [int(c) for c in counts]


def select(n: int, k: int, replacement: bool, rng: np.random.Generator) -> np.ndarray:
    """Multiplicity of each of a source's n documents in the mixture (summing to k)."""
    if replacement:
        return np.bincount(rng.integers(0, n, size=k), minlength=n).astype(np.int64) if n else np.zeros(0, np.int64)
    chosen = np.zeros(n, dtype=np.int64)
    chosen[rng.choice(n, size=k, replace=False) if k < n else np.arange(n)] = 1
    return chosen


def fingerprint_files(inputs) -> str:
    """sha256 over the listed files' relative names, sizes and modification times."""
    digest = hashlib.sha256()
    for info in inputs.fs.get_file_info(inputs.paths):
        mtime = info.mtime_ns if info.mtime_ns is not None else -1
        digest.update(f"{relative_source(info.path, inputs.base)}\0{info.size}\0{mtime}\n".encode())
    return digest.hexdigest()


class Mixture:
    def __init__(self, cfg: JobConfig, store: Store, tokenizer):
        p = cfg.prepare
        self.cfg, self.sources = cfg, []
        for i, spec in enumerate(p.inputs):
            scfg = cfg.model_copy(update={"prepare": p.for_source(spec)})
            try:
                inputs = list_input_files(store, spec.uri, scfg.prepare.input_format)
            except PrepareError as err:
                raise PrepareError(f"prepare.inputs[{i}]: {err}") from None
            is_file = inputs.paths == [store.resolve(spec.uri)[1]]
            self.sources.append(Source(i, spec, scfg, inputs, load_chat_format(scfg, store, tokenizer), is_file))
        self.rows_per_block = BATCHES_PER_BLOCK * p.tokenize_batch_size
        self.available = []
        for src in self.sources:
            n = sum(int(pc.sum(pc.is_null(block["reason"])).as_py() or 0)
                    for block in iter_local_documents(src.cfg, src.inputs, self.rows_per_block, src.chat))
            if not n:
                raise PrepareError(f"prepare.inputs[{src.index}]: no usable documents in {src.spec.uri}")
            self.available.append(n)
        self.counts = mixture_counts(self.available, [s.spec.weight for s in self.sources], p.mix_replacement,
                                     p.mix_documents)
        for src, n, k in zip(self.sources, self.available, self.counts):
            if k > n and not p.mix_replacement:
                raise PrepareError(f"prepare.mix_documents {p.mix_documents} needs {k} documents from "
                                   f"prepare.inputs[{src.index}] ({src.spec.uri}), which has {n} "
                                   f"(lower it or set prepare.mix_replacement: true)")
        self.multiplicity = [select(n, k, p.mix_replacement, np.random.default_rng([p.mix_seed, src.index]))
                             for src, n, k in zip(self.sources, self.available, self.counts)]
        labels = np.repeat(np.arange(len(self.sources)), self.counts)
        self.order = np.random.default_rng([p.mix_seed, len(self.sources)]).permutation(labels)
        self.stats = [Counter(records=0, skipped=0, used=0, tokens=0) for _ in self.sources]

    @property
    def total_bytes(self) -> int:
        return sum(s.inputs.total_bytes for s in self.sources)

    # -- the merged stream ------------------------------------------------------------------

    def source_rows(self, src: Source, tokenizer) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """A source's tokenized rows, renamed and numbered, each document repeated by its multiplicity
        (skipped records kept once, in place) → (table, ok mask)."""
        mult, start = self.multiplicity[src.index], 0
        counters: Counter = Counter()
        parquet = src.cfg.prepare.input_format == "parquet"
        for batch in iter_local_tokenized(src.cfg, src.inputs, tokenizer, src.chat):
            names, codes = encode_sources(batch["source"])
            lines = (number_parquet_rows([names[c] for c in codes], counters) if parquet
                     else batch["line"].to_numpy(zero_copy_only=False))
            ok = pc.is_null(batch["reason"]).to_numpy(zero_copy_only=False)
            self.stats[src.index]["records"] += batch.num_rows
            self.stats[src.index]["skipped"] += int((~ok).sum())
            reps = np.ones(batch.num_rows, dtype=np.int64)
            reps[ok] = mult[start:start + int(ok.sum())]
            start += int(ok.sum())
            uris = pa.array([src.file_uri(n) for n in names], pa.string())
            sources = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), uris).cast(pa.string())
            batch = batch.set_column(0, "source", sources).set_column(1, "line", pa.array(lines, pa.int64()))
            take = np.repeat(np.arange(batch.num_rows), reps)
            yield batch.take(pa.array(take)), ok[take]

    def tokenized(self, tokenizer) -> Iterator[pa.Table]:
        with contextlib.ExitStack() as stack:
            streams = [stack.enter_context(contextlib.closing(self.source_rows(s, tokenizer))) for s in self.sources]
            buffers: list[list[tuple[pa.Table, np.ndarray]]] = [[] for _ in self.sources]

            def take(i: int, docs: Optional[int]) -> tuple[pa.Table, np.ndarray]:
                """Source i's next rows through its `docs`-th document (all that is left when None)."""
                buf = buffers[i]
                while True:
                    have = sum(int(ok.sum()) for _, ok in buf)
                    if docs is not None and have >= docs:
                        break
                    nxt = next(streams[i], None)
                    if nxt is None:
                        if docs is not None:
                            raise RuntimeError(f"mixture source {i} ended {docs - have} documents early")
                        break
                    buf.append(nxt)
                table = pa.concat_tables([t for t, _ in buf]) if buf else None
                ok = np.concatenate([o for _, o in buf]) if buf else np.zeros(0, dtype=bool)
                end = len(ok) if docs is None else (int(np.flatnonzero(ok)[docs - 1]) + 1 if docs else 0)
                buffers[i][:] = [(table.slice(end), ok[end:])] if table is not None and end < len(ok) else []
                return (table.slice(0, end) if table is not None else None), ok[:end]

            step = self.rows_per_block
            for at in range(0, len(self.order), step):
                chunk = self.order[at:at + step]
                parts, keys = [], []
                for i in range(len(self.sources)):
                    positions = np.flatnonzero(chunk == i)
                    table, ok = take(i, len(positions))
                    if table is None or not len(ok):
                        continue
                    self.count_used(i, table, ok)
                    doc = np.cumsum(ok) - ok  # each row belongs to the next document (itself when ok)
                    parts.append(table)
                    keys.append(positions[doc])
                if parts:
                    order = np.argsort(np.concatenate(keys), kind="stable")
                    yield pa.concat_tables(parts).take(pa.array(order))
            for i in range(len(self.sources)):  # skipped records after each source's last document
                table, ok = take(i, None)
                if ok.any():
                    raise RuntimeError(f"mixture source {i} has {int(ok.sum())} documents past the plan")
                if table is not None and table.num_rows:
                    self.count_used(i, table, ok)
                    yield table

    def count_used(self, i: int, table: pa.Table, ok: np.ndarray) -> None:
        dropped = pc.fill_null(pc.equal(table["overlong"], "dropped"), False).to_numpy(zero_copy_only=False)
        used = ok & ~dropped
        lengths = pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False)
        self.stats[i]["used"] += int(used.sum())
        self.stats[i]["tokens"] += int(lengths[used].sum())

    # -- the manifest ---------------------------------------------------------------------

    def manifest_source(self) -> dict:
        p = self.cfg.prepare
        return {
            "inputs": [{
                "uri": s.spec.uri, "weight": s.spec.weight, "input_format": s.cfg.prepare.input_format,
                "format": s.cfg.prepare.format, "files": [relative_source(f, s.inputs.base) for f in s.inputs.paths],
                "bytes": s.inputs.total_bytes, "fingerprint": fingerprint_files(s.inputs),
                "records": self.stats[s.index]["records"], "skipped": self.stats[s.index]["skipped"],
                # Documents: parsed records available, picked (repeats counted) and distinct among them;
                # used: picked and not dropped as over-long; tokens: of the used ones (eos/bos included).
                "documents_available": n, "documents": k, "unique_documents": int(np.count_nonzero(m)),
                "documents_used": self.stats[s.index]["used"], "tokens": self.stats[s.index]["tokens"],
            } for s, n, k, m in zip(self.sources, self.available, self.counts, self.multiplicity)],
            "mix": {"seed": p.mix_seed, "replacement": p.mix_replacement, "documents": int(sum(self.counts)),
                    "requested_documents": p.mix_documents},
        }
