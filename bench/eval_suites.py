"""Named eval sets on one actor pool vs one `eft eval` per set, in one invocation.

    .venv/bin/python bench/eval_suites.py [--prompts 256] [--actors 2] [--rounds 2]

Two sets of `--prompts` records each, a generation set (greedy, `--max-new-tokens` each, no early
stop) and a multiple-choice set (three choices, scored by log-likelihood), on the benchmarks' model
(bench/_setup.py):
- baseline: one evaluation per set (`--sets gen`, then `--sets mc`), as a user tracking two tasks
  without named sets would run them: a pool started, and the model loaded in each actor, twice;
- eft: both sets in one `run_eval` (`eval.sets`), one pool that loads the model once.
Wall seconds end to end (sets read, pool started, results and summary written), median of
`--rounds` rounds, alternating. The predictions are checked to be the same both ways.
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

GEN_URI = "s3://eft/eval-sets/bench-gen.jsonl"
MC_URI = "s3://eft/eval-sets/bench-mc.jsonl"


def build_sets(n: int) -> tuple[list[dict], list[dict]]:
    texts = S.bench_texts()
    gen, mc = [], []
    for i in range(n):
        text = texts[i % len(texts)]
        cut = 24 + (i * 37) % 137
        gen.append({"prompt": text[:cut], "answer": text[cut:cut + 8]})
        other = texts[(i + 1) % len(texts)]
        mc.append({"prompt": text[:cut], "choices": [text[cut:cut + 16], other[cut:cut + 16], other[:16]],
                   "answer": 0})
    return gen, mc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with S.local_s3():
        from app.eval.results import load_predictions
        from app.eval.run import run_eval
        from app.storage import Store

        store = Store()
        S.seed_model_and_corpus(store, S.bench_texts())
        gen, mc = build_sets(args.prompts)
        for uri, records in ((GEN_URI, gen), (MC_URI, mc)):
            store.write_text(uri, "".join(json.dumps(r) + "\n" for r in records))
        tree = S.job_tree("eval-suites-bench", eval={
            "batch_size": 8, "max_new_tokens": args.max_new_tokens, "num_actors": args.actors,
            "sets": {"gen": {"uri": GEN_URI}, "mc": {"uri": MC_URI}}})
        tree["prepare"]["format"] = "text"
        cfg = S.build_job(tree)
        S.start_ray()
        try:
            import app.eval.render as render

            render.PromptRenderer.find_stop_ids = lambda self: [-1]  # bench only: no early stop
            apart, together, same = [], [], True
            before = S.load_average()
            for _ in range(args.rounds):
                began = time.perf_counter()
                for name in ("gen", "mc"):
                    run_eval(cfg, store, checkpoint="base", sets=[name])
                apart.append(time.perf_counter() - began)
                alone = {n: load_predictions(store, cfg.run_uri, "base", n) for n in ("gen", "mc")}
                began = time.perf_counter()
                run_eval(cfg, store, checkpoint="base")
                together.append(time.perf_counter() - began)
                same = same and all(load_predictions(store, cfg.run_uri, "base", n) == alone[n] for n in alone)
            after = S.load_average()
        finally:
            S.stop_ray()
    med = statistics.median
    rows = [["one eft eval per set (2 pools, the model loaded twice per actor)", f"{med(apart):.1f}", "1.00x"],
            [f"eval.sets: both sets on one pool ({args.actors} actors)", f"{med(together):.1f}",
             f"{med(apart) / med(together):.2f}x"]]
    rounds = ", ".join(f"{a:.1f}/{t:.1f}" for a, t in zip(apart, together))
    table = (f"Two sets of {args.prompts} records (generation, {args.max_new_tokens} new tokens each; multiple "
             f"choice, 3 choices), {args.actors} actors x 1 CPU, median of {args.rounds} rounds (alternating), "
             f"wall seconds end to end.\n\n"
             + markdown_table(["path", "end-to-end s", "speed-up"], rows)
             + f"\n\nPer round, apart/together s: {rounds}. Predictions the same both ways: {same}."
             + f"\n\n{S.load_note(before, after)}")
    save_result("eval_suites", {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "actors": args.actors,
                                "apart_s": apart, "together_s": together, "speedup": med(apart) / med(together),
                                "same_predictions": same}, table)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
