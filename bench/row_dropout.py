"""The cost of row-seeded dropout (app/model/dropout.py): forward + backward of a small LoRA
Llama (every linear adapted, lora.dropout 0.05), PEFT's nn.Dropout vs RowDropout, with and
without activation checkpointing. Same weights, same batch; the variants alternate, and each
figure is the median of the repeats. On CPU the time is the process's CPU time on one thread,
which a busy shared box disturbs far less than wall time. About a minute on 2 CPUs.

    .venv/bin/python bench/row_dropout.py [--hidden 256] [--layers 4] [--seq-len 128] [--micro 4] [--repeats 5]

Runs on CUDA when there is one (the masks are drawn there, on a generator on that device).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args, row_seeded: bool, checkpointed: bool, device):
    import torch
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.config import LoraConfig
    from app.model.architecture import build_peft_config
    from app.model.build import apply_activation_checkpointing
    from app.model.dropout import RowSeeds, apply_row_dropout

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.seq_len, use_cache=False)
    lora = LoraConfig(r=16, alpha=32, dropout=0.05, target_modules=TARGETS)
    model = get_peft_model(LlamaForCausalLM(config), build_peft_config(lora)).to(device).train()
    if checkpointed:
        apply_activation_checkpointing(model)
    seeds = apply_row_dropout(model, seed=0) if row_seeded else RowSeeds(0)
    return model, seeds


def step_seconds(model, seeds, tokens, step: int) -> float:
    import torch

    clock = time.perf_counter if tokens.is_cuda else time.process_time
    if tokens.is_cuda:
        torch.cuda.synchronize()
    start = clock()
    with seeds.rows(range(len(tokens)), step):
        model(input_ids=tokens, labels=tokens).loss.backward()
    if tokens.is_cuda:
        torch.cuda.synchronize()
    return clock() - start


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread: comparable on a shared box
    tokens = torch.randint(0, 1024, (args.micro, args.seq_len), device=device)

    rows, data = [], {"args": vars(args), "device": str(device), "variants": {}}
    for checkpointed in (False, True):
        models = {kind: build(args, kind == "row-seeded", checkpointed, device) for kind in ("nn.Dropout", "row-seeded")}
        times = {kind: [] for kind in models}
        for step in range(args.repeats + 1):
            for kind, (model, seeds) in models.items():
                seconds = step_seconds(model, seeds, tokens, step)
                if step:  # the first step warms up allocators and kernels
                    times[kind].append(seconds)
        base = statistics.median(times["nn.Dropout"])
        for kind, values in times.items():
            median = statistics.median(values)
            label = f"{kind}, AC {'on' if checkpointed else 'off'}"
            data["variants"][label] = {"median_s": median, "all_s": values, "ratio": median / base}
            rows.append([kind, "on" if checkpointed else "off", f"{median * 1000:.1f}", f"{median / base:.3f}"])
    table = (f"Forward + backward of a LoRA Llama ({args.layers} layers, hidden {args.hidden}, all 7 linears "
             f"adapted, r 16, lora.dropout 0.05: {7 * args.layers} dropout modules), micro-batch {args.micro} x "
             f"{args.seq_len} tokens, on {device} ({'wall' if device.type == 'cuda' else 'CPU'} time, one thread on CPU); "
             f"median of {args.repeats} steps, variants alternating.\n\n"
             + markdown_table(["dropout", "activation checkpointing", "ms per micro-batch fwd+bwd", "× nn.Dropout"], rows))
    save_result("row_dropout", data, table)


if __name__ == "__main__":
    main()
