"""eft against TRL, the library most users would otherwise pick: SFT against `SFTTrainer` and DPO
against `DPOTrainer`, on the same model, data, sequence length, LoRA, learning rate, batch and
number of steps, with the sides interleaved (eft, TRL, ... and the order swapped every round) so
that load drift on a shared box hits both.

    pip install -e '.[bench]'     # trl: a bench-only dependency, never imported by app/
    .venv/bin/python bench/peer_trl.py [--rounds 3] [--steps 14] [--warmup 4] [--scales one box]
                                       [--cases sft-packed sft-unpacked dpo-live dpo-precomputed]

Cases:
- `sft-packed`: eft's packed rows against TRL `packing=True` (best-fit decreasing, padding-free);
  `sft-unpacked`: `prepare.packing: false` (a document per row, each micro-batch trimmed after its
  longest row) against TRL `packing=False` (each batch padded to its longest example). Both sides
  cut a document longer than a row (eft `prepare.overlong: truncate`, TRL `max_length`).
- `dpo-live`: the reference is the model with its adapters disabled, one no-grad forward per
  micro-batch on both sides; `dpo-precomputed`: computed once before training on both sides (eft
  `eft prepare`'s reference pass, TRL `precompute_ref_log_probs`), not counted in a step.
  TRL's DPO has no packing (its `padding_free` falls back to padding in TRL 1.16): each DPO case
  runs TRL once and eft twice, on packed pairs and on a pair per row (`prepare.packing: false`).

Scales: `one` is one process a side on one thread (eft: 1 worker with `cpus_per_worker` 1; TRL:
torch on 1 thread); `box` is the whole 2-core box as each is used on it: eft with 2 workers of 1
thread each (Ray Train, FSDP2, gloo), TRL as one process on 2 threads.

Both sides: the bench model (random-init Llama, hidden 256, 4 layers, vocab 512), rank-8 LoRA on
every linear projection (alpha 16, no dropout), AdamW (betas 0.9/0.95, no weight decay) at a
constant 1e-3 with no warm-up, gradient clipping at 1.0, micro-batches of 2 rows (eft) or 2
examples (TRL), 8 rows or examples a step (global batch; DPO on packed pairs: TRL takes as many
pairs a step as eft's 8 rows hold on average), DPO beta 0.1 with the sigmoid loss, seed 0, no
activation checkpointing, fp32.

What is timed: each side's interval between consecutive optimizer-step ends, steady state (the
median after `--warmup` steps), which includes everything a step does: eft's `step_time_s` from
its metrics (data wait, forward and backward, optimizer, the loss all-reduce and metrics record,
heartbeat), TRL's time between its `on_step_end` callbacks (its data loader, forward and backward,
optimizer, logging). Neither counts start-up (Ray and workers for eft, dataset processing for
TRL) or the precomputed reference pass. tokens/s counts real (non-padding) tokens: the side's
mean real tokens per row or example of its own training set × rows or examples a step ÷ the
step time; pairs/s and documents/s the same way. The final loss and reward accuracy are the
means over each run's last 4 steps, so speed is not bought with learning.
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

from bench import _setup as S  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402

CASES = ("sft-packed", "sft-unpacked", "dpo-live", "dpo-precomputed")
SCALES = ("one", "box")
SEQ_LEN = 256
MICRO, GLOBAL = 2, 8
LR = 1e-3
BETA = 0.1
PREF_URI = "s3://eft/raw/bench-pairs.jsonl"
FINAL_STEPS = 4


def build_pairs() -> list[dict]:
    """TRL's standard preference form (three strings), about Python's help topics."""
    from app.dev.tiny import build_preference_corpus

    return build_preference_corpus(conversational=False, per_topic=4, max_chars=200)


def data_uri(case: str, packed: bool) -> str:
    return f"s3://eft/data/peer-{case.split('-')[0]}-{'packed' if packed else 'unpacked'}"


def eft_tree(case: str, packed: bool, workers: int, name: str) -> dict:
    sft = case.startswith("sft")
    prepare = ({"input_uri": S.RAW_URI, "overlong": "truncate"} if sft
               else {"input_uri": PREF_URI, "format": "preference"})
    tree = S.job_tree(
        name, data={"uri": data_uri(case, packed), "seq_len": SEQ_LEN},
        prepare={**prepare, "packing": packed},
        lora={**S.BENCH_LORA},
        training={"global_batch_size": GLOBAL, "micro_batch_size": MICRO, "lr": LR, "weight_decay": 0.0,
                  "grad_clip_norm": 1.0, "objective": "sft" if sft else "dpo"},
        scaling={"min_workers": workers, "max_workers": workers, "cpus_per_worker": 1})
    if not sft:
        tree["preference"] = {"beta": BETA, "loss": "sigmoid",
                              "reference": "live" if case == "dpo-live" else "precomputed"}
    return tree


# -- one run of a side --------------------------------------------------------------------------

def run_eft(store, case: str, packed: bool, scale: str, args, work: Path, name: str) -> dict:
    workers = 1 if scale == "one" else 2
    tree = eft_tree(case, packed, workers, name)
    tree["training"]["max_steps"] = args.steps
    path = S.write_job_yaml(tree, work / f"{name}.yaml")
    _, took = S.run_logged([str(S.VENV_BIN / "eft"), "train", str(path)], S.child_env(threads=1), work / f"{name}.log")
    cfg = S.build_job(tree)
    metrics = S.run_records(store, cfg.run_uri)["metrics"]
    manifest = json.loads(store.read_text(f"{cfg.data.uri}/manifest.json"))
    train = manifest["splits"]["train"]
    per_row = {"tokens": train["tokens"] / train["rows"]}
    if case.startswith("dpo"):
        per_row["pairs"] = train["pairs"] / train["rows"]
    else:
        per_row["documents"] = manifest["records"]["used"] / train["rows"]
    out = summarize_run([m["step_time_s"] for m in metrics], [m["loss"] for m in metrics],
                        [m.get("reward_accuracy") for m in metrics], per_row, GLOBAL, args.warmup, took)
    # Where eft's step goes (rank 0's phase timers): the profile the note's "where the time goes" reads.
    out["phases_s"] = {k: statistics.median(m[k] for m in metrics[args.warmup:])
                       for k in ("data_wait_s", "compute_s", "optimizer_s")}
    return out


def summarize_run(step_s: list[float], losses: list[float], accuracies: list, per_item: dict, items_per_step: float,
                  warmup: int, process_s: float) -> dict:
    steady = statistics.median(step_s[warmup:])
    out = {"steady_step_s": steady, "process_s": process_s, "step_times_s": step_s,
           "final_loss": statistics.fmean(losses[-FINAL_STEPS:]), "first_loss": losses[0]}
    for key, value in per_item.items():
        out[f"{key}_per_s"] = value * items_per_step / steady
    accuracies = [a for a in accuracies if a is not None]
    if accuracies:
        out["final_reward_accuracy"] = statistics.fmean(accuracies[-FINAL_STEPS:])
    return out


def run_trl_side(case: str, threads: int, steps: int, model_dir: str, data_path: str, pairs_per_step: int) -> dict:
    """In a process of its own: TRL's trainer on this case; the steps' end times, losses and
    reward accuracies from its callbacks and logs."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    records = [json.loads(line) for line in Path(data_path).read_text().splitlines() if line.strip()]
    ends: list[float] = []
    logs_at: dict[int, dict] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, _args, state, *_, **__):
            ends.append(time.perf_counter())

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "loss" in logs:
                logs_at[state.global_step] = dict(logs)

    sft = case.startswith("sft")
    per_device = MICRO if sft or case.endswith("unpacked") else max(1, round(pairs_per_step / (GLOBAL // MICRO)))
    common = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=GLOBAL // MICRO,
                  learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                  adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_steps=steps, logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
                  disable_tqdm=True, gradient_checkpointing=False, max_length=SEQ_LEN)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=S.BENCH_LORA["target_modules"])
    with tempfile.TemporaryDirectory() as out:
        if sft:
            from trl import SFTConfig, SFTTrainer

            config = SFTConfig(output_dir=out, packing=case == "sft-packed", dataset_text_field="text", **common)
            trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(records),
                                 processing_class=tok, peft_config=lora, callbacks=[StepClock()])
            data = trainer.train_dataset
            per_item = {"tokens": sum(map(len, data["input_ids"])) / len(data), "documents": len(records) / len(data)}
        else:
            from trl import DPOConfig, DPOTrainer

            config = DPOConfig(output_dir=out, beta=BETA, loss_type=["sigmoid"],
                               precompute_ref_log_probs=case == "dpo-precomputed", **common)
            trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(records),
                                 processing_class=tok, peft_config=lora, callbacks=[StepClock()])
            data = trainer.train_dataset
            columns = set(data.column_names)
            prompt = "prompt_ids" if "prompt_ids" in columns else "prompt_input_ids"
            chosen = "chosen_ids" if "chosen_ids" in columns else "chosen_input_ids"
            rejected = "rejected_ids" if "rejected_ids" in columns else "rejected_input_ids"
            tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in zip(data[prompt], data[chosen], data[rejected]))
            per_item = {"tokens": tokens / len(data), "pairs": 1.0}
        began = time.perf_counter()
        trainer.train()
    step_s = [b - a for a, b in zip([began, *ends], ends)]
    logged = [logs_at[s] for s in sorted(logs_at)]
    return {"step_s": step_s, "losses": [entry["loss"] for entry in logged],
            "accuracies": [entry.get("rewards/accuracies") for entry in logged], "per_item": per_item,
            "items_per_step": per_device * (GLOBAL // MICRO), "torch_threads": torch.get_num_threads()}


def run_trl(case: str, scale: str, args, model_dir: Path, data_path: Path, pairs_per_step: int, work: Path,
            name: str) -> dict:
    out = work / f"{name}.json"
    threads = 1 if scale == "one" else 2
    cmd = [S.PYTHON, __file__, "--side-trl", case, "--threads", str(threads), "--steps", str(args.steps),
           "--model-dir", str(model_dir), "--data", str(data_path), "--pairs-per-step", str(pairs_per_step),
           "--json", str(out)]
    _, took = S.run_logged(cmd, S.child_env(threads=threads), work / f"{name}.log")
    r = json.loads(out.read_text())
    return {**summarize_run(r["step_s"], r["losses"], r["accuracies"], r["per_item"], r["items_per_step"],
                            args.warmup, took), "torch_threads": r["torch_threads"], "items_per_step": r["items_per_step"]}


# -- the bench ----------------------------------------------------------------------------------

def prepare_datasets(store, cases: list[str], work: Path) -> dict:
    """`eft prepare` (the CLI) of each dataset the cases train on: {data uri: manifest}."""
    manifests = {}
    for case in cases:
        for packed in (True, False):
            uri = data_uri(case, packed)
            if uri in manifests or (case == "sft-packed" and not packed) or (case == "sft-unpacked" and packed):
                continue
            # The precomputed pass is the DPO datasets' (a live run reads the same shards without it).
            tree = eft_tree("dpo-precomputed" if case.startswith("dpo") else case, packed, 1, "prepare")
            path = S.write_job_yaml(tree, work / f"prepare-{uri.rsplit('/', 1)[-1]}.yaml")
            S.run_logged([str(S.VENV_BIN / "eft"), "prepare", str(path)], S.child_env(), work / f"{path.stem}.log")
            manifests[uri] = json.loads(store.read_text(f"{uri}/manifest.json"))
    return manifests


def variants(case: str) -> list[tuple[str, bool]]:
    """(side, packed) of one case's round: eft's packed and unpacked rows against one TRL for DPO."""
    if case == "sft-packed":
        return [("eft", True), ("trl", True)]
    if case == "sft-unpacked":
        return [("eft", False), ("trl", False)]
    return [("eft", True), ("trl", True), ("eft", False)]


def label(side: str, case: str, packed: bool) -> str:
    if side == "trl":
        return "trl"
    return "eft" if case.startswith("sft") else f"eft {'packed' if packed else 'pair per row'}"


def spread(values: list[float]) -> str:
    return f"{min(values):,.0f}–{max(values):,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--scales", nargs="+", choices=SCALES, default=list(SCALES))
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--side-trl", choices=CASES)
    p.add_argument("--threads", type=int)
    p.add_argument("--model-dir")
    p.add_argument("--data")
    p.add_argument("--pairs-per-step", type=int, default=GLOBAL)
    p.add_argument("--json")
    args = p.parse_args()
    if args.side_trl:
        result = run_trl_side(args.side_trl, args.threads, args.steps, args.model_dir, args.data, args.pairs_per_step)
        Path(args.json).write_text(json.dumps(result))
        return

    from app.dev.tiny import write_jsonl
    from app.storage import Store

    load_before = S.load_average()
    wall0 = time.time()
    runs: dict[str, list[dict]] = {}
    with S.local_s3(), tempfile.TemporaryDirectory(prefix="eft-bench-peer-trl-") as tmp:
        work = Path(tmp)
        store = Store()
        texts = S.bench_texts()
        S.seed_model_and_corpus(store, texts)
        pairs = build_pairs()
        store.write_bytes(PREF_URI, write_jsonl(pairs, work / "pairs.jsonl").read_bytes())
        write_jsonl(({"text": t} for t in texts), work / "text.jsonl")
        model_dir = work / "model"
        store.download_dir(S.MODEL_URI, model_dir)
        manifests = prepare_datasets(store, args.cases, work)
        packed_pairs = manifests.get(data_uri("dpo", True))
        pairs_per_step = (round(GLOBAL * packed_pairs["splits"]["train"]["pairs"] / packed_pairs["splits"]["train"]["rows"])
                          if packed_pairs else GLOBAL)
        tag = time.strftime("%H%M%S")
        for scale in args.scales:
            for r in range(args.rounds):
                for case in args.cases:
                    order = variants(case)
                    for side, packed in (order if r % 2 == 0 else order[::-1]):
                        name = f"peer-{case}-{scale}-{side}-{'p' if packed else 'u'}-{tag}-{r}"
                        key = f"{case}|{scale}|{label(side, case, packed)}"
                        print(f"{scale} round {r + 1}/{args.rounds}: {case} {label(side, case, packed)} ...", flush=True)
                        if side == "eft":
                            res = run_eft(store, case, packed, scale, args, work, name)
                        else:
                            data = work / ("text.jsonl" if case.startswith("sft") else "pairs.jsonl")
                            res = run_trl(case, scale, args, model_dir, data, pairs_per_step, work, name)
                        print(f"  {res['tokens_per_s']:,.0f} tokens/s, step {res['steady_step_s']:.3f} s, loss "
                              f"{res['first_loss']:.3f} → {res['final_loss']:.3f}", flush=True)
                        runs.setdefault(key, []).append(res)
    load_after = S.load_average()
    summary, rows = summarize(runs, args)
    table = render(summary, rows, args, pairs_per_step, manifests, load_before, load_after)
    save_result("peer_trl", {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                             "seq_len": SEQ_LEN, "micro_batch": MICRO, "global_batch": GLOBAL,
                             "trl_pairs_per_step_on_packed": pairs_per_step, "summary": summary,
                             "load_average": {"before": load_before, "after": load_after},
                             "bench_wall_s": time.time() - wall0, "runs": runs}, table)


def summarize(runs: dict, args) -> tuple[dict, list]:
    """Per case and scale: each variant's median and spread, and eft/TRL per round (the ratio of
    the round's runs, which were side by side) with its median."""
    summary, rows = {}, []
    for key, results in runs.items():
        case, scale, who = key.split("|")
        unit = "pairs_per_s" if case.startswith("dpo") else "documents_per_s"
        entry = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                 unit: statistics.median(r[unit] for r in results),
                 "tokens_per_s_all": [r["tokens_per_s"] for r in results],
                 "final_loss": statistics.median(r["final_loss"] for r in results)}
        if "final_reward_accuracy" in results[0]:
            entry["final_reward_accuracy"] = statistics.median(r["final_reward_accuracy"] for r in results)
        trl = runs.get(f"{case}|{scale}|trl")
        if who != "trl" and trl:
            per_round = [e["tokens_per_s"] / t["tokens_per_s"] for e, t in zip(results, trl)]
            entry["x_trl_per_round"] = per_round
            entry["x_trl"] = statistics.median(per_round)
        summary[key] = entry
        rows.append([case, scale, who, S.fmt(entry["tokens_per_s"]), spread(entry["tokens_per_s_all"]),
                     S.fmt(entry[unit], 1), f"{entry['x_trl']:.2f}" if "x_trl" in entry else "1",
                     ", ".join(f"{x:.2f}" for x in entry.get("x_trl_per_round", [])) or "—",
                     f"{entry['final_loss']:.3f}",
                     f"{entry['final_reward_accuracy']:.2f}" if "final_reward_accuracy" in entry else "—"])
    return summary, rows


