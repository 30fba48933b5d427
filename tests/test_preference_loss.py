"""Preference objectives (app/model/preference.py) against formulas written here, on a real tiny
HF Llama: each sequence's completion log-prob from packed rows equals the one from the sequence
alone through transformers; the chunked path equals the full one in value and gradient; DPO,
IPO, SimPO and ORPO equal their papers' (and TRL's) formulas; and at the first step, with the
initial policy as the reference, the DPO loss is ln 2."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import assert_close

from app.batch import IGNORE_INDEX as IGNORE
from app.model.preference import (
    build_pair_losses,
    chunked_token_logps,
    sequence_logps,
    sequence_tokens,
    sum_pair_metrics,
    token_logps_from_logits,
)

VOCAB = 96


def build_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


def build_pairs(n: int = 4, seed: int = 3) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists of assorted lengths."""
    g = torch.Generator().manual_seed(seed)

    def tokens(lo: int, hi: int) -> list[int]:
        return torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    return [(tokens(2, 6), tokens(1, 7), tokens(1, 7)) for _ in range(n)]


def pack(pairs, seq_len: int):
    """Rows of whole pairs (chosen then rejected, each prompt + completion), position ids restarting
    per document, prompts masked, padding at the end of a row; segments 2p / 2p+1 on completions."""
    rows, row = [], {"ids": [], "labels": [], "pos": [], "seg": []}
    for p, (prompt, chosen, rejected) in enumerate(pairs):
        docs = [(prompt, chosen, 2 * p), (prompt, rejected, 2 * p + 1)]
        if len(row["ids"]) + sum(len(a) + len(b) for a, b, _ in docs) > seq_len:
            rows.append(row)
            row = {"ids": [], "labels": [], "pos": [], "seg": []}
        for prompt_ids, completion, seg in docs:
            row["ids"] += prompt_ids + completion
            row["labels"] += [IGNORE] * len(prompt_ids) + completion
            row["pos"] += list(range(len(prompt_ids) + len(completion)))
            row["seg"] += [-1] * len(prompt_ids) + [seg] * len(completion)
    rows.append(row)
    for r in rows:  # padding: a segment of its own, unlabelled
        pad = seq_len - len(r["ids"])
        r["ids"] += [0] * pad
        r["labels"] += [IGNORE] * pad
        r["pos"] += list(range(pad))
        r["seg"] += [-1] * pad
    return ({k: torch.tensor([r[k] for r in rows]) for k in ("ids", "labels", "pos", "seg")})


