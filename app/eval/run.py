"""`eft eval`: one model of a run scored on its eval sets (and lm-eval tasks), results under
`<run>/eval/<label>/<set>/`, a summary in `<run>/eval/<label>/summary.json`.

sets (validated, fingerprinted) → the model to score (base, a checkpoint, an export) → prompts
rendered in the training format → the engine (one Ray Data actor pool for every set, or in this
process inside a validation task) → predictions decoded and scored per set → predictions.jsonl,
then results.json, per set → the harness's tasks on the same kind of pool → summary.json.
Everything that can be wrong with the sets, the harness config or the checkpoint is found before
a model is loaded.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from app.config import JobConfig
from app.elastic.resume import resolve_run_model
from app.eval.render import PromptRenderer
from app.config import DEFAULT_SET
from app.eval.results import save_results, step_label, write_summary
from app.eval.score import bootstrap_interval, score_choices, score_generation
from app.eval.sets import GENERATION, EvalSet, load_eval_set, pick_metric
from app.storage import Store, join

log = logging.getLogger("eft.eval")


class EvalError(RuntimeError):
    """An evaluation that cannot run as asked; one line naming the checkpoint, URI or key."""


def resolve_source(cfg: JobConfig, store: Store, checkpoint: str = "latest") -> dict:
    """`--checkpoint latest | base | STEP | URI` → what to load, its label and its step.
    A URI may be a checkpoint, an export (its merged model, else its adapter on model.uri), or any
    Hugging Face model directory."""
    from app.elastic.checkpoint import (check_complete, checkpoint_dir_name, find_latest_checkpoint,
                                        load_train_state)

    def from_checkpoint(uri: str) -> dict:
        step = load_train_state(store, uri).get("step")
        return {"kind": "checkpoint", "checkpoint_uri": uri, "step": step, "label": step_label(step),
                "cfg": cfg.model_dump(mode="json")}

    if checkpoint == "base":
        return {"kind": "base", "model_uri": cfg.model.uri, "step": 0, "label": "base"}
    if checkpoint == "latest":
        latest = find_latest_checkpoint(store, cfg.run_uri)
        if latest is None:
            raise EvalError(f"{cfg.run_uri}: no complete checkpoint to evaluate (train first, or pass "
                            f"--checkpoint base)")
        return from_checkpoint(latest)
    if checkpoint.isdigit():
        uri = join(cfg.run_uri, checkpoint_dir_name(int(checkpoint)))
        problem = check_complete(store, uri)
        if problem is not None:
            raise EvalError(f"--checkpoint {checkpoint}: {uri} is not a complete checkpoint ({problem})")
        return from_checkpoint(uri)
    uri = checkpoint.rstrip("/")
    if store.exists(join(uri, "export.json")):
        summary = store.read_json(join(uri, "export.json"))
        label = f"export-{step_label(summary['step'])}" if summary.get("step") is not None else "export"
        if summary.get("merged_uri"):
            return {"kind": "export", "model_uri": summary["merged_uri"], "step": summary.get("step"), "label": label}
        return {"kind": "export", "model_uri": summary.get("base_model_uri") or cfg.model.uri,
                "adapter_uri": summary["adapter_uri"], "step": summary.get("step"), "label": label}
    if store.exists(join(uri, "config.json")):
        return {"kind": "model", "model_uri": uri, "step": None, "label": "model-" + uri.rsplit("/", 1)[-1]}
    if store.exists(join(uri, "adapter_config.json")):
        return {"kind": "model", "model_uri": cfg.model.uri, "adapter_uri": uri, "step": None,
                "label": "adapter-" + uri.rsplit("/", 1)[-1]}
    problem = check_complete(store, uri)
    if problem is None:
        return from_checkpoint(uri)
    raise EvalError(f"--checkpoint {checkpoint}: not a checkpoint, an export or a model directory ({problem})")


def load_source_tokenizer(cfg: JobConfig, store: Store, source: dict):
    """The tokenizer and chat template the model was trained with: an export's (or a model
    directory's) own; for the base and checkpoints the one export would give them."""
    from transformers import AutoTokenizer

    from app.export import export_tokenizer

    if source["kind"] in ("export", "model"):
        return AutoTokenizer.from_pretrained(str(store.cache_locally(source.get("adapter_uri") or source["model_uri"])))
    return export_tokenizer(cfg, store)


def training_format(cfg: JobConfig, store: Store, tokenizer) -> str:
    """The format the run's examples were rendered in: prepare.format, else the dataset's."""
    if cfg.prepare is not None:
        return cfg.prepare.format
    from app.data.manifest import read_committed_manifest

    manifest = read_committed_manifest(store, cfg.data.uri) or {}
    fmt = manifest.get("source", {}).get("format")
    return fmt or ("chat" if tokenizer.chat_template else "text")


