"""RULER's metrics (scripts/eval/synthetic/constants.py), per prediction, as fractions in [0, 1].

RULER reports the mean over samples times 100; `string_match_all` serves niah, vt, cwe and fwe,
`string_match_part` the QA tasks.
"""

from __future__ import annotations

import re

# RULER's postprocess_pred: control characters become newlines, then the prediction is stripped.
_CONTROL = re.compile(r"[\x00-\x1f]")


def _clean(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction.strip()).strip().lower()


def string_match_all(prediction: str, expected: list[str]) -> float:
    """Fraction of the expected strings found in the prediction (substring, case-insensitive)."""
    if not expected:
        raise ValueError("expected at least one reference string")
    pred = _clean(prediction)
    return sum(ref.lower() in pred for ref in expected) / len(expected)


def string_match_part(prediction: str, expected: list[str]) -> float:
    """1.0 if any expected string is found in the prediction (substring, case-insensitive), else 0.0."""
    if not expected:
        raise ValueError("expected at least one reference string")
    pred = _clean(prediction)
    return float(any(ref.lower() in pred for ref in expected))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(sample, prediction: str) -> float:
    """The sample's metric applied to one prediction (the generated answer, after the answer prefix)."""
    return METRICS[sample.metric](prediction, sample.expected)
