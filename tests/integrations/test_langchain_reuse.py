"""KV reuse across the turns of an agent conversation through ChatFreeToken.

An agent resends its whole history each call; the engine must prefill only what it has not
computed yet. The figures are derived here independently of the Session's own bookkeeping:
the test taps the engine service, records the token ids each request submitted and generated,
computes the longest common prefix with what the engine had cached, and compares the result
with what the engine reports (`engine.stats()` counters and `usage_metadata.input_token_details
.cache_read`).

The model is the demo checkpoint with a Qwen3-thinking chat template, reasoning on: it drops
the reasoning (and the think block) of assistant turns before the last user query, so the turn
after a new user message must re-prefill from the first assistant turn that the template now
renders differently, and no earlier.
"""

from __future__ import annotations

import importlib.util
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel, Field

from freetoken_agent.chat_format import common_prefix
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "café", "你好", "🙂", "x,", "{a:", "1}", "!?"]
ASSISTANT = "<|im_start|>assistant\n"


def _qwen3_thinking_template() -> str:
    """The Qwen3-thinking template fixture of the chat-format tests (one copy in the repo)."""
    path = ROOT / "tests/freetoken_agent/test_chat_format.py"
    spec = importlib.util.spec_from_file_location("_chat_format_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QWEN3_THINKING


class Lookup(BaseModel):
    """Look a city up (bounded arguments, so a forced call of the demo model always closes)."""

    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=9)


class EngineTap:
    """Records, per engine request, the prompt ids submitted and the token ids generated, by
    wrapping EngineService.submit (what every ChatFreeToken call goes through)."""

    def __init__(self, service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.requests: list[tuple[list[int], list[int]]] = []
        submit = service.submit

        def tapped(prompt, sampling, sink) -> str:
            out: list[int] = []
            self.requests.append((list(prompt), out))

            def deliver(event) -> None:
                if event.token_id is not None:
                    out.append(event.token_id)
                sink(event)

            return submit(prompt, sampling, deliver)

        monkeypatch.setattr(service, "submit", tapped)

    def expected_reuse(self) -> tuple[int, int]:
        """The reuse the last request can get (a) from everything the engine has cached and
        (b) from the previous request alone. The engine caches each finished request's prompt
        and output but the last token (whose KV was never computed), matches the longest
        cached prefix, and always recomputes a prompt's last token."""
        prompt, _ = self.requests[-1]
        cached = [p + o[:-1] for p, o in self.requests[:-1]]
        best = max(common_prefix(seq, prompt) for seq in cached)
        return min(best, len(prompt) - 1), min(common_prefix(cached[-1], prompt), len(prompt) - 1)


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint with the Qwen3-thinking template (chat_template.jinja wins)."""
    folder = tmp_path_factory.mktemp("qwen3-thinking") / "model"
    shutil.copytree(ensure_demo_model(tmp_path_factory.mktemp("cache")), folder)
    (folder / "chat_template.jinja").write_text(_qwen3_thinking_template())
    return folder


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))


def test_agent_turns_prefill_only_what_the_engine_has_not_seen(
    qwen3_model: Path, rng_seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(rng_seed)
    llm = ChatFreeToken(
        model=str(qwen3_model),
        device="cpu",
        reasoning=True,
        temperature=0,
        max_tokens=40,
        engine_options={"kv_tokens": 16384, "max_model_len": 4096},
    )
    tap = EngineTap(llm.service, monkeypatch)
    tok = llm.service.tokenizer
    auto = llm.bind_tools([Lookup])
    forced = llm.bind_tools([Lookup], tool_choice="Lookup")

    history: list = [SystemMessage(_text(rng)), HumanMessage(_text(rng))]
    turns = [
        # (the runnable, the assistant turn the template strips now: the first one after
        #  the previous user query, counted among assistant turns; None: nothing stripped)
        (auto, None),
        (forced, 0),  # a new user message: a1's reasoning goes
        (auto, None),  # a tool result in the same query: a2 keeps its (empty) think block
        (auto, 1),  # a new user message: a2 and a3 lose their think blocks, from a2 on
    ]
    for k, (runnable, stripped) in enumerate(turns):
        before = llm.service.stats()["tokens"]
        message = runnable.invoke(history)
        after = llm.service.stats()["tokens"]
        assert len(tap.requests) == k + 1, "one engine request per turn"
        prompt, output = tap.requests[-1]
        usage = message.usage_metadata
        assert usage["input_tokens"] == len(prompt)
        assert usage["output_tokens"] == len(output) > 0
        if k == 0:
            expected = 0  # a fresh engine (its own model folder): nothing is cached yet
        else:
            expected, previous = tap.expected_reuse()
            assert expected == previous  # the previous turn is the longest match
        # Exact figures: the engine reused that much and prefilled only the rest.
        assert usage["input_token_details"]["cache_read"] == expected
        assert after["reused"] - before["reused"] == expected
        assert after["prefilled"] - before["prefilled"] == len(prompt) - expected
        if stripped is not None:
            # The re-prefill starts right at the body of the first stripped assistant turn:
            # everything before it is reused.
            head = tok.decode(prompt[:expected], skip_special_tokens=False)
            assert head.endswith(ASSISTANT) and head.count(ASSISTANT) == stripped + 1
            earlier = tap.requests[-2][0] + tap.requests[-2][1]
            assert prompt[:expected] == earlier[:expected]
            assert prompt[expected] != earlier[expected]  # diverges right there
        elif k > 0:
            # Only new messages: the whole previous prompt is reused (the new suffix starts
            # within the previous output, where the re-rendered reply differs from it).
            assert expected >= len(tap.requests[-2][0])

        history.append(message)
        if k == 0:
            thought = message.additional_kwargs.get("reasoning_content", "")
            history.append(HumanMessage(_text(rng)))
        elif k == 1:
            (call,) = message.tool_calls
            Lookup.model_validate(call["args"])
            history.append(ToolMessage(_text(rng), tool_call_id=call["id"]))
        elif k == 2:
            history.append(HumanMessage(_text(rng)))
    # a1's reasoning was in the engine's first sequence but left the prompt from turn 2 on.
    if thought.strip():
        assert thought.strip() in tok.decode(tap.requests[0][1], skip_special_tokens=False)
        assert thought.strip() not in tok.decode(tap.requests[-1][0], skip_special_tokens=False)
    assert isinstance(history[-1], AIMessage)
