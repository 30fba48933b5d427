"""`eval.harness`: lm-evaluation-harness tasks scored by eft's model (app/eval/harness.py) against
lm-eval's own Hugging Face model (`HFLM`) on the same merged export directory.

Three tiny local tasks, one of each request kind (multiple choice by log-likelihood,
`generate_until`, `loglikelihood_rolling`), with their data in local JSONL files
(`dataset_path: json`), so nothing touches the network.
The parity runs on the Ray Data actor pool through `eft eval`, at 1 actor and at 2 with one lost
(the cluster tier); a bad harness config is one line before any model (the fast tier).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from app.eval.harness import HarnessError, check_harness
from app.storage import Store, join
from test_eval import QUESTIONS, chat_base, make_cfg, tuned_run, write_set  # noqa: F401: fixtures

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]
WORDS = ["list", "tuple", "import", "class", "return", "loop", "None", "with"]


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path_factory, monkeypatch):
    """lm-eval reads the tasks' data through `datasets`: its cache in a temporary directory, no hub."""
    cache = tmp_path_factory.getbasetemp() / "hf-datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The three tasks' YAMLs and their JSONL data: what `eval.harness.include_path` names."""
    root = tmp_path_factory.mktemp("harness-tasks")
    docs = [{"question": q, "choices": [f" {w}" for w in WORDS[i % 4:i % 4 + 3]], "answer": i % 3,
             "target": WORDS[i], "text": f"{q} A {WORDS[i]} is a word of Python."}
            for i, q in enumerate(QUESTIONS)]
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(root / "docs.jsonl")}},
              "test_split": "test"}
    tasks = {
        "tiny_mc": {"output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
                    "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                    "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
        "tiny_gen": {"output_type": "generate_until", "doc_to_text": "Q: {{question}}\nA:",
                     "doc_to_target": "{{target}}",
                     "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 10, "do_sample": False},
                     "metric_list": [{"metric": "exact_match", "ignore_case": True}]},
        "tiny_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]},
    }
    for name, body in tasks.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **common, **body}))
    return root


def harness_cfg(cfg, task_dir: Path, **keys):
    # No max_length: both models take the merged export's own context length, by lm-eval's rule.
    harness = {"tasks": TASKS, "include_path": str(task_dir), "batch_size": 3, **keys}
    return cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"harness": harness_config(harness)})})


def harness_config(tree: dict):
    from app.config import HarnessConfig

    return HarnessConfig.model_validate(tree)


