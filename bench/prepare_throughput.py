"""Data prepare throughput: `eft prepare` tokens/s vs Hugging Face `datasets` (`load_dataset("json")`
+ `map(batched=True, num_proc=2)`) with the same fast tokenizer on the same corpus and cores,
and vs the raw tokenizer batch-encode rate on 2 processes (the limit). Target: eft ≥ 1.0× datasets.

    .venv/bin/python bench/prepare_throughput.py [--repeat 40] [--rounds 2] [--files 1,4]

The corpus is the pydoc corpus repeated `--repeat` times (40: ~30k documents, ~11.6 MB of
JSONL, ~5M tokens), written once as 1 JSONL file and once split into 4 (`--files`). Everything
is on local disk (input, tokenizer, output), so the comparison is about the pipelines, not S3.
eft runs with its defaults, where `prepare.engine: auto` picks the local engine for this size
(parse in the driver, a tokenizer thread per core: 2 here), and once more with `engine: ray`
(a Ray Data read/parse task per file, cutting it into blocks of a few tokenizer batches for
the default 2 tokenizer actors) on a running local Ray cluster, as after `eft local up`.
`datasets.map` gets num_proc=2 and shards by rows. TOKENIZERS_PARALLELISM=false everywhere,
so each process, actor or thread encodes on one core.

Work done: eft reads, tokenizes, packs into seq_len rows and writes Parquet shards + manifest;
datasets reads JSON into Arrow and writes the tokenized Arrow cache (a fresh cache dir per run,
so nothing is reused). Rates are the corpus's body tokens (one count, the same for every
variant) over the wall time of the call. Variants run interleaved (raw, then eft, datasets and eft
on the ray engine per layout, per round); the table gives medians and per-round ratios. Each round
also prepares one copy of the corpus with each, to split each pipeline's wall time into a fixed
start-up cost and a marginal rate. The whole machine's CPU time during each call (from /proc/stat) shows how much work
each pipeline does for the same tokens, since both keep the 2 cores busy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _setup as S  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402

BATCH = 256  # eft's prepare.tokenize_batch_size default, used for datasets.map and the raw loop too
# "eft": the defaults (engine auto → local at this size); "eft-ray": engine ray. In this order, the
# Ray workers still winding down after an eft-ray run load eft's next run, not datasets'.
VARIANTS = ("eft", "datasets", "eft-ray")
LABELS = {"eft": "`eft prepare` (defaults: auto → local engine, 2 threads)",
          "eft-ray": "`eft prepare` (engine: ray, 2 tokenizer actors)",
          "datasets": "`datasets` load_dataset + map(batched, num_proc=2)"}


def encode_all(tokenizer, texts: list[str]) -> int:
    from app.data.packing import encode_texts

    n = 0
    for i in range(0, len(texts), BATCH):
        n += sum(len(x) for x in encode_texts(tokenizer, texts[i:i + BATCH]))
    return n


def _raw_worker(tokenizer_dir: str, texts_path: str, barrier, out) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = json.loads(Path(texts_path).read_text())
    encode_all(tokenizer, texts[:200])  # warm
    barrier.wait()
    began = time.perf_counter()
    n = encode_all(tokenizer, texts)
    out.put((n, time.perf_counter() - began))


def raw_rate(tokenizer_dir: Path, texts: list[str], work: Path, procs: int = 2) -> dict:
    """`procs` processes, each batch-encoding half of the corpus at once: tokens / slowest time."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    paths = []
    for i in range(procs):
        paths.append(work / f"raw-part-{i}.json")
        paths[-1].write_text(json.dumps(texts[i::procs]))
    workers = [ctx.Process(target=_raw_worker, args=(str(tokenizer_dir), str(p), barrier, out)) for p in paths]
    for w in workers:
        w.start()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    tokens, slowest = sum(r[0] for r in results), max(r[1] for r in results)
    return {"tokens": tokens, "wall_s": slowest, "tokens_per_s": tokens / slowest}