def render(summary: dict, rows: list, args, pairs_per_step: int, manifests: dict, load_before, load_after) -> str:
    ratios = {k: v["x_trl"] for k, v in summary.items() if "x_trl" in v}
    headline = "; ".join(f"{k.replace('|', ' ')}: **{v:.2f}×**" for k, v in ratios.items())
    datasets = ", ".join(f"{uri.rsplit('/', 1)[-1]} {m['splits']['train']['rows']} rows"
                         + (f" / {m['splits']['train']['pairs']} pairs" if "pairs" in m["splits"]["train"] else "")
                         for uri, m in manifests.items())
    return "\n\n".join([
        f"eft against TRL (SFTTrainer, DPOTrainer) at equal settings: the bench model (random-init Llama, hidden "
        f"256, 4 layers), rank-8 LoRA on every linear projection, seq_len {SEQ_LEN}, micro-batch {MICRO}, "
        f"{GLOBAL} rows or examples a step (TRL DPO: {pairs_per_step} pairs a step, what eft's {GLOBAL} packed "
        f"rows hold on average), {args.steps} steps of which the first {args.warmup} are warm-up, {args.rounds} "
        f"rounds with the sides interleaved. eft's datasets: {datasets}.",
        markdown_table(["case", "scale", "side", "tokens/s (median)", "spread (min–max)", "docs or pairs/s",
                        "× TRL (median of rounds)", "× TRL per round", "final loss", "final reward acc."], rows),
        "tokens/s: real (non-padding) tokens through a step ÷ the steady step time (median interval between "
        "optimizer-step ends after warm-up; it includes data loading, logging and, for eft, its metrics record and "
        "heartbeat). `one`: 1 process on 1 thread a side (eft: one worker); `box`: eft with 2 workers × 1 thread, "
        "TRL one process on 2 threads. Final loss and reward accuracy: mean of the last "
        f"{FINAL_STEPS} steps. DPO's loss is per pair on both sides; SFT's per token.",
        f"Headline, eft ÷ TRL tokens/s: {headline}.",
        S.load_note(load_before, load_after),
    ])


if __name__ == "__main__":
    main()