@pytest.fixture(scope="module")
def hflm_reference(tuned_run, task_dir):
    """lm-eval's own HFLM on the merged export directory: its per-sample responses by task."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    _, exported = tuned_run
    merged = Store().cache_locally(exported["merged_uri"])
    model = HFLM(pretrained=str(merged), batch_size=1, device="cpu", dtype="float32")
    results = simple_evaluate(model=model, tasks=TASKS, task_manager=TaskManager(include_path=str(task_dir)),
                              log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                              fewshot_random_seed=0)
    return results


def responses(samples: list[dict]) -> list:
    """(doc_id, resps) of each sample: what the model answered to each request, in doc order."""
    return [(s["doc_id"], s["resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]


def assert_same_samples(ours: dict, reference: dict, tasks: list[str] = TASKS) -> None:
    """Per sample and request: the same log-likelihoods within fp32 tolerance, the same greedy
    flags, the same generated text; and so the same metrics."""
    for task in tasks:
        mine, theirs = responses(ours[task]), responses(reference[task])
        assert [d for d, _ in mine] == [d for d, _ in theirs] and len(mine) == len(QUESTIONS)
        for (_, a), (_, b) in zip(mine, theirs):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                x, y = x[0], y[0]
                if isinstance(y, str):
                    assert x == y
                elif isinstance(y, (list, tuple)):  # (loglikelihood, is_greedy)
                    assert float(x[0]) == pytest.approx(float(y[0]), rel=1e-5, abs=1e-4) and bool(x[1]) == bool(y[1])
                else:  # a rolling log-likelihood
                    assert float(x) == pytest.approx(float(y), rel=1e-5, abs=1e-4)


def read_samples(store: Store, run_uri: str, label: str, tasks: list[str] = TASKS) -> dict:
    out = {}
    for task in tasks:
        text = store.read_text(join(run_uri, "eval", label, "harness", f"samples_{task}.jsonl"))
        out[task] = [json.loads(line) for line in text.splitlines() if line.strip()]
    return out


def check_stored_harness(store: Store, cfg, label: str, hflm_reference: dict, num_actors: int,
                         tasks: list[str] = TASKS) -> None:
    """The samples are HFLM's, so are the metrics; lm-eval's JSON and the label's summary say so."""
    from app.eval.results import load_harness, load_summaries

    ours = read_samples(store, cfg.run_uri, label, tasks)
    assert_same_samples(ours, hflm_reference["samples"], tasks)
    # The generation task really generated: a model that says nothing cannot tell bugs apart.
    assert len({s["resps"][0][0] for s in ours["tiny_gen"]}) > 1
    stored = load_harness(store, cfg.run_uri, label)
    for task in tasks:
        for key, value in hflm_reference["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert stored["results"][task][key] == pytest.approx(value, rel=1e-4, abs=1e-4), (task, key)
    assert stored["eft"]["label"] == label and stored["eft"]["checkpoint"]["kind"] == "export"
    assert stored["eft"]["num_actors"] == num_actors
    (summary,) = [s for s in load_summaries(store, cfg.run_uri) if s["label"] == label]
    assert set(summary["harness"]) == set(tasks)
    assert summary["harness"]["tiny_mc"]["metric"] == "acc" and summary["harness"]["tiny_mc"]["n"] == len(QUESTIONS)
    assert summary["harness"]["tiny_gen"]["metric"] == "exact_match"
    assert summary["harness"]["tiny_mc"]["score"] == stored["results"]["tiny_mc"]["acc,none"]
    if "tiny_ppl" in tasks:
        assert summary["harness"]["tiny_ppl"]["metric"] == "word_perplexity"


def test_the_chat_template_renders_as_lm_evals_own(tuned_run, task_dir):
    """`apply_chat_template`: lm-eval renders each request as a conversation through the model's
    template; eft's model renders it with eft's own chat code (what training and serving use), and
    the requests and answers are those of lm-eval's HF model rendering it with transformers'. In
    this process (the actor's class and batches), on the multiple-choice task."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from app.eval.run import run_eval

    cfg, exported = tuned_run
    store = Store()
    chat = harness_cfg(cfg, task_dir, tasks=["tiny_mc"], apply_chat_template=True)
    summary = run_eval(chat, store, checkpoint=exported["export_uri"], in_process=True, sets=[])
    ours = read_samples(store, cfg.run_uri, summary["label"], ["tiny_mc"])
    model = HFLM(pretrained=str(store.cache_locally(exported["merged_uri"])), batch_size=1, device="cpu",
                 dtype="float32")
    reference = simple_evaluate(model=model, tasks=["tiny_mc"], task_manager=TaskManager(include_path=str(task_dir)),
                                log_samples=True, apply_chat_template=True, random_seed=0, numpy_random_seed=0,
                                torch_random_seed=0, fewshot_random_seed=0)["samples"]
    contexts = [s["arguments"][0][0] for s in sorted(ours["tiny_mc"], key=lambda s: s["doc_id"])]
    assert all(c.startswith("<|im_start|>user\n") for c in contexts), contexts[0]
    assert contexts == [s["arguments"][0][0] for s in sorted(reference["tiny_mc"], key=lambda s: s["doc_id"])]
    assert_same_samples(ours, reference, ["tiny_mc"])


def test_bad_harness_config_is_one_line_before_any_model(tuned_run, task_dir, monkeypatch, tmp_path, capsys):
    from app.cli import main

    cfg, _ = tuned_run
    with pytest.raises(HarnessError) as unknown:
        check_harness(harness_config({"tasks": ["tiny_mc", "no_such_task"], "include_path": str(task_dir)}))
    assert str(unknown.value).startswith("eval.harness.tasks: lm-eval: Tasks not found: no_such_task")
    with pytest.raises(HarnessError, match=r"^eval.harness.include_path .*/nowhere: not a directory"):
        check_harness(harness_config({"tasks": ["tiny_mc"], "include_path": str(tmp_path / "nowhere")}))
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as on a machine without the extra
    with pytest.raises(HarnessError) as missing:
        check_harness(harness_config({"tasks": ["tiny_mc"]}))
    assert str(missing.value) == ("eval.harness: lm-evaluation-harness is not installed "
                                  "(pip install 'eft[harness]')")
    path = tmp_path / "job.yaml"
    tree = cfg.model_dump(mode="json")
    tree["eval"]["harness"] = {"tasks": ["tiny_mc"], "include_path": str(task_dir)}
    path.write_text(yaml.safe_dump(tree))
    assert main(["eval", str(path), "--sets", "none"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "eft: error: eval.harness: lm-evaluation-harness is not installed (pip install 'eft[harness]')"


def test_the_harness_on_the_actor_pool_at_1_and_2_actors_one_lost_equals_hflm(
        ray_cluster, tuned_run, task_dir, hflm_reference, tmp_path, monkeypatch, caplog):
    """`eft eval --sets none` runs the harness alone on the Ray Data pool: at 1 actor (every request
    kind), then at 2 with one actor's process exiting at its first batch (its node reclaimed; the
    log-likelihood and generation tasks, a pool each); both give HFLM's per-sample results, and the
    loss costs only the batches that actor had not returned."""
    import app.eval.engine as engine
    from app.cli import main
    from app.dev.faults import ExitOnce

    cfg, exported = tuned_run
    store = Store()
    path = tmp_path / "job.yaml"
    tree = harness_cfg(cfg, task_dir).model_dump(mode="json")
    path.write_text(yaml.safe_dump(tree))
    assert main(["eval", str(path), "--checkpoint", exported["export_uri"], "--sets", "none"]) == 0
    check_stored_harness(store, cfg, "export-step-000005", hflm_reference, num_actors=1)

    marker = tmp_path / "exited"
    monkeypatch.setattr(engine, "ScoreEval", type("ExitingScoreEval", (ExitOnce, engine.ScoreEval),
                                                  {"marker": str(marker)}))
    with caplog.at_level("WARNING", logger="eft.cluster"):
        assert main(["eval", str(path), "--checkpoint", exported["export_uri"], "--sets", "none",
                     "--set", "eval.num_actors=2", "--set", "eval.harness.tasks=[tiny_mc, tiny_gen]"]) == 0
    assert marker.exists()
    assert any("an actor was lost (ActorDiedError)" in r.getMessage() for r in caplog.records)
    check_stored_harness(store, cfg, "export-step-000005", hflm_reference, num_actors=2,
                         tasks=["tiny_mc", "tiny_gen"])
