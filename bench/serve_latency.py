"""Serving latency: `eft serve` (Ray Serve, the transformers engine, asked through the `openai`
client over loopback HTTP) vs calling `generate` directly in one process, on the same chat prompts,
in one invocation. Goals on 2 cores with the tiny model: ≥ 0.8x the direct rate at concurrency 1
(1 replica), and above the direct rate at concurrency 4 with 2 replicas.

    .venv/bin/python bench/serve_latency.py [--prompts 48] [--max-tokens 32] [--rounds 2] [--model tiny|bench]

The model is the tests' tiny chat Llama (hidden 64, 2 layers, ChatML template, random init, about
0.15M parameters; `--model bench`: the benchmarks' hidden 256, 4 layers, results in
`serve_latency_bench.md`) as a real merged export (app/export.py's writers). Every request is greedy with
the same `max_tokens`, so both paths generate the same tokens for the same prompt (checked: the
answers must be identical), and the work per request is the same.

- direct: one process, one model, `apply_chat_template` + `generate` + decode per prompt; at
  concurrency 4, four threads calling `generate` on that model at once (what a server without
  processes of its own would do); torch on `--direct-threads` threads, 1 by default: at this size
  one thread is twice as fast as two (40 against 19 requests/s here), so the baseline is its best;
- eft serve: `start_serve` on a local Ray, 1 replica (1 CPU) for concurrency 1, scaled to 2 replicas
  for concurrency 4; the requests sent by `--concurrency` client threads with the real `openai`
  client (which runs on the same 2 cores: its cost is in eft's numbers).
Each path runs `--rounds` times per concurrency, alternating, after a warm-up of a few requests;
requests/s is the median round's, latency percentiles are over every request of every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _setup as S  # noqa: E402
from bench.common import markdown_table, save_result  # noqa: E402

BASE_URI = "s3://eft/models/serve-bench-chat"
RUNS_URI = "s3://eft/serve-bench-runs"
WARMUP = 4


def build_export(store, size: str = "tiny") -> dict:
    """A tiny ChatML base, exported merged through app/export.py's own writers (the LoRA adapters
    as built: B at zero, so the merged model is the base; the format is the point)."""
    from app.config import build_config
    from app.dev.tiny import add_chat_template, build_corpus, build_tiny_model, build_tiny_tokenizer
    from app.export import build_export_model, cache_model_dir, export_tokenizer, publish_export, write_export_trees
    from app.storage import join

    tokenizer = add_chat_template(build_tiny_tokenizer(build_corpus(max_docs=200), vocab_size=384))
    model = build_tiny_model(tokenizer, **({"initializer_range": 0.5} if size == "tiny" else S.BENCH_MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        store.upload_dir(tmp, BASE_URI, last=("config.json",))
    cfg = build_config({"name": "serve-bench", "model": {"uri": BASE_URI}, "data": {"uri": "s3://eft/data/unused"},
                        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                        "training": {"max_steps": 1}, "storage": {"root_uri": RUNS_URI}})
    out_uri = join(cfg.run_uri, "export", "checkpoint-00000000")
    base_dir = cache_model_dir(store, BASE_URI)
    summary = {"run_uri": cfg.run_uri, "checkpoint_uri": None, "step": 0, "base_model_uri": BASE_URI,
               "kinds": ["merged"], "export_uri": out_uri}
    with tempfile.TemporaryDirectory() as tmp:
        summary.update(write_export_trees(cfg, build_export_model(cfg, base_dir), export_tokenizer(cfg, store),
                                          base_dir, ["merged"], Path(tmp), out_uri))
        publish_export(store, Path(tmp), out_uri, summary)
    return summary


def build_prompts(n: int) -> list[list[dict]]:
    from app.dev.tiny import topic_sections

    titles = [title for title, _ in topic_sections()]
    return [[{"role": "user", "content": f"What is {titles[i % len(titles)]}?"}] for i in range(n)]


class Direct:
    """The baseline: the merged export in this process, `generate` called directly."""

    def __init__(self, store, merged_uri: str, max_tokens: int, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)

        local = store.cache_locally(merged_uri)
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        self.model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
        self.stop = [self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.max_tokens = max_tokens

    def ask(self, messages: list[dict]) -> str:
        import torch

        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)
        with torch.no_grad():
            out = self.model.generate(**ids, max_new_tokens=self.max_tokens, do_sample=False, eos_token_id=self.stop,
                                      pad_token_id=self.tokenizer.pad_token_id)
        tokens = out[0, ids["input_ids"].shape[1]:].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in self.stop), len(tokens))
        return self.tokenizer.decode(tokens[:cut], skip_special_tokens=True)


class Served:
    """The same questions through `eft serve`'s OpenAI API, one client per thread."""

    def __init__(self, handle, max_tokens: int):
        self.handle, self.max_tokens = handle, max_tokens
        self.local = threading.local()

    def ask(self, messages: list[dict]) -> str:
        import openai

        if not hasattr(self.local, "client"):
            self.local.client = openai.OpenAI(base_url=self.handle.url, api_key="loopback", max_retries=0, timeout=120)
        reply = self.local.client.chat.completions.create(model=self.handle.model, messages=messages, temperature=0,
                                                          max_tokens=self.max_tokens)
        return reply.choices[0].message.content