def build_rows(eval_set: EvalSet, renderer: PromptRenderer, batch_size: int, set_name: str = DEFAULT_SET,
               first_uid: int = 0) -> list[dict]:
    """One row per record: a uid unique among every set scored together, its prompt ids (and
    choices'), and a batch id fixed here. Records are batched by length (less padding), ties in
    record order, and a batch never mixes sets."""
    rows = []
    for record in eval_set.records:
        row = {"uid": first_uid + len(rows), "set": set_name, "index": record.index,
               "input_ids": renderer.ids(record)}
        if eval_set.kind != GENERATION:
            row["choice_ids"] = renderer.choice_ids(record)
        rows.append(row)
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["input_ids"])
                                                    + max((len(c) for c in rows[i].get("choice_ids", [])), default=0), i))
    for position, i in enumerate(order):
        rows[i]["batch_id"] = position // batch_size
    return rows


def pick_sets(ecfg, names: Optional[list[str]]) -> dict:
    """The named sets to score (`--sets a,b`; None: all; []: none), each as its own EvalConfig."""
    sets = ecfg.named_sets()
    if names is None:
        return sets
    unknown = [n for n in names if n not in sets]
    if unknown:
        raise EvalError(f"--sets {','.join(names)}: {unknown[0]!r} is not a set of eval "
                        f"(sets: {', '.join(sets) or 'none'})")
    return {n: sets[n] for n in names}


