"""`eft eval` against a real S3 endpoint, real exports loaded back by transformers, and references
the tests compute themselves: greedy `generate` on the merged export, log-likelihoods from
transformers logits, `apply_chat_template` with the export's template.

The fast tier scores in this process (the engine's in-process path: the same actor class and
batches as the Ray Data pipeline); the cluster tier runs the pipeline on 1 and 3 actors and the
evaluation on checkpoints during a real training run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import ConfigError, build_config
from app.dev.tiny import add_chat_template, build_corpus, build_tiny_model, build_tiny_tokenizer
from app.eval.render import PromptRenderer
from app.eval.results import load_predictions, load_results
from app.eval.run import EvalError, run_eval
from app.eval.score import bootstrap_interval, normalize, score_choices, score_generation
from app.eval.sets import EvalSetError, load_eval_set
from app.export import export_run
from app.storage import Store, join
from test_export import build_trained_model, write_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

RUNS = "s3://eft/eval-test-runs"
SETS = "s3://eft/eval-sets"
QUESTIONS = ["What is a list?", "Explain the import statement.", "How do loops work?", "What is None?",
             "Define a class.", "What does return do?", "What is a tuple?", "Why use with?"]


@pytest.fixture(scope="module")
def chat_base(s3):
    """A random-init tiny Llama whose tokenizer has ChatML's markers and template."""
    store = Store()
    tokenizer = add_chat_template(build_tiny_tokenizer(build_corpus(max_docs=200), vocab_size=384))
    model = build_tiny_model(tokenizer, initializer_range=0.5)
    uri = "s3://eft/models/eval-chat"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        store.upload_dir(tmp, uri, last=("config.json",))
    return uri


