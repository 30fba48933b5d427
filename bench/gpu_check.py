"""GPU check: a short LoRA and a short full fine-tune of a ~1B-parameter random-init Llama
(bf16 compute, FSDP2, one GPU) through the same prepare job and train loop as every run.
Prints tokens/s, MFU and peak memory, and the same fine-tunes' tokens/s in the plain-PyTorch
loop of bench/bare_loop.py (same model, rows, batch and precision; no Ray, no FSDP, no
checkpoint), and saves them to bench/results/gpu_check.{json,md}. Meant for one H100/H200 and
about 5 minutes; CI never runs it.

    .venv/bin/python bench/gpu_check.py [--lora-steps 30] [--full-steps 20] [--local-dir DIR]
                                        [--runs lora,full]  # also: lora-ddp (LoRA under DDP, not FSDP2)
    .venv/bin/python bench/gpu_check.py --smoke     # tiny model on CPU: checks the script itself

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
SMOKE_SIZE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "vocab": 512,
              "seq_len": 128}
# --runs: label, LoRA?, parallelism.
RUNS = {"lora": ("LoRA r=16", True, "fsdp"), "full": ("full", False, "fsdp"),
        "lora-ddp": ("LoRA r=16, DDP", True, "ddp")}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(store, base_uri: str, texts: list[str], size: dict) -> int:
    """A random-init Llama in Hugging Face format, stored in bf16 as real checkpoints are."""
    import torch

    from app.dev.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(texts, vocab_size=size["vocab"])
    model = build_tiny_model(tokenizer, hidden_size=size["hidden_size"], num_layers=size["num_layers"],
                             num_heads=size["num_heads"], intermediate_size=size["intermediate_size"],
                             max_positions=size["seq_len"], initializer_range=0.02).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        store.upload_dir(tmp, base_uri, last=("config.json",))
    return sum(p.numel() for p in model.parameters())


def build_job(root: str, name: str, steps: int, lora: bool, size: dict, use_gpu: bool, parallelism: str = "fsdp"):
    from app.config import build_config

    return build_config({
        "name": name,
        # auto: a LoRA base stays bf16, full fine-tuning keeps fp32 master weights; compute is bf16.
        "model": {"uri": f"{root}/models/llama-random", "dtype": "auto"},
        "lora": {"r": 16, "alpha": 32, "target_modules": LORA_TARGETS} if lora else None,
        "data": {"uri": f"{root}/data/gpu-check", "seq_len": size["seq_len"]},
        "prepare": {"input_uri": f"{root}/raw/gpu-check.jsonl"},
        "training": {"max_steps": steps, "global_batch_size": 16, "micro_batch_size": 4, "lr": 1e-4,
                     "parallelism": parallelism,
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


def run_check(root: str, store, args, size: dict, use_gpu: bool) -> tuple[list[list], int]:
    import ray

    from app.data.prepare import prepare_dataset
    from app.dev.tiny import build_corpus, write_jsonl
    from app.cluster import init_ray
    from app.train.launch import run_training
    from app.train.metrics import load_metrics

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
    return rows, n_params


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-steps", type=int, default=30)
    parser.add_argument("--full-steps", type=int, default=20)
    parser.add_argument("--runs", default="lora,full", type=lambda v: v.split(","),
                        help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--local-dir", help="keep model, data and runs under this directory instead of local S3")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, 3 steps each, nothing saved")
    args = parser.parse_args()
    if unknown := set(args.runs) - set(RUNS):
        parser.error(f"--runs: unknown run(s) {', '.join(sorted(unknown))} (choose from {', '.join(RUNS)})")
    if args.smoke:
        args.lora_steps = args.full_steps = 3
    size, use_gpu = (SMOKE_SIZE, False) if args.smoke else (FULL_SIZE, True)

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
        rows, n_params = run_check(root, Store(), args, size, use_gpu)
    table = "\n\n".join([
        f"Random-init Llama, {n_params / 1e9:.2f}B parameters (hidden {size['hidden_size']}, {size['num_layers']} "
        f"layers, vocab {size['vocab']}), seq_len {size['seq_len']}, global batch 16 = micro 4 × accum 4, one "
        f"worker, FSDP2 (DDP where the run says so), {'bf16 compute' if use_gpu else 'fp32 on CPU'}. Bare = bench/bare_loop.py, one process, "
        "the same model, rows, batch and precision (bf16 autocast), no Ray, FSDP or checkpoint. Steady state = "
        "median over steps 3 on; step 1 includes warm-up; run wall = `run_training` from call to return (Ray Train start, model load and sharding, the steps, one checkpoint).",
        markdown_table(["run", "steps", "eft tokens/s", "bare tokens/s", "eft / bare", "MFU", "peak GB", "step s", "step 1 s", "run wall s",
                        "final loss"], rows),
        f"Whole check: {time.monotonic() - wall0:.0f} s.",
    ])
    if args.smoke:
        print(table)
    else:
        save_result("gpu_check", {"rows": rows, "parameters": n_params, "size": size}, table)


if __name__ == "__main__":
    main()
