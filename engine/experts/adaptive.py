"""Policy `adaptive`: which of a layer's cache misses are fetched into slots; the rest run on
the CPU from the pool.

q* (policy.py) balances the two branches of this step only; a fill also keeps its expert for
later steps and evicts another, which the cache measures (`ExpertCache.fill_gain`: does
routing ask for the filled expert or its victim first):
- fills pay (temporal locality; with hysteresis, policy.FillVerdict): fetch every miss; one
  run on the CPU instead would leave the expert to miss again on the next steps (on the H200
  host, native routing at 12 layers ran at 406 tok/s fetching all against 299 splitting by q*);
- fills neither pay nor cost (near-uniform routing): the mode of SplitTrials (split_trials.py),
  whichever measured the shortest decode steps of
  - `split`: q* of the misses fetched,
  - `all`: every miss fetched,
  - `none`: only free slots filled, the cache left as it is,
  - `layers`: the cache made of whole layers (layer_layout.py), their misses fetched and every
    other layer's run on the CPU. It is tried only where it can pay (`layers_may_pay`): entering
    it fills whole layers, evicting the other layers' experts, and where few layers miss (the
    working set nearly fits: on the H200, native routing at 12 layers and 621 slots) one block
    of it cost 27 ms a token against 6 and left the cache to refill, and a round measured 192
    tok/s against 456;
- fills cost (the steps' working set exceeds the cache: victims are needed again before fills
  are): fetch none, so the cache keeps what it has; except the experts serving more tokens
  than the CPU's knee (a short prefill chunk; `Bandwidths.knee`, measured by `freetoken
  calibrate`): the CPU would take longer over those than a fetch plus the victim's later miss.
Free slots cost no victim: misses always fill those (in `layers` mode, those of kept layers).

All of the above is the `stops` path of a decode step: the host decides at each layer that
misses. The `device` path (policy gpu-fill's: every miss filled by the layer itself, no host
stop, no CPU branch), the `shared` path (the same, with the CPU worker taking q*'s share of
each layer's misses, the least used, and never all of them while fills pay: cpu_share.py) and
the `split` path (every fill cut between the link and the CPU worker: split_expert.py) are the
others; PathTrials (step_paths.py) keeps whichever measured the shorter steps, per decode batch
size. While one of the last two is kept, its own trials tune it by step time: the CPU's share
(ShareTrials, share_trials.py) and the cut (CutTrials, cut_trials.py); while the paths are
measured they hold their kept values.
"""

from __future__ import annotations

from freetoken_agent.engine.experts import layer_layout
from freetoken_agent.engine.experts.cut_trials import CutTrials
from freetoken_agent.engine.experts.fill_races import MIN_RACES, RACE_MAX_TOKENS
from freetoken_agent.engine.experts.offset_trials import OffsetTrials
from freetoken_agent.engine.experts.policy import (
    Bandwidths,
    FillVerdict,
    split_count,
)
from freetoken_agent.engine.experts.share_trials import ShareTrials
from freetoken_agent.engine.experts.split_trials import SplitTrials
from freetoken_agent.engine.experts.step_paths import PathTrials

STOPS_EMA = 0.1  # weight of the newest decode step in the running count of stopping layers


