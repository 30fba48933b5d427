"""The scoring engine: a Ray Data pipeline over rendered prompts, on an actor pool that holds the model.

Rows (one per record of every set scored together: a unique `uid`, its set, index, batch id and
prompt ids; for multiple choice each choice's continuation ids) go to `ScoreEval` actors
(`eval.num_actors`, each loading the model once for all the sets), each set with its own settings:
- generation: greedy (or seeded sampling) `generate` over a batch, left-padded, stopping at the
  stop ids; returns each record's new tokens, cut before the first stop token;
- multiple choice: one forward over every (prompt + choice) of a batch, right-padded; returns each
  choice's summed log-probability of its tokens given the prompt and the choice's earlier tokens.
Batches are fixed before Ray sees them (the driver assigns `batch_id`), and an actor computes each
batch id on its own, so which records share a padded batch, and so every prediction, is the same at
any number of actors.

The model is the base, a merged or adapter export, or a training checkpoint (base + the
checkpoint's weights, as export reads them), in fp32 on CPU and bf16 on GPU.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np
import pyarrow as pa

from app.eval.render import pad_left
from app.storage import Store

log = logging.getLogger(__name__)


def load_eval_model(store: Store, source: dict, device):
    """The model a `source` (app.eval.run.resolve_source) names, ready for inference."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if source.get("checkpoint_uri"):
        from app.config import JobConfig
        from app.export import build_export_model, cache_model_dir, load_checkpoint_weights

        cfg = JobConfig.model_validate(source["cfg"])
        model = build_export_model(cfg, cache_model_dir(store, cfg.model.uri))
        load_checkpoint_weights(store, model, source["checkpoint_uri"], trainable_only=cfg.lora is not None)
        if cfg.lora is not None:
            model = model.merge_and_unload()  # one matmul per layer instead of two; same function
        model = model.to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(store.cache_locally(source["model_uri"])), dtype=dtype,
                                                     use_safetensors=True)
        if source.get("adapter_uri"):
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(store.cache_locally(source["adapter_uri"]))).merge_and_unload()
    return model.to(device).eval()


def sum_continuation_logprobs(logits, ids, spans: list[tuple[int, int, int]]) -> tuple[list[float], list[bool]]:
    """Each span's (row, context_len, length) summed log p(ids[row, t] | ids[row, :t]) over the
    continuation t in [context_len, context_len + length): the token at t is scored by the logits
    at position t - 1. Also whether every continuation token is the argmax there (lm-eval's
    `is_greedy`). `logits` [rows, T, V] and `ids` [rows, T] on one device; the log-softmax, the
    gather and the argmax run there, on the continuation's positions only, and two numbers per span
    come to the host. (Moving each choice's whole [T, V] log-softmax to the CPU cost a copy of
    the sequence's logits per choice.)"""
    import torch

    sums, greedy = [], []
    for row, context_len, length in spans:
        logp = logits[row, context_len - 1:context_len + length - 1].float().log_softmax(-1)
        targets = ids[row, context_len:context_len + length]
        sums.append(logp.gather(-1, targets[:, None]).double().sum())
        greedy.append((logp.argmax(-1) == targets).all())
    if not sums:
        return [], []
    return torch.stack(sums).cpu().tolist(), torch.stack(greedy).cpu().tolist()


