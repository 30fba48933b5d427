"""Seeded sampling: each completion drawn from a generator of its own.

transformers' `generate` draws every row of a batch from one generator, so a completion depends
on which other prompts shared its batch: another world size, another number of rollout actors,
another completion. Here a completion's draws come from its own seed, (run seed, step, prompt
id, sample index): the same step samples the same completions however the prompts are spread.
A token can still differ when a draw lands within rounding of a boundary between two tokens'
cumulative probabilities, because batches of another shape round differently (see the tests,
which count it).

The decode loop is eft's own over the model's KV cache: left-padded prompts, one forward per
new token for the whole batch. Under FSDP2 every rank takes part in every forward, so with
`lockstep` the ranks agree after each token whether any row anywhere is still going, and a rank
whose rows are done keeps stepping on padding until the last one finishes (transformers'
`synced_gpus`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def completion_seed(run_seed: int, step: int, prompt_id: str, sample_index: int) -> int:
    """A 63-bit seed from the completion's coordinates alone."""
    digest = hashlib.sha256(f"{run_seed}/{step}/{prompt_id}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose cumulative probability reaches `top_p` (at least one),
    renormalized. `probs`: [rows, vocab]."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the tokens ranked above
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def draw_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row the first token whose cumulative probability exceeds
    the row's uniform draw."""
    cdf = probs.double().cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return picked.clamp(max=probs.shape[-1] - 1)


@dataclass(frozen=True)
class Completions:
    tokens: list[list[int]]  # each row's completion, its stop token included when it stopped
    truncated: list[bool]  # cut at max_new_tokens without a stop token


@torch.no_grad()
def sample_completions(model, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int,
                       stop_token_ids: set[int], pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0,
                       lockstep: bool = False) -> Completions:
    """Completions of `prompts` (token ids), row i drawn with `seeds[i]`. `temperature` 0 is
    greedy. `lockstep`: keep every rank of the default process group forwarding until all are done."""
    import torch.distributed as dist

    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    device = next(model.parameters()).device
    rows, width = len(prompts), max((len(p) for p in prompts), default=0)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)
    attention = torch.zeros((rows, width), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        if prompt:
            input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long, device=device)
            attention[i, width - len(prompt):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator(device="cpu").manual_seed(seed) for seed in seeds]
    stops = torch.tensor(sorted(stop_token_ids), dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    out = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    cache, step_ids, step_positions = None, input_ids, positions
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    synced = lockstep and dist.is_available() and dist.is_initialized()
    for t in range(max_new_tokens):
        # `cache`: transformers 5.x's name for the KV cache (`past_key_values` before; checked on 5.25).
        # Only the last position's logits: a prompt's full [rows, width, vocab] would dwarf the cache.
        result = model(input_ids=step_ids, attention_mask=attention, position_ids=step_positions, cache=cache,
                       use_cache=True, logits_to_keep=1)
        cache = result["cache"]
        logits = result.logits[:, -1, :].float()
        # Every row draws its uniform every step, done or not: a row's draws never depend on others.
        uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(device)
        if temperature == 0:
            tokens = logits.argmax(dim=-1)
        else:
            probs = filter_top_p(torch.softmax(logits / temperature, dim=-1), top_p)
            tokens = draw_tokens(probs, uniforms)
        tokens = torch.where(done, torch.full_like(tokens, pad_token_id), tokens)
        out[:, t] = tokens
        lengths += (~done).long()
        done = done | torch.isin(tokens, stops)
        going = (~done).any().to(torch.int32).reshape(1)
        if synced:  # one host sync per token: the rollout's, never the update's
            dist.all_reduce(going, op=dist.ReduceOp.MAX)
        if not bool(going.item()):
            break
        step_ids = tokens[:, None]
        attention = torch.cat([attention, torch.ones((rows, 1), dtype=attention.dtype, device=device)], dim=1)
        step_positions = step_positions[:, -1:] + 1
    # One copy to the host at the end: the loop's only sync is whether to go on.
    finished, lengths, out = done.cpu().tolist(), lengths.cpu().tolist(), out.cpu()
    completions = [out[i, :lengths[i]].tolist() for i in range(rows)]
    return Completions(tokens=completions, truncated=[not f for f in finished])