def machine_busy_s() -> Optional[float]:
    """CPU seconds the whole machine has been busy (every core and process) since boot; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    idle, iowait = fields[3], fields[4]
    return (sum(fields) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def busy_between(before: Optional[float], after: Optional[float]) -> Optional[float]:
    return None if before is None or after is None else after - before


def run_eft(tree: dict, store, work: Path, name: str, input_path: Path, body_tokens: int,
            engine: Optional[str] = None) -> dict:
    """`eft prepare` in-process, unchanged (`engine` None: the default); the driver's read loop is
    wrapped only to note when the first tokenized block arrives and, on the ray engine, how many
    tasks Ray Data ran for the tokenize stage."""
    import re

    from app.data import prepare as P

    prepare = {**tree["prepare"], "input_uri": str(input_path), **({"engine": engine} if engine else {})}
    cfg = S.build_job({**tree, "name": name, "data": {**tree["data"], "uri": str(work / "out" / name)},
                       "prepare": prepare})
    seen: dict = {}
    datasets_built = []
    original_build, original_add = P.build_token_dataset, P.DocumentConsumer.add_batch

    def build(*args, **kwargs):
        datasets_built.append(original_build(*args, **kwargs))
        return datasets_built[-1]

    def add_batch(self, batch):
        seen.setdefault("first_block_s", time.perf_counter() - began)
        return original_add(self, batch)

    P.build_token_dataset, P.DocumentConsumer.add_batch = build, add_batch
    try:
        busy, began = machine_busy_s(), time.perf_counter()
        manifest = P.prepare_dataset(cfg, store)
        wall, busy = time.perf_counter() - began, busy_between(busy, machine_busy_s())
    finally:
        P.build_token_dataset, P.DocumentConsumer.add_batch = original_build, original_add
    if datasets_built:
        found = re.search(r"TokenizeDocuments\)[^:]*: (\d+) tasks executed, (\d+) blocks produced",
                          datasets_built[0].stats())
        seen["tokenize_tasks"], seen["tokenized_blocks"] = (int(found[1]), int(found[2])) if found else (None, None)
    return {"wall_s": wall, "busy_cpu_s": busy, "tokens_per_s": body_tokens / wall, "engine": manifest["stats"]["engine"],
            "manifest_tokens_per_s": manifest["stats"]["tokens_per_s"],
            "train_rows": manifest["splits"]["train"]["rows"], **seen}


def run_datasets(files: list[Path], tokenizer, work: Path, name: str, body_tokens: int) -> dict:
    import datasets

    from app.data.packing import encode_texts

    def tokenize(batch):
        return {"input_ids": encode_texts(tokenizer, batch["text"])}

    cache = work / "hf-cache" / name
    busy, began = machine_busy_s(), time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    loaded = time.perf_counter()
    out = ds.map(tokenize, batched=True, batch_size=BATCH, num_proc=2, remove_columns=ds.column_names)
    wall, busy = time.perf_counter() - began, busy_between(busy, machine_busy_s())
    assert len(out) == len(ds)
    return {"wall_s": wall, "busy_cpu_s": busy, "load_s": loaded - began, "map_s": wall - (loaded - began),
            "tokens_per_s": body_tokens / wall, "map_tokens_per_s": body_tokens / (wall - (loaded - began))}


def run_variant(variant: str, tree: dict, store, work: Path, name: str, files: list[Path], src: Path,
                tokenizer, tokens: int) -> dict:
    if variant == "datasets":
        return run_datasets(files, tokenizer, work, name, tokens)
    return run_eft(tree, store, work, name, src, tokens, engine="ray" if variant == "eft-ray" else None)


def busy_note(runs: dict, layouts: list[int]) -> str:
    """The whole machine's CPU time per call: how much of the cores each pipeline kept busy."""
    parts = []
    for n in layouts:
        for variant in VARIANTS:
            busy = S.median(x.get("busy_cpu_s") for x in runs[f"{variant}/{n}"])
            wall = S.median(x["wall_s"] for x in runs[f"{variant}/{n}"])
            if busy is not None:
                parts.append(f"{variant} {n} file(s) {busy:.1f} cpu-s ({busy / wall:.2f} of {os.cpu_count()} cores)")
    return ("Machine CPU time during each call (every core and process, Ray's included; median): "
            + "; ".join(parts) + ".") if parts else "Machine CPU time: not available on this OS."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=40, help="copies of the pydoc corpus")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--files", default="1,4", help="input layouts: number of JSONL files, comma-separated")
    args = parser.parse_args()
    layouts = [int(x) for x in args.files.split(",")]

    import datasets
    from transformers import AutoTokenizer

    from app.storage import Store
    from app.dev.tiny import build_corpus, save_tiny_base, write_jsonl

    datasets.disable_progress_bars()
    load_before = S.load_average()
    wall0 = time.time()
    texts = S.bench_texts(args.repeat)
    with tempfile.TemporaryDirectory(prefix="eft-bench-prepare-") as tmp:
        work = Path(tmp)
        store = Store()
        tokenizer_dir = work / "model"
        save_tiny_base(store, str(tokenizer_dir), texts=build_corpus(), **S.BENCH_MODEL)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        inputs = {}
        for n in layouts:
            size = -(-len(texts) // n)
            inputs[n] = [write_jsonl(({"text": t} for t in texts[i * size:(i + 1) * size]),
                                     work / "raw" / f"{n}-files" / f"part-{i:03d}.jsonl") for i in range(n)]
        corpus_mb = sum(f.stat().st_size for f in inputs[layouts[0]]) / 1e6
        # One copy of the corpus in one file: its wall time is mostly each pipeline's fixed start-up cost.
        small_texts = S.bench_texts(1)
        small_input = [write_jsonl(({"text": t} for t in small_texts), work / "raw" / "small" / "part-000.jsonl")]
        small_tokens = encode_all(tokenizer, small_texts)
        began = time.perf_counter()
        body_tokens = encode_all(tokenizer, texts)
        one_core = {"tokens_per_s": body_tokens / (time.perf_counter() - began)}
        tree = S.job_tree("prep", model={"uri": str(tokenizer_dir)}, storage={"root_uri": str(work / "runs")})
        S.start_ray()
        runs: dict[str, list[dict]] = {"raw": []}
        try:
            for r in range(args.rounds):
                print(f"round {r + 1}/{args.rounds}: raw tokenizer, 2 processes ...", flush=True)
                runs["raw"].append(raw_rate(tokenizer_dir, texts, work))
                for n in layouts:
                    src = inputs[n][0] if n == 1 else inputs[n][0].parent
                    for variant in VARIANTS:
                        key, name = f"{variant}/{n}", f"{variant}-{n}-{r}"
                        print(f"round {r + 1}/{args.rounds}: {variant}, {n} file(s) ...", flush=True)
                        res = run_variant(variant, tree, store, work, name, inputs[n], src, tokenizer, body_tokens)
                        print(f"  {res['tokens_per_s']:,.0f} tokens/s ({res['wall_s']:.1f} s)"
                              + (f"; {res['engine']} engine, first block to the driver after "
                                 f"{res['first_block_s']:.1f} s" if variant != "datasets" else ""), flush=True)
                        runs.setdefault(key, []).append(res)
                for variant in VARIANTS:
                    print(f"round {r + 1}/{args.rounds}: {variant}, 1 copy of the corpus (start-up cost) ...",
                          flush=True)
                    name = f"{variant}-small-{r}"
                    res = run_variant(variant, tree, store, work, name, small_input, small_input[0], tokenizer,
                                      small_tokens)
                    print(f"  {res['wall_s']:.1f} s", flush=True)
                    runs.setdefault(f"{variant}/small", []).append(res)
        finally:
            S.stop_ray()
    load_after = S.load_average()

    rate = {k: S.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    wall = {k: S.median(x["wall_s"] for x in v) for k, v in runs.items()}
    ratios = {}
    for n in layouts:
        ratios[n] = {}
        for variant in ("eft", "eft-ray"):
            per_round = [e["tokens_per_s"] / d["tokens_per_s"]
                         for e, d in zip(runs[f"{variant}/{n}"], runs[f"datasets/{n}"])]
            ratios[n][f"{variant}/datasets"] = S.median(per_round)
            ratios[n][f"{variant}/datasets per_round"] = per_round
        for variant in VARIANTS:
            ratios[n][f"{variant}/raw"] = S.median(x["tokens_per_s"] / w["tokens_per_s"]
                                                   for x, w in zip(runs[f"{variant}/{n}"], runs["raw"]))
    rows = [["raw tokenizer batch-encode, 2 processes (limit)", "—", S.fmt(rate["raw"]), S.fmt(wall["raw"], 1),
             "1.00", "—"]]
    for n in layouts:
        for variant in VARIANTS:
            key = f"{variant}/{n}"
            vs_ds = "1.00" if variant == "datasets" else f"{ratios[n][f'{variant}/datasets']:.2f}"
            rows.append([LABELS[variant], n, S.fmt(rate[key]), S.fmt(wall[key], 1),
                         f"{ratios[n][f'{variant}/raw']:.2f}", f"**{vs_ds}**" if variant == "eft" else vs_ds])
    met = {n: ratios[n]["eft/datasets"] >= 1.0 for n in layouts}
    # Marginal rate on one file: the extra tokens of the big corpus over the extra wall time.
    big = 1 if 1 in layouts else layouts[0]
    marginal = {v: (body_tokens - small_tokens) / max(wall[f"{v}/{big}"] - wall[f"{v}/small"], 1e-9)
                for v in VARIANTS}
    ds_parts = {n: (S.median(x["load_s"] for x in runs[f"datasets/{n}"]),
                    S.median(x["map_s"] for x in runs[f"datasets/{n}"])) for n in layouts}
    table = "\n\n".join([
        f"Corpus: the pydoc corpus x {args.repeat} = {len(texts):,} documents, {corpus_mb:.1f} MB of JSONL, "
        f"{body_tokens:,} tokens (BPE, vocab 512); seq_len {tree['data']['seq_len']}; {args.rounds} rounds, "
        f"interleaved. One process on one core encodes {S.fmt(one_core['tokens_per_s'])} tokens/s.",
        markdown_table(["pipeline", "input files", "tokens/s (median)", "wall s", "× raw limit", "× datasets"], rows),
        "eft (defaults) / datasets: " + "; ".join(
            f"{n} file(s) **{ratios[n]['eft/datasets']:.2f}** (per round "
            + ", ".join(f"{p:.2f}" for p in ratios[n]["eft/datasets per_round"])
            + f"; target ≥ 1.0: {'met' if met[n] else 'NOT met'})" for n in layouts)
        + ". The engine `auto` picked: " + ", ".join(sorted({x["engine"] for x in runs["eft/1"]})) + ".",
        f"Start-up vs throughput (one file): on one copy of the corpus ({small_tokens:,} tokens) `eft prepare` takes "
        f"{S.fmt(wall['eft/small'], 1)} s (ray engine {S.fmt(wall['eft-ray/small'], 1)} s) and datasets "
        f"{S.fmt(wall['datasets/small'], 1)} s; the marginal rate from there to the {args.repeat}-copy corpus is eft "
        f"{S.fmt(marginal['eft'])} tokens/s (ray engine {S.fmt(marginal['eft-ray'])}) vs datasets "
        f"{S.fmt(marginal['datasets'])} tokens/s (**{marginal['eft'] / marginal['datasets']:.2f}×**; ray engine "
        f"{marginal['eft-ray'] / marginal['datasets']:.2f}×).",
        "Inside `eft prepare` on the ray engine (Ray Data stats, driver clock): the tokenize stage ran "
        + "; ".join(f"{S.median(x['tokenize_tasks'] for x in runs[f'eft-ray/{n}']):g} task(s) for {n} file(s)"
                    for n in layouts)
        + " on its 2 tokenizer actors. The first tokenized block reached the driver (which packs and "
        "writes the shards) after " + "; ".join(
            f"{S.fmt(S.median(x['first_block_s'] for x in runs[f'eft-ray/{n}']), 1)} s of "
            f"{S.fmt(wall[f'eft-ray/{n}'], 1)} s ({n} file(s))" for n in layouts)
        + " on the ray engine; " + "; ".join(
            f"{S.fmt(S.median(x['first_block_s'] for x in runs[f'eft/{n}']), 2)} s of {S.fmt(wall[f'eft/{n}'], 1)} s "
            f"({n} file(s))" for n in layouts) + " on the local engine.",
        "datasets' wall split into load_dataset (JSON → Arrow) / map: " + "; ".join(
            f"{n} file(s) {S.fmt(a, 1)} s / {S.fmt(b, 1)} s" for n, (a, b) in ds_parts.items()) + ".",
        busy_note(runs, layouts),
        S.load_note(load_before, load_after),
    ])
    save_result("prepare_throughput", {
        "repeat": args.repeat, "documents": len(texts), "corpus_mb": corpus_mb, "body_tokens": body_tokens,
        "rounds": args.rounds, "one_core_tokens_per_s": one_core["tokens_per_s"], "small_tokens": small_tokens,
        "startup_wall_s": {v: wall[f"{v}/small"] for v in VARIANTS},
        "marginal_tokens_per_s": marginal, "median_tokens_per_s": rate,
        "median_wall_s": wall, "ratios": ratios, "target": {"eft/datasets >=": 1.0, "met": met}, "runs": runs,
        "load_average": {"before": load_before, "after": load_after}, "bench_wall_s": time.time() - wall0}, table)


if __name__ == "__main__":
    main()