def logp_alone(model, prompt: list[int], completion: list[int]) -> float:
    """The completion's summed log-prob, the sequence on its own: transformers' logits, by hand."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[len(prompt) + i - 1, tok]) for i, tok in enumerate(completion))


def packed_logps(model, pairs, seq_len: int = 40, chunk_tokens=None):
    batch = pack(pairs, seq_len)
    if chunk_tokens is None:
        # No cache and no attention mask: transformers then keeps attention inside each document.
        logits = model(input_ids=batch["ids"], position_ids=batch["pos"], use_cache=False).logits
        tokens = token_logps_from_logits(logits, batch["labels"])
    else:
        hidden = model.model(input_ids=batch["ids"], position_ids=batch["pos"], use_cache=False).last_hidden_state
        tokens = chunked_token_logps(hidden, model.lm_head.weight, batch["labels"], chunk_tokens, torch.float32)
    n = 2 * len(pairs)
    return sequence_logps(tokens, batch["seg"], n), sequence_tokens(batch["seg"], n)


def test_packed_pairs_give_each_sequence_the_log_prob_it_has_alone():
    model, pairs = build_llama(), build_pairs(6)
    with torch.no_grad():
        packed, lengths = packed_logps(model, pairs)
    assert len(pack(pairs, 40)["ids"]) >= 2  # the pairs really span several rows
    alone = torch.tensor([logp_alone(model, p, c) for p, chosen, rejected in pairs for c in (chosen, rejected)],
                         dtype=torch.float32)
    assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert lengths.tolist() == [len(c) for _, chosen, rejected in pairs for c in (chosen, rejected)]


@pytest.mark.parametrize("chunk_tokens", [7, 16, 1000])
def test_the_chunked_path_equals_the_full_one_in_value_and_gradient(chunk_tokens):
    pairs = build_pairs(5)
    results = []
    for chunk in (None, chunk_tokens):
        model = build_llama()
        logps, lengths = packed_logps(model, pairs, chunk_tokens=chunk)
        chosen, rejected = logps[0::2], logps[1::2]
        # A non-linear objective: each token's gradient depends on its pair's log-probs.
        pair = build_pair_losses("simpo", chosen, rejected, chosen_tokens=lengths[0::2],
                                 rejected_tokens=lengths[1::2], beta=2.0)
        pair.losses.sum().backward()
        results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, full_grads), (chunked, chunked_grads) = results
    assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    for name, grad in full_grads.items():
        assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert float(full_grads["lm_head.weight"].abs().max()) > 0


def sigmoid_log(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def test_each_objective_is_its_formula():
    """Per pair, in float64 Python from the summed log-probs: DPO (sigmoid, label smoothing),
    IPO, SimPO and ORPO."""
    chosen = torch.tensor([-12.0, -3.5, -20.25, -7.0], dtype=torch.float64)
    rejected = torch.tensor([-15.0, -2.0, -19.0, -9.5], dtype=torch.float64)
    ref_c = torch.tensor([-13.0, -3.0, -21.0, -7.5], dtype=torch.float64)
    ref_r = torch.tensor([-14.0, -2.5, -18.0, -9.0], dtype=torch.float64)
    n_c = torch.tensor([6, 2, 9, 4])
    n_r = torch.tensor([7, 1, 8, 5])
    beta, ls, gamma, lam = 0.1, 0.1, 0.5, 0.2
    c, r, rc, rr = (t.tolist() for t in (chosen, rejected, ref_c, ref_r))
    lc, lr = n_c.tolist(), n_r.tolist()

    dpo = build_pair_losses("dpo", chosen, rejected, chosen_tokens=n_c, rejected_tokens=n_r, ref_chosen=ref_c,
                            ref_rejected=ref_r, beta=beta, label_smoothing=ls)
    for i in range(4):
        z = beta * ((c[i] - rc[i]) - (r[i] - rr[i]))
        assert float(dpo.losses[i]) == pytest.approx(-(1 - ls) * sigmoid_log(z) - ls * sigmoid_log(-z), rel=1e-12)
        assert float(dpo.rewards_chosen[i]) == pytest.approx(beta * (c[i] - rc[i]), rel=1e-12)
        assert float(dpo.rewards_rejected[i]) == pytest.approx(beta * (r[i] - rr[i]), rel=1e-12)

    ipo = build_pair_losses("dpo", chosen, rejected, chosen_tokens=n_c, rejected_tokens=n_r, ref_chosen=ref_c,
                            ref_rejected=ref_r, beta=beta, loss="ipo")
    for i in range(4):
        h = (c[i] - rc[i]) / lc[i] - (r[i] - rr[i]) / lr[i]
        assert float(ipo.losses[i]) == pytest.approx((h - 1 / (2 * beta)) ** 2, rel=1e-12)

    simpo = build_pair_losses("simpo", chosen, rejected, chosen_tokens=n_c, rejected_tokens=n_r, beta=2.0,
                              simpo_gamma=gamma)
    for i in range(4):
        z = 2.0 * (c[i] / lc[i] - r[i] / lr[i]) - gamma
        assert float(simpo.losses[i]) == pytest.approx(-sigmoid_log(z), rel=1e-12)
        assert float(simpo.rewards_chosen[i]) == pytest.approx(2.0 * c[i] / lc[i], rel=1e-12)

    orpo = build_pair_losses("orpo", chosen, rejected, chosen_tokens=n_c, rejected_tokens=n_r, beta=beta,
                             orpo_lambda=lam)
    for i in range(4):
        pc, pr = math.exp(c[i] / lc[i]), math.exp(r[i] / lr[i])
        log_odds = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
        assert float(orpo.losses[i]) == pytest.approx(-c[i] / lc[i] - lam * sigmoid_log(log_odds), rel=1e-10)

    metrics = sum_pair_metrics(dpo, chosen, rejected)
    margins = [beta * ((c[i] - rc[i]) - (r[i] - rr[i])) for i in range(4)]
    assert float(metrics["reward_margin"]) == pytest.approx(sum(margins), rel=1e-12)
    assert float(metrics["reward_accuracy"]) == sum(m > 0 for m in margins)
    assert float(metrics["logps_chosen"]) == pytest.approx(sum(c), rel=1e-12)


def test_a_lora_policy_at_its_start_against_its_base_as_reference_has_dpo_loss_ln_2():
    """B = 0: the policy (packed, adapters on) is its base (each sequence alone, adapters off),
    so every pair's DPO loss is ln 2; a mask, packing or alignment slip would move it."""
    from peft import get_peft_model

    from app.config import LoraConfig
    from app.model.architecture import build_peft_config

    model = get_peft_model(build_llama(), build_peft_config(LoraConfig(r=4, alpha=8,
                                                                       target_modules=["q_proj", "v_proj"])))
    pairs = build_pairs(6, seed=11)
    with model.disable_adapter():
        ref = torch.tensor([logp_alone(model, p, c) for p, chosen, rejected in pairs for c in (chosen, rejected)],
                           dtype=torch.float32)
    logps, lengths = packed_logps(model, pairs)
    pair = build_pair_losses("dpo", logps[0::2], logps[1::2], chosen_tokens=lengths[0::2],
                             rejected_tokens=lengths[1::2], ref_chosen=ref[0::2], ref_rejected=ref[1::2])
    assert float(pair.losses.detach().mean()) == pytest.approx(math.log(2), abs=1e-4)
    assert not torch.equal(logps[0::2], logps[1::2])  # the pairs differ: ln 2 is not a coincidence


