"""Eval throughput: `eft eval`'s Ray Data actor pool vs a plain single-process transformers loop over
the same prompts, at the same batch size, in one invocation. Goal: ≥ 1.0x on 2 cores with 2 actors.

    .venv/bin/python bench/eval_throughput.py [--prompts 1024] [--batch-size 8] [--max-new-tokens 32] [--actors 2]

The model is the benchmarks' (hidden 256, 4 layers, random init, see bench/_setup.py), the prompts
`--prompts` paragraphs of the pydoc corpus (754 of them, then round again at other cuts) cut to
24-160 characters, each with a made-up answer (the score is not the point). 1024 prompts is the
size of a typical task set (GSM8K's test split has 1,319); on a set of 192 the actors' start-up,
about 12 s on 2 cores, is most of the eval. Generation is greedy with a fixed number of new tokens (the
model's EOS is masked out, so every prompt costs the same in both paths).

- baseline: one process, torch on every core, the prompts in file order, batches of
  `--batch-size` left-padded, `model.generate` (what a user would write by hand);
- eft: `run_eval(..., checkpoint="base")` through the actor pool (`--actors` actors, one CPU each),
  timed end to end: the set read and rendered, the actors started, the model loaded in each, the
  results written.
Each is run `--rounds` times, alternating; prompts/s is the median. Beside the end-to-end ratio,
the steady rates: the baseline's loop without its model load, and eft from the first batch that
came back to the last (the pool's start-up left out). The baseline's process has torch and
transformers imported already; each actor imports them afresh, inside eft's time.
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
    for i in range(n):
        text = texts[i % len(texts)]
        cut = 24 + (i * 37) % 137  # lengths spread like a real set's
        records.append({"prompt": text[:cut], "answer": text[cut:cut + 8]})
    return records


def run_baseline(store, records: list[dict], batch_size: int, max_new_tokens: int) -> tuple[float, float]:
    """Seconds for a plain loop (load, then batches in file order, left-padded, greedy), and of
    its loop alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    began = time.perf_counter()
    local = store.cache_locally(S.MODEL_URI)
    tokenizer = AutoTokenizer.from_pretrained(local, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    loop_began = time.perf_counter()
    for i in range(0, len(records), batch_size):
        prompts = [tokenizer.bos_token + r["prompt"] for r in records[i:i + batch_size]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    ended = time.perf_counter()
    return ended - began, ended - loop_began


def run_eft(cfg, store) -> tuple[float, float, dict]:
    """Seconds end to end, seconds from the pool's first batch back to its last, and the results."""
    import app.cluster
    from app.eval.run import run_eval

    pool = app.cluster.map_on_actor_pool
    arrivals = []

    def timed_pool(*args, **kwargs):
        for batch in pool(*args, **kwargs):
            arrivals.append(time.perf_counter())
            yield batch

    app.cluster.map_on_actor_pool = timed_pool
    try:
        began = time.perf_counter()
        results = run_eval(cfg, store, checkpoint="base")
        ended = time.perf_counter()
    finally:
        app.cluster.map_on_actor_pool = pool
    # The steady span counts the batches after the first; scale to the whole set.
    steady = (arrivals[-1] - arrivals[0]) * len(arrivals) / max(len(arrivals) - 1, 1)
    return ended - began, steady, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
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
            base, base_loop, eft, eft_steady, last = [], [], [], [], None
            before = S.load_average()
            for _ in range(args.rounds):
                seconds, loop = run_baseline(store, records, args.batch_size, args.max_new_tokens)
                base.append(seconds)
                base_loop.append(loop)
                seconds, steady, last = run_eft(cfg, store)
                eft.append(seconds)
                eft_steady.append(steady)
            after = S.load_average()
        finally:
            S.stop_ray()
    n = len(records)
    med = statistics.median
    base_rate, eft_rate = n / med(base), n / med(eft)
    loop_rate, steady_rate = n / med(base_loop), n / med(eft_steady)
    rows = [["plain transformers loop (1 process, 2 threads)", f"{med(base):.1f}", f"{base_rate:.2f}", "1.00x",
             f"{loop_rate:.2f}", "1.00x"],
            [f"eft eval (Ray Data, {args.actors} actors x 1 CPU)", f"{med(eft):.1f}", f"{eft_rate:.2f}",
             f"{eft_rate / base_rate:.2f}x", f"{steady_rate:.2f}", f"{steady_rate / loop_rate:.2f}x"]]
    # eft's start-up (its end-to-end time less its steady span) against the steady rates: the set size
    # from which eft's end to end is faster than the plain loop's.
    startup_s = med(eft) - med(eft_steady)
    per_prompt_gain_s = 1 / loop_rate - 1 / steady_rate
    break_even = startup_s / per_prompt_gain_s if per_prompt_gain_s > 0 else None
    rounds = ", ".join(f"{b:.1f}/{e:.1f}" for b, e in zip(base, eft))
    table = (f"{n} prompts, batch size {args.batch_size}, {args.max_new_tokens} new tokens each, greedy, median of "
             f"{args.rounds} rounds (alternating); end to end: eft from the set read to the results written "
             f"(actors started, model loaded per actor), the baseline from its model load; steady: the "
             f"baseline's loop alone, eft's batches after the pool's first one came back.\n\n"
             + markdown_table(["path", "end-to-end s", "prompts/s", "vs baseline", "steady prompts/s",
                               "vs baseline"], rows)
             + f"\n\nPer round, baseline/eft end-to-end s: {rounds}. eft's start-up (end to end less the steady "
               f"span): {startup_s:.1f} s; at the steady rates, eft is faster end to end from "
               + (f"about {break_even:.0f} prompts." if break_even else "no set size.")
             + f"\n\n{S.load_note(before, after)}")
    save_result("eval_throughput", {"prompts": n, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                                    "actors": args.actors, "baseline_s": base, "baseline_loop_s": base_loop,
                                    "eft_s": eft, "eft_steady_s": eft_steady, "ratio": eft_rate / base_rate,
                                    "steady_ratio": steady_rate / loop_rate, "startup_s": startup_s,
                                    "break_even_prompts": break_even, "score": last["results"]["default"]["score"]}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
