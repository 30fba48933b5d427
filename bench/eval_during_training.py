"""Evaluation on checkpoints does not hold up the steps: step times of the same run with evaluation
off, with the real evaluation of every checkpoint, and with a planted slow one, in one invocation.

    .venv/bin/python bench/eval_during_training.py [--steps 40] [--save-every 10] [--delay-s 30]

The bench model (hidden 256, 4 layers, LoRA, 2 x 1-CPU workers, see bench/_setup.py) for `--steps`
steps, a checkpoint every `--save-every`:
- off: no eval section;
- eval: `eval.every_checkpoints: 1`, 32 generation prompts of the pydoc corpus, 16 new tokens each,
  scored in Ray Train's validation task (1 CPU) while the workers step;
- slow eval: the same, through `app.dev.faults.slow_validation`, which first waits `--delay-s`
  (no CPU used) at every checkpoint, so each evaluation outlasts the steps up to the next one.
Per run: the median and the maximum step time (`step_time_s` of the metrics, one record per step),
the steps' total, the run's wall time (which includes the wait at the end for the last
evaluation: Ray Train finishes pending validations before `fit()` returns), and the checkpoint
steps that got a score. On 2 cores the real evaluation takes CPU from the workers; the planted
wait does not, so its step times are the ones that show whether anything blocks.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _setup as S  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402

SET_URI = "s3://eft/eval-sets/during-bench.jsonl"


def run(store, name: str, tree_extra: dict, validation_fn=None) -> dict:
    from app.eval.results import load_results
    from app.train.launch import run_training

    cfg = S.build_job(S.job_tree(name, **tree_extra))
    began = time.perf_counter()
    run_training(cfg, store, validation_fn=validation_fn)
    wall = time.perf_counter() - began
    metrics = [m for m in S.run_records(store, cfg.run_uri)["metrics"] if m.get("step_time_s") is not None]
    steps = [m["step_time_s"] for m in metrics]
    return {"name": name, "wall_s": wall, "median_step_s": S.median(steps), "max_step_s": max(steps),
            "steps_total_s": sum(steps), "scored_steps": [r["step"] for r in load_results(store, cfg.run_uri)]}


def main() -> int:
    from app.dev.faults import slow_validation

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--delay-s", type=float, default=30.0)
    args = parser.parse_args()
    training = {"max_steps": args.steps}
    checkpoint = {"save_every_steps": args.save_every}
    evaluation = {"uri": SET_URI, "every_checkpoints": 1, "max_new_tokens": 16, "batch_size": 8}
    with S.bench_session(S.job_tree("prep")) as (store, _):
        records = [{"prompt": t[:64], "answer": t[64:72]} for t in S.bench_texts()[:32]]
        store.write_text(SET_URI, "".join(json.dumps(r) + "\n" for r in records))
        before = S.load_average()
        results = [
            run(store, "during-off", {"training": training, "checkpoint": checkpoint}),
            run(store, "during-eval", {"training": training, "checkpoint": checkpoint, "eval": evaluation}),
            run(store, "during-slow", {"training": training, "checkpoint": checkpoint, "eval": evaluation},
                validation_fn=functools.partial(slow_validation, delay_s=args.delay_s)),
        ]
        after = S.load_average()
    off = results[0]
    labels = {"during-off": "evaluation off", "during-eval": "every checkpoint evaluated",
              "during-slow": f"every checkpoint, planted {args.delay_s:.0f} s wait first"}
    rows = [[labels[r["name"]], f"{r['median_step_s']:.3f}", f"{r['median_step_s'] / off['median_step_s']:.2f}x",
             f"{r['max_step_s']:.2f}", f"{r['steps_total_s']:.1f}", f"{r['wall_s']:.1f}",
             ", ".join(map(str, r["scored_steps"])) or "-"] for r in results]
    table = (f"{args.steps} steps, a checkpoint every {args.save_every}; step times from the run's metrics.\n\n"
             + markdown_table(["run", "median step s", "vs off", "max step s", "steps total s", "run wall s",
                               "steps scored"], rows)
             + f"\n\n{S.load_note(before, after)}")
    save_result("eval_during_training", {"steps": args.steps, "save_every": args.save_every,
                                         "delay_s": args.delay_s, "runs": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
