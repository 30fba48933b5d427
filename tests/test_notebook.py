"""notebooks/finetune.ipynb, executed top to bottom by a real Jupyter kernel against this
session's S3 endpoint and Ray cluster, with small settings injected after its parameters cell: one
run of the chat job (the notebook's rank sweep at one rank), watched live, compared, exported,
sampled through its adapter, asked through its chat template and scored against the base."""

from __future__ import annotations

import ast
import os
import re
import uuid
from pathlib import Path

import nbformat
import pytest

from app.config import load_config
from app.storage import Store, join

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "finetune.ipynb"
CONFIG = ROOT / "jobs" / "configs" / "tiny-chat.yaml"
STEPS = 4
# One run: the rank sweep's cells (watch the first, train the others, compare, export the best)
# all run on it; more ranks would add runs, not code paths.
RANKS = [8]


def tagged(nb, tag: str):
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def stdout_of(cell) -> str:
    """What the cell printed, without stderr: progress bars there would split its lines."""
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.get("name") == "stdout")


def shown_text(cell) -> str:
    """Streams plus the text/plain of displays: rich prints to a Jupyter kernel as a display."""
    return text_of(cell) + "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs
                                   if o.output_type in ("display_data", "execute_result"))


def has_png(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.outputs)


def test_committed_notebook_is_valid_and_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0] is tagged(nb, "parameters")
    assert all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.fixture(scope="module")
def executed(s3, ray_cluster, base_cache):
    """The notebook run once: one LoRA run of STEPS steps of the chat job, watched live. The kernel
    joins this session's cluster the way a user's kernel joins `eft local up`'s."""
    from nbclient import NotebookClient

    prefix = f"nbtest-{uuid.uuid4().hex[:6]}"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # As papermill does: a cell right after the `parameters` cell overrides some of its defaults.
    injected = nbformat.v4.new_code_cell("\n".join([
        f"CONFIG = {str(CONFIG)!r}",
        f"MAX_STEPS = {STEPS}",
        f"SAVE_EVERY_STEPS = {STEPS}",
        f"LORA_RANKS = {RANKS!r}",
        f"RUN_PREFIX = {prefix!r}",
        f"BASE_CACHE_DIR = {str(base_cache)!r}",
        # One eval actor: the base, the checkpoint and the export are scored by the same code at
        # any pool size (tests/test_train.py checks 1 against 3); each actor is a process to start.
        # One training worker too: the job's 2-worker FSDP2 run is `make demo`'s
        # (tests/test_local_and_demo.py), and the notebook's cells read the run, not its ranks.
        'OVERRIDES = ["eval.num_actors=1", "scaling.min_workers=1", "scaling.max_workers=1"]',
    ]), metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(nb.cells.index(tagged(nb, "parameters")) + 1, injected)
    # The kernel gets the S3 endpoint and credentials the `s3` fixture put in os.environ.
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)
    return nb, prefix


def run_cfg(prefix: str, rank: int):
    return load_config(CONFIG, [f"name={prefix}-r{rank}"])


def test_notebook_trains_every_rank_and_watches_the_first_live(executed):
    nb, prefix = executed
    store = Store()
    for rank in RANKS:
        cfg = run_cfg(prefix, rank)
        summary = store.read_json(join(cfg.run_uri, "summary.json"))
        assert summary["status"] == "succeeded" and summary["steps"] == STEPS, rank
        assert f"r: {rank}" in store.read_text(join(cfg.run_uri, "config.yaml"))
    watch = tagged(nb, "watch")
    assert has_png(watch)
    # The last frame is drawn after the run ended: the status reports the final step.
    assert f"step {STEPS}/{STEPS}" in text_of(watch)


def test_notebook_compares_the_ranks_on_one_figure(executed):
    nb, _ = executed
    compare = tagged(nb, "compare")
    assert [o for o in compare.outputs if "image/png" in o.get("data", {})], compare.outputs


def test_notebook_exports_the_adapter_and_generates(executed):
    nb, prefix = executed
    store = Store()
    exported = [rank for rank in RANKS if store.exists(join(run_cfg(prefix, rank).run_uri, "export"))]
    assert len(exported) == 1
    printed = re.search(r"^adapter: (\S+)$", "".join(stdout_of(c) for c in nb.cells if c.cell_type == "code"),
                        re.MULTILINE)
    assert printed and f"{prefix}-r{exported[0]}/export/" in printed.group(1)
    assert store.exists(join(printed.group(1), "adapter_config.json"))
    assert store.exists(join(printed.group(1), "adapter_model.safetensors"))
    sample = re.search(r"^sample: (.+)$", stdout_of(tagged(nb, "generate")), re.MULTILINE)
    assert sample and ast.literal_eval(sample.group(1)).strip()


def test_notebook_previews_trains_exports_and_chats(executed):
    nb, prefix = executed
    store = Store()
    (rank,) = RANKS
    summary = store.read_json(join(run_cfg(prefix, rank).run_uri, "summary.json"))
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    # The preview is the ChatML rendering of one conversation, as prepare tokenizes it.
    assert "<|im_start|>user" in shown_text(tagged(nb, "chat-preview"))
    answer_cell = stdout_of(tagged(nb, "chat-answer"))
    printed = "".join(stdout_of(c) for c in nb.cells if c.cell_type == "code")
    merged = re.search(r"^merged: (\S+)$", printed, re.MULTILINE)
    assert merged and f"{prefix}-r{rank}/export/" in merged.group(1)
    assert store.exists(join(merged.group(1), "config.json"))
    prompt = re.search(r"^prompt: (.+)$", answer_cell, re.MULTILINE)
    question = re.search(r"^question: (.+)$", answer_cell, re.MULTILINE)
    answer = re.search(r"^answer: (.+)$", answer_cell, re.MULTILINE)
    assert prompt and question and answer, answer_cell
    question = ast.literal_eval(question.group(1))
    # The exported tokenizer's chat template renders the question as a user turn, then opens the
    # assistant's turn (the generation prompt).
    rendered = ast.literal_eval(prompt.group(1))
    assert question and f"<|im_start|>user\n{question}" in rendered, rendered
    assert rendered.rstrip().endswith("<|im_start|>assistant"), rendered
    assert ast.literal_eval(answer.group(1)).replace("<|im_end|>", "").strip(), answer_cell


def test_notebook_scores_base_and_tuned_on_one_plot(executed):
    """The eval cell scores the base and the export on the held-out task prompts, and plots them
    with the run's own scores of its checkpoints."""
    from app.eval.results import load_results

    nb, prefix = executed
    cell = tagged(nb, "chat-eval")
    assert has_png(cell)
    out = stdout_of(cell)
    scores = re.search(rf"^set default: base exact_match (\S+)% on 100 held-out prompts, tuned (\S+)% "
                       rf"\(the export of step {STEPS}\)$", out, re.MULTILINE)
    assert scores, out
    assert float(scores.group(1)) <= 10.0
    assert len(re.findall(r"^  'Is \d+ even or odd\?' \(answer '(?:even|odd)'\): base .+, tuned .+$", out,
                          re.MULTILINE)) == 3, out
    (rank,) = RANKS
    labels = [r["label"] for r in load_results(Store(), run_cfg(prefix, rank).run_uri)]
    step = f"{STEPS:06d}"
    assert labels == ["base", f"step-{step}", f"export-step-{step}"], labels
