"""Policy `adaptive`: which of a layer's cache misses are fetched into slots; the rest run on
the CPU from the pool.

q* (policy.py) balances the two branches of this step only; a fill also keeps its expert for
later steps and evicts another, which the cache measures (`ExpertCache.fill_gain`: does
routing ask for the filled expert or its victim first):
- fills pay (temporal locality; with hysteresis, policy.FillVerdict): fetch every miss; one
  run on the CPU instead would leave the expert to miss again on the next steps (on the H200
  host, native routing at 12 layers ran at 406 tok/s fetching all against 299 splitting by q*);
- fills neither pay nor cost (near-uniform routing): the mode of SplitTrials (split_trials.py):
  q*, every miss or none, whichever measured the shortest decode steps;
- fills cost (the steps' working set exceeds the cache: victims are needed again before fills
  are): fetch none, so the cache keeps what it has; except the experts serving more than
  CPU_KNEE_TOKENS tokens (a short prefill chunk): the CPU would take longer over those than a
  fetch plus the victim's later miss.
Free slots cost no victim: misses always fill those.
"""

from __future__ import annotations

from freetoken_agent.engine.experts.policy import (
    CPU_KNEE_TOKENS,
    Bandwidths,
    FillVerdict,
    split_count,
)
from freetoken_agent.engine.experts.split_trials import SplitTrials


class AdaptiveFetches:
    def __init__(self) -> None:
        self.verdict = FillVerdict()  # the fill race, read with hysteresis
        self.trials = SplitTrials()  # the in-band mode, from measured decode steps

    def choose(
        self, lids: list[int], tokens: list[int], gain: float, free_slots: int, bw: Bandwidths
    ) -> list[int]:
        """The misses to fetch, a prefix of `lids` (sorted by `tokens`, the tokens each serves
        this step, most first), given the cache's fill race `gain` and its free slots."""
        verdict = self.verdict(gain)
        mode = self.trials.mode if verdict == "band" else verdict
        if mode == "all":
            return lids
        if mode == "none":
            q = sum(1 for t in tokens if t > CPU_KNEE_TOKENS)
        else:
            q = split_count(tokens, bw)
        return lids[: max(q, min(free_slots, len(lids)))]

    def step_timed(self, gain: float, n_tokens: int, seconds: float) -> None:
        """A decode step of `n_tokens` tokens took `seconds`: a sample for the trials when the
        race left the split to them."""
        if n_tokens > 0 and self.verdict(gain) == "band":
            self.trials.step_done(seconds / n_tokens)