class ScoreEval:
    """Ray Data actor: loads the model once, then scores batches of rendered records."""

    def __init__(self, endpoint: Optional[str], region: str, source: dict, settings: dict[str, dict], use_gpu: bool):
        import torch

        self.device = torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")
        self.model = load_eval_model(Store(endpoint, region), source, self.device)
        self.settings = settings  # by set name

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out = []
        for set_name, batch_id in sorted({(r["set"], r["batch_id"]) for r in rows}):
            group = [r for r in rows if r["set"] == set_name and r["batch_id"] == batch_id]
            s = self.settings[set_name]
            if s["kind"] == "generation":
                out += self.generate(group, batch_id, s)
            elif s["kind"] == "generate_until":
                out += self.generate_until(group, s)
            else:
                out += self.score(group, s)
        return pa.Table.from_pylist(out, schema=OUTPUT_SCHEMA)

    def generate(self, rows: list[dict], batch_id: int, s: dict) -> list[dict]:
        import torch

        ids, mask = pad_left([r["input_ids"] for r in rows], s["pad_id"])
        sampling = s["temperature"] > 0
        if sampling:
            torch.manual_seed(s["seed"] * 1_000_003 + batch_id)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.as_tensor(ids, device=self.device), attention_mask=torch.as_tensor(mask, device=self.device),
                max_new_tokens=s["max_new_tokens"], do_sample=sampling,
                **({"temperature": s["temperature"]} if sampling else {"temperature": None, "top_p": None, "top_k": None}),
                eos_token_id=s["stop_ids"], pad_token_id=s["pad_id"])
        new = out[:, ids.shape[1]:].cpu().numpy()
        stops = set(s["stop_ids"])
        results = []
        for r, tokens in zip(rows, new):
            tokens = tokens.tolist()
            cut = next((i for i, t in enumerate(tokens) if t in stops), None)
            results.append({"uid": r["uid"], "output_ids": tokens if cut is None else tokens[:cut],
                            "stopped": cut is not None})
        return results

    def generate_until(self, rows: list[dict], s: dict) -> list[dict]:
        """lm-eval's `generate_until`, greedy, a batch at a time (left-padded, as the sets'
        generation), stopping as lm-eval's HF model stops: its own stop criteria (each `until`
        string looked for in the last few decoded tokens) or EOS, at most `max_new_tokens`. A batch
        holds requests of one `until` and length (the harness batches them so, as lm-eval groups
        them by their generation kwargs); the text is cut before the first stop string by the
        caller. The tokenizer comes in the settings (the driver's, pickled by Ray), as the actor's
        node may not have the driver's files."""
        import torch
        from lm_eval.models.utils_hf import stop_sequences_criteria

        tokenizer = s["tokenizer"]
        until, max_new_tokens = rows[0]["until"], rows[0]["max_new_tokens"]
        if any(r["until"] != until or r["max_new_tokens"] != max_new_tokens for r in rows):
            raise ValueError("generate_until: a batch mixes stop strings or lengths")
        ids, mask = pad_left([r["input_ids"] for r in rows], s["pad_id"])
        width = ids.shape[1]
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.as_tensor(ids, device=self.device), attention_mask=torch.as_tensor(mask, device=self.device),
                max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                stopping_criteria=stop_sequences_criteria(tokenizer, list(until), width, len(rows)),
                pad_token_id=s["pad_id"])  # EOS: the model's generation config, as lm-eval's HF model
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        results = []
        for r, tokens in zip(rows, out[:, width:].cpu().tolist()):
            cut = next((j for j, t in enumerate(tokens) if t in eos), None)
            results.append({"uid": r["uid"], "output_ids": tokens if cut is None else tokens[:cut + 1],
                            "stopped": None})
        return results

    def score(self, rows: list[dict], s: dict) -> list[dict]:
        import torch

        seqs, spans = [], []
        for r in rows:
            for choice in r["choice_ids"]:
                spans.append((len(seqs), len(r["input_ids"]), len(choice)))
                seqs.append(list(r["input_ids"]) + list(choice))
        width = max(len(s) for s in seqs)
        ids = np.full((len(seqs), width), s["pad_id"], dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = seq
            mask[i, :len(seq)] = 1
        with torch.no_grad():
            ids_on_device = torch.as_tensor(ids, device=self.device)
            logits = self.model(input_ids=ids_on_device,
                                attention_mask=torch.as_tensor(mask, device=self.device)).logits
            sums, greedy = sum_continuation_logprobs(logits, ids_on_device, spans)
        results, at = [], 0
        for r in rows:
            count = len(r["choice_ids"])
            results.append({"uid": r["uid"], "choice_logprobs": sums[at:at + count],
                            "choice_greedy": greedy[at:at + count]})
            at += count
        return results


OUTPUT_SCHEMA = pa.schema([("uid", pa.int64()), ("output_ids", pa.list_(pa.int64())), ("stopped", pa.bool_()),
                           ("choice_logprobs", pa.list_(pa.float64())), ("choice_greedy", pa.list_(pa.bool_()))])


def run_pipeline(store: Store, rows: list[dict], source: dict, settings: dict[str, dict], num_actors: int,
                 cpus_per_actor: float, use_gpu: bool) -> dict[int, dict]:
    """Every row through the actor pool; {uid: output row}."""
    from app.cluster import init_ray, map_on_actor_pool

    init_ray(num_cpus=os.cpu_count())  # a Ray of its own only when none is joined or running
    blocks = build_blocks(rows)
    out: dict[int, dict] = {}
    for batch in map_on_actor_pool(blocks, ScoreEval, (store.endpoint, store.region, source, settings, use_gpu),
                                   key="uid", size=num_actors, num_cpus=cpus_per_actor,
                                   num_gpus=1 if use_gpu else 0, what="eval", size_key="eval.num_actors"):
        for row in batch.to_pylist():
            out[row["uid"]] = row
    return out


def run_in_process(store: Store, rows: list[dict], source: dict, settings: dict[str, dict],
                   use_gpu: bool) -> dict[int, dict]:
    """The same batches in this process (evaluation inside Ray Train's validation task)."""
    scorer = ScoreEval(store.endpoint, store.region, source, settings, use_gpu)
    out: dict[int, dict] = {}
    for block in build_blocks(rows):
        for row in scorer(block).to_pylist():
            out[row["uid"]] = row
    return out


def build_blocks(rows: list[dict]) -> list[pa.Table]:
    """One Arrow block per (set, batch id): a block is the unit an actor takes, never split across two."""
    by_batch: dict[tuple, list[dict]] = {}
    for row in rows:
        by_batch.setdefault((row["set"], row["batch_id"]), []).append(row)
    return [pa.Table.from_pylist(group) for _, group in sorted(by_batch.items())]


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def run_vllm(rows: list[dict], model_dir: str, settings: dict, num_actors: int) -> dict[int, dict]:
    """Generation through ray.data.llm's vLLM processor (GPU workers, `eft[vllm]`) on the rendered
    prompt ids, so vLLM sees exactly the tokens the transformers path would. Not run in CI."""
    import ray.data
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=model_dir, concurrency=num_actors, batch_size=max(len(rows) // num_actors, 1),
        chat_template_stage=False, tokenize_stage=False, detokenize_stage=False,
        engine_kwargs={"seed": settings["seed"]})
    sampling = {"temperature": settings["temperature"], "max_tokens": settings["max_new_tokens"],
                "stop_token_ids": settings["stop_ids"], "detokenize": False, "seed": settings["seed"]}
    processor = build_processor(
        config,
        preprocess=lambda row: {"uid": row["uid"], "tokenized_prompt": row["input_ids"],
                                "sampling_params": sampling},
        postprocess=lambda row: {"uid": row["uid"], "output_ids": list(row["generated_tokens"])})
    ds = processor(ray.data.from_items([{"uid": r["uid"], "input_ids": r["input_ids"]} for r in rows]))
    stops = set(settings["stop_ids"])
    out = {}
    for row in ds.take_all():
        tokens = list(row["output_ids"])
        cut = next((i for i, t in enumerate(tokens) if t in stops), None)
        out[row["uid"]] = {"uid": row["uid"], "output_ids": tokens if cut is None else tokens[:cut],
                           "stopped": cut is not None}
    return out
