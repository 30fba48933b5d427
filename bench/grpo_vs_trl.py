"""eft's GRPO step against TRL's `GRPOTrainer` on the same tiny model, prompts, group size,
lengths, LoRA, learning rate and reward: steps/s from steady-state step times, one process a
side, the sides interleaved (eft, TRL, TRL, eft, ...) so load drift on a shared box hits both.

    pip install -e '.[bench]'     # trl: a bench-only dependency, never imported by app/
    .venv/bin/python bench/grpo_vs_trl.py [--rounds 3] [--steps 6] [--prompts 8] [--group 8]
                                          [--max-new-tokens 16] [--threads 1 2]

Both sides: the shipped tiny chat base (app/dev/tiny_chat_base) with rank-8 LoRA on every linear
layer; the parity prompts as chat messages, rendered by the tokenizer's chat template; sampling at
temperature 1, top-p 1, stopping at the template's end of turn (the model's generation config
names both stop tokens) or `--max-new-tokens`; two rewards, weight 1 each: `exact_match` and the
demo's `brevity_reward` (eft's functions, called from TRL's reward functions; the base answers in
prose, so exact match alone gives every group zero advantage); one update per batch (TRL `num_iterations=1`), no KL (`beta=0`), the clipped
loss normalized over the batch's completion tokens (TRL `loss_type="dapo"`), group-std advantage
scaling, AdamW at a constant 1e-3, gradient clipping at 1.0, no activation checkpointing (TRL's
GRPOConfig turns it on by default; eft's worker does not unless `training.activation_checkpointing`).

What each side's step timer includes: generation, the reward, advantages, the forward and
backward of the loss and the optimizer step. eft: `ColocatedRollouts.build` (its own seeded decode
loop over the KV cache, rewards, packing) then the update, as a training worker runs them, without
Ray. TRL: `Trainer.training_step` plus the optimizer, timed between its callbacks'
`on_step_begin` and `on_step_end`, which includes its generation (transformers `generate`),
reward and logging of that step. The first step of each run is warm-up and not counted.

"At two" is the whole 2-core box as one process a side gets it: `--threads 2` for eft and TRL
alike (torch intra-op threads), not two eft workers against two TRL processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-3


def build_records(n: int) -> list[dict]:
    from app.dev.tasks import build_task_records

    _, records = build_task_records(0, n, seed=1)
    return records


def run_eft(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.config import build_config
    from app.dev.tiny import SHIPPED_BASE
    from app.eval.render import PromptRenderer
    from app.eval.sets import build_record
    from app.model.loss import apply_loss
    from app.model.sharding import Float64GradSum
    from app.rl.colocated import ColocatedRollouts
    from app.rl.prompts import PromptSet, build_prompt_id
    from app.train.objective import GrpoObjective

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(SHIPPED_BASE)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(SHIPPED_BASE),
                           LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    apply_loss(model, "chunked", 1024)
    renderer = PromptRenderer(tok, tok.chat_template, "prompts")
    records = build_records(500)
    prompts = PromptSet([build_prompt_id(r) for r in records],
                        [renderer.ids(build_record(r, 0, "b")) for r in records], records)
    cfg = build_config({
        "name": "bench-grpo", "model": {"uri": "s3://b/m"}, "data": {"uri": "s3://b/d", "seq_len": 128},
        "training": {"objective": "grpo", "max_steps": args.steps + 1, "micro_batch_size": 8},
        "rl": {"rewards": [{"reward": "exact_match"}, {"reward": "app.dev.tasks:brevity_reward"}],
               "prompts_per_step": args.prompts, "group_size": args.group,
               "max_new_tokens": args.max_new_tokens}, "storage": {"root_uri": "s3://b/r"}})
    rollouts = ColocatedRollouts(cfg, prompts, tok, renderer.stop_ids, tok.pad_token_id, 0, 1, torch.device("cpu"))
    grpo = GrpoObjective(cfg)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    exact = Float64GradSum(params)
    steps = []
    for step in range(args.steps + 1):
        began = time.perf_counter()
        built = rollouts.build(model, step)
        units = sum(grpo.units(m[2], m[3]) for m in built.micro)
        for _, x, y, positions, advantages in built.micro:
            loss, _ = grpo.forward(model, x, y, positions, advantages, torch.device("cpu"), None)
            (loss / max(units, 1)).backward()
            exact.add_micro_batch()  # as the worker sums a GRPO step's gradient (app/train/loop.py)
        exact.reduce_into_grads(world=1)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        n = max(built.sums["completions"], 1)
        steps.append({"step_s": time.perf_counter() - began, "reward_mean": built.sums["reward_sum"] / n,
                      "completion_len_mean": built.sums["completion_tokens"] / n})
    return {"steps": steps[1:]}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from app.dev.tiny import SHIPPED_BASE
    from app.rl.rewards import build_one_reward

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(SHIPPED_BASE)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_BASE)
    records = build_records(500)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in records])
    def as_trl_reward(name: str):
        fn = build_one_reward(name)

        def reward(prompts, completions, answer, **_):
            return [fn("", c[0]["content"] if isinstance(c, list) else c, a, {}) for c, a in zip(completions, answer)]

        reward.__name__ = name.rsplit(":", 1)[-1]
        return reward

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append({"step_s": time.perf_counter() - self.began})

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs and steps:
                steps[-1].update(reward_mean=logs["reward"],
                                 completion_len_mean=logs.get("completions/mean_length"))

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
            gradient_accumulation_steps=1, max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.0,
            num_iterations=1, loss_type="dapo", scale_rewards="group", max_steps=args.steps + 1, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
            disable_tqdm=True, log_completions=False, gradient_checkpointing=False, reward_weights=[1.0, 1.0])
        trainer = GRPOTrainer(model=model, reward_funcs=[as_trl_reward("exact_match"),
                                                            as_trl_reward("app.dev.tasks:brevity_reward")], args=config, train_dataset=data,
                              processing_class=tok, callbacks=[StepTimer()],
                              peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
        trainer.train()
    return {"steps": steps[1:]}


def run_side(side: str, args) -> dict:
    """One run of one side in a process of its own; its steps from the JSON it writes."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--side", side, "--json", out.name, "--steps", str(args.steps),
               "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
               str(args.max_new_tokens), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{side} run failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--side", choices=["eft", "trl"])
    p.add_argument("--json")
    args = p.parse_args()
    if args.side:
        result = (run_eft if args.side == "eft" else run_trl)(
            argparse.Namespace(**{**vars(args), "threads": args.threads[0]}))
        Path(args.json).write_text(json.dumps(result))
        return

    runs: dict = {}
    for threads in args.threads:
        for round_ in range(args.rounds):
            # Alternate which side goes first in each round.
            for side in (("eft", "trl") if round_ % 2 == 0 else ("trl", "eft")):
                result = run_side(side, argparse.Namespace(**{**vars(args), "threads": threads}))
                runs.setdefault(f"{side}@{threads}", []).append(result["steps"])
                print(f"{side} threads={threads} round {round_ + 1}: "
                      f"{statistics.median(s['step_s'] for s in result['steps']):.3f} s/step", flush=True)

    def per_run_steps_per_s(key: str) -> list[float]:
        return [1.0 / statistics.median(s["step_s"] for s in steps) for steps in runs[key]]

    def last_reward(key: str) -> float:
        return statistics.mean(steps[-1].get("reward_mean") or 0.0 for steps in runs[key])

    rows, summary = [], {}
    for threads in args.threads:
        eft, trl = per_run_steps_per_s(f"eft@{threads}"), per_run_steps_per_s(f"trl@{threads}")
        ratio = statistics.median(eft) / statistics.median(trl)
        summary[threads] = {"eft_steps_per_s": eft, "trl_steps_per_s": trl, "ratio": ratio}
        for side, values in (("eft", eft), ("TRL GRPOTrainer", trl)):
            rows.append([f"{threads}", side, f"{statistics.median(values):.2f}",
                         f"{min(values):.2f}-{max(values):.2f}",
                         f"{last_reward(('eft' if side == 'eft' else 'trl') + f'@{threads}'):.3f}"])
        rows.append([f"{threads}", "**eft / TRL**", f"**{ratio:.2f}x**", "", ""])
    table = markdown_table(["threads", "side", "steps/s (median of runs)", "spread (runs)",
                            "reward, last step (mean of runs)"], rows)
    table += (f"\n{args.prompts} prompts x {args.group} completions a step, at most {args.max_new_tokens} new "
              f"tokens, {args.steps} timed steps after 1 warm-up, {args.rounds} interleaved runs a side.\n")
    save_result("grpo_vs_trl", {"args": vars(args), "summary": summary, "runs": runs}, table)


if __name__ == "__main__":
    main()
