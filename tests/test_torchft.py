"""The core of the replicas-mode prototype (bench/torchft_replicas.py) without Ray: two torchft
replica groups over gloo, one SIGKILLed mid-step, the survivor committing on alone, a
replacement healing from it. Real torchft lighthouse, managers and process groups."""

from __future__ import annotations

import numpy as np

from bench.torchft_replicas import GLOBAL_BATCH, check_replicas, read_logs, run_group_process

STEPS, DIE_AT, HOLD_AT = 14, 4, 8


def build_inputs(tmp_path):
    """A tiny Llama in HF format and a table of packed rows with a fixed per-step order."""
    from app.dev.tiny import build_corpus, build_tiny_model, build_tiny_tokenizer, pack_blocks

    texts = build_corpus(max_docs=80)
    tokenizer = build_tiny_tokenizer(texts, vocab_size=300)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    blocks = pack_blocks(tokenizer, texts, 32).numpy()
    rng = np.random.default_rng(0)
    step_rows = np.concatenate([rng.permutation(len(blocks)) for _ in range(3)])[:STEPS * GLOBAL_BATCH]
    np.savez(tmp_path / "rows.npz", row_id=np.arange(len(blocks)) + 1000, input_ids=blocks, labels=blocks,
             step_rows=step_rows.reshape(STEPS, GLOBAL_BATCH))
    return step_rows.reshape(STEPS, GLOBAL_BATCH) + 1000


def test_survivor_commits_alone_and_replacement_heals(tmp_path, rank_processes):
    from torchft.coordination import LighthouseServer

    step_ids = build_inputs(tmp_path)
    (tmp_path / "logs").mkdir()
    config = {"data": str(tmp_path / "rows.npz"), "base_dir": str(tmp_path / "base"), "lr": 1e-2,
              "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "min_replicas": 1,
              "groups": 2, "log_dir": str(tmp_path / "logs"), "die_group": 1, "die_at": DIE_AT, "hold_at": HOLD_AT}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=1000)
    ctx = rank_processes.get_context("spawn")
    try:
        procs = [ctx.Process(target=run_group_process, args=(g, config, lighthouse.address())) for g in (0, 1)]
        for p in procs:
            p.start()
        procs[1].join(timeout=120)
        assert procs[1].exitcode == -9, "group 1 was to SIGKILL itself mid-step"
        replacement = ctx.Process(target=run_group_process, args=(1, config, lighthouse.address()))
        replacement.start()
        for p in (procs[0], replacement):
            p.join(timeout=120)
            assert p.exitcode == 0
    finally:
        for p in [*procs, replacement] if "replacement" in locals() else procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()

    records = [r for r in read_logs(tmp_path / "logs") if r["kind"] == "step"]
    survivor = [r for r in records if r["group"] == 0]
    # The step the killed group was in failed for the survivor and was retried with the same rows.
    assert any(r["step"] == DIE_AT and not r["committed"] for r in survivor)
    alone = [r["step"] for r in survivor if r["committed"] and r["participants"] == 1]
    assert DIE_AT in alone and len(alone) >= HOLD_AT - DIE_AT
    late = sorted((r for r in records if r["group"] == 1 and r["pid"] == replacement.pid), key=lambda r: r["t0"])
    assert late and late[0]["healed"] and late[0]["step"] >= HOLD_AT
    assert all(r["participants"] == 2 for r in late if r["committed"])

    checked = check_replicas({"records": records, "log_dir": str(tmp_path / "logs")}, step_ids)
    assert checked["exactly_once"], "every row of every step consumed once, at 1 or 2 participants"
    assert checked["steps_committed"] == STEPS
    assert checked["final_groups"] == 2 and checked["final_weights_identical"]
