"""Peak memory of the loss phase: forward + backward of the output layer and the cross-entropy
alone, at a Llama-3 vocabulary (128256) and seq_len 4096, `training.loss: full` vs `chunked`,
with the head frozen (LoRA) and trained (full fine-tune). CPU, fp32, about 3-5 minutes.

    .venv/bin/python bench/loss_memory.py [--seq-len 4096] [--vocab 128256] [--hidden 2048] [--chunk 1024]

How the peak is measured (Linux): each variant runs in a fresh process, which builds its inputs
(the final hidden states as a leaf that needs grad, the head's weight, the labels) and runs the
loss once on 8 tokens so that lazy one-off allocations (thread pools, kernels) are already there.
Then it resets the kernel's high-water mark of its resident memory (`5` into
/proc/self/clear_refs), reads VmRSS, runs `loss_sum` forward and backward once and reads VmHWM
(the peak since the reset). The difference is the loss phase's peak above its inputs, the
gradients it leaves included. Tensors this size are mmap'ed by the allocator and returned to the
OS when freed, so resident memory follows the live tensors. The hidden size is 2048 by default (Llama-3-8B
has 4096) to fit a small box; it changes the weight and its gradient, not the logits.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

def read_status_kb(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


VARIANTS = [("full", False), ("chunked", False), ("full", True), ("chunked", True)]


def measure(mode: str, trainable_head: bool, seq_len: int, vocab: int, hidden_size: int, chunk: int) -> dict:
    """In this (fresh) process: the loss phase's peak resident memory above its inputs."""
    import torch
    import torch.nn as nn

    from app.model.loss import apply_loss, loss_sum

    class HeadOnly(nn.Module):
        """A causal LM whose decoder is replaced by fixed final hidden states."""

        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(hidden_size, vocab, bias=False)
            self.lm_head.weight.requires_grad_(trainable_head)
            self.hidden = None

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids, **kwargs):
            return type("Out", (), {"logits": self.lm_head(self.hidden[:, :input_ids.shape[1]])})

    torch.manual_seed(0)
    model = HeadOnly()
    apply_loss(model, mode, chunk)
    model.hidden = torch.randn(1, seq_len, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, seq_len))
    labels[:, :seq_len // 8] = -100  # a masked prompt, as instruction data has
    ids = torch.zeros_like(labels)
    loss_sum(model, ids[:, :8], labels[:, :8], None).backward()  # warm-up: one-off allocations
    model.zero_grad(set_to_none=True)
    model.hidden.grad = None
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = read_status_kb("VmRSS")
    t0 = time.perf_counter()
    loss = loss_sum(model, ids, labels, None)
    loss.backward()
    seconds = time.perf_counter() - t0
    after = read_status_kb("VmHWM")
    return {"mode": mode, "trainable_head": trainable_head, "peak_above_inputs_gb": (after - before) * 1024 / 1e9,
            "baseline_rss_gb": before * 1024 / 1e9, "loss": float(loss), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=1024, help="training.loss_chunk_tokens")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, trainable = args.child.split(":")
        print(json.dumps(measure(mode, trainable == "1", args.seq_len, args.vocab, args.hidden, args.chunk)))
        return

    results = []
    for mode, trainable in VARIANTS:
        cmd = [sys.executable, __file__, "--child", f"{mode}:{int(trainable)}", "--seq-len", str(args.seq_len),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    logits_gb = args.seq_len * args.vocab * 4 / 1e9
    rows, ratios = [], {}
    for head in (False, True):
        full, chunked = (next(r for r in results if r["mode"] == m and r["trainable_head"] == head)
                         for m in ("full", "chunked"))
        ratio = chunked["peak_above_inputs_gb"] / full["peak_above_inputs_gb"]
        ratios["trained head" if head else "frozen head"] = ratio
        for r in (full, chunked):
            rows.append(["trained (full FT)" if head else "frozen (LoRA)", r["mode"], f"{r['peak_above_inputs_gb']:.2f}",
                         f"{r['peak_above_inputs_gb'] / logits_gb:.2f}", f"{r['seconds']:.1f}", f"{r['loss']:.1f}",
                         f"{ratio:.1%}" if r is chunked else ""])
    table = "\n\n".join([
        f"Loss phase only (output layer + cross-entropy, forward + backward), fp32 on CPU: seq_len {args.seq_len}, "
        f"vocab {args.vocab}, hidden {args.hidden} (Llama-3-8B: 4096; reduced to fit the box — the logits do not "
        f"depend on it), micro-batch 1, 1/8 of the labels masked, `training.loss_chunk_tokens` {args.chunk}. "
        f"One fp32 copy of the full logits is {logits_gb:.2f} GB. Peak = VmHWM after the phase (reset before it) minus "
        f"VmRSS before it, each variant in a fresh process after an 8-token warm-up (see the script's docstring); it includes "
        f"the gradients the phase leaves (hidden states; the weight when trained).",
        markdown_table(["head", "training.loss", "peak above inputs GB", "× full logits", "seconds", "loss sum",
                        "chunked / full"], rows),
        "Goal: chunked ≤ 25% of full. " + "; ".join(f"{k}: {v:.1%}" for k, v in ratios.items()) + ". Seconds: "
        "the phase's wall clock, for orientation only (the box may be shared: see the load average).",
    ])
    save_result("loss_memory", {"args": vars(args), "results": results, "ratios": ratios,
                                "full_logits_fp32_gb": logits_gb}, table)


if __name__ == "__main__":
    main()
