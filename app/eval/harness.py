"""lm-evaluation-harness tasks scored by eft's own model on the eval actor pool (`eval.harness`).

lm-eval runs the tasks (its prompts, few-shot sampling, filters and metrics); the model it calls
is `PoolLM`, an implementation of lm-eval's `LM` interface whose requests go to the same Ray Data
actor pool `eft eval` scores its sets on (`ScoreEval`, app/eval/engine.py), so a large checkpoint
is scored on the cluster's GPUs, as base, checkpoint or export are loaded for the sets, and a lost
actor costs only the batches it had not returned. Each request is tokenized exactly as lm-eval's
own Hugging Face model (`HFLM`) tokenizes it, through lm-eval's `TemplateLM` and its helpers, so
the per-sample results are HFLM's on the same weights:
- `loglikelihood`: (context, continuation) token ids, the joint sequence cut to its last
  `max_length + 1` tokens; the continuation's summed log-probability and whether it is greedy;
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows of `max_length`, summed;
- `generate_until`: greedy generation from the context's last `max_length - max_gen_toks`
  tokens, stopping at the task's `until` strings or EOS, the text cut before the first of them.
Results go to `<run>/eval/<label>/harness/`: lm-eval's results JSON as it writes it (`results.json`,
last) and each task's per-sample lines (`samples_<task>.jsonl`).

On a cluster lm-eval fetches each task's dataset from the Hugging Face Hub (docs/eval.md says how
to pre-fetch them for clusters without internet); a task whose data are local files
(`dataset_path: json`, `dataset_kwargs.data_files`) under `include_path` needs no network.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Optional

from app.config import HARNESS_DIR, HarnessConfig
from app.storage import Store, join

log = logging.getLogger("eft.eval")

EXTRA = "pip install 'eft[harness]'"
LOGLIKELIHOOD = "loglikelihood"
GENERATE_UNTIL = "generate_until"


class HarnessError(RuntimeError):
    """The harness cannot run as configured; one line naming the key or the task."""


def check_harness(hcfg: HarnessConfig) -> None:
    """Before a model is loaded: lm-eval installed, the include path there, every task known to it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise HarnessError(f"eval.harness: lm-evaluation-harness is not installed ({EXTRA})") from None
    if hcfg.include_path is not None and not Path(hcfg.include_path).is_dir():
        raise HarnessError(f"eval.harness.include_path {hcfg.include_path}: not a directory (local task YAMLs)")
    found = load_task_manager(hcfg).match_tasks(list(hcfg.tasks))
    missing = [t for t in hcfg.tasks if t not in found]
    if missing:
        # lm-eval's own words (its `validate` command's), then where tasks come from.
        raise HarnessError(f"eval.harness.tasks: lm-eval: Tasks not found: {', '.join(missing)} (`lm-eval ls tasks` "
                           f"lists them; eval.harness.include_path adds local task YAMLs)")


