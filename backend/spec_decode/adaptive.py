"""How many of a step's drafts are worth verifying.

A draft token costs a query row whether or not it is accepted. While a step is bound by
memory bandwidth (small batches) a row costs next to nothing, so every draft pays; once the
batch makes a step compute-bound, each row adds its share of the step's time and only drafts
likely to be accepted pay for it. The budget keeps the drafts that raise the step's expected
output tokens per second, from two measurements the engine feeds it:

- the step's cost as a function of its scheduled tokens: a moving average of the seconds of
  recent steps in each power-of-two bucket of token counts, interpolated between buckets;
- the acceptance rate at each draft position, given that the position was reached (the
  drafts before it accepted): a moving average over recent verifications.

The expected acceptance of a request's j-th draft is the product of the rates up to j; the
drafts are taken in falling order of it while (tokens + expected accepted) / step seconds
still grows. With no measured cost yet, nothing is trimmed: the first steps measure.
"""

from __future__ import annotations

import math

# Weight of a new measurement in the moving averages: about the last 20 steps (cost) and the
# last 50 verifications reaching a position (acceptance).
COST_WEIGHT = 0.05
ACCEPTANCE_WEIGHT = 0.02
# Before any verification: drafts are assumed as good as a coin toss, so that they get tried.
PRIOR_ACCEPTANCE = 0.5


class DraftBudget:
    def __init__(self, max_drafts: int) -> None:
        self.acceptance = [PRIOR_ACCEPTANCE] * max_drafts
        self._cost: dict[int, list[float]] = {}  # bucket -> [mean tokens, mean seconds]

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        bucket = num_tokens.bit_length()
        point = self._cost.get(bucket)
        if point is None:
            self._cost[bucket] = [float(num_tokens), seconds]
        else:
            point[0] += COST_WEIGHT * (num_tokens - point[0])
            point[1] += COST_WEIGHT * (seconds - point[1])

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        # Positions up to the first rejection were reached; all before it were accepted.
        for position in range(min(num_drafts, num_accepted + 1, len(self.acceptance))):
            accepted = 1.0 if position < num_accepted else 0.0
            self.acceptance[position] += ACCEPTANCE_WEIGHT * (accepted - self.acceptance[position])

    def step_seconds(self, num_tokens: float) -> float | None:
        """The measured cost of a step of `num_tokens`: interpolated between buckets, flat below
        the smallest, and past the largest extended by the slope of the last two (flat with one
        point: a size not yet tried is assumed free, so that it gets tried and measured)."""
        if not self._cost:
            return None
        points = sorted(self._cost.values())
        if num_tokens <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if num_tokens <= x1:
                return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0) if x1 > x0 else y1
        if len(points) == 1:
            return points[-1][1]
        (x0, y0), (x1, y1) = points[-2], points[-1]
        slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
        return y1 + slope * (num_tokens - x1)

    def trim(self, num_drafts: list[int], num_base_tokens: int, num_base_outputs: int) -> list[int]:
        """How many of each request's drafts to keep, for a step that would schedule
        `num_base_tokens` tokens and produce `num_base_outputs` tokens without drafts."""
        seconds = self.step_seconds(num_base_tokens)
        if seconds is None:
            return list(num_drafts)
        candidates = []
        for index, count in enumerate(num_drafts):
            expected = 1.0
            for position in range(min(count, len(self.acceptance))):
                expected *= self.acceptance[position]
                candidates.append((-expected, position, index))
        candidates.sort()
        kept = [0] * len(num_drafts)
        outputs = float(num_base_outputs)
        extra = 0
        for negative_expected, position, index in candidates:
            if kept[index] != position:
                continue  # an earlier draft of this request was not kept
            expected = -negative_expected
            longer = self.step_seconds(num_base_tokens + extra + 1)
            if expected <= 0 or not math.isfinite(longer) or (outputs + expected) * seconds < outputs * longer:
                break
            kept[index] = position + 1
            outputs += expected
            extra += 1
            seconds = longer
        return kept
