"""Choices: the runs of one completion request, one per choice (OpenAI's `n`), read as one.

    choices = Choices([run_0, ..., run_n-1])   # TurnRuns (chat) or TextRuns (text)
    await choices.start()                      # every run submitted; refusals raise here
    async for index, event in choices.events(): ...   # the runs' events, interleaved
    choices.cancel()                           # any time: every run's request aborted

Each choice is an engine request of its own, as vLLM fans a request with n > 1 out into n
child requests, seeded as vLLM seeds them (integrations/choice_sampling.py). A request with
one choice is the same code with one run.

Why the first choice starts alone. The prefix cache takes a prompt's pages when its prefill
ends (Scheduler.advance), so requests admitted in the same step as that prefill find nothing
cached and each prefill the whole prompt (measured on the CPU demo model: three requests of one
200-token prompt submitted together prefilled 200 tokens each; submitted after the first one's
first token, the later two reused 192 and prefilled 8, the rest of the last page). So `start`
submits the first choice, waits for its first engine event (its prompt is cached by then), then
submits the others, which reuse it: the prompt is prefilled once, for the price of the other
choices' first tokens coming one prefill later. A request that asks for the prompt's entries
(prompt_logprobs, echo's logprobs) reuses no cached prefix: each choice prefills it, and all
start at once (`shares_prompt`); copying the first choice's entries to the others would save
those prefills, not done. Forking the first choice's KV into n sequences
at its first token would save that wait, but needs pages shared copy-on-write between running
requests, which the KV pool does not do.

One failing choice fails the request: a choice whose run raises, or ends with finish_reason
"error" (an engine error), cancels every other choice (a first choice that fails before its
first token leaves the others unstarted: `runs` is then that one alone), and `error` says what
went wrong, which the routes report as they report a single choice's failure
(openai_routes.py). A client that goes away cancels them all (`cancel`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from freetoken_agent.integrations.server.completion_format import Choice
from freetoken_agent.integrations.server.text_run import TextRun
from freetoken_agent.integrations.server.turn_run import TurnRun
from freetoken_agent.session import Usage

Run = TurnRun | TextRun
_ENDED = object()  # a run's events are over


class Choices:
    """A request's runs, choice i's at index i (see the module docstring)."""

    def __init__(self, runs: Sequence[Run], shares_prompt: bool = True) -> None:
        """`shares_prompt`: the later choices can reuse the first one's cached prompt (not
        when the request asks for the prompt's entries: such requests reuse no prefix)."""
        self.runs = list(runs)
        self.shares_prompt = shares_prompt
        self.error: str | None = None  # set when a choice failed (the others are cancelled)

    @property
    def n(self) -> int:
        return len(self.runs)

    async def start(self) -> None:
        """Submit every choice, the first alone until its prompt is cached when the others can
        reuse it (see the module docstring); a refusal of any raises here, with every run
        cancelled."""
        first, rest = self.runs[0], self.runs[1:]
        try:
            await first.start()
            if rest and self.shares_prompt:
                await first.first_event.wait()
                if first.failed_early:  # the request fails with it: start no other choice
                    self.runs = [first]
                    return
            await asyncio.gather(*(run.start() for run in rest))
        except BaseException:
            self.cancel()
            raise

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, event) as the runs give them, each run's ending with its Usage.
        Raises what a run raised, the other runs cancelled."""
        queue: asyncio.Queue = asyncio.Queue()  # (index, event | exception | _ENDED)
        # Held here: the loop keeps tasks weakly.
        pumps = [asyncio.create_task(self._pump(i, run, queue)) for i, run in enumerate(self.runs)]
        running = len(self.runs)
        try:
            while running:
                index, item = await queue.get()
                if item is _ENDED:
                    running -= 1
                elif isinstance(item, BaseException):
                    self.cancel()
                    raise item
                else:
                    yield index, item
        finally:
            for pump in pumps:
                pump.cancel()

    async def _pump(self, index: int, run: Run, queue: asyncio.Queue) -> None:
        try:
            async for event in run.events():
                queue.put_nowait((index, event))
                if isinstance(event, Usage) and event.finish_reason == "error":
                    self._fail(event.error or "the engine failed this request")
        except Exception as e:  # noqa: BLE001 - handed to the reader, raised there
            queue.put_nowait((index, e))
        queue.put_nowait((index, _ENDED))

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            self.cancel()

    def cancel(self) -> None:
        """Abort every choice's request (a no-op for those that have ended)."""
        for run in self.runs:
            run.cancel()

    def finish_reason(self, index: int) -> str | None:
        return self.runs[index].finish_reason()

    def results(self) -> list[Choice]:
        """Each choice's reply, finish reason, log-probabilities and prompt entries, in order."""
        return [
            Choice(run.reply, run.finish_reason(), run.logprobs, run.prompt_logprobs)
            for run in self.runs
        ]

    @property
    def usage(self) -> Usage | None:
        """The request's usage, as OpenAI counts it over choices: the prompt once (the first
        choice's figures: its length and what it reused), the completion (and reasoning)
        tokens of all; None until every choice has ended."""
        usages = [run.usage for run in self.runs]
        if any(u is None for u in usages):
            return None
        total = sum(u.completion_tokens for u in usages)
        counted = [u.reasoning_tokens for u in usages]
        reasoning = None if None in counted else sum(counted)
        return dataclasses.replace(usages[0], completion_tokens=total, reasoning_tokens=reasoning)