@functools.lru_cache(maxsize=8)
def load_task_manager_for(include_path: Optional[str], tasks: tuple[str, ...]):
    """lm-eval's task index. Indexing its own ~15k tasks costs seconds of CPU, so when every task
    is among `include_path`'s the index holds those alone; built once per process."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(local.match_tasks(list(tasks))) >= set(tasks):
            return local
    return TaskManager(include_path=include_path)


def load_task_manager(hcfg: HarnessConfig):
    return load_task_manager_for(hcfg.include_path, tuple(hcfg.tasks))


def model_max_length(store: Store, model_uri: str, tokenizer) -> int:
    """What lm-eval's HF model takes as the context length when none is given, by lm-eval's own
    rule (the config's text model, its top level, the tokenizer's `model_max_length`, 2048)."""
    from lm_eval.models.utils import resolve_max_length

    from app.model.architecture import load_model_config

    return resolve_max_length(load_model_config(store, model_uri), tokenizer)


def build_pool_lm(cfg, store: Store, source: dict, tokenizer, hcfg: HarnessConfig, in_process: bool, chat=None):
    """lm-eval's LM for `source`: a subclass of its TemplateLM, built here so that lm-eval is
    imported only when the harness runs."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from app.eval.engine import run_in_process, run_pipeline

    ecfg, use_gpu = cfg.eval, cfg.scaling.use_gpu
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    max_length = hcfg.max_length or model_max_length(store, source.get("model_uri") or cfg.model.uri, tokenizer)

    def run(rows: list[dict], settings: dict) -> dict[int, dict]:
        if in_process:
            return run_in_process(store, rows, source, settings, use_gpu)
        return run_pipeline(store, rows, source, settings, ecfg.num_actors, ecfg.cpus_per_actor, use_gpu)

    def assign_batches(rows: list[dict], size: int) -> list[dict]:
        """Longest first (as lm-eval orders them), `size` a batch; the batch is the unit an actor
        takes. Generation requests batch only with those of the same stop strings and length, as
        lm-eval groups them by their generation kwargs."""
        kwargs = lambda r: (tuple(r.get("until") or ()), r.get("max_new_tokens", 0))  # noqa: E731
        order = sorted(range(len(rows)), key=lambda i: (kwargs(rows[i]), -len(rows[i]["input_ids"])
                                                        - len(rows[i].get("choice_ids", [[]])[0]), i))
        batch, previous, filled = -1, None, size
        for i in order:
            if kwargs(rows[i]) != previous or filled == size:
                batch, previous, filled = batch + 1, kwargs(rows[i]), 0
            rows[i]["batch_id"] = batch
            filled += 1
        return rows

    class PoolLM(TemplateLM):
        """lm-eval's model interface over eft's eval actor pool."""

        def __init__(self):
            super().__init__()
            self.tokenizer = tokenizer

        @property
        def eot_token_id(self) -> int:
            return tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            # HFLM's choice: the BOS token conditions an empty context, else EOS.
            return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

        @property
        def max_length(self) -> int:
            return max_length

        def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
            from lm_eval.models.utils import has_bos_prefix

            special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            if add_special_tokens is None and has_bos_prefix(string, tokenizer.decode(self.prefix_token_id)):
                special = {"add_special_tokens": False}  # the string carries its BOS already
            return tokenizer.encode(string, **special)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            rows = []
            for uid, (_, context_enc, continuation_enc) in enumerate(requests):
                seq = (list(context_enc) + list(continuation_enc))[-(max_length + 1):]
                cut = len(seq) - len(continuation_enc)
                rows.append({"uid": uid, "set": LOGLIKELIHOOD, "index": uid, "input_ids": seq[:cut],
                             "choice_ids": [seq[cut:]]})
            if not rows:
                return []
            out = run(assign_batches(rows, hcfg.batch_size), {LOGLIKELIHOOD: {"kind": LOGLIKELIHOOD, "pad_id": pad_id}})
            return [(out[r["uid"]]["choice_logprobs"][0], bool(out[r["uid"]]["choice_greedy"][0])) for r in rows]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows, owner = [], []
            for i, (string,) in enumerate(req.args for req in requests):
                for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=max_length, context_len=1)):
                    windows.append((None, context, continuation))
                    owner.append(i)
            totals = [0.0] * len(requests)
            for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
                totals[i] += logprob
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            eos = tokenizer.decode(self.eot_token_id)
            rows, stops = [], []
            for uid, (context, gen_kwargs) in enumerate(req.args for req in requests):
                kwargs = normalize_gen_kwargs(gen_kwargs, hcfg.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = kwargs.pop("max_gen_toks")
                if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                    log.warning("harness: a task asks for sampling (%s); eft's harness model decodes greedily",
                                {k: kwargs[k] for k in ("do_sample", "temperature") if k in kwargs})
                ids = self.tok_encode(context)[-(max_length - max_gen_toks):]
                rows.append({"uid": uid, "set": GENERATE_UNTIL, "index": uid, "input_ids": ids, "until": until,
                             "max_new_tokens": max_gen_toks})
                stops.append(until)
            if not rows:
                return []
            settings = {GENERATE_UNTIL: {"kind": GENERATE_UNTIL, "pad_id": pad_id, "stop_ids": None,
                                         "tokenizer": tokenizer}}
            out = run(assign_batches(rows, hcfg.batch_size), settings)
            return [postprocess_generated_text(tokenizer.decode(out[r["uid"]]["output_ids"], skip_special_tokens=True),
                                               stop, None) for r, stop in zip(rows, stops)]

        def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
            # eft's own chat rendering (app/data/chat.py), the code training and serving render with.
            return chat.render_text(chat_history, add_generation_prompt=add_generation_prompt)[0]

        @property
        def tokenizer_name(self) -> str:
            return getattr(tokenizer, "name_or_path", "eft").replace("/", "__")

    return PoolLM()


def run_harness(cfg, store: Store, source: dict, tokenizer, hcfg: HarnessConfig, in_process: bool = False,
                chat=None) -> dict:
    """lm-eval's simple_evaluate on PoolLM; its results under `<run>/eval/<label>/harness/`.
    `chat`: the model's ChatFormat (app.data.chat), which `apply_chat_template` renders with."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    from app.eval.results import eval_uri

    check_harness(hcfg)
    if hcfg.apply_chat_template and chat is None:
        raise HarnessError(f"eval.harness.apply_chat_template: {source['label']} has no chat template to render with")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lm = build_pool_lm(cfg, store, source, tokenizer, hcfg, in_process, chat)
    log.info("harness: %s on %s (%s)", ", ".join(hcfg.tasks), source["label"], source["kind"])
    results = simple_evaluate(
        model=lm, tasks=list(hcfg.tasks), num_fewshot=hcfg.num_fewshot, limit=hcfg.limit,
        task_manager=load_task_manager(hcfg), log_samples=True,
        apply_chat_template=hcfg.apply_chat_template, random_seed=hcfg.seed, numpy_random_seed=hcfg.seed,
        torch_random_seed=hcfg.seed, fewshot_random_seed=hcfg.seed)
    samples = results.pop("samples", {}) or {}
    results["eft"] = {"label": source["label"], "step": source.get("step"), "run_uri": cfg.run_uri,
                      "checkpoint": {k: source.get(k) for k in ("kind", "checkpoint_uri", "model_uri", "adapter_uri")},
                      "num_actors": 1 if in_process else cfg.eval.num_actors, "harness": hcfg.model_dump(mode="json")}
    out = join(eval_uri(cfg.run_uri, source["label"]), HARNESS_DIR)
    if store.list_files(out):
        store.delete_prefix(out)  # results.json first: a half-replaced harness never reads as finished
    for task, rows in samples.items():
        store.write_text(join(out, f"samples_{task}.jsonl"),
                         "".join(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n"
                                 for row in rows))
    store.write_text(join(out, "results.json"), json.dumps(results, default=handle_non_serializable, indent=2))
    for task, metrics in (results.get("results") or {}).items():
        log.info("harness %s, %s: %s", source["label"], task,
                 ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k))
    return json.loads(json.dumps(results, default=handle_non_serializable))
