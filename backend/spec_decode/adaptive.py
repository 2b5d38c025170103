"""How many of a step's drafts are worth verifying.

A draft token costs a query row whether or not it is accepted. While a step is bound by
memory bandwidth (small batches) a row costs next to nothing, so every draft pays; once the
batch makes a step compute-bound, each row adds its share of the step's time and only drafts
likely to be accepted pay for it. The budget keeps the drafts that raise the step's expected
output tokens per second, from two measurements the engine feeds it:

- the step's cost as a function of its scheduled tokens: a moving average of the seconds of
  recent steps in each power-of-two bucket of token counts, interpolated between buckets, a
  bucket not yet measured priced from those below it (`CostCurve.seconds`);
- the acceptance rate at each draft position, given that the position was reached (the
  drafts before it accepted): a moving average over recent verifications.

The expected acceptance of a request's j-th draft is the product of the rates up to j; the
drafts are taken in falling order of it while (tokens + expected accepted) / step seconds
still grows. With no measured cost yet, nothing is trimmed: the first steps measure.

A draft model costs passes of its own before any of that: a catch-up pass over each request's
new tokens, then one pass per further draft, whatever the verification later keeps. Those
seconds are sunk by the time drafts are trimmed, so the draft length is decided before
drafting (`draft_length`), from the draft's measured pass cost beside the target's step cost.
"""

from __future__ import annotations

import math
from bisect import bisect_right

# Weight of a new measurement in the moving averages: about the last 20 steps (cost) and the
# last 50 verifications reaching a position (acceptance).
COST_WEIGHT = 0.05
ACCEPTANCE_WEIGHT = 0.02
# Before any verification: drafts are assumed as good as a coin toss, so that they get tried.
PRIOR_ACCEPTANCE = 0.5


def _bucket(num_tokens: float) -> int:
    """The power-of-two bucket of a token count: [2^(b-1), 2^b) is bucket b."""
    return int(num_tokens).bit_length()


class CostCurve:
    """Seconds of a forward pass as a function of its tokens: a moving average of recent
    passes in each power-of-two bucket of token counts, interpolated between buckets."""

    def __init__(self) -> None:
        self._points: dict[int, list[float]] = {}  # bucket -> [mean tokens, mean seconds]

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        bucket = _bucket(num_tokens)
        point = self._points.get(bucket)
        if point is None:
            self._points[bucket] = [float(num_tokens), seconds]
        else:
            point[0] += COST_WEIGHT * (num_tokens - point[0])
            point[1] += COST_WEIGHT * (seconds - point[1])

    def seconds(self, num_tokens: float) -> float | None:
        """The measured cost of `num_tokens`: flat below the smallest bucket, interpolated
        between two measured buckets with none unmeasured between them, and elsewhere (past
        the largest, or where it falls in or beyond a bucket never measured) extended from the
        measured buckets below it by the slope of the last two (flat with one). A size not yet
        tried is so priced by the sizes below it, never by a far larger one, and gets tried and
        measured: at one request the next larger steps measured are often the prefill chunks,
        whose slope would price a draft's row at over twice its cost, and the rows past the
        longest run of drafts tried would never be tried. None before any pass."""
        if not self._points:
            return None
        buckets = sorted(self._points)
        means = [self._points[b][0] for b in buckets]
        costs = [self._points[b][1] for b in buckets]
        if num_tokens <= means[0]:
            return costs[0]
        below = bisect_right(means, num_tokens) - 1
        above = below + 1
        if above < len(buckets) and buckets[above] in (buckets[below] + 1, _bucket(num_tokens)):
            share = (num_tokens - means[below]) / (means[above] - means[below])
            return costs[below] + (costs[above] - costs[below]) * share
        if below == 0:
            return costs[0]
        slope = max(0.0, (costs[below] - costs[below - 1]) / (means[below] - means[below - 1]))
        return costs[below] + slope * (num_tokens - means[below])


class DraftBudget:
    def __init__(self, max_drafts: int) -> None:
        self.acceptance = [PRIOR_ACCEPTANCE] * max_drafts
        self.step_cost = CostCurve()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.step_cost.observe(num_tokens, seconds)

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        # Positions up to the first rejection were reached; all before it were accepted.
        for position in range(min(num_drafts, num_accepted + 1, len(self.acceptance))):
            accepted = 1.0 if position < num_accepted else 0.0
            self.acceptance[position] += ACCEPTANCE_WEIGHT * (accepted - self.acceptance[position])

    def step_seconds(self, num_tokens: float) -> float | None:
        return self.step_cost.seconds(num_tokens)

    def expected_accepted(self, num_drafts: int) -> float:
        """Expected accepted tokens of a request's first `num_drafts` drafts."""
        total, reached = 0.0, 1.0
        for rate in self.acceptance[:num_drafts]:
            reached *= rate
            total += reached
        return total

    def draft_length(self, num_speculating: int, num_base_tokens: int, num_base_outputs: int, max_drafts: int,
                     pass_cost: CostCurve) -> int:
        """How many drafts a draft model should make for each of `num_speculating` requests,
        for a step of `num_base_tokens` tokens and `num_base_outputs` outputs without drafts:
        the length whose expected output tokens per second of the step, the draft's passes
        included, is highest. Before either cost is measured, all of them (to measure).

        A request's catch-up pass feeds its last token and the drafts accepted since its last
        pass, about 1 + the expected accepted tokens; every further pass feeds one token."""
        step = self.step_seconds(num_base_tokens)
        if step is None or pass_cost.seconds(1) is None or num_speculating <= 0:
            return max_drafts
        best, best_rate = 0, num_base_outputs / step
        for k in range(1, max_drafts + 1):
            accepted = self.expected_accepted(k)
            catch_up = pass_cost.seconds(num_speculating * (1.0 + accepted))
            seconds = (self.step_seconds(num_base_tokens + num_speculating * k) + catch_up
                       + (k - 1) * pass_cost.seconds(num_speculating))
            rate = (num_base_outputs + num_speculating * accepted) / seconds
            if math.isfinite(rate) and rate > best_rate:
                best, best_rate = k, rate
        return best

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
