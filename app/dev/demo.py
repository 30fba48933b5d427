"""`eft demo` / `make demo`: the whole pipeline on the embedded local stack.

Default job (jobs/configs/tiny-chat.yaml): a tiny Llama pre-trained on Python's own documentation
(once per bucket, cached on disk) → conversations about Python answered from the same docs →
chat prepare (one record previewed as training sees it) → LoRA + FSDP2 fine-tune on 2 CPU workers
with periodic checkpoints, each scored on the task while training goes on → export (adapter +
merged, chat template included) → the same question asked of the base (through its chat template)
and of the export served by `eft serve` (Ray Serve on loopback, asked through the `openai` client)
→ summary. The headline is a task score: the conversations include
a task the base cannot do (the parity of a number, app/dev/tasks.py), and `eft eval` scores the base
and the export on 100 numbers the fine-tune never saw.

`--config jobs/configs/tiny-cpu.yaml`: the text job on a random-init base, ending in a text sample.
`--config jobs/configs/tiny-grpo.yaml`: GRPO on the parity task from a short SFT of the chat job
(app/dev/grpo_demo.py), ending in the held-out score before and after.
`--config jobs/configs/tiny-dpo.yaml`: DPO on preference pairs about the same docs (the chosen answer
the topic's own, the rejected one another topic's or cut short), from reference log-probs computed
once by the prepare step, ending in the reward margin and accuracy.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import tempfile
from urllib.parse import urlsplit
from pathlib import Path
from typing import Optional

from app.dev import local
from app.config import load_config
from app.storage import Store, is_s3, join, s3_endpoint

log = logging.getLogger("eft.demo")
CONFIGS = Path(__file__).resolve().parents[2] / "jobs" / "configs"
DEFAULT_CONFIG = CONFIGS / "tiny-chat.yaml"
TEXT_CONFIG = CONFIGS / "tiny-cpu.yaml"
QUESTION = 'What is the "assert" statement?'
# Jobs on the pre-trained chat base (a preference job tunes it further), shown a reply before and after.
CHAT_FORMATS = ("chat", "sharegpt", "preference")
DPO_CONFIG = CONFIGS / "tiny-dpo.yaml"


class DemoBucketError(RuntimeError):
    """The demo was pointed at a bucket it would not own, reported as one line naming it."""


def is_loopback_endpoint(endpoint: Optional[str]) -> bool:
    if not endpoint:
        return False  # the default AWS endpoint
    host = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def demo_uris(cfg) -> list[str]:
    """Every URI the demo writes to (inputs it seeds, the dataset, the run and its export)."""
    uris = [cfg.model.uri, cfg.data.uri, cfg.storage.root_uri]
    if cfg.prepare is not None:
        uris += [cfg.prepare.input_uri] if cfg.prepare.input_uri else [s.uri for s in cfg.prepare.inputs or []]
    return uris


def check_demo_bucket(cfg, store: Store, allow_remote: bool = False) -> None:
    """The demo writes under its config's s3:// URIs (`s3://eft/...` by default). On the local stack
    that bucket is the one the stack created; anywhere else it is somebody's (`eft` is a public
    bucket name eft does not own), so the demo refuses unless told the bucket is the user's."""
    endpoint = s3_endpoint(store.endpoint)
    if allow_remote or is_loopback_endpoint(endpoint):
        return
    for uri in demo_uris(cfg):
        if is_s3(uri):
            bucket = uri[len("s3://"):].split("/", 1)[0]
            raise DemoBucketError(
                f"demo: refusing to write to s3://{bucket} at {endpoint or 'the default AWS endpoint'}, which is "
                f"not a loopback endpoint (the demo writes only to its local stack; pass --allow-remote-bucket "
                f"if s3://{bucket} there is yours)")


