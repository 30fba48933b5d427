"""GRPO's objective and rewards (app/rl), against their formulas written here in float64. No Ray:
the trainer that feeds them (issue 39) runs in the cluster tier."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

from app.rl.loss import STD_EPS, group_advantages, grpo_token_loss
from app.rl.rewards import RewardError, RewardErrors, build_one_reward, build_reward_fn


def test_advantages_are_group_relative_scaled_or_not_and_zero_std_groups_are_counted():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 2.0])  # 3 groups of 3, the middle all right
    scaled = group_advantages(rewards, 3)
    plain = group_advantages(rewards, 3, scale="none")
    for g in range(3):
        part = [float(r) for r in rewards[g * 3:(g + 1) * 3]]
        mean = sum(part) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in part) / 2)  # the sample std, as TRL
        for i, r in enumerate(part):
            assert plain.values[g * 3 + i].item() == pytest.approx(r - mean, abs=1e-6)
            assert scaled.values[g * 3 + i].item() == pytest.approx((r - mean) / (std + STD_EPS), abs=1e-5)
    assert scaled.zero_std.tolist() == [False, True, False] and scaled.keep.all()
    filtered = group_advantages(rewards, 3, filter_zero_std=True)
    assert filtered.keep.tolist() == [True] * 3 + [False] * 3 + [True] * 3
    with pytest.raises(ValueError, match="not whole groups of 4"):
        group_advantages(rewards, 4)


def reference_loss(logp, old, adv, mask, n, clip_low, clip_high, ref=None, beta=0.0) -> float:
    """The objective token by token in float64."""
    total = 0.0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            term = -min(ratio * adv[i], clipped * adv[i])
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                term += beta * (math.exp(d) - d - 1)
            total += term
    return total / n


def test_the_clipped_surrogate_and_k3_equal_their_formula_on_both_clip_sides():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    # Ratios far from 1 both ways, so that both bounds bind somewhere (DAPO's 0.2 / 0.28).
    old = logp + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.5
    ref = logp + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.tensor([1.5, -0.7, 0.0, -2.0], dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False  # padding
    mask[3, :] = False  # a truncated completion under rl.mask_truncated: no loss at all
    n = 40.0  # the global batch's completion tokens: this micro-batch holds only some of them
    out = grpo_token_loss(logp, old, adv, mask, n, clip_low=0.2, clip_high=0.28, ref_logp=ref, kl_beta=0.05)
    want = reference_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), n, 0.2, 0.28, ref.tolist(), 0.05)
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    ratio = torch.exp(logp - old)
    high = (adv[:, None] > 0) & (ratio > 1.28) & mask
    low = (adv[:, None] < 0) & (ratio < 0.8) & mask
    assert high.any() and low.any()  # both sides were exercised
    assert out.clipped_tokens.item() == (high | low).sum().item()
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert out.kl_sum.item() == pytest.approx((k3 * mask).sum().item(), rel=1e-12) and (k3 >= 0).all()
    # Without β the reference changes nothing.
    bare = grpo_token_loss(logp, old, adv, mask, n, 0.2, 0.28, ref_logp=ref, kl_beta=0.0)
    assert bare.loss.item() == pytest.approx(reference_loss(logp.tolist(), old.tolist(), adv.tolist(),
                                                            mask.tolist(), n, 0.2, 0.28), rel=1e-12)


def test_on_policy_the_gradient_is_minus_advantage_times_grad_logp_over_the_global_tokens():
    """At updates_per_batch 1 the old log-probs are the policy's own (ρ = 1): the gradient is
    −Σ A·∇log π / N. Split over two "ranks" (micro-batches) with unequal token counts, each
    divided by the global count, the summed gradients equal the whole batch's: the same at any
    world size."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    inputs = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 7, (3, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.9, -1.3, 0.4], dtype=torch.float64)
    n = float(mask.sum())

    def token_logp(rows):
        logits = inputs[rows] @ weight
        return torch.log_softmax(logits, -1).gather(-1, targets[rows][..., None])[..., 0]

    whole = token_logp(slice(None))
    grpo_token_loss(whole, whole.detach(), adv, mask, n).loss.backward()
    got = weight.grad.clone()
    weight.grad = None
    (-(adv[:, None] * token_logp(slice(None)) * mask).sum() / n).backward()
    assert torch.allclose(got, weight.grad, rtol=1e-12, atol=1e-14)
    weight.grad = None
    for rows in (slice(0, 1), slice(1, 3)):  # rank 0: 4 tokens; rank 1: 3
        part = token_logp(rows)
        grpo_token_loss(part, part.detach(), adv[rows], mask[rows], n).loss.backward()
    assert torch.allclose(got, weight.grad, rtol=1e-12, atol=1e-14)