def write_set(name: str, records: list, kind: str = "jsonl") -> str:
    uri = join(SETS, f"{name}.{kind}")
    if kind == "parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(records), buf)
        Store().write_bytes(uri, buf.getvalue())
    else:
        Store().write_text(uri, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return uri


def score_one(cfg, store, **kwargs) -> dict:
    """One set's results (the config's only set, `default`) of an evaluation."""
    summary = run_eval(cfg, store, **kwargs)
    (results,) = summary["results"].values()
    return results


def make_cfg(name: str, base_uri: str, eval_uri: str, fmt: str = "chat", **eval_keys):
    return build_config({
        "name": name, "model": {"uri": base_uri}, "data": {"uri": "s3://eft/data/unused"},
        "prepare": {"input_uri": "s3://eft/raw/unused.jsonl", "format": fmt},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
        "training": {"max_steps": 10}, "storage": {"root_uri": RUNS},
        "eval": {"uri": eval_uri, "max_new_tokens": 12, "batch_size": 3, **eval_keys},
    })


@pytest.fixture(scope="module")
def tuned_run(chat_base):
    """A LoRA run of the chat base with a checkpoint at step 5, exported merged."""
    store = Store()
    cfg = make_cfg("eval-run", chat_base, write_set("placeholder", [{"prompt": "x", "answer": "y"}]))
    model, optim = build_trained_model(cfg, seed=3)
    write_checkpoint(store, cfg.run_uri, model, optim, step=5, trainable_only=True)
    return cfg, export_run(cfg, merge=True, store=store)


def reference_generate(model_dir: Path, prompts: list, max_new_tokens: int) -> list[str]:
    """The test's own greedy answers: apply_chat_template with the export's template, one prompt
    at a time, stopping at EOS or <|im_end|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    out = []
    for prompt in prompts:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                 pad_token_id=tokenizer.pad_token_id)
        tokens = gen[0, ids["input_ids"].shape[1]:].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in stop), len(tokens))
        out.append(tokenizer.decode(tokens[:cut], skip_special_tokens=True))
    return out


# -- generation --------------------------------------------------------------------------------


def test_generation_scores_the_merged_exports_own_greedy_answers(tuned_run, tmp_path):
    cfg, exported = tuned_run
    store = Store()
    merged = store.cache_locally(exported["merged_uri"])
    prompts = QUESTIONS[:6] + [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]]
    expected = reference_generate(merged, prompts, max_new_tokens=12)
    assert len(set(expected)) > 1, "a model that answers everything alike cannot tell scoring bugs apart"
    # Records 0, 2 and 4 accept the model's own answer (respaced and upper-cased: normalization);
    # record 1 accepts a word of it (contains); the others expect something else.
    records = []
    for i, (prompt, answer) in enumerate(zip(prompts, expected)):
        key = {"messages": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        if i in (0, 2, 4):
            accepted = ["no such answer", "  " + " ".join(answer.upper().split()) + " "]
        elif i == 1:
            accepted = answer.split()[0] if answer.split() else "zzz"
        else:
            accepted = "zzz never said"
        records.append({**key, "answer": accepted})
    set_uri = write_set("generation", records)
    for metric, score in (("exact_match", 3 / 7), ("contains", 4 / 7)):
        cfg_m = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"uri": set_uri, "metric": metric})})
        results = score_one(cfg_m, store, checkpoint=exported["export_uri"], in_process=True)
        predictions = load_predictions(store, cfg.run_uri, results["label"])
        assert [p["prediction"] for p in predictions] == expected
        assert results["label"] == "export-step-000005" and results["step"] == 5
        assert results["metric"] == metric and results["n"] == 7
        assert results["score"] == pytest.approx(score)
        assert [p["correct"] for p in predictions][:3] == [True, metric == "contains", True]
        low, high = results["interval"]
        assert 0 <= low <= results["score"] <= high <= 1 and low < high
    stored = store.read_json(join(cfg.run_uri, "eval", "export-step-000005", "default", "results.json"))
    assert stored["eval_set"]["fingerprint"] == load_eval_set(store, cfg_m.eval).fingerprint
    assert stored["decoding"]["greedy"] and stored["decoding"]["max_new_tokens"] == 12


def test_a_checkpoint_scores_as_its_merged_export(tuned_run):
    """The checkpoint (base + its adapter weights, fp32) and the export merged from it answer alike."""
    cfg, exported = tuned_run
    store = Store()
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"uri": write_set(
        "few", [{"prompt": q, "answer": "x"} for q in QUESTIONS])})})
    from_ckpt = score_one(cfg, store, checkpoint="latest", in_process=True)
    from_export = score_one(cfg, store, checkpoint=exported["export_uri"], in_process=True)
    assert from_ckpt["label"] == "step-000005"
    assert ([p["prediction"] for p in load_predictions(store, cfg.run_uri, "step-000005")]
            == [p["prediction"] for p in load_predictions(store, cfg.run_uri, "export-step-000005")])
    assert from_export["checkpoint"]["kind"] == "export" and from_ckpt["checkpoint"]["kind"] == "checkpoint"


# -- multiple choice -----------------------------------------------------------------------------


def reference_choice_logprobs(model, prompt_ids: list[int], choice_ids: list[int], shift: int = 0) -> float:
    """log p(choice | prompt) from one unpadded forward; `shift` plants an off-by-one."""
    ids = torch.tensor([prompt_ids + choice_ids])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
    n = len(prompt_ids)
    return sum(float(logp[n - 1 + j + shift, t]) for j, t in enumerate(choice_ids))


def test_multiple_choice_log_likelihoods_equal_transformers_reference(tuned_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, exported = tuned_run
    store = Store()
    records = [{"prompt": q, "choices": ["a list", "a tuple of things", "nothing"], "answer": i % 3}
               for i, q in enumerate(QUESTIONS[:5])]
    records.append({"messages": [{"role": "user", "content": "Pick one."}], "choices": [" yes", " no"], "answer": 1})
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"uri": write_set("choices", records, "parquet"),
                                                                     "batch_size": 4})})
    results = score_one(cfg, store, checkpoint=exported["export_uri"], in_process=True)
    assert results["metric"] == "acc" and set(results["metrics"]) == {"acc", "acc_norm"}
    predictions = load_predictions(store, cfg.run_uri, results["label"])

    merged = store.cache_locally(exported["merged_uri"])
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    off_by_one = []
    for record, prediction in zip(records, predictions):
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        choice_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in record["choices"]]
        expected = [reference_choice_logprobs(model, prompt_ids, c) for c in choice_ids]
        np.testing.assert_allclose(prediction["choice_logprobs"], expected, rtol=1e-5, atol=1e-4)
        assert prediction["correct"] == (int(np.argmax(expected)) == record["answer"])
        off_by_one += [abs(reference_choice_logprobs(model, prompt_ids, c, shift=-1) - e)
                       for c, e in zip(choice_ids, expected)]
    # The same check fails a scorer that reads each choice token's logits one position early.
    assert max(off_by_one) > 1e-2


def test_multiple_choice_gathers_on_the_device_and_only_the_sums_reach_the_host(chat_base, monkeypatch):
    """Each choice's whole [T, V] log-softmax went to the CPU; now the gather runs where the logits
    are, and nothing as wide as the vocabulary is moved to the host."""
    from transformers import AutoModelForCausalLM

    from app.eval.engine import ScoreEval

    settings = {"kind": "multiple_choice", "pad_id": 0}
    scorer = ScoreEval(None, "us-east-1", {"kind": "base", "model_uri": chat_base}, {"mc": settings}, use_gpu=False)
    vocab = scorer.model.config.vocab_size
    rows = [{"uid": 0, "input_ids": [5, 17, 30, 8], "choice_ids": [[40], [41, 42], [43, 44, 45]]},
            {"uid": 1, "input_ids": [9, 12], "choice_ids": [[60, 61, 62, 63], [70]]}]
    moved = []
    for name in ("cpu", "numpy", "tolist"):
        original = getattr(torch.Tensor, name)

        def recording(self, *args, _original=original, **kwargs):
            moved.append(tuple(self.shape))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, recording)
    out = scorer.score(rows, settings)
    monkeypatch.undo()
    assert moved and not [shape for shape in moved if shape and shape[-1] == vocab], moved
    model = AutoModelForCausalLM.from_pretrained(Store().cache_locally(chat_base), dtype=torch.float32).eval()
    for row, result in zip(rows, out):
        expected = []
        for choice in row["choice_ids"]:
            ids = torch.tensor([row["input_ids"] + choice])
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
            n = len(row["input_ids"])
            expected.append(sum(float(logp[n - 1 + j, t]) for j, t in enumerate(choice)))
        np.testing.assert_allclose(result["choice_logprobs"], expected, rtol=1e-5, atol=1e-4)


def test_choice_rules_follow_lm_eval():
    # The longer choice wins per character, the shorter one in total.
    assert score_choices([-5.0, -4.0], ["much longer", "a"], 1) == {"acc": True, "acc_norm": False}
    assert score_choices([-9.0, -5.0], ["much longer", "a"], 0) == {"acc": False, "acc_norm": True}


# -- rendering -----------------------------------------------------------------------------------


def test_messages_render_as_apply_chat_template_with_the_exports_template(tuned_run):
    from transformers import AutoTokenizer

    from app.eval.run import build_rows, load_source_tokenizer, resolve_source, training_format

    cfg, exported = tuned_run
    store = Store()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is <|im_end|>?"},
                {"role": "assistant", "content": "A marker."}, {"role": "user", "content": "And pass?"}]
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"uri": write_set(
        "render", [{"messages": messages, "answer": "x"}, {"prompt": "Plain?", "answer": "y"}])})})
    source = resolve_source(cfg, store, exported["export_uri"])
    tokenizer = load_source_tokenizer(cfg, store, source)
    renderer = PromptRenderer(tokenizer, tokenizer.chat_template, training_format(cfg, store, tokenizer))
    rows = build_rows(load_eval_set(store, cfg.eval), renderer, batch_size=8)
    exported_tok = AutoTokenizer.from_pretrained(store.cache_locally(exported["merged_uri"]))
    want = [exported_tok.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"]
            for m in (messages, [{"role": "user", "content": "Plain?"}])]
    assert [r["input_ids"] for r in rows] == want
    assert renderer.stop_ids == [exported_tok.eos_token_id, exported_tok.convert_tokens_to_ids("<|im_end|>")]


def test_an_instruction_run_renders_prompts_as_training_did(chat_base):
    """Instruction training put `[bos] + prompt` before the response; a prompt record renders the same."""
    from transformers import AutoTokenizer

    from one_document import tokenize_document

    from app.data.formats import Document

    tokenizer = AutoTokenizer.from_pretrained(Store().cache_locally(chat_base))
    renderer = PromptRenderer(tokenizer, tokenizer.chat_template, "instruction")
    from app.eval.sets import build_record

    record = build_record({"prompt": "Name a loop.", "answer": "for"}, 0, "t:1")
    ids, labels = tokenize_document(tokenizer, Document(" for", "Name a loop."))
    prompt_len = int(np.argmax(np.asarray(labels) != -100))
    assert renderer.ids(record) == list(ids[:prompt_len])
    assert renderer.mode == "instruction prompt"


def test_a_template_that_refuses_the_probe_stops_at_eos_and_says_so(chat_base, caplog):
    """The end-of-turn stop token is found by rendering a probe reply; a template that refuses it
    leaves generation to stop at EOS only, which was silent."""
    import logging

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Store().cache_locally(chat_base))
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no replies here') }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    with caplog.at_level(logging.WARNING, logger="eft.eval"):
        renderer = PromptRenderer(tokenizer, template, "chat")
    assert renderer.stop_ids == [tokenizer.eos_token_id]
    assert "the chat template refuses a probe conversation (TemplateError: no replies here); generation stops at " \
           "EOS only" in caplog.text


# -- the set -------------------------------------------------------------------------------------


def test_bad_records_are_counted_skips_and_over_the_limit_one_line(s3):
    from app.config import EvalConfig

    store = Store()
    records = [{"prompt": "ok", "answer": "a"}, {"answer": "no prompt"}, "{not json",
               {"prompt": "p", "choices": ["a", "b"]}, {"prompt": "p", "choices": ["a", "b"], "answer": 2},
               {"messages": [{"role": "user", "content": "hi"}], "answer": ["x", "y"]}]
    uri = write_set("bad", records)
    eval_set = load_eval_set(store, EvalConfig(uri=uri, max_bad_records=4))
    assert len(eval_set.records) == 2 and eval_set.read == 6
    assert eval_set.skipped == {"neither prompt nor messages": 1, "bad JSON": 1,
                                "choices without an answer index": 1,
                                "answer index 2 out of range for 2 choices": 1}
    assert eval_set.bad_lines[0] == "bad.jsonl:2: neither prompt nor messages"
    with pytest.raises(EvalSetError) as err:
        load_eval_set(store, EvalConfig(uri=uri, max_bad_records=3))
    message = str(err.value)
    assert "\n" not in message and "4 records cannot be scored" in message and "bad.jsonl:2" in message
    assert len(load_eval_set(store, EvalConfig(uri=uri, max_bad_records=4), limit=1).records) == 1


def test_an_empty_answer_is_a_counted_bad_record(s3):
    """An empty accepted answer is in every prediction: `contains` scored the record right
    whatever the model said."""
    from app.config import EvalConfig

    assert score_generation("anything at all", [""], "contains") == (True, None)  # why it cannot be scored
    records = [{"prompt": "p", "answer": "a"}, {"prompt": "p", "answer": ""}, {"prompt": "p", "answer": ["a", " "]},
               {"messages": [{"role": "user", "content": "hi"}], "answer": "\n"}]
    eval_set = load_eval_set(Store(), EvalConfig(uri=write_set("empty-answers", records), metric="contains",
                                                 max_bad_records=3))
    assert [r.where for r in eval_set.records] == ["empty-answers.jsonl:1"]
    assert eval_set.skipped == {"an answer is empty": 3}
    assert eval_set.bad_lines[0] == "empty-answers.jsonl:2: an answer is empty"


def test_a_metric_that_does_not_fit_the_records_is_a_config_error(s3):
    from app.config import EvalConfig

    store = Store()
    gen = write_set("gen-only", [{"prompt": "p", "answer": "a"}])
    mc = write_set("mc-only", [{"prompt": "p", "choices": ["a", "b"], "answer": 0}])
    with pytest.raises(ConfigError, match="eval.metric acc: .* holds generation records"):
        load_eval_set(store, EvalConfig(uri=gen, metric="acc"))
    with pytest.raises(ConfigError, match="eval.metric exact_match: .* holds multiple-choice records"):
        load_eval_set(store, EvalConfig(uri=mc, metric="exact_match"))
    mixed = write_set("mixed", [{"prompt": "p", "answer": "a"}, {"prompt": "p", "choices": ["a", "b"], "answer": 0}])
    with pytest.raises(EvalSetError, match="mixes generation records"):
        load_eval_set(store, EvalConfig(uri=mixed))
    with pytest.raises(ValueError, match="eval.answer_regex"):
        build_config({"name": "x", "model": {"uri": "s3://eft/m"}, "data": {"uri": "s3://eft/d"},
                      "training": {"max_steps": 1}, "storage": {"root_uri": RUNS},
                      "eval": {"uri": gen, "metric": "regex"}})


def test_eval_cli_config_errors_are_one_line(tmp_path, capsys):
    from app.cli import main

    path = tmp_path / "job.yaml"
    path.write_text("name: x\nmodel: {uri: s3://eft/m}\ndata: {uri: s3://eft/d}\ntraining: {max_steps: 1}\n"
                    "storage: {root_uri: s3://eft/r}\neval: {uri: s3://eft/e.jsonl, metric: bleu}\n")
    assert main(["eval", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eft: error:") and "eval.metric" in err and "\n" not in err


def test_bad_suite_configs_are_one_line_each(tmp_path, capsys):
    """A set name used twice (eval.uri is `default`; or a YAML key given twice), a name that cannot
    name a directory, an unknown set in every_checkpoints_sets or --sets: one line each, exit 2 or
    1, before anything is read."""
    from app.cli import main

    head = ("name: x\nmodel: {uri: s3://eft/m}\ndata: {uri: s3://eft/d}\ntraining: {max_steps: 1}\n"
            "storage: {root_uri: s3://eft/r}\n")
    cases = {
        "eval: {uri: s3://eft/e.jsonl, sets: {default: {uri: s3://eft/f.jsonl}}}\n":
            "the set name default is used twice (eval.uri is the set named default)",
        "eval:\n  sets:\n    qa: {uri: s3://eft/e.jsonl}\n    qa: {uri: s3://eft/f.jsonl}\n":
            "key 'qa' is given twice in one mapping (line 9)",
        "eval: {sets: {harness: {uri: s3://eft/e.jsonl}}}\n": "eval.sets.harness: a set name is letters",
        "eval: {sets: {a/b: {uri: s3://eft/e.jsonl}}}\n": "eval.sets.a/b: a set name is letters",
        "eval: {uri: s3://eft/e.jsonl, every_checkpoints_sets: [qa]}\n":
            "eval.every_checkpoints_sets: 'qa' is not a set (sets: default)",
        "eval: {sets: {qa: {uri: s3://eft/e.jsonl, metric: regex}}}\n":
            "eval.sets.qa.metric regex needs eval.sets.qa.answer_regex",
        "eval: {every_checkpoints: 1}\n": "eval: nothing to score (set eval.uri, eval.sets or eval.harness)",
        "eval: {harness: {tasks: [arc_easy]}, every_checkpoints: 1}\n":
            "eval.every_checkpoints: no set to score on checkpoints",
        "eval: {uri: s3://eft/e.jsonl, every_checkpoints: 1, every_checkpoints_sets: []}\n":
            "eval.every_checkpoints: no set to score on checkpoints",
    }
    path = tmp_path / "job.yaml"
    for body, message in cases.items():
        path.write_text(head + body)
        assert main(["eval", str(path)]) == 2, body
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"eft: error: {path}") and message in err and "\n" not in err, (body, err)
    path.write_text(head + "eval: {uri: s3://eft/e.jsonl, sets: {mc: {uri: s3://eft/f.jsonl}}}\n")
    assert main(["eval", str(path), "--sets", "mc,qa"]) == 1
    assert capsys.readouterr().err.strip() == ("eft: error: --sets mc,qa: 'qa' is not a set of eval "
                                               "(sets: default, mc)")
    assert main(["eval", str(path), "--sets", "none", "--no-harness"]) == 1
    assert capsys.readouterr().err.strip() == ("eft: error: nothing to score: no set chosen (--sets) and no harness "
                                               "(eval.harness, or --no-harness)")


def test_named_sets_score_apart_and_together_alike(tuned_run):
    """Two sets on one checkpoint, one after the other: the second leaves the first's predictions
    and results as they were, and the label's summary lists both. Scored together (one pool, one
    model) each set's predictions are those of its evaluation alone. A set's own keys override the
    section's (batch size, tokens), the rest are shared."""
    from app.eval.results import load_summaries

    cfg, exported = tuned_run
    store = Store()
    gen = write_set("suite-gen", [{"prompt": q, "answer": "x"} for q in QUESTIONS[:5]])
    mc = write_set("suite-mc", [{"prompt": q, "choices": [" a list", " a tuple", " None"], "answer": i % 3}
                                for i, q in enumerate(QUESTIONS[:4])])
    suites = cfg.model_copy(update={"name": "eval-suites"})
    suites = build_config({**suites.model_dump(mode="json"), "eval": {
        "max_new_tokens": 12, "batch_size": 3,
        "sets": {"gen": {"uri": gen}, "mc": {"uri": mc, "batch_size": 2}}}})
    run_uri = suites.run_uri
    # The runs' directories differ: copy the checkpoint the label is scored from.
    for name in store.list_files(join(cfg.run_uri, "checkpoint-00000005")):
        store.write_bytes(join(run_uri, "checkpoint-00000005", name),
                          store.read_bytes(join(cfg.run_uri, "checkpoint-00000005", name)))
    label_dir = join(run_uri, "eval", "step-000005")

    def files(set_name: str) -> dict:
        return {n: store.read_bytes(join(label_dir, set_name, n)) for n in ("predictions.jsonl", "results.json")}

    first = run_eval(suites, store, checkpoint="5", in_process=True, sets=["gen"])
    assert list(first["results"]) == ["gen"] and list(first["sets"]) == ["gen"]
    gen_alone = files("gen")
    second = run_eval(suites, store, checkpoint="5", in_process=True, sets=["mc"])
    assert files("gen") == gen_alone, "scoring one set rewrote another's"
    assert sorted(second["sets"]) == ["gen", "mc"] and second["sets"]["gen"]["score"] == first["results"]["gen"]["score"]
    assert second["results"]["mc"]["metric"] == "acc" and second["results"]["mc"]["decoding"]["batch_size"] == 2
    assert first["results"]["gen"]["decoding"]["batch_size"] == 3
    mc_alone = files("mc")
    both = run_eval(suites, store, checkpoint="5", in_process=True)
    assert sorted(both["results"]) == ["gen", "mc"]
    for set_name, alone in (("gen", gen_alone), ("mc", mc_alone)):
        assert files(set_name)["predictions.jsonl"] == alone["predictions.jsonl"], set_name
        assert both["results"][set_name]["score"] == json.loads(alone["results.json"])["score"]
    (summary,) = load_summaries(store, run_uri)
    assert summary["label"] == "step-000005" and summary["step"] == 5
    assert {k: (v["metric"], v["n"]) for k, v in summary["sets"].items()} == {"gen": ("exact_match", 5),
                                                                              "mc": ("acc", 4)}
    assert load_predictions(store, run_uri, "step-000005", "mc")[0]["choices"] == [" a list", " a tuple", " None"]


