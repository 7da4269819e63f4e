"""What the Kubernetes Job controller decides about a failed pod of an Indexed Job, as pure
functions of the Job's spec (no cluster): the matching ``podFailurePolicy`` rule, whether the
index is retried under ``backoffLimitPerIndex``, and after how long its pod is recreated.

Sources: the Job API reference (``PodFailurePolicyRule``: rules are checked in order, the first
match wins; ``Count`` and no match both count against the backoff limit; ``Ignore`` recreates the
pod without counting), KEP-3850 (backoff limit per index: an index fails once its counted failures
exceed ``backoffLimitPerIndex``; the Job fails once failed indexes exceed ``maxFailedIndexes``;
pods are recreated after an exponential delay per index, 10 s, 20 s, 40 s ... capped at 6 minutes,
and ignored failures are skipped in that count).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The Job controller's pod re-creation delay: the first, its doubling, and the cap.
BACKOFF_BASE_S = 10.0
BACKOFF_CAP_S = 360.0


def matching_rule(job: Mapping[str, Any], container: str, exit_code: int | None,
                  conditions: Iterable[tuple[str, str]] = ()) -> tuple[str, int | None]:
    """The action of the first ``podFailurePolicy`` rule that matches a failed pod whose container
    ``container`` ended with ``exit_code`` (None: it never ran) and whose pod has ``conditions``
    (``(type, status)`` pairs); ``("Count", None)`` when none matches."""
    held = set(conditions)
    for index, rule in enumerate(job["spec"].get("podFailurePolicy", {}).get("rules", [])):
        on_codes = rule.get("onExitCodes")
        if on_codes is not None:
            if exit_code is None or exit_code == 0 or on_codes.get("containerName") not in (None, container):
                continue
            listed = exit_code in on_codes["values"]
            if listed if on_codes["operator"] == "In" else not listed:
                return rule["action"], index
            continue
        patterns = rule.get("onPodConditions", [])
        if any((p["type"], p.get("status", "True")) in held for p in patterns):
            return rule["action"], index
    return "Count", None


@dataclass
class IndexState:
    """One index of an Indexed Job with ``backoffLimitPerIndex``: its counted failures so far."""

    index: int
    counted: int = 0
    failed: bool = False


@dataclass(frozen=True)
class Decision:
    """What the Job controller does after one pod failure of an index."""

    action: str            # the rule's action, or "Count" by default
    rule: int | None       # the rule's position, None when none matched
    recreate: bool         # a replacement pod is made for the index
    delay_s: float         # ... after this long
    job_failed: str = ""   # the Job's Failed reason, when this failure ends the Job


def on_pod_failure(job: Mapping[str, Any], state: IndexState, failed_indexes: int, container: str,
                   exit_code: int | None, conditions: Iterable[tuple[str, str]] = ()) -> Decision:
    """Applies one failure of ``state``'s index to it and says what happens next.
    ``failed_indexes`` counts the Job's indexes already failed."""
    spec = job["spec"]
    assert spec.get("completionMode") == "Indexed" and "backoffLimitPerIndex" in spec, "an Indexed Job per index"
    action, rule = matching_rule(job, container, exit_code, conditions)
    if action == "FailJob":
        return Decision(action, rule, False, 0.0, "PodFailurePolicy")
    if action == "Ignore":
        # Not counted, and skipped when the delay is computed (KEP-3850).
        delay = _delay_s(state.counted) if state.counted else 0.0
        return Decision(action, rule, True, delay)
    if action == "FailIndex" or state.counted >= spec["backoffLimitPerIndex"]:
        state.failed = True
        limit = spec.get("maxFailedIndexes")
        ends = limit is not None and failed_indexes + 1 > limit
        return Decision(action, rule, False, 0.0, "MaxFailedIndexesExceeded" if ends else "")
    state.counted += 1
    return Decision(action, rule, True, _delay_s(state.counted))


def _delay_s(counted: int) -> float:
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (counted - 1))