def test_builtin_rewards_score_as_eval_does():
    record = {"prompt": "Is 7 even or odd?", "answer": "odd"}
    exact = build_one_reward("exact_match")
    assert exact(record["prompt"], "  ODD ", "odd", record) == 1.0 and exact("", "odd.", "odd", record) == 0.0
    assert build_one_reward("contains")("", "It is odd.", ["odd", "uneven"], record) == 1.0
    regex = build_one_reward("regex", answer_regex=r"answer: (\w+)")
    assert regex("", "so the answer: Odd", "odd", record) == 1.0 and regex("", "odd", "odd", record) == 0.0
    with pytest.raises(RewardError, match="^reward regex needs answer_regex"):
        build_one_reward("regex")
    math_ok = build_one_reward("math")
    assert math_ok("", "The answer is $\\frac{1}{2}$", "0.5", record) == 1.0
    assert math_ok("", "The answer is $\\frac{1}{3}$", "0.5", record) == 0.0


def test_user_rewards_combine_and_their_errors_leave_the_record_out_never_scored_zero(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent('''
        def length_penalty(prompt, completion, answer, record):
            return -len(completion) / 100

        def picky(prompt, completion, answer, record):
            if record.get("id") == "bad":
                raise KeyError("no field 'units'")
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    errors = RewardErrors(limit=1)
    score = build_reward_fn([("exact_match", 1.0), ("my_rewards:length_penalty", 0.5), ("my_rewards:picky", 0.1)],
                            errors=errors)
    good = score("q", "odd", {"id": "a", "answer": "odd"})
    assert good.total == pytest.approx(1.0 - 0.5 * 0.03 + 0.1) and good.parts["exact_match"] == 1.0
    bad = score("q", "odd", {"id": "bad", "answer": "odd"})
    assert bad.total is None and bad.parts["my_rewards:picky"] is None
    assert errors.by_reason() == {"my_rewards:picky: KeyError": 1}
    with pytest.raises(RewardError) as over:
        score("q", "odd", {"id": "bad", "answer": "odd"})
    assert str(over.value) == ("reward my_rewards:picky failed 2 times, more than rl.max_reward_errors=1; last on "
                               "record bad: KeyError: \"no field 'units'\"")
    for name, line in [("my_rewards:nope", "reward my_rewards:nope: my_rewards has no function nope"),
                       ("no_such_module:f", "reward no_such_module:f: cannot import no_such_module "
                                            "(ModuleNotFoundError: No module named 'no_such_module')"),
                       ("f1", "reward 'f1': not a built-in (exact_match, contains, regex, math) nor module:function")]:
        with pytest.raises(RewardError) as refused:
            build_reward_fn([(name, 1.0)])
        assert str(refused.value) == line
    with pytest.raises(RewardError, match="^no reward: set rl.reward or rl.rewards$"):
        build_reward_fn([])


@pytest.fixture(scope="module")
def tiny_policy():
    from app.dev.tiny import build_corpus, build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(build_corpus(max_docs=20), vocab_size=300)
    return build_tiny_model(tok).eval(), tok


def test_each_completion_is_drawn_from_its_own_seed_however_the_prompts_are_batched(tiny_policy):
    """One batch of 6, two of 3 in another order, six of 1: the same completions (the prompts
    differ in length, so the padding, and with it every batch's shapes, differ). The step, the
    prompt id and the sample index each change the draw."""
    from app.rl.sampling import completion_seed, sample_completions

    model, tok = tiny_policy
    texts = ["The list", "A class is", "Functions", "The import statement", "If the", "While"]
    prompts = [tok(t)["input_ids"] for t in texts]
    seeds = [completion_seed(0, 3, f"p{i // 2}", i % 2) for i in range(6)]
    kw = dict(max_new_tokens=12, stop_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id,
              temperature=1.0, top_p=0.9)
    whole = sample_completions(model, prompts, seeds, **kw)
    order = [5, 2, 0, 4, 1, 3]
    parts = [sample_completions(model, [prompts[i] for i in half], [seeds[i] for i in half], **kw)
             for half in (order[:3], order[3:])]
    shuffled = {i: (c, t) for half, part in zip((order[:3], order[3:]), parts)
                for i, c, t in zip(half, part.tokens, part.truncated)}
    singles = [sample_completions(model, [p], [s], **kw) for p, s in zip(prompts, seeds)]
    for i in range(6):
        assert shuffled[i] == (whole.tokens[i], whole.truncated[i]), i
        assert singles[i].tokens[0] == whole.tokens[i], i
    assert len(set(map(tuple, whole.tokens))) == 6  # sampled, not greedy: the seeds matter
    assert len({completion_seed(0, 3, "p0", 0), completion_seed(0, 4, "p0", 0), completion_seed(0, 3, "p1", 0),
                completion_seed(0, 3, "p0", 1), completion_seed(1, 3, "p0", 0)}) == 5


def test_completions_stop_at_a_stop_token_and_are_truncated_at_the_limit(tiny_policy):
    from app.rl.sampling import filter_top_p, sample_completions

    model, tok = tiny_policy
    prompt = tok("The list")["input_ids"]
    greedy = sample_completions(model, [prompt], [0], max_new_tokens=8, stop_token_ids={tok.eos_token_id},
                                pad_token_id=tok.pad_token_id, temperature=0)
    first = greedy.tokens[0][0]
    assert len(greedy.tokens[0]) == 8 and greedy.truncated == [True]
    stopped = sample_completions(model, [prompt], [0], max_new_tokens=8, stop_token_ids={first},
                                 pad_token_id=tok.pad_token_id, temperature=0)
    assert stopped.tokens == [[first]] and stopped.truncated == [False]  # the stop token is part of it
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert filter_top_p(probs, 0.7).tolist() == [[0.625, 0.375, 0.0, 0.0]]
    assert filter_top_p(probs, 0.1).tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_rollouts_pack_whole_with_their_advantages_and_score_as_they_would_alone(tiny_policy):
    """Prompt + completion documents packed into rows: only completion tokens are labels, each
    carries its completion's advantage, no document crosses a row, and a completion's token
    log-probs in its packed row equal those of the document alone (document isolation)."""
    from app.batch import IGNORE_INDEX
    from app.model.loss import token_logps
    from app.rl.rollouts import NO_SAMPLE, pack_rollouts

    model, tok = tiny_policy
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 290, (n,), generator=gen).tolist() for n in (5, 3, 7, 4, 6)]
    completions = [torch.randint(5, 290, (n,), generator=gen).tolist() for n in (6, 9, 2, 8, 1)]
    advantages = np.array([0.5, -1.0, 0.25, 2.0, -0.75], dtype=np.float32)
    packed = pack_rollouts(prompts, completions, advantages, seq_len=20, pad_id=tok.pad_token_id)
    ids, labels, positions = (torch.as_tensor(a, dtype=torch.long) for a in packed.rows)
    assert ids.shape[1] == 20 and packed.completion_tokens() == sum(map(len, completions))
    assert ((labels != IGNORE_INDEX) == torch.as_tensor(packed.sample != NO_SAMPLE)).all()
    logps = token_logps(model, ids, labels, None, positions)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rows, cols = np.nonzero(packed.sample == i)
        assert len(set(rows.tolist())) == 1 and labels[rows, cols].tolist() == c  # whole, in order
        assert (packed.advantages[rows, cols] == advantages[i]).all()
        alone_ids = torch.tensor([p + c])
        alone_labels = torch.tensor([[IGNORE_INDEX] * len(p) + c])
        alone = token_logps(model, alone_ids, alone_labels, None)[0, len(p):]
        torch.testing.assert_close(logps[rows, cols], alone, rtol=1e-5, atol=1e-5)
    assert (packed.advantages[packed.sample == NO_SAMPLE] == 0).all()
    with pytest.raises(ValueError, match=r"^rollout 0: prompt \(5\) \+ completion \(6\) tokens exceed data.seq_len 10$"):
        pack_rollouts(prompts, completions, advantages, seq_len=10, pad_id=tok.pad_token_id)


def test_a_full_fine_tunes_kl_reference_is_a_frozen_copy_of_the_base(tiny_policy):
    """Without LoRA the reference is a frozen copy (app/model/build.py's `frozen`): at the base's
    weights the KL is 0 exactly, and once the policy moves it is k3 of the two models' token
    log-probs; the copy gets no gradient and does not move."""
    import copy

    from app.batch import IGNORE_INDEX
    from app.config import build_config
    from app.model.loss import token_logps
    from app.rl.rollouts import pack_rollouts
    from app.train.objective import build_objective

    model, tok = tiny_policy
    policy = copy.deepcopy(model).train()
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    cfg = build_config({**GRPO_JOB, "rl": {"reward": "exact_match", "kl_beta": 0.1}})
    objective = build_objective(cfg, reference)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 290, (n,), generator=gen).tolist() for n in (4, 6, 3)]
    completions = [torch.randint(5, 290, (n,), generator=gen).tolist() for n in (5, 2, 7)]
    packed = pack_rollouts(prompts, completions, np.array([1.0, -0.5, 0.25], dtype=np.float32), 32, tok.pad_token_id)
    ids, labels, positions = packed.rows
    _, metrics = objective.forward(policy, ids, labels, positions, packed.advantages, torch.device("cpu"), None)
    assert metrics[1].item() == 0.0  # k3 at equal log-probs
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.02)
    loss, metrics = objective.forward(policy, ids, labels, positions, packed.advantages, torch.device("cpu"), None)
    x, y, p = (torch.as_tensor(a, dtype=torch.long) for a in (ids, labels, positions))
    mask = y != IGNORE_INDEX
    mask[:, 0] = False
    with torch.no_grad():
        logp, ref = (token_logps(m, x, y, None, p).double() for m in (policy, reference))
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert metrics[1].item() == pytest.approx((k3 * mask).sum().item(), rel=1e-4) and metrics[1].item() > 0
    loss.backward()
    assert all(q.grad is None for q in reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


def test_the_plan_counts_a_full_fine_tunes_frozen_reference_and_leaves_actors_rollouts_out():
    from pathlib import Path

    from app.config import build_config
    from app.model.architecture import parse_model_config
    from app.plan import describe_reference, estimate_memory

    path = Path(__file__).resolve().parents[1] / "jobs" / "models" / "Meta-Llama-3-8B" / "config.json"
    model_config = parse_model_config(path.read_bytes(), str(path))
    job = {**GRPO_JOB, "data": {**GRPO_JOB["data"], "seq_len": 1024}, "scaling": {"use_gpu": True},
           "training": {**GRPO_JOB["training"], "micro_batch_size": 1}}
    bare = build_config({**job, "rl": {"reward": "exact_match"}})
    kl = build_config({**job, "rl": {"reward": "exact_match", "kl_beta": 0.1}})
    # Many groups per rank: colocated, the rollout's KV cache is the workers' peak.
    big = {"reward": "exact_match", "prompts_per_step": 64, "group_size": 16}
    colocated = build_config({**job, "rl": big})
    actors = build_config({**job, "rl": {**big, "rollout": "actors", "rollout_actors": 2}})
    for world in (1, 8):
        a, b = estimate_memory(bare, model_config, world, "fsdp"), estimate_memory(kl, model_config, world, "fsdp")
        assert b.parameters - a.parameters == a.parameters  # the frozen copy, sharded as the policy
        assert b.total_bytes > a.total_bytes
    assert "a frozen copy of the base, sharded as the policy" in describe_reference(kl)
    on_workers = estimate_memory(colocated, model_config, 8, "fsdp")
    assert on_workers.peak_phase == "rollout"
    assert estimate_memory(actors, model_config, 8, "fsdp").total_bytes < on_workers.total_bytes
    assert "on 2 rollout actor(s)" in describe_reference(actors)


GRPO_JOB = {"name": "grpo-bad", "model": {"uri": "s3://eft/models/m"}, "data": {"uri": "s3://eft/data/d", "seq_len": 64},
            "prepare": {"input_uri": "s3://eft/raw/p.jsonl", "format": "prompts"},
            "training": {"objective": "grpo", "max_steps": 2}, "storage": {"root_uri": "s3://eft/runs"}}


@pytest.mark.parametrize("rl, line", [
    (None, "config: training.objective grpo needs a reward: set rl.reward (exact_match, contains, regex, math or "
           "module:function) or rl.rewards"),
    ({"reward": "exact_match", "group_size": 1}, "config: rl.group_size: Input should be greater than or equal to 2"),
    ({"reward": "regex"}, "config: rl: rl reward regex needs rl.answer_regex (the regex that extracts the answer)"),
    ({"reward": "exact_match", "rollout": "actors"}, "config: rl: rl.rollout actors needs rl.rollout_actors >= 1"),
    ({"reward": "exact-match"}, "config: rl: rl reward 'exact-match': not a built-in (exact_match, contains, regex, "
                                "math) nor module:function"),
])
def test_a_bad_grpo_config_is_one_line(rl, line):
    from app.config import ConfigError, build_config

    with pytest.raises(ConfigError) as refused:
        build_config({**GRPO_JOB, **({"rl": rl} if rl else {})})
    assert str(refused.value) == line


def test_rollout_actors_refuse_a_quantized_base_in_one_line():
    from app.config import ConfigError, build_config

    job = {**GRPO_JOB, "lora": {"r": 8, "quantize_base": "nf4"},
           "rl": {"reward": "exact_match", "rollout": "actors", "rollout_actors": 2}}
    with pytest.raises(ConfigError) as refused:
        build_config(job)
    assert str(refused.value) == ("config: rl.rollout actors with lora.quantize_base: the actors would sample from the "
                                  "unquantized base, not the policy being trained (use rl.rollout: colocated)")
    job["rl"]["rollout"] = "colocated"
    assert build_config(job).rl.rollout_actors == 2


def test_an_unimportable_reward_is_one_line_before_storage_or_ray(tmp_path):
    """`eft train` builds the rewards right after the config: a `module:function` that does not
    import is one line, exit 1, with nothing heavy imported and no endpoint asked."""
    import subprocess
    import sys

    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**GRPO_JOB, "rl": {"reward": "no_such_module:score"}}))
    probe = ("import sys\nfrom app.cli import main\ncode = main(['train', sys.argv[1]])\n"
             "print(sorted(m for m in ('torch', 'ray', 'transformers', 'pyarrow') if m in sys.modules))\n"
             "sys.exit(code)\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
    out = subprocess.run([sys.executable, "-c", probe, str(job)], capture_output=True, text=True, timeout=60, env=env,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        "eft: error: reward no_such_module:score: cannot import no_such_module (ModuleNotFoundError: No module named "
        "'no_such_module')"]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_step_samples_the_same_completions_at_world_1_and_2():
    """The step's prompts split over two ranks (each sampling its share alone) give every (prompt,
    sample) the tokens one rank gives it holding them all, and the ranks' summed statistics are the
    one rank's. The policy is the shipped chat base with the chunked loss set up, as on a worker."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.config import build_config
    from app.dev.tasks import build_task_records
    from app.dev.tiny import SHIPPED_BASE
    from app.eval.render import PromptRenderer
    from app.eval.sets import build_record
    from app.model.loss import apply_loss
    from app.rl.colocated import ColocatedRollouts
    from app.rl.prompts import PromptSet, build_prompt_id

    tok = AutoTokenizer.from_pretrained(SHIPPED_BASE)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_BASE)
    apply_loss(model, "chunked", 16)
    renderer = PromptRenderer(tok, tok.chat_template, "prompts")
    _, records = build_task_records(0, 12, seed=5)
    prompts = PromptSet([build_prompt_id(r) for r in records], [renderer.ids(build_record(r, 0, "t")) for r in records],
                        records)
    cfg = build_config({**GRPO_JOB, "data": {"uri": "s3://eft/data/d", "seq_len": 96},
                        "rl": {"rewards": [{"reward": "contains"}, {"reward": "app.dev.tasks:brevity_reward"}],
                               "prompts_per_step": 5, "group_size": 3, "max_new_tokens": 10}})
    pad = tok.pad_token_id

    def run(rank: int, world: int):
        return ColocatedRollouts(cfg, prompts, tok, renderer.stop_ids, pad, rank, world, torch.device("cpu")).build(
            model, step=3)

    whole = run(0, 1)
    # No process group here: each "rank" reduces only its own statistics, so they are given the
    # micro-batch count the all-reduce's maximum would give both (here the one rank's, which is
    # more than either rank's own).
    count = whole.maxima["micro_batches"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ColocatedRollouts, "reduce",
                      lambda self, sums, maxima: (sums, {**maxima, "micro_batches": count}))
        parts = [run(0, 2), run(1, 2)]
    assert len(whole.samples) == 15 and sorted(s[:2] for s in whole.samples) == sorted(
        s[:2] for p in parts for s in p.samples)
    by_key = {s[:2]: s[2:] for p in parts for s in p.samples}
    assert {s[:2]: s[2:] for s in whole.samples} == by_key
    for key in ("completions", "reward_sum", "completion_tokens", "trained_tokens", "groups_zero_std"):
        assert whole.sums[key] == pytest.approx(sum(p.sums[key] for p in parts)), key
    # Another step draws other completions of the same prompts.
    again = ColocatedRollouts(cfg, prompts, tok, renderer.stop_ids, pad, 0, 1, torch.device("cpu")).build(model, 4)
    assert {s[:2]: s[2] for s in again.samples} != {s[:2]: s[2] for s in whole.samples}
    # Every micro-batch is whole, its advantages only on completion tokens, at most micro_batch_size
    # x seq_len tokens.
    for row_ids, inputs, labels, positions, advantages in whole.micro:
        assert inputs.shape == labels.shape == advantages.shape == positions.shape
        assert inputs.size <= 96 and inputs.shape[1] % 8 == 0
        assert not advantages[labels == -100].any()
    # Each group's micro-batches are the same arrays (row ids, tokens, labels, positions, advantages)
    # on whichever rank holds it: one rank holds prompt slots 0-4, rank 0 of 2 slots 0, 2, 4 and
    # rank 1 slots 1, 3; each rank then forwards label-free one-row padding micro-batches up to
    # the count of the rank with the most.
    def by_slot(micro):
        out = {}
        for mb in micro:
            out.setdefault(int(mb[0][0] - 3 * 1_000_003) // 1_009, []).append(mb)
        return out

    whole_slots = by_slot(whole.micro)
    assert sorted(whole_slots) == [0, 1, 2, 3, 4]
    for rank, slots in {0: [0, 2, 4], 1: [1, 3]}.items():
        got = by_slot(parts[rank].micro)
        assert len(parts[rank].micro) == count
        for slot in slots:
            assert len(got[slot]) == len(whole_slots[slot])
            for a, b in zip(got[slot], whole_slots[slot]):
                assert all(np.array_equal(x, y) for x, y in zip(a, b)), (rank, slot)
        padding = [mb for slot, mbs in got.items() if slot >= 5 for mb in mbs]
        assert len(padding) == count - sum(len(whole_slots[j]) for j in slots)
        assert all(mb[1].shape == (1, 8) and (mb[2] == -100).all() and not mb[4].any() for mb in padding)
    # A group is packed at the width that takes the fewest positions (the narrower on a tie): three
    # 5-token rollouts share one row of 16; three of 30 take a row of 32 each (96 positions, as one
    # row of 96 does; two rows of 64 would take 128).
    from app.rl.colocated import pack_group

    short = pack_group([[1, 2]] * 3, [[3, 4, 5]] * 3, np.ones(3, np.float32), 96, 0)
    assert short.rows.input_ids.shape == (1, 16)
    long = pack_group([[1, 2]] * 3, [list(range(3, 31))] * 3, np.ones(3, np.float32), 96, 0)
    assert long.rows.input_ids.shape == (3, 32) and long.completion_tokens() == 3 * 28


def test_a_float64_gradient_sum_does_not_depend_on_the_order_of_the_micro_batches():
    """Three micro-batches' gradients whose fp32 sum depends on the order (autograd accumulates
    (1 + 1e-8) - 1 = 0, but (1 - 1) + 1e-8 = 1e-8): summed in float64, either order gives the
    same gradient, bit for bit, and each micro-batch's own gradient leaves .grad for the next."""
    from app.model.sharding import Float64GradSum

    weight = torch.nn.Parameter(torch.zeros(2))
    parts = [torch.tensor([1.0, 3.0]), torch.tensor([1e-8, 1e-7]), torch.tensor([-1.0, -3.0])]

    def summed(order, exact: bool) -> torch.Tensor:
        total = Float64GradSum([weight]) if exact else None
        weight.grad = None
        for i in order:
            (weight * parts[i]).sum().backward()
            if total is not None:
                total.add_micro_batch()
                assert weight.grad is None
        if total is not None:
            total.reduce_into_grads(world=1)
        assert weight.grad.dtype == torch.float32
        return weight.grad.clone()

    assert not torch.equal(summed([0, 1, 2], exact=False), summed([0, 2, 1], exact=False))
    assert torch.equal(summed([0, 1, 2], exact=True), summed([0, 2, 1], exact=True))
    assert torch.equal(summed([2, 1, 0], exact=True), torch.tensor([1e-8, 1e-7]))
