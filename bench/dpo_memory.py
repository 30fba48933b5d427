"""Peak memory of one DPO step (LoRA, chunked per-token log-probs) by where the reference
log-probs come from: `precomputed` (read with the rows: one model), `live` (the same model with
its adapters disabled, one more no-grad forward) and `naive` (a second, frozen copy of the model
held beside the policy, as peers without either do). CPU, fp32, at the tiny model's size and at a
bench size (~90M parameters). About 5 minutes.

    .venv/bin/python bench/dpo_memory.py [--sizes tiny,bench]

How the peak is measured (Linux): each variant runs in a fresh process, with glibc's mmap threshold
fixed (FIXED_MALLOC) so that resident memory follows the live tensors. It reads VmRSS, builds
what it holds (the policy with LoRA adapters on every linear; the naive variant also a second
copy of the model), runs one step on 8 tokens so that one-off allocations are there, resets the
kernel's high-water mark (`5` into /proc/self/clear_refs), runs one full step (reference
log-probs, forward and backward of the pair loss, AdamW) and reads VmHWM. Reported: the peak above
the process's start (the models included) and the step's own peak above what was resident before
it. The rows are packed pairs as `eft prepare` writes them: each row two pairs, a prompt
(a quarter of each document) and completions filling the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab=512, seq_len=256, micro=2),
    "bench": dict(hidden_size=768, num_layers=6, num_heads=12, intermediate_size=2048, vocab=32000, seq_len=1024,
                  micro=2),
}
VARIANTS = ("precomputed", "live", "naive")
# glibc raises its mmap threshold each time a large mmapped block is freed, after which blocks of
# that size come from the heap and stay resident when freed: the resident peak would then depend on
# each variant's allocation history. Fixed, every large tensor is mmapped and returned when freed,
# so resident memory follows the live tensors in every variant alike.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def read_status_kb(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def build_rows(seq_len: int, micro: int, vocab: int):
    """`micro` packed rows of two pairs each: chosen and rejected documents of a prompt (a quarter
    of the document) and a completion, position_ids restarting at each document, prompts unlabelled."""
    import numpy as np

    rng = np.random.default_rng(0)
    doc = seq_len // 4
    ids = rng.integers(0, vocab, size=(micro, seq_len)).astype(np.int64)
    positions = np.tile(np.arange(doc), (micro, 4))
    labels = ids.copy()
    labels[positions < doc // 4] = -100
    return ids, labels, positions


def measure(variant: str, size: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.config import build_config
    from app.model.loss import apply_loss, token_logps
    from app.model.preference import pair_segments, sequence_logps
    from app.train.objective import PreferenceObjective

    s = SIZES[size]
    torch.manual_seed(0)
    start = read_status_kb("VmRSS")
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                         num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                         num_key_value_heads=s["num_heads"], max_position_embeddings=s["seq_len"],
                         tie_word_embeddings=False)
    base = LlamaForCausalLM(config)
    reference_model = None
    if variant == "naive":
        reference_model = LlamaForCausalLM(config)
        reference_model.load_state_dict(base.state_dict())
        reference_model.requires_grad_(False).eval()
        apply_loss(reference_model, "chunked", 1024)
    policy = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=LINEAR))
    apply_loss(policy, "chunked", 1024)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    cfg = build_config({"name": "b", "model": {"uri": "/m"}, "lora": {"r": 16}, "data": {"uri": "/d"},
                        "storage": {"root_uri": "/r"}, "training": {"objective": "dpo", "max_steps": 1},
                        "preference": {"reference": "live" if variant == "live" else "precomputed"}})
    objective = PreferenceObjective(cfg)
    ids, labels, positions = build_rows(s["seq_len"], s["micro"], s["vocab"])

    def step(ids, labels, positions):
        ref = None
        if variant != "live":
            segments, pairs = pair_segments(labels, positions)
            n = 2 * int(pairs.sum())
            if variant == "naive":
                with torch.no_grad():
                    t = [torch.as_tensor(a) for a in (ids, labels, positions)]
                    ref = sequence_logps(token_logps(reference_model, *t[:2], None, t[2]),
                                         torch.as_tensor(segments), n).numpy()
            else:
                ref = -torch.rand(n).numpy() * 100  # read with the rows; its values do not change memory
        loss, _ = objective.forward(policy, ids, labels, positions, ref, torch.device("cpu"), None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    short = slice(0, 8)
    step(ids[:1, short], labels[:1, short], positions[:1, short])  # warm-up: one-off allocations
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = read_status_kb("VmRSS")
    t0 = time.perf_counter()
    loss = step(ids, labels, positions)
    seconds = time.perf_counter() - t0
    peak = read_status_kb("VmHWM")
    parameters = sum(p.numel() for p in base.parameters())
    return {"variant": variant, "size": size, "parameters": parameters, "tokens": int(ids.size),
            "peak_above_start_gb": (peak - start) * 1024 / 1e9, "step_peak_gb": (peak - before) * 1024 / 1e9,
            "resident_before_step_gb": (before - start) * 1024 / 1e9, "loss": loss, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,bench")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, size = args.child.split(":")
        print(json.dumps(measure(variant, size)))
        return
    results = []
    for size in args.sizes.split(","):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--child", f"{variant}:{size}"], check=True,
                                 capture_output=True, text=True, env={**os.environ, **FIXED_MALLOC}).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    rows, ratios = [], {}
    for size in args.sizes.split(","):
        by = {r["variant"]: r for r in results if r["size"] == size}
        base = by["precomputed"]["peak_above_start_gb"]
        for variant in VARIANTS:
            r = by[variant]
            ratio = r["peak_above_start_gb"] / base
            ratios[f"{size} {variant}"] = ratio
            rows.append([size, f"{r['parameters'] / 1e6:.1f}M", r["tokens"], variant,
                         f"{r['peak_above_start_gb']:.3f}", f"{r['resident_before_step_gb']:.3f}",
                         f"{r['step_peak_gb']:.3f}", f"{ratio:.2f}×", f"{r['seconds']:.1f}"])
    table = "\n\n".join([
        "One DPO step (LoRA r=16 on every linear, chunked per-token log-probs, AdamW), fp32 on CPU, micro-batch 2 "
        "packed rows of two pairs each. `precomputed`: the reference log-probs come with the rows (eft's default, "
        "computed once by `eft prepare`); `live`: the model with its adapters disabled, one more no-grad forward; "
        "`naive`: a second frozen copy of the model beside the policy. Peak = VmHWM after the step (reset before "
        "it), each variant in a fresh process with glibc's mmap threshold fixed (see the script's docstring).",
        markdown_table(["size", "parameters", "tokens", "reference", "peak above start GB", "held before the step GB",
                        "step's own peak GB", "peak vs precomputed", "seconds"], rows),
        "The naive variant's extra is the second model (its weights: 4 bytes a parameter here); live adds no "
        "weights, only its no-grad forward's transients. Seconds: the step's wall clock, for orientation only.",
    ])
    save_result("dpo_memory", {"args": vars(args), "results": results, "ratios": ratios}, table)


if __name__ == "__main__":
    main()