class AdaptiveFetches:
    def __init__(
        self,
        cache,
        n_layers: int,
        device_tokens: int = RACE_MAX_TOKENS,
        path_params: dict | None = None,
        **trial_params,
    ) -> None:
        """`device_tokens`: the largest decode step the device path serves (the bank's);
        `trial_params`: SplitTrials' schedule, `path_params`: PathTrials' (their defaults
        otherwise)."""
        self.cache = cache  # the bank's ExpertCache
        self.n_layers = n_layers
        self.device_tokens = device_tokens
        self.verdict = FillVerdict()  # the fill race, read with hysteresis
        self.trial_params = trial_params
        self.path_params = path_params or {}
        self.shared_ok = False  # whether the `shared` path can run (the bank's CpuShare)
        self.split_ok = False  # whether the `split` path can run (the bank's SplitExpert)
        # Whether `shared` waits for the fill race to judge (`_path_allowed`); off only to
        # hold shared from the first step (`bench offload --no-shared-gate`).
        self.shared_gate = True
        self._trials: dict[int, SplitTrials] = {}  # per decode batch size
        self._paths: dict[int, PathTrials] = {}  # per decode batch size
        self._shares: dict[int, ShareTrials] = {}  # per decode batch size: the shared path's
        self.share_params: dict = {}  # ShareTrials' schedule (its defaults otherwise)
        # A CPU share (a fraction of a layer's misses) every shared step runs, in place of
        # q*'s tuned by ShareTrials: benches map step time against the share with it
        # (`bench offload --hold-share`). None: q*'s and the trials'.
        self.held_share: float | None = None
        # Whether the share may take every miss of a layer where fills do not pay
        # (engine/experts/device_path.py `_set_share`); off, a layer that misses always keeps
        # a fill (`bench offload --every-miss-ab` measures both in one engine).
        self.cpu_all_misses = True
        self._cuts: dict[int, CutTrials] = {}  # per decode batch size: the split path's cut
        self.cut_params: dict = {}  # CutTrials' schedule (its defaults otherwise)
        self._measuring: dict[int, bool] = {}  # per batch size: the last step's paths measured
        # Per decode batch size: layers with a miss per step (each a stop for the host),
        # running average over steps outside `layers` mode; and the count of this step so far.
        self._stops: dict[int, float] = {}
        self._stops_now = 0
        self.mode = "split"  # the mode of the latest `choose`

    def trials(self, n_tokens: int) -> SplitTrials:
        """The in-band mode's trials for decode steps of `n_tokens` tokens. Each batch size
        has its own: its steps' time per token differs (four tokens share one step's stops),
        so a mode measured while the batch was larger would look faster."""
        if n_tokens not in self._trials:
            self._trials[n_tokens] = SplitTrials(
                allowed=lambda mode: mode != "layers" or self.layers_may_pay(n_tokens),
                **self.trial_params,
            )
        return self._trials[n_tokens]

    def paths(self, n_tokens: int) -> PathTrials:
        """The step path's trials for decode steps of `n_tokens` tokens."""
        if n_tokens not in self._paths:
            params = {"shared": self.shared_ok, "split": self.split_ok,
                      "allowed": self._path_allowed, "keepable": self._path_keepable,
                      **self.path_params}  # fmt: skip
            self._paths[n_tokens] = PathTrials(**params)
        return self._paths[n_tokens]

    def drop_split(self) -> None:
        """The split path failed for good (its worker, or a copy behind): off, and the path
        trials that had it as a candidate start anew without it (kept, they would time
        `device` steps under its name)."""
        self.split_ok = False
        self._paths.clear()

    def shares(self, n_tokens: int) -> ShareTrials:
        """The shared path's share trials for decode steps of `n_tokens` tokens."""
        if n_tokens not in self._shares:
            self._shares[n_tokens] = ShareTrials(**self.share_params)
        return self._shares[n_tokens]

    def share_offset(self, n_tokens: int) -> float:
        """The offset from q*'s CPU share for the next shared step (share_trials.py)."""
        return self._offset(n_tokens, self.shares(n_tokens))

    def cuts(self, n_tokens: int) -> CutTrials:
        """The split path's cut trials for decode steps of `n_tokens` tokens."""
        if n_tokens not in self._cuts:
            self._cuts[n_tokens] = CutTrials(**self.cut_params)
        return self._cuts[n_tokens]

    def cut_offset(self, n_tokens: int, span: tuple[float, float] | None = None) -> float:
        """The offset from the rates' cut, in I, for the next split step (cut_trials.py);
        `span`: the offsets within which the cut still moves (SplitExpert.offset_span)."""
        trials = self.cuts(n_tokens)
        if span is not None:
            trials.bounds = span
        return self._offset(n_tokens, trials)

    def _offset(self, n_tokens: int, trials: OffsetTrials) -> float:
        """The trials' offset while their path is kept; their kept bias while the path trials
        measure (they time the path as it would be kept, not at a candidate being tried)."""
        if self.path_measured(n_tokens) and not self.paths(n_tokens).exploring:
            return trials.offset
        return trials.bias

    def chosen_paths(self) -> dict[int, str]:
        """The path each decode batch size's last measurement kept (for Engine.stats)."""
        return {n: t.chosen for n, t in sorted(self._paths.items()) if t.choices}

    def path(self, n_tokens: int) -> str:
        """`stops`, `device`, `shared` or `split` for a decode step of `n_tokens` tokens (longer
        calls, and steps past `device_tokens`: stops). `shared` kept from a measurement gives
        way to `device` until the fill race has judged (`_path_allowed`), `split` once its
        worker failed."""
        if not self.path_measured(n_tokens):
            return "stops"
        path = self.paths(n_tokens).path
        if path == "shared" and not self._path_allowed(path):
            return "device"
        return "device" if path == "split" and not self.split_ok else path  # (worker failed)

    def fills_pay(self) -> bool:
        """Whether the fill race says fills pay (the verdict `all`, with its hysteresis)."""
        return self.verdict(self.cache.fill_gain) == "all"

    def fills_judged(self) -> bool:
        """Whether enough fill races have settled for the race to say anything (MIN_RACES;
        before that its gain reads 0)."""
        return self.cache.races.settled >= MIN_RACES

    def _path_allowed(self, path: str) -> bool:
        """`shared` once the fill race has judged. Before, its CPU share starts no race, so
        where misses are rare (native routing, ~0.4 fills a token) the gain stayed at its
        unjudged 0 and the cache stopped learning: 578 tok/s against gpu-fill's 824 (twenty-
        first session, peer slice b=1, 4.75 experts a token on the CPU). Whether fills pay no
        longer matters: while fills pay the share never takes all of a layer's misses (a
        lone miss fills) and takes the least used (kernels/reference_fills.py
        `cpu_misses`), so under locality the cache keeps learning while the CPU shortens the
        layers that miss several. Until the thirty-sixth session the share took q*'s of
        every layer's misses in order, and `shared` waited while fills paid (48 layers /
        32 GB, Zipf 1.0 / loc 0.7, b=1: 77.8 tok/s against gpu-fill's 111.3); with the rule,
        held on `shared`: b=1 124.4 against 130.7, **b=4 227.9 against 179.1**
        (bench/results/NOTES.md), so the path trials choose."""
        if path != "shared" or not self.shared_gate:
            return True
        return self.fills_judged()

    def _path_keepable(self, path: str) -> bool:
        """`stops` is measured but not kept once the race has judged that fills pay. Then the
        stops path fetches every miss, as the device path does, and adds a host stop at each
        layer that misses, so it can only measure faster on borrowed time: its blocks inherit
        the cache the device blocks filled, and its misses run on the CPU while the verdict
        sits in its band leave the cache colder for the device blocks after them. On the H200
        every row that kept `stops` under Zipf routing lost to gpu-fill (peer slice b=1,
        thirty-second session: trials 2.48 against 2.73 ms a token, the row 346.5 against
        435.3 tok/s; b=4 591.5 against 633.9 in the twenty-sixth; 12 layers b=4 487.3 against
        513.7 in the twentieth), where rows that kept `device` came within 0-7% of it (the
        rule measured: 408.1 against 434.6, thirty-third session). One block of it still runs
        each measurement (RotatedTrials `_spent`): its steps are the fill races' only source
        (the device path's fills race nothing, device_fills.py), so a change of routing still
        turns the verdict; its later blocks only cost (the peer slice's native b=1 stops steps
        ran 2.05 ms against 0.98 on the device path)."""
        return path != "stops" or not (self.fills_pay() and self.fills_judged())

    def _paths_exploring(self, n_tokens: int) -> bool:
        """Whether the path trials measure now: the stops path then runs its split trials'
        chosen mode, not their next trial, so PathTrials compares the device with the stops
        path as it would run (mid-trials, the peer slice's uniform stops path measured 12.8 ms
        a token against 10.9 with its `layers` mode), and the split trials take no sample.
        Holding the stops path until the split trials were done instead left it in them for
        most of a measurement at 48 layers under Zipf routing, whose race drifts in and out
        of the band (57.9 tok/s against 103 on the device path)."""
        return self.path_measured(n_tokens) and self.paths(n_tokens).exploring

    def path_measured(self, n_tokens: int) -> bool:
        """Whether decode steps of `n_tokens` tokens choose their path by PathTrials."""
        return 0 < n_tokens <= min(RACE_MAX_TOKENS, self.device_tokens)

    def layers_may_pay(self, n_tokens: int) -> bool:
        """Whether `layers` could shorten decode steps of `n_tokens` tokens: it hits no more
        experts than any layout of the same slots, so it wins only by stopping at fewer layers,
        which it can do only if the steps now stop at more layers than the ones it leaves out."""
        stops = self._stops.get(n_tokens)
        return stops is not None and stops > self.n_layers - layer_layout.whole_layers(self.cache)

    def choose(
        self, lids: list[int], tokens: list[int], protect: set[int], bw: Bandwidths, n_tokens: int
    ) -> list[int]:
        """The misses to fetch, a prefix of `lids` (one layer's, sorted by `tokens`, the tokens
        each serves this step, most first) in a call of `n_tokens` tokens; `protect` holds the
        layer's experts. Entering `layers` mode first makes the kept layers whole (fills of its
        own, published)."""
        cache = self.cache
        if n_tokens <= RACE_MAX_TOKENS:
            self._stops_now += 1  # called once per layer with misses
        mode = self.verdict(cache.fill_gain)
        if mode == "band" and n_tokens > RACE_MAX_TOKENS:
            # A prefill chunk too short to stream: measured by nothing, it keeps the layout
            # decode chose (whole layers) or splits by q*.
            mode = "layers" if cache.kept_layers else "split"
        elif mode == "band":
            trials = self.trials(n_tokens)
            mode = trials.chosen if self._paths_exploring(n_tokens) else trials.mode
        self.mode = mode
        if mode != "layers":
            cache.kept_layers = frozenset()
        elif not cache.kept_layers:
            cache.kept_layers = layer_layout.kept_layers(cache, self.n_layers)
            layer_layout.complete(cache, cache.kept_layers, protect)
        if mode == "all":
            return lids
        if mode == "layers" and lids and cache.kept(lids[0]):
            return lids
        if mode in ("none", "layers"):
            q = sum(1 for t in tokens if t > bw.knee)
        else:
            q = split_count(tokens, bw)
        return lids[: max(q, min(cache.free_slots, len(lids)))]

    def behind(self, tokens: list[int], bw: Bandwidths) -> int:
        """How many of a decode stop's fetches (serving `tokens` tokens each, most first) to
        fill behind the layer's compute (EngineConfig.fill_behind): while fills pay (`all`),
        every miss is filled, as the next steps ask for them again, but the layer need wait
        only for the first q (q* of split_count, at least one) and run the rest on the CPU
        meanwhile. A stop then takes max(q fills, the CPU's share) instead of every fill: the
        Zipf trace at 48 layers stops ~12 times a token for ~2.2 fills of 172 us each."""
        if self.mode != "all" or len(tokens) < 2:
            return 0
        return len(tokens) - max(1, split_count(tokens, bw))

    def step_timed(self, n_tokens: int, seconds: float) -> None:
        """A decode step of `n_tokens` tokens took `seconds`: a sample for the trials when the
        race left the split to them."""
        if not 0 < n_tokens <= RACE_MAX_TOKENS:
            return
        was_exploring, on_stops = False, True
        if self.path_measured(n_tokens):
            paths = self.paths(n_tokens)
            path = self.path(n_tokens)
            was_exploring, on_stops = paths.exploring, paths.path == "stops"
            paths.step_done(seconds / n_tokens)
            # The first step after the paths were measured is no sample for the kept path's
            # own trials: it pays the hand-over, and under overlap it was launched while they
            # were still measured (at the kept value, not the candidate its trials now try).
            kept = not was_exploring and not self._measuring.get(n_tokens, False)
            self._measuring[n_tokens] = was_exploring
            if kept and path == "shared":  # the path kept: a sample for its share
                self.shares(n_tokens).step_done(seconds / n_tokens)
            elif kept and path == "split":  # ... or for its cut
                self.cuts(n_tokens).step_done(seconds / n_tokens)
        if not on_stops:
            return
        stops, self._stops_now = self._stops_now, 0
        if not self.cache.kept_layers:
            was = self._stops.get(n_tokens)
            self._stops[n_tokens] = stops if was is None else was + STOPS_EMA * (stops - was)
        if self.verdict(self.cache.fill_gain) == "band" and not was_exploring:
            self.trials(n_tokens).step_done(seconds / n_tokens)