def run_eval(cfg: JobConfig, store: Optional[Store] = None, checkpoint: str = "latest", limit: Optional[int] = None,
             in_process: bool = False, source: Optional[dict] = None, sets: Optional[list[str]] = None,
             harness: bool = True) -> dict:
    """Score one model of `cfg`'s run on the eval sets (`sets`: their names, None for all) and,
    when `harness` and `eval.harness` is set, on lm-evaluation-harness's tasks. Returns the
    label's summary, with each scored set's results.json content (plus `examples`) under
    `results[set]` and lm-eval's results under `harness_results`."""
    if cfg.eval is None:
        raise EvalError("eval: section missing (eval.uri, eval.sets or eval.harness names what to score)")
    ecfg = cfg.eval
    store = store or Store.from_config(cfg.storage)
    chosen = pick_sets(ecfg, sets)
    harness_cfg = ecfg.harness if harness else None
    if harness_cfg is not None:
        from app.eval.harness import check_harness

        check_harness(harness_cfg)  # the extra, the tasks: before a model or a set is read
    if not chosen and harness_cfg is None:
        raise EvalError("nothing to score: no set chosen (--sets) and no harness (eval.harness, or --no-harness)")
    cfg = resolve_run_model(cfg, store)
    started = time.monotonic()
    eval_sets = {name: load_eval_set(store, one, limit) for name, one in chosen.items()}
    metrics = {name: pick_metric(chosen[name], es.kind) for name, es in eval_sets.items()}
    source = source or resolve_source(cfg, store, checkpoint)
    tokenizer = load_source_tokenizer(cfg, store, source)
    renderer = PromptRenderer(tokenizer, tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
                              training_format(cfg, store, tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else renderer.stop_ids[0]
    rows, settings = [], {}
    for name, eval_set in eval_sets.items():
        one = chosen[name]
        rows += build_rows(eval_set, renderer, one.batch_size, name, first_uid=len(rows))
        settings[name] = {"kind": eval_set.kind, "max_new_tokens": one.max_new_tokens, "temperature": one.temperature,
                          "seed": one.seed, "stop_ids": renderer.stop_ids, "pad_id": pad_id}
        log.info("eval %s (%s) on %d %s records of set %s (%s), rendered as %s", source["label"], source["kind"],
                 len(eval_set.records), eval_set.kind.replace("_", "-"), name, one.uri, renderer.mode)
    outputs = run_engine(cfg, store, rows, source, settings, in_process) if rows else {}
    scored = {}
    for name, eval_set in eval_sets.items():
        one = chosen[name]
        by_index = {r["index"]: outputs[r["uid"]] for r in rows if r["set"] == name}
        predictions, correct, extra = score_outputs(eval_set, by_index, tokenizer, metrics[name], one)
        low, high = bootstrap_interval(np.asarray(correct), seed=one.seed)
        results = {
            "label": source["label"], "set": name, "metric": metrics[name], "score": float(np.mean(correct)),
            "n": len(correct), "interval": [low, high], "interval_level": 0.95, "metrics": extra,
            "step": source.get("step"), "checkpoint": {k: source.get(k) for k in
                                                        ("kind", "checkpoint_uri", "model_uri", "adapter_uri")},
            "run_uri": cfg.run_uri, "base_model_uri": cfg.model.uri,
            "eval_set": {**eval_set.describe(), "limit": limit}, "rendering": renderer.mode,
            "decoding": ({"greedy": one.temperature == 0, "temperature": one.temperature, "seed": one.seed,
                          "max_new_tokens": one.max_new_tokens, "stop_token_ids": renderer.stop_ids,
                          "batch_size": one.batch_size, "padding": "left"}
                         if eval_set.kind == GENERATION else {"scoring": "log-likelihood", "batch_size": one.batch_size}),
            "num_actors": 1 if in_process else ecfg.num_actors, "wall_s": round(time.monotonic() - started, 3),
            "created_at": time.time(),
        }
        save_results(store, cfg.run_uri, source["label"], name, predictions, results)
        log.info("eval %s, set %s: %s %.4f (95%% interval %.4f-%.4f) on %d records", source["label"], name,
                 metrics[name], results["score"], low, high, len(correct))
        scored[name] = {**results, "examples": predictions[:3]}
    harness_results = None
    if harness_cfg is not None:
        from app.eval.harness import run_harness

        harness_results = run_harness(cfg, store, source, tokenizer, harness_cfg, in_process, renderer.chat)
    summary = write_summary(store, cfg.run_uri, source["label"])
    return {**summary, "results": scored, "harness_results": harness_results}


def run_engine(cfg: JobConfig, store: Store, rows: list[dict], source: dict, settings: dict[str, dict],
               in_process: bool) -> dict:
    """{uid: output} of every row: vLLM for the generation sets where it applies, the actor pool
    (or this process) for the rest, one pool for all of them."""
    from app.eval.engine import run_in_process, run_pipeline, run_vllm, vllm_available

    ecfg, use_gpu = cfg.eval, cfg.scaling.use_gpu
    generates = any(s["kind"] == GENERATION for s in settings.values())
    engine_ok = generates and source.get("model_uri") and not source.get("adapter_uri") and (
        ecfg.engine == "vllm" or (ecfg.engine == "auto" and use_gpu and vllm_available()))
    outputs: dict[int, dict] = {}
    rest = rows
    if engine_ok:
        if not vllm_available():
            raise EvalError("eval.engine vllm: vLLM is not installed (pip install 'eft[vllm]')")
        rest = []
        for name, s in settings.items():
            mine = [r for r in rows if r["set"] == name]
            if s["kind"] == GENERATION:
                outputs.update(run_vllm(mine, str(store.cache_locally(source["model_uri"])), s, ecfg.num_actors))
            else:
                rest += mine
    if not rest:
        return outputs
    if in_process:
        outputs.update(run_in_process(store, rest, source, settings, use_gpu))
    else:
        outputs.update(run_pipeline(store, rest, source, settings, ecfg.num_actors, ecfg.cpus_per_actor, use_gpu))
    return outputs


def score_outputs(eval_set: EvalSet, outputs: dict, tokenizer, metric: str, ecfg) -> tuple[list, list, dict]:
    """Predictions (one per record, in the set's order), `correct` under `metric`, and every metric
    that applies to the set's kind."""
    predictions, correct = [], []
    tally: dict[str, list[bool]] = {}
    for record in eval_set.records:
        out = outputs[record.index]
        row = {"index": record.index, "where": record.where}
        row.update({"prompt": record.prompt} if record.prompt is not None else {"messages": record.messages})
        if eval_set.kind == GENERATION:
            text = tokenizer.decode(out["output_ids"], skip_special_tokens=True)
            verdicts = {}
            for m in ("exact_match", "contains") + (("regex",) if ecfg.answer_regex else ()):
                verdicts[m], extracted = score_generation(text, record.answers, m, ecfg.normalize, ecfg.answer_regex)
                if m == "regex":
                    row["extracted"] = extracted
            row.update(prediction=text, answer=record.answers[0] if len(record.answers) == 1 else record.answers,
                       stopped=out["stopped"])
        else:
            verdicts = score_choices(out["choice_logprobs"], record.choices, record.answer_index)
            row.update(choices=record.choices, answer=record.answer_index, choice_logprobs=out["choice_logprobs"],
                       prediction=int(np.argmax(out["choice_logprobs"])))
        for m, ok in verdicts.items():
            tally.setdefault(m, []).append(bool(ok))
        row["correct"] = bool(verdicts[metric])
        correct.append(row["correct"])
        predictions.append(row)
    return predictions, correct, {m: float(np.mean(v)) for m, v in tally.items()}
