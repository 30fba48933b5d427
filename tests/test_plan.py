"""`eft plan`: memory per worker by component, the parallelism `auto` picks from it, the reference
jobs' conclusions, and one prediction checked against a measured peak of real training steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config import ConfigError, build_config, load_config
from app.plan import GIB, as_config, build_plan, choose_parallelism, estimate_memory

CONFIGS = Path(__file__).resolve().parents[1] / "jobs" / "configs"
SMALL = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
         "tie_word_embeddings": False}
# Blocks outweigh the embeddings here, as in real models.
DEEP = {**SMALL, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 16}
# The published configs of the reference jobs' models, as they ship with eft for planning.
MODELS = Path(__file__).resolve().parents[1] / "jobs" / "models"
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def job(lora=True, use_gpu=True, workers=(8, 8), **training):
    return build_config({
        "name": "plan-test", "model": {"uri": "/tmp/plan-test-model"},
        "lora": {"r": 16, "target_modules": ALL_LINEAR} if lora else None,
        "data": {"uri": "/tmp/plan-test/data", "seq_len": 2048},
        "training": {"max_steps": 1, "global_batch_size": 48, "micro_batch_size": 1, **training},
        "scaling": {"min_workers": workers[0], "max_workers": workers[1], "use_gpu": use_gpu},
        "storage": {"root_uri": "/tmp/plan-test/runs"},
    })


def test_fsdp_shards_scale_with_the_world_size_and_ddp_replicates():
    cfg = job(lora=False)
    fsdp = {w: estimate_memory(cfg, SMALL, w, "fsdp") for w in (1, 2, 4, 8)}
    ddp = {w: estimate_memory(cfg, SMALL, w, "ddp") for w in (1, 8)}
    for w in (2, 4, 8):
        for part in ("parameters", "gradients", "optimizer_state"):
            # Within FSDP2's dim-0 padding of each parameter.
            assert getattr(fsdp[w], part) == pytest.approx(getattr(fsdp[1], part) / w, rel=0.01), (part, w)
    assert fsdp[8].total_bytes < fsdp[1].total_bytes
    for part in ("parameters", "gradients", "optimizer_state", "sharding", "total_bytes"):
        assert getattr(ddp[8], part) == getattr(ddp[1], part)
    # Activations do not shard: each worker runs its own micro-batch.
    assert fsdp[8].activations == fsdp[1].activations


def test_lora_needs_far_less_than_a_full_fine_tune():
    lora, full = estimate_memory(job(lora=True), DEEP, 8, "ddp"), estimate_memory(job(lora=False), DEEP, 8, "ddp")
    assert lora.gradients < full.gradients / 20 and lora.optimizer_state < full.optimizer_state / 20
    assert lora.allocated_bytes < full.allocated_bytes / 2


def test_chunked_loss_far_below_the_full_loss_at_a_big_vocabulary():
    big_vocab = {**SMALL, "vocab_size": 128256}
    # 4096 tokens a micro-batch, chunks of 1024.
    full = estimate_memory(job(loss="full", micro_batch_size=2), big_vocab, 8, "fsdp")
    chunked = estimate_memory(job(loss="chunked", micro_batch_size=2), big_vocab, 8, "fsdp")
    assert chunked.loss < full.loss / 4
    assert chunked.allocated_bytes < full.allocated_bytes / 2


def test_activation_checkpointing_and_qlora_cut_what_they_should():
    plain = estimate_memory(job(), DEEP, 1, "fsdp")
    assert estimate_memory(job(activation_checkpointing=True), DEEP, 1, "fsdp").activations < plain.activations / 2
    nf4 = build_config({**job().model_dump(mode="json"), "lora": {"r": 16, "target_modules": ALL_LINEAR,
                                                                  "quantize_base": "nf4"}})
    # The blocks' linears, 61% of this base, go from 2 bytes (bf16) to ~0.52.
    assert estimate_memory(nf4, DEEP, 1, "fsdp").parameters < plain.parameters * 0.6


def test_auto_picks_ddp_when_it_fits_and_fsdp_when_not():
    cfg = job(workers=(2, 8), global_batch_size=8, pad_uneven_batches=True)
    ddp = estimate_memory(cfg, SMALL, 2, "ddp").total_bytes
    fsdp = {w: estimate_memory(cfg, SMALL, w, "fsdp").total_bytes for w in range(2, 9)}
    roomy = build_plan(cfg, SMALL, int(ddp / 0.9) + GIB)
    assert roomy.choice == "ddp" and f"{ddp / GIB:.1f} GiB" in roomy.why
    tight = build_plan(cfg, SMALL, int((ddp - 1) / 0.9))
    assert tight.choice == "fsdp" and tight.fits("fsdp", 8) and not tight.fits("ddp", 2)
    assert f"{ddp / GIB:.1f} GiB" in tight.why and f"{max(fsdp.values()) / GIB:.1f} GiB" in tight.why


def test_a_range_crossing_the_ddp_boundary_runs_fsdp_throughout(monkeypatch):
    import app.plan as plan

    real = plan.estimate_memory
    cfg = job(workers=(2, 4), global_batch_size=8, pad_uneven_batches=True)
    budget = 10 * GIB

    def ddp_fits_only_at_two(cfg, model_config, world, parallelism):
        e = real(cfg, model_config, world, parallelism)
        if parallelism == "ddp":
            return e.__class__(**{**e.__dict__, "total_bytes": GIB if world == 2 else 20 * GIB})
        return e

    monkeypatch.setattr(plan, "estimate_memory", ddp_fits_only_at_two)
    crossing = build_plan(cfg, SMALL, int(budget / 0.9))
    assert crossing.choice == "fsdp"
    assert "DDP fits only at 2..2 workers, so the range runs FSDP2 throughout" in crossing.why


def test_cpu_workers_resolve_auto_to_fsdp_without_reading_the_model():
    cfg = load_config(CONFIGS / "tiny-cpu.yaml", ["model.uri=s3://no-such-bucket/model", "training.parallelism=auto"])
    assert cfg.training.parallelism == "auto"
    parallelism, why = choose_parallelism(cfg)
    assert parallelism == "fsdp" and "CPU" in why
    assert choose_parallelism(job(parallelism="ddp"))[0] == "ddp"


def test_gpu_memory_on_cpu_workers_is_rejected_naming_the_key():
    with pytest.raises(ConfigError, match=r"scaling\.gpu_memory_gib"):
        load_config(CONFIGS / "tiny-cpu.yaml", ["scaling.gpu_memory_gib=80"])
    with pytest.raises(ConfigError, match=r"scaling\.gpu_memory_gib"):
        load_config(CONFIGS / "llama3-8b-lora.yaml", ["scaling.gpu_memory_gib=0"])


def write_model_config(directory: Path, tree: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tree))
    return str(directory)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from app.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_json_and_its_one_line_errors(tmp_path, capsys):
    model = write_model_config(tmp_path / "small", SMALL)
    config = str(CONFIGS / "llama3-8b-lora.yaml")
    code, out, _ = run_cli(capsys, "plan", config, "--json", "--set", f"model.uri={model}")
    assert code == 0
    plan = json.loads(out)
    assert plan["choice"] == "ddp" and plan["gpu_memory_from"] == "scaling.gpu_memory_gib"
    assert {(e["parallelism"], e["world"]) for e in plan["estimates"]} == {("ddp", 8), ("fsdp", 8)}
    assert all(e["fits"] and e["total_bytes"] > 0 for e in plan["estimates"])

    code, out, _ = run_cli(capsys, "plan", config, "--set", f"model.uri={model}", "--node-type", "g5.12xlarge")
    assert code == 0 and "A10G-24GB" in out and "training.parallelism auto -> " in out

    code, _, err = run_cli(capsys, "plan", config, "--set", f"model.uri={model}", "--node-type", "dgx-9000")
    assert code != 0 and "--node-type: unknown node type 'dgx-9000'" in err and err.count("\n") == 1
    missing = tmp_path / "nowhere"
    code, _, err = run_cli(capsys, "plan", config, "--set", f"model.uri={missing}")
    assert code != 0 and f"{missing}/config.json: cannot read the model config" in err and err.count("\n") == 1


@pytest.mark.parametrize("name, model_dir, node_type, expected", [
    # The conclusions the configs' comments quote from `eft plan`.
    ("llama3-70b-lora", "Meta-Llama-3-70B", "p4d.24xlarge", {("fsdp", 16): True, ("fsdp", 32): True,
                                                             ("ddp", 16): False, ("ddp", 32): False,
                                                             "choice": "fsdp"}),
    ("llama3-8b-lora", "Meta-Llama-3-8B", "p5.48xlarge", {("fsdp", 8): True, ("ddp", 8): True, "choice": "ddp"}),
    ("llama3-8b-dpo", "Meta-Llama-3-8B", "p5.48xlarge", {("fsdp", 8): True, ("ddp", 8): True, "choice": "ddp"}),
])
def test_reference_jobs_fit_as_their_configs_say(monkeypatch, capsys, name, model_dir, node_type, expected):
    """Planned from the published config.json that ships in jobs/models/, with no bucket at all:
    storage points at a closed port, which any storage read would fail on."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    model = str(MODELS / model_dir)
    assert f"--set model.uri=jobs/models/{model_dir}" in (CONFIGS / f"{name}.yaml").read_text()
    code, out, _ = run_cli(capsys, "plan", str(CONFIGS / f"{name}.yaml"), "--json", "--node-type", node_type,
                           "--set", f"model.uri={model}")
    assert code == 0
    plan = json.loads(out)
    fits = {(e["parallelism"], e["world"]): e["fits"] for e in plan["estimates"]}
    assert plan["choice"] == expected.pop("choice")
    assert {key: fits[key] for key in expected} == expected
    # auto decides the same from the config alone (its scaling.gpu_memory_gib is that GPU's).
    cfg = load_config(CONFIGS / f"{name}.yaml", [f"model.uri={model}"])
    assert cfg.training.parallelism == "auto" and choose_parallelism(cfg)[0] == plan["choice"]
    quoted = (CONFIGS / f"{name}.yaml").read_text()
    for e in plan["estimates"]:
        if e["world"] in (8, 16, 32):
            label = "DDP" if e["parallelism"] == "ddp" else "FSDP2"
            assert f"{label} {e['world']}: {e['total_bytes'] / GIB:.1f} GiB" in quoted, (label, e["world"])


