"""GPU check: short LoRA and full fine-tunes of random-init Llamas (bf16 compute, one GPU)
through the same prepare job and train loop as every run. Two shapes:

- `--shape 1b` (default): ~1B parameters, FSDP2; tokens/s, MFU and peak memory next to the same
  fine-tunes in the plain-PyTorch loop of bench/bare_loop.py (same model, rows, batch and
  precision; no Ray, no FSDP, no checkpoint). About 5 minutes on an H100/H200.
- `--shape 8b`: Llama-3-8B dimensions (hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256,
  seq_len 2048) with `--layers` of the 32 decoder layers (default 4, so that eight runs, a
  full fine-tune's optimizer state and its checkpoints fit one GPU, its disk and 10 minutes),
  LoRA and full, each side by side with `training.loss` full vs chunked and `training.compile`
  off vs on (by default full/off, chunked/off, chunked/on: each factor against the baseline;
  `--combos` adds full/on): tokens/s, MFU, peak memory and the memory plan's prediction
  (`app.plan.estimate_memory`, where it exists). Sized for ≤ 10 minutes on an H200 (not yet
  timed on one).

Results go to bench/results/gpu_check.{json,md} (1b) or gpu_check_8b.{json,md}. CI never runs it.

    .venv/bin/python bench/gpu_check.py [--lora-steps 30] [--full-steps 20] [--local-dir DIR]
                                        [--runs lora,full]  # also: lora-ddp (LoRA under DDP, not FSDP2)
    .venv/bin/python bench/gpu_check.py --shape 8b --local-dir DIR [--layers 4] [--steps 6]
                                        [--combos full:off,chunked:off,chunked:on,full:on]
    .venv/bin/python bench/gpu_check.py [--shape 8b] --smoke   # tiny model on CPU: checks the script itself

Storage is the embedded local S3 endpoint, or with --local-dir a local directory (for a GPU
machine that has Ray and the model libraries but not the local-stack packages).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

# Width 2048, 18 layers, MLP 5504, vocab 8192: ~1.0B parameters.
FULL_SIZE = {"hidden_size": 2048, "num_layers": 18, "num_heads": 16, "intermediate_size": 5504, "vocab": 8192,
             "seq_len": 2048}
# Llama-3-8B's dimensions; `--layers` sets how many of its 32 decoder layers are built.
LLAMA3_8B_SIZE = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
                  "intermediate_size": 14336, "vocab": 128256, "seq_len": 2048}
SMOKE_SIZE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "vocab": 512,
              "seq_len": 128}
# --combos for --shape 8b: training.loss : training.compile. The first is each mode's baseline.
# By default three of the four, to fit 10 minutes of device time: each factor against the baseline.
COMBOS = ["full:off", "chunked:off", "chunked:on", "full:on"]
DEFAULT_COMBOS = COMBOS[:3]
# --runs: label, LoRA?, parallelism.
RUNS = {"lora": ("LoRA r=16", True, "fsdp"), "full": ("full", False, "fsdp"),
        "lora-ddp": ("LoRA r=16, DDP", True, "ddp")}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_random_llama(tokenizer, size: dict):
    """Random init straight in bf16. The vocabulary is the shape's, even where the tokenizer
    trained on the small corpus has fewer tokens (ids past it are simply never seen)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=max(size["vocab"], len(tokenizer)), hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"], num_hidden_layers=size["num_layers"],
        num_attention_heads=size["num_heads"], num_key_value_heads=size.get("num_kv_heads", size["num_heads"]),
        max_position_embeddings=size["seq_len"], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        initializer_range=0.02,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def save_base(store, base_uri: str, texts: list[str], size: dict) -> int:
    """A random-init Llama in Hugging Face format, stored in bf16 as real checkpoints are."""
    from app.dev.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(texts, vocab_size=min(size["vocab"], 8192))
    model = build_random_llama(tokenizer, size)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        store.upload_dir(tmp, base_uri, last=("config.json",))
    return sum(p.numel() for p in model.parameters())


