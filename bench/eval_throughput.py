"""Eval throughput: `eft eval`'s Ray Data actor pool vs a plain single-process transformers loop over
the same prompts, at the same batch size, in one invocation. Goal: ≥ 1.0x on 2 cores with 2 actors.

    .venv/bin/python bench/eval_throughput.py [--prompts 192] [--batch-size 8] [--max-new-tokens 32] [--actors 2]

The model is the benchmarks' (hidden 256, 4 layers, random init, see bench/_setup.py), the prompts
the first `--prompts` paragraphs of the pydoc corpus cut to 24-160 characters, each with a made-up
answer (the score is not the point). Generation is greedy with a fixed number of new tokens (the
model's EOS is masked out, so every prompt costs the same in both paths).

- baseline: one process, torch on every core, the prompts in file order, batches of
  `--batch-size` left-padded, `model.generate` (what a user would write by hand);
- eft: `run_eval(..., checkpoint="base")` through the actor pool (`--actors` actors, one CPU each),
  timed end to end: the set read and rendered, the actors started, the model loaded in each, the
  results written.
Each is run `--rounds` times, alternating; prompts/s is the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _setup as S  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402

SET_URI = "s3://eft/eval-sets/bench.jsonl"


def build_prompts(n: int) -> list[dict]:
    texts = S.bench_texts()
    records = []
    for i, text in enumerate(texts[:n]):
        cut = 24 + (i * 37) % 137  # lengths spread like a real set's
        records.append({"prompt": text[:cut], "answer": text[cut:cut + 8]})
    return records


def run_baseline(store, records: list[dict], batch_size: int, max_new_tokens: int) -> float:
    """Seconds for a plain loop: load, then batches in file order, left-padded, greedy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    began = time.perf_counter()
    local = store.cache_locally(S.MODEL_URI)
    tokenizer = AutoTokenizer.from_pretrained(local, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    for i in range(0, len(records), batch_size):
        prompts = [tokenizer.bos_token + r["prompt"] for r in records[i:i + batch_size]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    return time.perf_counter() - began


def run_eft(cfg, store) -> tuple[float, dict]:
    from app.eval.run import run_eval

    began = time.perf_counter()
    results = run_eval(cfg, store, checkpoint="base")
    return time.perf_counter() - began, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with S.local_s3():
        from app.storage import Store

        store = Store()
        S.seed_model_and_corpus(store, S.bench_texts())
        records = build_prompts(args.prompts)
        store.write_text(SET_URI, "".join(json.dumps(r) + "\n" for r in records))
        # No EOS stop in either path: every prompt generates exactly max_new_tokens.
        tree = S.job_tree("eval-bench", eval={"uri": SET_URI, "batch_size": args.batch_size,
                                              "max_new_tokens": args.max_new_tokens, "num_actors": args.actors})
        tree["prepare"]["format"] = "text"
        cfg = S.build_job(tree)
        S.start_ray()
        try:
            import app.eval.render as render

            render.PromptRenderer.find_stop_ids = lambda self: [-1]  # bench only: a stop id no token has
            base, eft, last = [], [], None
            before = S.load_average()
            for _ in range(args.rounds):
                base.append(run_baseline(store, records, args.batch_size, args.max_new_tokens))
                seconds, last = run_eft(cfg, store)
                eft.append(seconds)
            after = S.load_average()
        finally:
            S.stop_ray()
    n = len(records)
    base_rate, eft_rate = n / statistics.median(base), n / statistics.median(eft)
    rows = [["plain transformers loop (1 process, 2 threads)", f"{statistics.median(base):.1f}",
             f"{base_rate:.2f}", "1.00x"],
            [f"eft eval (Ray Data, {args.actors} actors x 1 CPU)", f"{statistics.median(eft):.1f}",
             f"{eft_rate:.2f}", f"{eft_rate / base_rate:.2f}x"]]
    table = (f"{n} prompts, batch size {args.batch_size}, {args.max_new_tokens} new tokens each, greedy, median of "
             f"{args.rounds} rounds (alternating); eft timed end to end (set read and rendered, actors started, "
             f"model loaded per actor, results written).\n\n"
             + markdown_table(["path", "wall s", "prompts/s", "vs baseline"], rows)
             + f"\n\n{S.load_note(before, after)}")
    save_result("eval_throughput", {"prompts": n, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                                    "actors": args.actors, "baseline_s": base, "eft_s": eft,
                                    "ratio": eft_rate / base_rate, "score": last["score"]}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
