"""The choices of one ChatFreeToken call (`n`, as ChatOpenAI names it): n Session turns of the
same history, each its own engine request, read into n ChunkBuilders.

Choice i is sampled as integrations/choice_sampling.py says (seeded seed + i). The first choice
starts alone and the others at its first engine event, when its prompt is cached, so they reuse
it instead of each prefilling it (server/choices.py says why requests started together do
not). Choice 0 runs where the call runs (the calling thread, or the caller's task), the others
in threads (tasks) of their own; a call with one choice is the same code, with nothing else.

A choice that fails (its turn raises: the engine's error, a timeout, a cancelled task) cancels
the others, and the call raises the first failure (ChoiceGroup keeps it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from langchain_core.outputs import ChatGeneration, ChatResult

from freetoken_agent.integrations.choice_sampling import choice_count, choice_sampling
from freetoken_agent.integrations.langchain_call import (
    PreparedCall,
    aretried_turn,
    retried_turn,
)
from freetoken_agent.integrations.langchain_chunks import ChunkBuilder
from freetoken_agent.integrations.langchain_runtime import ChoiceGroup, SessionPool

STREAM_ONE = "n must be 1 when streaming."  # ChatOpenAI's rule, in its words


def split_n(options: dict[str, Any], default: int | None) -> tuple[int, dict[str, Any]]:
    """A call's choice count (its `n`, else the model's) and its other options."""
    options = dict(options)
    return choice_count(options.pop("n", default)), options


def one_choice(options: dict[str, Any], default: int | None) -> dict[str, Any]:
    """A stream's options without `n`, which must be 1: a stream carries one generation."""
    n, options = split_n(options, default)
    if n > 1:
        raise ValueError(STREAM_ONE)
    return options


def choice_calls(call: PreparedCall, n: int) -> list[PreparedCall]:
    """The call of each of n choices: the same but for the sampling (its seed)."""
    return [call._replace(sampling=choice_sampling(call.sampling, i)) for i in range(n)]


def run_choices(
    pool: SessionPool, calls: Sequence[PreparedCall], max_retries: int, builders: Sequence[Any]
) -> None:
    """Run every choice, feeding choice i's events to `builders[i]` (ChunkBuilder.chunk)."""
    group = ChoiceGroup()

    def run(i: int) -> None:
        for event in retried_turn(pool, calls[i], max_retries, group):
            builders[i].chunk(event)

    def later(i: int) -> None:  # a thread of its own
        group.first.wait()
        if group.cancelled:
            return
        try:
            run(i)
        except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
            group.fail(e)

    threads = [
        threading.Thread(target=later, args=(i,), name=f"freetoken-choice-{i}", daemon=True)
        for i in range(1, len(calls))
    ]
    for thread in threads:
        thread.start()
    try:
        run(0)
    except BaseException as e:  # noqa: BLE001 - the first failure is raised below
        group.fail(e)
    for thread in threads:
        thread.join()
    if group.error is not None:
        raise group.error


async def arun_choices(
    pool: SessionPool, calls: Sequence[PreparedCall], max_retries: int, builders: Sequence[Any]
) -> None:
    """The same on an asyncio loop: choice i in a task of its own. One executor thread waits for
    the first event for all the later choices (a thread each would take n - 1 of the loop's
    default executor, which every `to_thread` of the process shares)."""
    group = ChoiceGroup()
    first = asyncio.ensure_future(asyncio.to_thread(group.first.wait)) if len(calls) > 1 else None

    async def run(i: int) -> None:
        if i:
            await asyncio.shield(first)  # a cancelled choice leaves the wait to the others
            if group.cancelled:
                return
        try:
            async for event in aretried_turn(pool, calls[i], max_retries, group):
                builders[i].chunk(event)
        except BaseException as e:
            group.fail(e)
            raise

    tasks = [asyncio.ensure_future(run(i)) for i in range(len(calls))]
    try:
        await asyncio.gather(*tasks)
    except BaseException as e:
        group.fail(e)  # the caller's cancellation, or a choice's failure kept first
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise group.error from None
    finally:
        if first is not None:
            group.first.set()  # the waiting thread returns (cancel set it already on a failure)
            await asyncio.gather(first, return_exceptions=True)


def chat_result(builders: Sequence[ChunkBuilder]) -> ChatResult:
    """The call's ChatResult: one generation per choice, in order."""
    generations = [ChatGeneration(message=b.message(), generation_info=b.generation_info())
                   for b in builders]  # fmt: skip
    return ChatResult(generations=generations, llm_output={"model_name": builders[0].model_name})