def build_job(root: str, name: str, steps: int, lora: bool, size: dict, use_gpu: bool, parallelism: str = "fsdp",
              loss: str = "chunked", compile: bool = False, global_batch: int = 16, micro_batch: int = 4):
    from app.config import build_config

    return build_config({
        "name": name,
        # auto: a LoRA base stays bf16, full fine-tuning keeps fp32 master weights; compute is bf16.
        "model": {"uri": f"{root}/models/llama-random", "dtype": "auto"},
        "lora": {"r": 16, "alpha": 32, "target_modules": LORA_TARGETS} if lora else None,
        "data": {"uri": f"{root}/data/gpu-check", "seq_len": size["seq_len"]},
        "prepare": {"input_uri": f"{root}/raw/gpu-check.jsonl"},
        "training": {"max_steps": steps, "global_batch_size": global_batch, "micro_batch_size": micro_batch,
                     "lr": 1e-4, "parallelism": parallelism, "loss": loss, "loss_chunk_tokens": 1024, "compile": compile,
                     "mixed_precision": "bf16" if use_gpu else "fp32", "log_every_steps": 1},
        "checkpoint": {"save_every_steps": steps},
        "scaling": {"min_workers": 1, "max_workers": 1, "use_gpu": use_gpu, "cpus_per_worker": 4 if use_gpu else 1},
        "storage": {"root_uri": f"{root}/runs"},
    })


def steady(metrics: list[dict], key: str) -> float | None:
    """Median over steps 3 on: past allocator warm-up and caching, and robust to the odd slow step."""
    values = [m[key] for m in metrics if m["step"] > 2 and m.get(key) is not None]
    return statistics.median(values) if values else None