def ensure_inputs(cfg, store: Store, cache_dir: Optional[Path] = None) -> Optional[dict]:
    """The raw corpus and the base model the config points at, built here if absent. A chat job
    (prepare.format chat) gets conversations (about Python, and the parity task's) and the
    pre-trained chat base (built once per bucket; once per `cache_dir` when given), and its eval set
    the task's held-out prompts; a text job the documents and a random-init base. Returns the
    pre-train's report for a chat job."""
    from app.dev.tasks import TASK_EVAL, TASK_TRAIN, build_task_records
    from app.dev.tiny import (
        build_chat_corpus, build_corpus, build_preference_corpus, save_pretrained_base, save_tiny_base, write_jsonl,
    )

    texts = build_corpus()
    fmt = cfg.prepare.format
    chat = fmt in CHAT_FORMATS
    task_train, task_eval = build_task_records(TASK_TRAIN, TASK_EVAL) if fmt == "chat" else ([], [])
    if task_eval and cfg.eval is not None and not store.exists(cfg.eval.uri):
        store.write_text(cfg.eval.uri, "".join(json.dumps(r) + "\n" for r in task_eval))
        log.info("wrote %d held-out task prompts to %s", len(task_eval), cfg.eval.uri)
    if not store.exists(cfg.prepare.input_uri):
        records = (build_chat_corpus() + task_train if fmt == "chat" else build_preference_corpus()
                   if fmt == "preference" else [{"text": t} for t in texts])
        with tempfile.TemporaryDirectory() as tmp:
            path = write_jsonl(records, Path(tmp) / "corpus.jsonl")
            store.write_bytes(cfg.prepare.input_uri, path.read_bytes())
        kind = {"chat": f"conversations ({len(task_train)} of them the task's)",
                "preference": "preference pairs"}.get(fmt, "documents")
        log.info("wrote %d %s to %s", len(records), kind, cfg.prepare.input_uri)
    if chat:
        report = save_pretrained_base(store, cfg.model.uri, texts=texts, cache_dir=cache_dir, log=log.info)
        log.info("pre-trained chat base at %s (%s): held-out loss %.2f → %.2f in %.0f s", cfg.model.uri,
                 report["source"], report["held_out_loss_before"], report["held_out_loss_after"], report["seconds"])
        return report
    if not store.exists(join(cfg.model.uri, "config.json")):
        save_tiny_base(store, cfg.model.uri, texts=texts, max_positions=max(512, cfg.data.seq_len))
        log.info("saved a tiny random-init Llama + BPE tokenizer to %s", cfg.model.uri)
    return None


def cache_dir_for(state_dir: Path) -> Path:
    """Where pre-trained bases are kept between stacks of one state dir."""
    return Path(state_dir).absolute() / "cache"


def seed_local_stack(store: Store, cache_dir: Optional[Path] = None) -> None:
    """What `eft local up` seeds: the inputs of the demo's chat job and of the text job."""
    for path in (DEFAULT_CONFIG, TEXT_CONFIG, DPO_CONFIG):
        cfg = load_config(path)
        check_demo_bucket(cfg, store)
        ensure_inputs(cfg, store, cache_dir=cache_dir)


