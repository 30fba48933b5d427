"""Verifiable rewards: what a completion of a prompt record earns.

A reward is a name: a built-in, or `module:function` importable where the rollouts are scored
(the working directory or the image), called as `(prompt: str, completion: str, answer, record:
dict) -> float`. Built in:

- `exact_match`, `contains`, `regex`: eval's generation metrics (app.eval.score), with the same
  normalization and `answer_regex`, as 1.0 or 0.0: a model is rewarded for what eval scores.
- `math`: the completion's final answer equivalent to the record's, by `math-verify` (LaTeX,
  fractions, sets, intervals), a maintained verifier rather than a hand-written parser.

Several rewards combine as a weighted sum (`build_reward_fn`). A reward that raises is an error
of its record, never a 0: `RewardErrors` counts them by reason, the caller leaves the record's
whole group out of the step (a 0 inside the group's baseline would move every other
completion's advantage), and past the limit the run stops in one line naming the reward and the
record.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from app.eval.score import score_generation

BUILTIN = ("exact_match", "contains", "regex", "math")

RewardFn = Callable[[str, str, Any, dict], float]


class RewardError(RuntimeError):
    """A reward that cannot be used, or one that failed too often: one line."""


def accepted_answers(answer: Any) -> list[str]:
    if answer is None:
        return []
    return [str(a) for a in answer] if isinstance(answer, (list, tuple)) else [str(answer)]


def build_metric_reward(metric: str, normalize: bool = True, answer_regex: Optional[str] = None) -> RewardFn:
    if metric == "regex" and not answer_regex:
        raise RewardError("reward regex needs answer_regex (the pattern that extracts the answer)")

    def reward(prompt: str, completion: str, answer: Any, record: dict) -> float:
        correct, _ = score_generation(completion, accepted_answers(answer), metric, normalize, answer_regex)
        return 1.0 if correct else 0.0

    reward.__name__ = metric
    return reward


def math_reward(prompt: str, completion: str, answer: Any, record: dict) -> float:
    from math_verify import parse, verify

    predicted = parse(completion)
    return 1.0 if any(verify(parse(gold), predicted) for gold in accepted_answers(answer)) else 0.0


def import_reward(spec: str) -> RewardFn:
    """`module:function`, imported now: a name that does not resolve is one line before any work."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(f"reward {spec!r}: not a built-in ({', '.join(BUILTIN)}) nor module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # whatever the user's module raises on import
        raise RewardError(f"reward {spec}: cannot import {module_name} ({type(err).__name__}: {err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {spec}: {module_name} has no function {attr}")
    return fn


def build_one_reward(name: str, normalize: bool = True, answer_regex: Optional[str] = None) -> RewardFn:
    if name in ("exact_match", "contains", "regex"):
        return build_metric_reward(name, normalize, answer_regex)
    if name == "math":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise RewardError("reward math needs the math-verify package (pip install math-verify)") from None
        return math_reward
    return import_reward(name)


@dataclass
class RewardErrors:
    """Failed reward calls, by reward and reason; `check` stops the run past `limit`."""

    limit: int
    counts: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, reward: str, err: BaseException, record_id: Any) -> None:
        self.counts[(reward, type(err).__name__)] += 1
        if self.total > self.limit:
            raise RewardError(f"reward {reward} failed {self.total} times, more than rl.max_reward_errors="
                              f"{self.limit}; last on record {record_id}: {type(err).__name__}: {err}")

    def by_reason(self) -> dict[str, int]:
        return {f"{reward}: {reason}": n for (reward, reason), n in sorted(self.counts.items())}


@dataclass(frozen=True)
class Scored:
    total: Optional[float]  # the weighted sum; None if any reward failed (the group is left out)
    parts: dict[str, Optional[float]]  # each reward's own value


def build_reward_fn(rewards: list[tuple[str, float]], normalize: bool = True, answer_regex: Optional[str] = None,
                    errors: Optional[RewardErrors] = None) -> Callable[[str, str, dict], Scored]:
    """Scores one completion of a record against every (reward, weight): `fn(prompt, completion,
    record)` with the record's `answer`. A reward that raises, or returns no finite number, is
    recorded in `errors` and makes the total None."""
    if not rewards:
        raise RewardError("no reward: set rl.reward or rl.rewards")
    built = [(name, weight, build_one_reward(name, normalize, answer_regex)) for name, weight in rewards]
    errors = errors if errors is not None else RewardErrors(limit=0)

    def score(prompt: str, completion: str, record: dict) -> Scored:
        parts: dict[str, Optional[float]] = {}
        for name, _, fn in built:
            try:
                value = float(fn(prompt, completion, record.get("answer"), record))
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}")
            except Exception as err:  # a user's function: any failure is its record's
                errors.add(name, err, record.get("id", record.get("prompt_id")))
                value = None
            parts[name] = value
        if any(v is None for v in parts.values()):
            return Scored(None, parts)
        return Scored(sum(weight * parts[name] for name, weight, _ in built), parts)

    return score
