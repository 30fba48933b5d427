"""GPU check: a short LoRA and a short full fine-tune of a ~1B-parameter random-init Llama
(bf16, FSDP2, one GPU) through the same train loop as every run, on the embedded local stack.
Prints tokens/s, MFU and peak memory and saves them to bench/results/gpu_check.*. Meant for
one H100/H200 and about 5 minutes; CI never runs it.

    .venv/bin/python bench/gpu_check.py [--lora-steps 30] [--full-steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

BASE, DATA, RAW = "s3://eft/models/llama-1b-random", "s3://eft/data/gpu-check", "s3://eft/raw/gpu-check.jsonl"
SEQ_LEN = 2048


def save_1b_base(store, texts: list[str]) -> None:
    """~1B parameters: width 2048, 18 layers, MLP 5504, vocab 8192; saved in bf16."""
    import torch

    from app.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(texts, vocab_size=8192)
    model = build_tiny_model(tokenizer, hidden_size=2048, num_layers=18, num_heads=16, intermediate_size=5504,
                             max_positions=SEQ_LEN, initializer_range=0.02).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        store.upload_dir(tmp, BASE, last=("config.json",))
    print(f"base: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters at {BASE}")


def build_job(name: str, steps: int, lora: bool):
    from app.config import build_config

    return build_config({
        "name": name, "model": {"uri": BASE, "dtype": "bfloat16"},
        "lora": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]} if lora else None,
        "data": {"uri": DATA, "seq_len": SEQ_LEN},
        "prepare": {"input_uri": RAW},
        "training": {"max_steps": steps, "global_batch_size": 16, "micro_batch_size": 4, "lr": 1e-4,
                     "mixed_precision": "bf16", "log_every_steps": 1},
        "checkpoint": {"save_every_steps": steps},
        "scaling": {"min_workers": 1, "max_workers": 1, "use_gpu": True, "cpus_per_worker": 4},
        "storage": {"root_uri": "s3://eft/gpu-check-runs"},
    })


def steady(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics[len(metrics) // 2:] if m.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> None:
    import ray

    from app import local
    from app.data.prepare import prepare_dataset
    from app.storage import Store
    from app.tiny import build_corpus, write_jsonl
    from app.train.launch import run_training
    from app.train.metrics import load_metrics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-steps", type=int, default=30)
    parser.add_argument("--full-steps", type=int, default=20)
    args = parser.parse_args()

    s3 = local.start_s3_server()
    os.environ.update(local.LOCAL_S3_ENV)
    os.environ["AWS_ENDPOINT_URL"] = s3.endpoint
    rows = []
    try:
        store = Store()
        texts = build_corpus()
        save_1b_base(store, texts)
        with tempfile.TemporaryDirectory() as tmp:
            store.write_bytes(RAW, write_jsonl(({"text": t} for t in texts), Path(tmp) / "c.jsonl").read_bytes())
        prepare_dataset(build_job("prepare", 1, lora=True), store)
        for name, steps, lora in (("lora", args.lora_steps, True), ("full", args.full_steps, False)):
            cfg = build_job(f"gpu-{name}", steps, lora)
            summary = run_training(cfg, store)
            metrics = load_metrics(store, cfg.run_uri)
            rows.append([name, summary["steps"], f"{steady(metrics, 'tokens_per_s'):,.0f}",
                         f"{(steady(metrics, 'mfu') or 0):.1%}", f"{steady(metrics, 'peak_mem_gb'):.1f}",
                         f"{steady(metrics, 'step_time_s'):.3f}", round(summary["final_train_loss"], 3)])
    finally:
        ray.shutdown()
        s3.stop()
    table = markdown_table(["run", "steps", "tokens/s", "MFU", "peak GB", "step s", "final loss"], rows)
    save_result("gpu_check", {"rows": rows}, table)


if __name__ == "__main__":
    main()