def run_bare_loop(model_dir: Path, data_dir: Path, steps: int, lora: bool, use_gpu: bool) -> float:
    """Steady-state tokens/s of bench/bare_loop.py on the same fine-tune, in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bare.json"
        cmd = [sys.executable, str(Path(__file__).with_name("bare_loop.py")), "--model-dir", str(model_dir),
               "--data-dir", str(data_dir), "--steps", str(steps), "--global-batch", "16", "--micro-batch", "4",
               "--lr", "1e-4", "--device", "cuda" if use_gpu else "cpu", "--out", str(out)]
        if lora:
            cmd += ["--lora", json.dumps({"r": 16, "alpha": 32, "target_modules": LORA_TARGETS})]
        subprocess.run(cmd, check=True)
        result = json.loads(out.read_text())
    step_s = steady(result["steps"], "step_time_s")
    return 16 * result["seq_len"] / step_s


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def prepare_base_and_data(root: str, store, size: dict, use_gpu: bool) -> int:
    """The random base and the prepared corpus every run of the check trains on; Ray started."""
    from app.cluster import init_ray
    from app.data.prepare import prepare_dataset
    from app.dev.tiny import build_corpus, write_jsonl

    t0 = time.monotonic()
    texts = build_corpus()
    n_params = save_base(store, f"{root}/models/llama-random", texts, size)
    print(f"base: {n_params / 1e9:.3f}B parameters, saved in {time.monotonic() - t0:.0f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # The corpus ×4, so an epoch is several steps at seq_len 2048.
        raw = write_jsonl(({"text": t} for _ in range(4) for t in texts), Path(tmp) / "c.jsonl")
        store.write_bytes(f"{root}/raw/gpu-check.jsonl", raw.read_bytes())
    init_ray()
    prepare_dataset(build_job(root, "prepare", 1, True, size, use_gpu), store)
    return n_params


def run_check(root: str, store, args, size: dict, use_gpu: bool) -> tuple[list[list], int, list[dict]]:
    import ray

    from app.observe.metrics import load_metrics
    from app.train.launch import run_training

    n_params = prepare_base_and_data(root, store, size, use_gpu)
    runs = []
    for run in args.runs:
        name, lora, parallelism = RUNS[run]
        steps = args.lora_steps if lora else args.full_steps
        cfg = build_job(root, f"gpu-{run}", steps, lora, size, use_gpu, parallelism)
        started = time.monotonic()
        summary = run_training(cfg, store)
        wall = time.monotonic() - started
        metrics = load_metrics(store, cfg.run_uri)
        peak = steady(metrics, "peak_mem_gb") or steady(metrics, "peak_rss_gb")
        runs.append((name, steps, lora, summary, metrics, wall, peak))
    nccl = [summary.get("nccl") for _, _, _, summary, *_ in runs]
    ray.shutdown()  # the bare loop gets the GPU to itself
    # The bare loop reads local files: a local root as is, S3 through the store's node cache.
    model_dir, data_dir = store.cache_locally(f"{root}/models/llama-random"), store.cache_locally(f"{root}/data/gpu-check")
    rows = []
    bare: dict[tuple[int, bool], float] = {}  # LoRA under FSDP2 and under DDP share one baseline
    for name, steps, lora, summary, metrics, wall, peak in runs:
        if (steps, lora) not in bare:
            bare[steps, lora] = run_bare_loop(model_dir, data_dir, steps, lora, use_gpu)
        eft_rate, bare_rate = steady(metrics, "tokens_per_s"), bare[steps, lora]
        rows.append([name, summary["steps"], fmt(eft_rate, ",.0f"), fmt(bare_rate, ",.0f"),
                     fmt(eft_rate / bare_rate if eft_rate else None, ".2f"),
                     fmt(steady(metrics, "mfu"), ".1%"), fmt(peak, ".1f"), fmt(steady(metrics, "step_time_s"), ".3f"),
                     fmt(metrics[0].get("step_time_s") if metrics else None, ".1f"), f"{wall:.0f}",
                     round(summary["final_train_loss"], 3)])
        print(rows[-1], flush=True)
    return rows, n_params, nccl


def predict_peak_gb(cfg, store) -> float | None:
    """The memory plan's per-GPU peak for this run, as torch.cuda.max_memory_allocated counts it
    (the measured column: no CUDA context)."""
    from app.model.architecture import load_model_config
    from app.plan import estimate_memory

    try:
        estimate = estimate_memory(cfg, load_model_config(store, cfg.model.uri), world=1,
                                   parallelism=cfg.training.parallelism)
    except Exception as err:  # a plan bug must not cost the measured runs their device time
        print(f"predicted peak: app.plan.estimate_memory failed: {type(err).__name__}: {err}", flush=True)
        return None
    return estimate.allocated_bytes / 1e9


def run_matrix(root: str, store, args, size: dict, use_gpu: bool) -> tuple[list[list], int, list[dict]]:
    """LoRA and full, each with every (training.loss, training.compile) of --combos; one run's
    files are deleted before the next starts (a full fine-tune's checkpoint is ~12 bytes/parameter)."""
    from app.observe.metrics import load_metrics
    from app.train.launch import run_training

    n_params = prepare_base_and_data(root, store, size, use_gpu)
    rows, nccl = [], []
    for mode in args.runs:
        lora = mode == "lora"
        baseline: dict = {}
        for combo in args.combos:
            loss, compiled = combo.split(":")
            cfg = build_job(root, f"gpu8b-{mode}-{loss}-{compiled}", args.steps, lora, size, use_gpu,
                            loss=loss, compile=compiled == "on", global_batch=8, micro_batch=4)
            predicted = predict_peak_gb(cfg, store)
            started = time.monotonic()
            summary = run_training(cfg, store)
            wall = time.monotonic() - started
            nccl.append(summary.get("nccl"))
            metrics = load_metrics(store, cfg.run_uri)
            store.delete_prefix(cfg.run_uri)
            rate = steady(metrics, "tokens_per_s")
            peak = steady(metrics, "peak_mem_gb") or steady(metrics, "peak_rss_gb")
            baseline = baseline or {"rate": rate, "peak": peak}
            rows.append([RUNS[mode][0], loss, compiled, summary["steps"], fmt(rate, ",.0f"),
                         fmt(rate / baseline["rate"] if rate and baseline["rate"] else None, ".2f"),
                         fmt(steady(metrics, "mfu"), ".1%"), fmt(peak, ".1f"),
                         fmt(peak / baseline["peak"] if peak and baseline["peak"] else None, ".2f"),
                         fmt(predicted, ".1f"), fmt(steady(metrics, "step_time_s"), ".3f"),
                         fmt(metrics[0].get("step_time_s") if metrics else None, ".1f"), f"{wall:.0f}",
                         round(summary["final_train_loss"], 3)])
            print(rows[-1], flush=True)
    return rows, n_params, nccl


def describe_nccl(records: list) -> str:
    """What NCCL picked on this machine, as rank 0 recorded it (app/observe/nccl.py)."""
    seen = [r for r in records if r]
    if not seen:
        return "NCCL transport: none recorded (CPU run, or NCCL_DEBUG set without NCCL_DEBUG_FILE)."
    r = seen[0]
    return (f"NCCL transport as rank 0 recorded it: NCCL {r.get('nccl_version')}, network {r.get('network')}, "
            f"plugin {r.get('plugin') or 'internal'}, fabric {r.get('fabric') or 'none'}, {r.get('nodes')} node(s), "
            f"channels {', '.join(r.get('channels') or []) or '-'}; the same in all {len(seen)} run(s): "
            f"{all(s.get('network') == r.get('network') for s in seen)}.")


def describe_matrix(size: dict, n_params: int, use_gpu: bool, steps: int) -> str:
    return (f"Random-init Llama with Llama-3-8B dimensions (hidden {size['hidden_size']}, {size['num_heads']} heads, "
            f"{size.get('num_kv_heads', size['num_heads'])} KV heads, MLP {size['intermediate_size']}, vocab "
            f"{size['vocab']}) but **{size['num_layers']} of its 32 decoder layers**: {n_params / 1e9:.2f}B parameters. "
            f"seq_len {size['seq_len']}, global batch 8 = micro 4 × accum 2, {steps} steps, one worker, FSDP2, "
            f"{'bf16 compute' if use_gpu else 'fp32 on CPU'}; LoRA r=16 on all linear layers of the blocks (base "
            f"in bf16), full = fp32 master weights. Steady state = median over steps 3 on; step 1 includes warm-up "
            f"(and compilation); × base = against the same mode's first row. Predicted = `app.plan.estimate_memory` "
            f"(allocated bytes, as the measured column).")


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-steps", type=int, default=30)
    parser.add_argument("--full-steps", type=int, default=20)
    parser.add_argument("--runs", default="lora,full", type=lambda v: v.split(","),
                        help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--local-dir", help="keep model, data and runs under this directory instead of local S3")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, 3 steps each, nothing saved")
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b")
    parser.add_argument("--layers", type=int, default=4, help="--shape 8b: decoder layers built, of Llama-3-8B's 32")
    parser.add_argument("--steps", type=int, default=6, help="--shape 8b: steps per run")
    parser.add_argument("--combos", default=",".join(DEFAULT_COMBOS), type=lambda v: v.split(","),
                        help="--shape 8b: comma-separated training.loss:compile pairs, the first the baseline")
    args = parser.parse_args()
    if unknown := set(args.runs) - set(RUNS):
        parser.error(f"--runs: unknown run(s) {', '.join(sorted(unknown))} (choose from {', '.join(RUNS)})")
    if args.shape == "8b" and (unknown := set(args.combos) - set(COMBOS)):
        parser.error(f"--combos: unknown pair(s) {', '.join(sorted(unknown))} (choose from {', '.join(COMBOS)})")
    if args.shape == "8b" and "lora-ddp" in args.runs:
        parser.error("--runs lora-ddp: --shape 8b runs lora and full under FSDP2")
    if args.smoke:
        args.lora_steps = args.full_steps = args.steps = 3
        size, use_gpu = SMOKE_SIZE, False
    elif args.shape == "8b":
        size, use_gpu = {**LLAMA3_8B_SIZE, "num_layers": args.layers}, True
    else:
        size, use_gpu = FULL_SIZE, True

    from app.storage import Store

    wall0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.local_dir:
            root = str(Path(args.local_dir).absolute())
        else:
            from app.dev import local

            stack.enter_context(local.serve_s3())
            root = "s3://eft/gpu-check"
        stack.callback(ray.shutdown)
        if args.shape == "8b":
            rows, n_params, nccl = run_matrix(root, Store(), args, size, use_gpu)
        else:
            rows, n_params, nccl = run_check(root, Store(), args, size, use_gpu)
    if args.shape == "8b":
        table = "\n\n".join([
            describe_matrix(size, n_params, use_gpu, args.steps),
            markdown_table(["run", "training.loss", "compile", "steps", "tokens/s", "× base", "MFU", "peak GB",
                            "× base", "predicted GB", "step s", "step 1 s", "run wall s", "final loss"], rows),
            describe_nccl(nccl),
            f"Whole check: {time.monotonic() - wall0:.0f} s.",
        ])
        if args.smoke:
            print(table)
        else:
            save_result("gpu_check_8b", {"rows": rows, "parameters": n_params, "size": size, "nccl": nccl}, table)
        return
    table = "\n\n".join([
        f"Random-init Llama, {n_params / 1e9:.2f}B parameters (hidden {size['hidden_size']}, {size['num_layers']} "
        f"layers, vocab {size['vocab']}), seq_len {size['seq_len']}, global batch 16 = micro 4 × accum 4, one "
        f"worker, FSDP2 (DDP where the run says so), {'bf16 compute' if use_gpu else 'fp32 on CPU'}. Bare = bench/bare_loop.py, one process, "
        "the same model, rows, batch and precision (bf16 autocast), no Ray, FSDP or checkpoint. Steady state = "
        "median over steps 3 on; step 1 includes warm-up; run wall = `run_training` from call to return (Ray Train start, model load and sharding, the steps, one checkpoint).",
        markdown_table(["run", "steps", "eft tokens/s", "bare tokens/s", "eft / bare", "MFU", "peak GB", "step s", "step 1 s", "run wall s",
                        "final loss"], rows),
        describe_nccl(nccl),
        f"Whole check: {time.monotonic() - wall0:.0f} s.",
    ])
    if args.smoke:
        print(table)
    else:
        save_result("gpu_check", {"rows": rows, "parameters": n_params, "size": size, "nccl": nccl}, table)


if __name__ == "__main__":
    main()