def chat_reply(model_uri: str, store: Store, question: str = QUESTION, max_new_tokens: int = 200) -> str:
    """Ask the model at `model_uri` one question through its own chat template; the reply as
    generated, special tokens shown (a fine-tuned reply ends with the end-of-turn token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local_dir = store.cache_locally(model_uri)
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    model = AutoModelForCausalLM.from_pretrained(local_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    torch.manual_seed(0)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=10,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=False)


def ask_served_model(export_uri: str, question: str = QUESTION, max_tokens: int = 200) -> tuple[str, str]:
    """Serve the export (`eft serve`'s start_serve: Ray Serve on loopback, a free port) and ask it one
    question through the `openai` client, as any OpenAI-speaking program would; the app is deleted
    afterwards. Returns (the reply, where it was served)."""
    import openai

    from app.serve.launch import start_serve

    handle = start_serve(export_uri, port=None, app_name="eft-demo")
    try:
        # On loopback without a token the server checks none; the client still wants a key to send.
        client = openai.OpenAI(base_url=handle.url, api_key="no-token-on-loopback", max_retries=0, timeout=120)
        # Sampled as the base's reply is, but seeded: the same demo prints the same answer.
        reply = client.chat.completions.create(model=handle.model, messages=[{"role": "user", "content": question}],
                                               temperature=0.7, top_p=0.9, seed=0, max_tokens=max_tokens)
        return reply.choices[0].message.content, f"{handle.model} at {handle.url}"
    finally:
        handle.stop()


def preview_one(cfg, store: Store) -> None:
    """`eft prepare --preview 1`: the first record as prepare tokenizes it (trained tokens in bold)."""
    from rich.console import Console

    from app.data.preview import preview_records, render_preview

    tokenizer, records = preview_records(cfg, 1, store)
    render_preview(Console(highlight=False), tokenizer, records, cfg)


def generate_sample(merged_uri: str, store: Store, prompt: str = "The import statement") -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local_dir = store.cache_locally(merged_uri)
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    model = AutoModelForCausalLM.from_pretrained(local_dir)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=40, do_sample=True, top_k=20,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def report_rewards(store: Store, cfg, window: int = 10) -> int:
    """A preference job's verdict: a step holds a few pairs, so one step's loss is noisy; the mean
    of the last `window` steps against the first's ln 2 (the policy starts as the reference), and
    how often the chosen answer won over those steps."""
    from app.observe.metrics import load_metrics

    metrics = load_metrics(store, cfg.run_uri)
    last = metrics[-window:]
    mean = {key: sum(m[key] for m in last) / len(last) for key in ("loss", "reward_margin", "reward_accuracy")}
    print(f"rewards:  over the last {len(last)} steps, loss {mean['loss']:.4f} (from {metrics[0]['loss']:.4f}), "
          f"margin {mean['reward_margin']:.3f}, chosen preferred in {mean['reward_accuracy']:.0%} of the pairs")
    return 0 if mean["loss"] < metrics[0]["loss"] and mean["reward_accuracy"] > 0.5 else 1


def describe_task(cfg, results: dict) -> str:
    example = results["examples"][0]
    prompt = example["prompt"] if "prompt" in example else example["messages"][-1]["content"]
    return (f"{results['n']} held-out prompts of {cfg.eval.uri} (e.g. {prompt!r} → "
            f"{example['answer']!r}), {results['metric']}")


def run_demo(config_path: Optional[str] = None, state_dir: Path = Path(".eft"), max_steps: Optional[int] = None,
             keep_stack: bool = False, allow_remote_bucket: bool = False) -> int:
    from app.data.manifest import read_committed_manifest
    from app.data.prepare import prepare_dataset
    from app.data.reference import needs_reference
    from app.config import DEFAULT_SET
    from app.eval.run import run_eval
    from app.export import export_run
    from app.dev.tasks import format_score
    from app.report import render_summary
    from app.train.launch import run_training

    overrides = [f"training.max_steps={max_steps}"] if max_steps else []
    cfg = load_config(config_path or DEFAULT_CONFIG, overrides)
    use_stack = not (os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("RAY_ADDRESS"))
    # A stack that `eft local up` left running in state_dir is the user's: use it, leave it up.
    running = local.status(state_dir) if use_stack else None
    started_stack = use_stack and not (running and running["s3_alive"] and running["ray_alive"])
    if use_stack:
        state = local.up(state_dir)
        os.environ.update(local.local_env(state))
        log.info("local stack up: S3 %s, Ray %s", state["s3_endpoint"], state["ray_address"])
    try:
        store = Store.from_config(cfg.storage)
        check_demo_bucket(cfg, store, allow_remote_bucket)  # before the first write
        if cfg.training.objective == "grpo":
            from app.dev.grpo_demo import run_grpo_demo

            return run_grpo_demo(cfg, store, DEFAULT_CONFIG, lambda sft: ensure_inputs(sft, store, cache_dir_for(state_dir)))
        chat = cfg.prepare.format in CHAT_FORMATS
        pretrained = ensure_inputs(cfg, store, cache_dir=cache_dir_for(state_dir))
        if chat:
            preview_one(cfg, store)
        # A DPO dataset may lack its reference log-probs yet: prepare computes (or resumes) just those.
        if read_committed_manifest(store, cfg.data.uri) is None or needs_reference(cfg):
            manifest = prepare_dataset(cfg, store)
            log.info("prepared %d train rows", manifest["splits"]["train"]["rows"])
        before = chat_reply(cfg.model.uri, store) if chat else None
        base_score = run_eval(cfg, store, checkpoint="base")["results"][DEFAULT_SET] if cfg.eval is not None else None
        summary = run_training(cfg, store)
        exported = export_run(cfg, merge=True, store=store)
        tuned_score = (run_eval(cfg, store, checkpoint=exported["export_uri"])["results"][DEFAULT_SET]
                       if cfg.eval is not None else None)
        render_summary(summary)
        print(f"exported: {exported['adapter_uri']} (adapter), {exported['merged_uri']} (merged)")
        if pretrained:
            print(f"base:     pre-trained {pretrained['steps']} steps in {pretrained['seconds']:.0f} s "
                  f"({pretrained['source']}): held-out loss {pretrained['held_out_loss_before']:.2f} → "
                  f"{pretrained['held_out_loss_after']:.2f} (uniform {pretrained['uniform_loss']:.2f})")
        if chat:
            print(f"question: {QUESTION!r}")
            print(f"base:     {before!r}")
            answer, where = ask_served_model(exported["export_uri"])
            print(f"served:   {where} (eft serve: Ray Serve, OpenAI API)")
            print(f"answer:   {answer!r}")
        else:
            print(f"sample:   {generate_sample(exported['merged_uri'], store)!r}")
        first, final = summary["first_train_loss"], summary["final_train_loss"]
        print(f"train loss {first:.4f} → {final:.4f} over {summary['steps']} steps")
        if base_score is not None:
            print(f"task:     {describe_task(cfg, base_score)}")
            print(f"score:    base {format_score(base_score)} → fine-tuned {format_score(tuned_score)}")
        if cfg.training.objective != "sft":
            return report_rewards(store, cfg)
        return 0 if final < first else 1
    finally:
        if started_stack and not keep_stack:
            import ray

            ray.shutdown()
            local.down(state_dir)
