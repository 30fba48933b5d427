"""`eft demo` / `make demo`: the whole pipeline on the embedded local stack.

Real corpus (Python's own documentation topics) → BPE tokenizer + tiny random-init Llama
saved to S3 in HF format → prepare → LoRA + FSDP2 fine-tune on 2 CPU workers with periodic
checkpoints → export (adapter + merged) → generate a sample → summary.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from app import local
from app.config import load_config
from app.storage import Store, join

log = logging.getLogger("eft.demo")
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "tiny-cpu.yaml"


def ensure_inputs(cfg, store: Store) -> None:
    """The raw corpus and the base model the config points at, built here if absent."""
    from app.tiny import build_corpus, save_tiny_base, write_jsonl

    texts = build_corpus()
    if not store.exists(cfg.prepare.input_uri):
        with tempfile.TemporaryDirectory() as tmp:
            path = write_jsonl(({"text": t} for t in texts), Path(tmp) / "corpus.jsonl")
            store.write_bytes(cfg.prepare.input_uri, path.read_bytes())
        log.info("wrote %d documents to %s", len(texts), cfg.prepare.input_uri)
    if not store.exists(join(cfg.model.uri, "config.json")):
        save_tiny_base(store, cfg.model.uri, texts=texts, max_positions=max(512, cfg.data.seq_len))
        log.info("saved a tiny random-init Llama + BPE tokenizer to %s", cfg.model.uri)


def generate_sample(merged_uri: str, store: Store, prompt: str = "The import statement") -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local_dir = store.cache_locally(merged_uri)
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    model = AutoModelForCausalLM.from_pretrained(local_dir)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=40, do_sample=True, top_k=20,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def run_demo(config_path: Optional[str] = None, state_dir: Path = Path(".eft"), max_steps: Optional[int] = None,
             keep_stack: bool = False) -> int:
    from app.data.manifest import read_committed_manifest
    from app.data.prepare import prepare_dataset
    from app.export import export_run
    from app.summary import render_summary
    from app.train.launch import run_training

    overrides = [f"training.max_steps={max_steps}"] if max_steps else []
    cfg = load_config(config_path or DEFAULT_CONFIG, overrides)
    use_stack = not (os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("RAY_ADDRESS"))
    # A stack that `eft local up` left running in state_dir is the user's: use it, leave it up.
    running = local.status(state_dir) if use_stack else None
    started_stack = use_stack and not (running and running["s3_alive"] and running["ray_alive"])
    if use_stack:
        state = local.up(state_dir)
        os.environ.update(local.local_env(state))
        log.info("local stack up: S3 %s, Ray %s", state["s3_endpoint"], state["ray_address"])
    try:
        store = Store.from_config(cfg.storage)
        ensure_inputs(cfg, store)
        if read_committed_manifest(store, cfg.data.uri) is None:
            manifest = prepare_dataset(cfg, store)
            log.info("prepared %d train rows", manifest["splits"]["train"]["rows"])
        summary = run_training(cfg, store)
        exported = export_run(cfg, merge=True, store=store)
        sample = generate_sample(exported["merged_uri"], store)
        render_summary(summary)
        print(f"exported: {exported['adapter_uri']} (adapter), {exported['merged_uri']} (merged)")
        print(f"sample:   {sample!r}")
        first, final = summary["first_train_loss"], summary["final_train_loss"]
        print(f"train loss {first:.4f} → {final:.4f} over {summary['steps']} steps")
        return 0 if final < first else 1
    finally:
        if started_stack and not keep_stack:
            import ray

            ray.shutdown()
            local.down(state_dir)
