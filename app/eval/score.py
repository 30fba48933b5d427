"""Scoring: predictions against answers, choices by log-likelihood, and the score's interval.

Pure functions (numpy, re): the engine produces generations and per-choice log-likelihoods, these
turn them into `correct` per record and a score with a bootstrap 95% interval.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

BOOTSTRAP_SAMPLES = 1000
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Strip, case-fold, collapse whitespace runs to one space."""
    return _SPACE.sub(" ", text.strip()).casefold()


def extract_answer(prediction: str, pattern: str) -> Optional[str]:
    """`metric: regex`: the first match's first group (the whole match when it has none), or None."""
    match = re.search(pattern, prediction)
    if match is None:
        return None
    return match.group(1) if match.re.groups else match.group(0)


def score_generation(prediction: str, answers: list[str], metric: str, use_normalize: bool = True,
                     answer_regex: Optional[str] = None) -> tuple[bool, Optional[str]]:
    """(correct, the extracted answer for `regex`) of one generation against its accepted answers."""
    norm = normalize if use_normalize else (lambda s: s)
    extracted = None
    if metric == "regex":
        extracted = extract_answer(prediction, answer_regex)
        if extracted is None:
            return False, None
        candidate = norm(extracted)
        return any(candidate == norm(a) for a in answers), extracted
    candidate = norm(prediction)
    if metric == "contains":
        return any(norm(a) in candidate for a in answers), None
    if metric == "exact_match":
        return any(candidate == norm(a) for a in answers), None
    raise ValueError(f"not a generation metric: {metric!r}")


def score_choices(logprobs: list[float], choices: list[str], answer: int) -> dict[str, bool]:
    """lm-eval's multiple-choice rule: `acc` picks the choice with the highest log-likelihood,
    `acc_norm` the highest per character of the choice (ties go to the first, as argmax does)."""
    ll = np.asarray(logprobs, dtype=np.float64)
    per_char = ll / np.asarray([len(c) for c in choices], dtype=np.float64)
    return {"acc": int(np.argmax(ll)) == answer, "acc_norm": int(np.argmax(per_char)) == answer}


def bootstrap_interval(correct: np.ndarray, seed: int = 0, samples: int = BOOTSTRAP_SAMPLES,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap of the mean over records (resampling the records with replacement).

    Scores are 0 or 1 (right or wrong): the number right in a resample of n records is then
    Binomial(n, k/n) for k right in the set, so that count is drawn directly, `samples` numbers
    in all. Drawing the resamples' record indices instead held a samples × n array (800 MB at
    n = 100k) for the same distribution."""
    correct = np.asarray(correct, dtype=np.float64)
    if correct.size == 0:
        return 0.0, 0.0
    if not np.isin(correct, (0.0, 1.0)).all():
        raise ValueError("bootstrap_interval: scores must be 0 or 1 (right or wrong)")
    rng = np.random.default_rng(seed)
    means = rng.binomial(correct.size, correct.mean(), size=samples) / correct.size
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)