def test_unknown_objectives_and_losses_are_named():
    x = torch.zeros(2)
    n = torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="preference.loss 'hinge'"):
        build_pair_losses("dpo", x, x, chosen_tokens=n, rejected_tokens=n, ref_chosen=x, ref_rejected=x, loss="hinge")
    with pytest.raises(ValueError, match="training.objective dpo needs the reference log-probs"):
        build_pair_losses("dpo", x, x, chosen_tokens=n, rejected_tokens=n)
    with pytest.raises(ValueError, match="training.objective 'kto'"):
        build_pair_losses("kto", x, x, chosen_tokens=n, rejected_tokens=n)


@pytest.mark.parametrize("rejected_sure", [False, True], ids=["chosen-sure", "both-sure"])
@pytest.mark.parametrize("chunk_tokens", [None, 2], ids=["full", "chunked"])
def test_orpo_on_a_one_token_answer_the_model_is_sure_of_has_finite_gradients(chunk_tokens, rejected_sure):
    """A confident model gives a one-token answer probability 1 in fp32: a mean log-prob of
    exactly 0, where ORPO's log(1 - p) is -inf. The gradient of every weight was NaN (and, with
    the rejected answer as sure, the loss too)."""
    torch.manual_seed(0)
    dim, vocab = 8, 16
    # One row: [prompt, chosen] then [prompt, rejected]; position 0 predicts the chosen token,
    # position 2 the rejected one.
    labels = torch.tensor([[IGNORE, 7, IGNORE, 9]])
    segments = torch.tensor([[-1, 0, -1, 1]])
    hidden = 0.1 * torch.randn(1, 4, dim)
    weight = 0.1 * torch.randn(vocab, dim)
    hidden[0, 0, 0], weight[7, 0] = 100.0, 10.0  # logit 1000 for the chosen token
    if rejected_sure:
        hidden[0, 2, 1], weight[9, 1] = 100.0, 10.0
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    if chunk_tokens is None:
        per_token = token_logps_from_logits(hidden @ weight.t(), labels)
    else:
        per_token = chunked_token_logps(hidden, weight, labels, chunk_tokens, torch.float32)
    logps = sequence_logps(per_token, segments, 2)
    assert float(logps[0]) == 0.0 and (float(logps[1]) == 0.0) == rejected_sure  # really sure, in fp32
    tokens = sequence_tokens(segments, 2).float()
    pair = build_pair_losses("orpo", logps[0::2], logps[1::2], chosen_tokens=tokens[0::2],
                             rejected_tokens=tokens[1::2], orpo_lambda=0.1)
    assert torch.isfinite(pair.losses).all()
    pair.losses.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    if not rejected_sure:
        assert float(hidden.grad[0, 2].abs().max()) > 0  # the unsure rejected answer still learns


@pytest.mark.parametrize("objective", ["sft", "simpo"])
def test_unpacked_rows_cut_after_their_last_label_give_the_same_loss(objective):
    """`prepare.packing: false` rows (a pair, or a document, per row, the rest padding) trimmed per
    micro-batch (trim_micro_batch) train exactly what the whole rows train: same loss and metrics."""
    import numpy as np

    from app.config import build_config
    from app.data.packing import Packer
    from app.data.stream import trim_micro_batch
    from app.train.objective import build_objective

    model, pairs = build_llama(), build_pairs(6)
    docs = [(prompt, completion) for prompt, chosen, rejected in pairs for completion in (chosen, rejected)]
    packer = Packer(48, 0, packing=False)
    ids = np.array([t for p, c in docs for t in p + c])
    labels = np.array([t for p, c in docs for t in [IGNORE] * len(p) + c])
    lengths = [len(p) + len(c) for p, c in docs]
    if objective == "sft":
        packer.add(ids, labels, lengths)
    else:
        packer.add_units(ids, labels, lengths, docs_per_unit=2)
    rows = packer.finish()
    micro = (np.arange(len(rows.input_ids)), rows.input_ids, rows.labels, rows.position_ids)
    trimmed = trim_micro_batch(micro)
    width = trimmed[1].shape[1]
    assert width % 8 == 0 and width < 48 and (rows.labels[:, width:] == IGNORE).all()
    assert width - 8 < max(np.flatnonzero(r != IGNORE).max() + 1 for r in rows.labels)
    cfg = build_config({"name": "trim", "model": {"uri": "s3://b/m"}, "data": {"uri": "s3://b/d", "seq_len": 48},
                        "training": {"objective": objective, "max_steps": 1}, "storage": {"root_uri": "s3://b/r"}})
    objective_fn = build_objective(cfg)
    with torch.no_grad():
        whole = objective_fn.forward(model, *micro[1:], None, torch.device("cpu"), None)
        cut = objective_fn.forward(model, *trimmed[1:], None, torch.device("cpu"), None)
    assert objective_fn.units(rows.labels, rows.position_ids) == objective_fn.units(trimmed[2], trimmed[3])
    assert_close(cut[0], whole[0], rtol=1e-5, atol=1e-6)
    assert_close(cut[1], whole[1], rtol=1e-5, atol=1e-6)