def test_prediction_matches_a_measured_peak_within_20_percent(tmp_path):
    """One small model, world 1, FSDP2 and full fine-tuning: the real build and steps, measured."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.dev.memory import measure_training_peak

    tree = {**SMALL, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": 16000}
    model_dir = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in tree.items() if k != "model_type"})).save_pretrained(model_dir)
    cfg = build_config({
        "name": "plan-measured", "model": {"uri": str(model_dir)}, "lora": None,
        "data": {"uri": str(tmp_path / "data"), "seq_len": 256},
        "training": {"max_steps": 2, "global_batch_size": 1, "loss": "full", "parallelism": "fsdp"},
        "scaling": {"min_workers": 1, "max_workers": 1}, "storage": {"root_uri": str(tmp_path / "runs")},
    })
    predicted = estimate_memory(cfg, json.loads((model_dir / "config.json").read_text()), 1, "fsdp").total_bytes
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        measured = measure_training_peak(cfg, rank=0, world=1)["peak_bytes"]
    finally:
        dist.destroy_process_group()
    assert abs(predicted / measured - 1) <= 0.20, (predicted, measured)


def test_a_precomputed_reference_plans_as_sft_and_a_live_one_adds_a_forward_phase():
    """DPO on precomputed log-probs holds one model: the plan's peaks are the SFT job's at the same
    shape. The live reference adds a no-grad forward phase below the peak, and says what it costs."""
    model = str(MODELS / "Meta-Llama-3-8B")
    dpo = load_config(CONFIGS / "llama3-8b-dpo.yaml", [f"model.uri={model}"])
    sft = load_config(CONFIGS / "llama3-8b-dpo.yaml", [f"model.uri={model}", "training.objective=sft",
                                                        "prepare.format=instruction", "preference.reference=null"])
    llama = as_config(json.loads((MODELS / "Meta-Llama-3-8B" / "config.json").read_text()))
    plans = {name: build_plan(cfg, llama, 80 * GIB) for name, cfg in (("dpo", dpo), ("sft", sft))}
    for key, estimate in plans["sft"].estimates.items():
        assert plans["dpo"].estimates[key].total_bytes == estimate.total_bytes
    assert plans["sft"].reference is None and "holds one model" in plans["dpo"].reference
    live = load_config(CONFIGS / "llama3-8b-dpo.yaml", [f"model.uri={model}", "preference.reference=live"])
    assert estimate_memory(live, llama, 8, "fsdp").peak_phase == "backward start"
    assert "adapters disabled" in build_plan(live, llama, 80 * GIB).reference