def run_round(path, prompts: list, concurrency: int) -> tuple[float, list[float], list[str]]:
    """(seconds for all prompts, each request's latency, the answers in prompt order)."""
    def timed(messages):
        began = time.perf_counter()
        text = path.ask(messages)
        return time.perf_counter() - began, text

    for messages in prompts[:WARMUP]:
        path.ask(messages)
    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(timed, prompts))
    return time.perf_counter() - began, [r[0] for r in results], [r[1] for r in results]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--direct-threads", type=int, default=1)
    parser.add_argument("--model", choices=["tiny", "bench"], default="tiny")
    args = parser.parse_args()

    cases = [(1, 1), (4, 2)]  # (concurrency, replicas)
    measured: dict = {}
    with S.local_s3():
        from app.storage import Store

        store = Store()
        summary = build_export(store, args.model)
        prompts = build_prompts(args.prompts)
        direct = Direct(store, summary["merged_uri"], args.max_tokens, args.direct_threads)
        S.start_ray()
        before = S.load_average()
        try:
            from app.cluster import find_free_port
            from app.serve.launch import DEFAULT_HOST, start_serve

            handle, port = None, find_free_port(DEFAULT_HOST)  # Serve's proxy binds one port for good
            for concurrency, replicas in cases:
                # The same app re-run with more replicas: Serve scales the deployment in place.
                handle = start_serve(summary["export_uri"], port=port, replicas=replicas, max_tokens=args.max_tokens)
                served = Served(handle, args.max_tokens)
                runs = {"direct": [], "serve": []}
                for _ in range(args.rounds):
                    for name, path in (("direct", direct), ("serve", served)):
                        runs[name].append(run_round(path, prompts, concurrency))
                measured[concurrency] = {"replicas": replicas, **runs}
            handle.stop()
        finally:
            after = S.load_average()
            S.stop_ray()

    rows, data = [], {"prompts": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "direct_threads": args.direct_threads, "model": args.model, "cases": []}
    goals = {1: lambda r: r >= 0.8, 4: lambda r: r > 1.0}
    serial = None  # the direct rate one request at a time: no caller of one process does better
    for concurrency, runs in measured.items():
        same = all(d[2] == s[2] for d, s in zip(runs["direct"], runs["serve"]))
        rates = {name: args.prompts / statistics.median(r[0] for r in runs[name]) for name in ("direct", "serve")}
        lat = {name: [x for r in runs[name] for x in r[1]] for name in ("direct", "serve")}
        ratio = rates["serve"] / rates["direct"]
        serial = serial or rates["direct"]
        threads = f", torch on {args.direct_threads} thread(s)"
        for name, label in (("direct", "generate directly, 1 process" + threads
                             + (", 4 caller threads" if concurrency > 1 else "")),
                            ("serve", f"eft serve, {runs['replicas']} replica(s) x 1 CPU")):
            rows.append([concurrency, label, f"{rates[name]:.1f}", f"{rates[name] / rates['direct']:.2f}x",
                         f"{rates[name] / serial:.2f}x", f"{1000 * statistics.median(lat[name]):.0f}",
                         f"{1000 * percentile(lat[name], 95):.0f}"])
        data["cases"].append({"concurrency": concurrency, "replicas": runs["replicas"], "rates": rates, "ratio": ratio,
                              "ratio_to_direct_one_at_a_time": rates["serve"] / serial,
                              "goal_met": goals[concurrency](ratio), "answers_identical": same,
                              "round_seconds": {n: [r[0] for r in runs[n]] for n in runs if n != "replicas"},
                              "p50_ms": {n: 1000 * statistics.median(v) for n, v in lat.items()},
                              "p95_ms": {n: 1000 * percentile(v, 95) for n, v in lat.items()}})
    verdict = "; ".join(f"concurrency {c['concurrency']}: {c['ratio']:.2f}x the direct rate "
                        f"({'goal met' if c['goal_met'] else 'goal not met'}; "
                        f"{c['ratio_to_direct_one_at_a_time']:.2f}x direct one request at a time; answers "
                        f"{'identical' if c['answers_identical'] else 'DIFFER'})" for c in data["cases"])
    size = "tiny chat Llama (hidden 64, 2 layers)" if args.model == "tiny" else "bench Llama (hidden 256, 4 layers)"
    table = (f"The {size}; {args.prompts} chat prompts, greedy, max_tokens {args.max_tokens}, {args.rounds} rounds per path "
             f"alternating after {WARMUP} warm-up requests; requests/s of the median round, latency over every "
             f"request, as the client sees it.\n\n"
             + markdown_table(["concurrency", "path", "requests/s", "vs direct", "vs direct, one at a time",
                               "p50 ms", "p95 ms"], rows)
             + f"\n\n{verdict}.\n\n{S.load_note(before, after)}")
    save_result("serve_latency" + ("" if args.model == "tiny" else "_bench"), data, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
