"""Where a GRPO step's time goes, colocated: the rollout (seeded sampling over the KV cache,
rewards, group advantages, packing) against the update (forward + backward of the clipped
objective over the packed rollouts, and the optimizer), and generated tokens/s; with an SFT step
on the same packed rows as the baseline of the update (a GRPO update is one policy forward and
backward, as SFT's is: the ratio should be about 1).

    .venv/bin/python bench/grpo_step.py [--steps 8] [--prompts 8] [--group 8] [--max-new-tokens 16] [--threads 1]
                                        [--actors 2]

The policy is the shipped tiny chat base (app/dev/tiny_chat_base: ~0.8M parameters) with rank-8
LoRA adapters on every linear layer and the chunked loss, as on a worker; the prompts are the
parity task's, rendered through eval's chat-template code; the reward is `exact_match`. One
process, no Ray, one intra-op thread by default. The SFT baseline and the GRPO update alternate
step by step on the same rows.

With `--actors N` the same steps are also sampled on N rollout actors (`rl.rollout: actors`,
app/rl/actors.py) on a local Ray: each step's policy is published (gathered, written to a run
directory under a temporary root, offered through the object store) and the actors sample the
same prompts from the same seeds; colocated and actors alternate which goes first, and the bench
counts the completions whose tokens differ between the two (rounding in batches of another
shape; the issue asks how often). The actors run transformers; vLLM is not available on this box.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, save_result  # noqa: E402

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--actors", type=int, default=0, help="also sample on this many rollout actors (local Ray)")
    args = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.config import build_config
    from app.dev.tasks import build_task_records
    from app.dev.tiny import SHIPPED_BASE
    from app.eval.render import PromptRenderer
    from app.eval.sets import build_record
    from app.model.loss import apply_loss
    from app.rl.colocated import ColocatedRollouts
    from app.rl.prompts import PromptSet, build_prompt_id
    from app.train.objective import GrpoObjective, SftObjective

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(SHIPPED_BASE)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(SHIPPED_BASE), LoraConfig(
        r=8, lora_alpha=16, target_modules=ALL_LINEAR))
    apply_loss(model, "chunked", 1024)
    renderer = PromptRenderer(tok, tok.chat_template, "prompts")
    _, records = build_task_records(0, 500, seed=1)
    prompts = PromptSet([build_prompt_id(r) for r in records], [renderer.ids(build_record(r, 0, "b")) for r in records],
                        records)
    work = Path(tempfile.mkdtemp(prefix="eft-bench-grpo-"))
    rl = {"reward": "exact_match", "prompts_per_step": args.prompts, "group_size": args.group,
          "max_new_tokens": args.max_new_tokens}
    cfg = build_config({
        "name": "bench-grpo", "model": {"uri": str(SHIPPED_BASE)}, "data": {"uri": "s3://b/d", "seq_len": 128},
        "lora": {"r": 8, "alpha": 16, "target_modules": ALL_LINEAR},
        "training": {"objective": "grpo", "max_steps": args.steps, "micro_batch_size": 8},
        "rl": rl, "storage": {"root_uri": str(work / "runs")}})
    rollouts = ColocatedRollouts(cfg, prompts, tok, renderer.stop_ids, tok.pad_token_id, 0, 1, torch.device("cpu"))
    on_actors = None
    if args.actors:
        import ray

        from app.rl.actors import ActorRollouts

        # The actors' threads as the trainer's: each samples with one intra-op thread by default.
        ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": str(args.threads)}})
        actors_cfg = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"rollout": "actors",
                                                                              "rollout_actors": args.actors})})
        on_actors = ActorRollouts(actors_cfg, prompts, tok, renderer.stop_ids, tok.pad_token_id, 0, 1,
                                  torch.device("cpu"))
    grpo, sft = GrpoObjective(cfg), SftObjective()
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def update(objective, micro) -> float:
        began = time.perf_counter()
        units = sum(objective.units(m[2], m[3]) for m in micro)
        for _, x, y, positions, advantages in micro:
            loss, _ = objective.forward(model, x, y, positions, advantages, torch.device("cpu"), None)
            (loss / max(units, 1)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    def sample(placement, step: int):
        began = time.perf_counter()
        built = placement.build(model, step)
        return built, time.perf_counter() - began

    rows = []
    for step in range(args.steps + 1):  # step 0 warms up (and starts the actors)
        if on_actors is None:
            built, rollout_s = sample(rollouts, step)
        elif step % 2:
            (built, rollout_s), (remote, actors_s) = sample(rollouts, step), sample(on_actors, step)
        else:
            (remote, actors_s), (built, rollout_s) = sample(on_actors, step), sample(rollouts, step)
        # Alternate which goes first: load drift on a shared box hits both alike.
        if step % 2:
            sft_s, grpo_s = update(sft, built.micro), update(grpo, built.micro)
        else:
            grpo_s, sft_s = update(grpo, built.micro), update(sft, built.micro)
        if step:
            rows.append({"step": step, "rollout_s": rollout_s, "update_s": grpo_s, "sft_s": sft_s,
                         "generated_tokens": built.sums["completion_tokens"],
                         "trained_tokens": built.sums["trained_tokens"], "positions": sum(m[1].size for m in built.micro),
                         "reward_mean": built.sums["reward_sum"] / max(built.sums["completions"], 1)})
            if on_actors is not None:
                differ = sum(a[2] != b[2] for a, b in zip(built.samples, remote.samples))
                rows[-1].update(actors_rollout_s=actors_s, completions_differing=differ)

    med = {k: statistics.median(r[k] for r in rows) for k in ("rollout_s", "update_s", "sft_s")}
    gen_tps = statistics.median(r["generated_tokens"] / r["rollout_s"] for r in rows)
    ratio_update_sft = statistics.median(r["update_s"] / r["sft_s"] for r in rows)
    share = statistics.median(r["rollout_s"] / (r["rollout_s"] + r["update_s"]) for r in rows)
    table = markdown_table(
        ["what (median of steps)", "value"],
        [["rollout s / step", f"{med['rollout_s']:.3f}"], ["GRPO update s / step", f"{med['update_s']:.3f}"],
         ["SFT step s on the same rows (baseline)", f"{med['sft_s']:.3f}"],
         ["GRPO update / SFT step", f"{ratio_update_sft:.2f}x"],
         ["rollout share of the step", f"{share:.0%}"], ["generated tokens/s (rollout)", f"{gen_tps:,.0f}"],
         ["completions / step", f"{args.prompts * args.group}"],
         ["generated tokens / step", f"{statistics.median(r['generated_tokens'] for r in rows):.0f}"]])
    result = {"args": vars(args), "steps": rows, "median": med, "update_over_sft": ratio_update_sft,
              "rollout_share": share, "generated_tokens_per_s": gen_tps}
    if on_actors is not None:
        actors_s = statistics.median(r["actors_rollout_s"] for r in rows)
        differing = sum(r["completions_differing"] for r in rows)
        completions = args.steps * args.prompts * args.group
        table += "\n\n" + markdown_table(
            ["colocated vs actors (median of steps)", "value"],
            [["rollout s / step, colocated (1 process)", f"{med['rollout_s']:.3f}"],
             [f"rollout s / step, {args.actors} actor(s) (policy published each step)", f"{actors_s:.3f}"],
             ["actors / colocated", f"{actors_s / med['rollout_s']:.2f}x"],
             ["completions whose tokens differ", f"{differing} of {completions}"]])
        result.update(actors_rollout_s=actors_s, actors_over_colocated=actors_s / med["rollout_s"],
                      completions_differing=differing, completions=completions)
    save_result("grpo_step" if not args.actors else "grpo_step_actors", result, table)
    shutil.rmtree(work, ignore_errors=True)  # the published policy versions and the actors' events


if __name__ == "__main__":
    main()