# -- scoring -------------------------------------------------------------------------------------


def test_generation_metrics():
    assert normalize("  Hello \n  World ") == "hello world"
    assert score_generation(" HELLO  world", ["hello world"], "exact_match") == (True, None)
    assert score_generation(" HELLO  world", ["hello world"], "exact_match", use_normalize=False) == (False, None)
    assert score_generation("it is 42.", ["42"], "contains") == (True, None)
    assert score_generation("The answer: 42.", ["42"], "regex", answer_regex=r"answer:\s*(\d+)") == (True, "42")
    assert score_generation("no number", ["42"], "regex", answer_regex=r"(\d+)") == (False, None)


def test_bootstrap_interval_brackets_the_mean():
    correct = np.array([1] * 30 + [0] * 70)
    low, high = bootstrap_interval(correct, seed=0)
    assert low < 0.3 < high and 0.15 < low and high < 0.45
    assert bootstrap_interval(correct, seed=0) == (low, high)
    with pytest.raises(ValueError, match="0 or 1"):
        bootstrap_interval(np.array([0.5, 1.0]))


def test_the_bootstrap_draws_the_count_right_not_every_record():
    """Resampling the records drew a samples × n index array (800 MB at n = 100k); for right/wrong
    scores the count right in a resample is binomial, drawn directly: the same interval, in a
    few kilobytes."""
    import tracemalloc

    correct = np.array([1] * 130 + [0] * 70)
    rng = np.random.default_rng(1)
    by_records = correct[rng.integers(0, correct.size, size=(20000, correct.size))].mean(axis=1)
    want = np.percentile(by_records, [2.5, 97.5])
    np.testing.assert_allclose(bootstrap_interval(correct, seed=0, samples=20000), want, atol=0.012)
    many = np.arange(20_000) % 3 == 0
    tracemalloc.start()
    try:
        low, high = bootstrap_interval(many, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert low < many.mean() < high and high - low < 0.02
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB"  # the index array alone was 160 MB here


# -- results in status and report ----------------------------------------------------------------


def test_status_and_report_show_base_against_tuned(tuned_run):
    from app.report import build_status, load_run, save_report

    cfg, exported = tuned_run
    store = Store()
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"uri": write_set(
        "report", [{"prompt": q, "answer": "x"} for q in QUESTIONS[:4]])})})
    score_one(cfg, store, checkpoint="base", in_process=True)
    score_one(cfg, store, checkpoint="latest", in_process=True)
    labels = [r["label"] for r in load_results(store, cfg.run_uri)]
    assert labels[0] == "base" and "step-000005" in labels
    run = load_run(store, cfg.run_uri)
    status = build_status(run)
    assert status["eval"]["base"]["label"] == "base"
    assert status["eval"]["latest"]["label"] in ("step-000005", "export-step-000005")
    assert any("eval_default_exact_match" in row for row in run["metrics"] if row.get("step") == 5)
    assert status["eval"]["grid"]["labels"][0] == "base" and status["eval"]["grid"]["rows"][0]["name"] == "default"
    from rich.console import Console

    from app.report import build_grid_table, build_status_rows

    console = Console(record=True, width=200)
    console.print(build_grid_table(status["eval"]["grid"]))
    shown = console.export_text()
    base = status["eval"]["sets"]["default"]["base"]
    assert "set / task" in shown and "step-000005" in shown
    assert f"{base['score']:.3f} ({base['interval'][0]:.3f}-{base['interval'][1]:.3f})" in shown
    # The first line is the default set's (other tests of this module's run may add a harness line).
    line = dict(build_status_rows(status))["eval"].splitlines()[0]
    latest = status["eval"]["sets"]["default"]["latest"]
    assert line == (f"default: {latest['metric']} {latest['score']:.3f} (95% {latest['interval'][0]:.3f}-"
                    f"{latest['interval'][1]:.3f}, n={latest['n']}) at {latest['label']}; base {base['score']:.3f}")
    written = save_report(store, run)
    assert join(cfg.run_uri, "report", "eval.png") in written
    markdown = store.read_text(join(cfg.run_uri, "report", "report.md"))
    assert "## Evaluation" in markdown and "| prompt | answer | base |" in markdown
    assert "| set / task | metric | base | step-000005 |" in markdown
    assert "### Examples of set default" in markdown and QUESTIONS[0] in markdown


def test_the_demo_task_holds_out_numbers_it_never_trains_on():
    import re

    from app.dev.tasks import build_task_records

    train, held = build_task_records(4000, 100)
    assert (len(train), len(held)) == (4000, 100)
    trained = {int(re.search(r"\d+", c["messages"][0]["content"]).group()) for c in train}
    numbers = [int(re.search(r"\d+", e["prompt"]).group()) for e in held]
    assert len(set(numbers)) == 100 and not trained & set(numbers)
    assert all(e["answer"] == ("odd" if n % 2 else "even") for e, n in zip(held, numbers))
    assert {e["answer"] for e in held} == {"odd", "even"}
    assert all(c["messages"][1]["content"] == ("odd" if n % 2 else "even")
               for c, n in zip(train, (int(re.search(r"\d+", c["messages"][0]["content"]).group()) for c in train)))
    assert build_task_records(4000, 100) == (train, held)
