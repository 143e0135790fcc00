"""An engine that answers with chosen texts, for the output paths a random-weight demo model
never takes (free-form or malformed tool calls, engine errors). What an EngineService drives:
submit / step / abort. Used by the LangChain tests and the server tests."""

from __future__ import annotations

import time

from freetoken_agent import Engine
from freetoken_agent.engine.outputs import TokenEvent
from freetoken_agent.engine.text.detokenizer import IncrementalDetokenizer


class ScriptedEngine:
    """Answers each request with a queued reply: (text, finish_reason) or (text, finish_reason,
    error). One token per step, canonical tokenization; a reply with an error ends at once, as
    an engine failure does, with no more tokens. A request asking for logprobs gets made-up
    ones: -0.5 * (its position + 1), and its own token as its one top alternative."""

    def __init__(self, real: Engine) -> None:
        self.tokenizer, self.spec, self.max_model_len = (
            real.tokenizer,
            real.spec,
            real.max_model_len,
        )
        self.thinking = real.thinking  # the think-block markers (what a budget needs)
        self.replies: list[tuple] = []  # (text, reason) or (text, reason, error)
        self.prompts: list[list[int]] = []
        self.samplings: list = []  # each request's SamplingParams, in order
        self.running: dict[str, list] = {}
        self.events: dict[str, list[TokenEvent]] = {}  # not taken yet, as Engine keeps them
        self.submitted = 0
        self.finished = 0

    def submit(self, prompt, sampling, **options) -> str:  # (options: as Engine's, unused)
        rid = f"s{self.submitted}"
        self.submitted += 1
        self.prompts.append(list(prompt))
        self.samplings.append(sampling)
        reply, reason, *rest = self.replies.pop(0)
        error = rest[0] if rest else None
        detok = IncrementalDetokenizer(self.tokenizer)
        self.running[rid] = [self.tokenizer.encode(reply), 0, detok, reason, error]
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[TokenEvent]:
        events = []
        for rid, state in list(self.running.items()):
            ids, i, detok, reason, error = state
            if error is not None or i == len(ids):
                events.append(TokenEvent(rid, None, "", i, True, reason, error))
                del self.running[rid]
                self.finished += 1
                continue
            state[1] += 1
            event = TokenEvent(rid, ids[i], detok.push(ids[i]), i)
            k = self.samplings[int(rid[1:])].logprobs
            if k is not None:  # made-up values, distinct per position: -0.5, -1.0, ...
                event.logprob = -0.5 * (i + 1)
                event.top_logprobs = ((ids[i], event.logprob),)[:k]
            events.append(event)
        for event in events:
            self.events.setdefault(event.request_id, []).append(event)
        return events

    def take_events(self, rid: str) -> list[TokenEvent]:
        return self.events.pop(rid, [])

    def abort(self, rid: str) -> None:
        self.running.pop(rid, None)

    def release(self, rid: str) -> None:
        self.abort(rid)
        self.events.pop(rid, None)

    def stats(self) -> dict:
        return {"tokens": {"reused": 0, "prefilled": 0}, "requests": {"finished": self.finished}}


class PacedEngine(ScriptedEngine):
    """A ScriptedEngine that sleeps `delay` before each step once a request has written
    `slow_after` tokens: a generation stopped early ends long before its reply would have."""

    slow_after = 10**9
    delay = 0.02

    def step(self):
        if any(state[1] >= self.slow_after for state in self.running.values()):
            time.sleep(self.delay)
        return super().step()


def record_requests(engine: Engine) -> list:
    """Every Request the (real) engine is given from now on, in order, kept as they run."""
    requests: list = []
    submit = engine.submit

    def recording(*args, **kwargs):
        rid = submit(*args, **kwargs)
        requests.append(engine._requests[rid])
        return rid

    engine.submit = recording
    return requests
