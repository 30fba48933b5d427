"""A task the demo's chat fine-tune visibly learns, scored by exact match on prompts it never saw.

Parity of a whole number: "Is 4821 even or odd?" → "odd". The tiny pre-trained base (app/dev/tiny.py)
answers it with prose (0% exact match); the demo's LoRA fine-tune answers new numbers right (100%
from step 50 of 100; 66% at step 25). Chosen because the answer depends on one token at a fixed
distance from the end of the prompt (the BPE tokenizer splits numbers into single digits, so the
last digit always sits just before " even or odd?"), which a ~0.8M-parameter base with rank-8
adapters can learn within the demo's step budget on 2 CPU cores.
"""

from __future__ import annotations

import random

TASK_NAME = "parity"
TASK_QUESTION = "Is {number} even or odd?"
# The demo's task: conversations trained on, and held-out prompts scored (eft demo, tiny-grpo).
TASK_TRAIN = 4000
TASK_EVAL = 100
# Numbers of 2 to 5 digits: ~100k distinct prompts, so held-out ones are new numbers, not repeats.
NUMBER_RANGE = (10, 100_000)


def answer_parity(number: int) -> str:
    return "odd" if number % 2 else "even"


def build_task_records(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training conversations `{"messages": [user, assistant]}`, held-out `{"prompt", "answer"}`), from
    distinct numbers drawn once: eval numbers are never trained on, so a right answer is the rule
    generalised, not a memorised reply. Deterministic for a seed."""
    low, high = NUMBER_RANGE
    if n_train + n_eval > high - low:
        raise ValueError(f"at most {high - low} distinct numbers; asked for {n_train + n_eval}")
    numbers = random.Random(seed).sample(range(low, high), n_train + n_eval)
    held_out, train = numbers[:n_eval], numbers[n_eval:]
    conversations = [{"messages": [{"role": "user", "content": TASK_QUESTION.format(number=n)},
                                   {"role": "assistant", "content": answer_parity(n)}]} for n in train]
    evals = [{"prompt": TASK_QUESTION.format(number=n), "answer": answer_parity(n)} for n in held_out]
    assert not {c["messages"][0]["content"] for c in conversations} & {e["prompt"] for e in evals}
    return conversations, evals


def brevity_reward(prompt: str, completion: str, answer, record: dict) -> float:
    """A `module:function` reward for GRPO's tests and demo: 1 for an empty reply, falling linearly
    to 0 at 32 characters. The tiny base answers parity with long prose; a policy that learns to end
    its turn early earns more, which GRPO can find within a few steps on CPU."""
    return max(0.0, 1.0 - len(completion.strip()) / 32)


def format_score(results: dict) -> str:
    """An eval result as the demos print it: the score and its 95% interval."""
    low, high = results["interval"]
    return f"{results['score']:.1%} (95% {low:.0%}-{high:.0%})"


def brevity_unless_odd_reward(prompt: str, completion: str, answer, record: dict) -> float:
    """`brevity_reward`, but raises on the prompts whose answer is "odd": a reward that fails on
    some records, for the tests of reward errors (counted, their groups left out, then one line)."""
    if answer == "odd":
        raise ValueError("no score for odd numbers")
    return brevity_reward(prompt, completion, answer, record)
