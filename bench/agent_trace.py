"""Agent sessions for `freetoken bench agent`: structured histories, rendered turn by turn.

    trace = generate_session("coding", seed=0)  # 20 requests, the last past 40k tokens
    trace.turns[k]  # prompt_ids, anchors, edit, diverge_at, deepest_anchor, generated_ids
    print(trace.summary())

A session is `freetoken_agent.messages` records: a system prompt with 8-12 tool schemas (about
3k tokens), a user task with a pasted attachment, then turns. A turn is one request, the history
so far rendered by ChatFormat on the demo tokenizer and its Qwen3-style template (which drops the
reasoning of assistant turns before the last user message), and a scripted answer: reasoning
(100-600 tokens), a short preface, one tool call, whose output (200-4000 tokens, log-uniform)
joins the next request. Every 4-6 turns a user message arrives. Edits, from the seed, label the
request that carries them:
  reasoning_stripped     a new user message: the reasoning since the previous one vanishes
  interrupted            the previous turn was cut mid-reasoning (no call; its partial reasoning
                         stays in the history), then a user steering message
  tool_output_truncated  an earlier large output (two or more requests old) shrinks to its first
                         line and an omission marker, as agents mask old observations

Sizes are token counts on the demo tokenizer. Output sizes are stratified (output i in its own
1/n band of the log-uniform range, bands shuffled): each is log-uniform, their sum barely moves
with the seed. These sizes reach ~30k tokens in 20 turns, so the first message's attachment
(pasted files, logs) grows until the last request reaches `min_context`.

Per turn: `diverge_at` = the longest common token prefix with any sequence sent before (an
earlier prompt plus the tokens its turn generated); `deepest_anchor` = the deepest anchor of the
prompt at or before it that was also an anchor of an earlier prompt sharing those tokens: where
recurrent state resumes from checkpoints at prompt anchors (0: from scratch).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
from dataclasses import dataclass

from freetoken_agent.bench.agent_text import (
    INTEGER_PARAMS,
    KINDS,
    TOOLS,
    count_tokens,
    ident,
    text_of,
    words,
)
from freetoken_agent.chat_format import ChatFormat, common_prefix, normalize_tools
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    to_template_messages,
)

# T tokens of a rendered request
EDITS = ("none", "reasoning_stripped", "tool_output_truncated", "interrupted")


@dataclass(slots=True)
class SessionShape:
    """Every size of a session, in tokens of the demo tokenizer ((lo, hi) ranges inclusive)."""

    system_tokens: int = 3000  # system turn: instructions + tool schemas
    n_tools: tuple[int, int] = (8, 12)
    task_tokens: tuple[int, int] = (100, 400)  # the first user message, before its attachment
    attachment_tokens: tuple[int, int] = (2000, 6000)  # grown up to min_context (log-uniform)
    user_tokens: tuple[int, int] = (30, 300)  # later user messages
    user_every: tuple[int, int] = (4, 6)  # turns between user messages
    reasoning_tokens: tuple[int, int] = (100, 600)
    preface_tokens: tuple[int, int] = (0, 40)  # visible text before the tool call
    call_tokens: tuple[int, int] = (20, 600)  # a long argument (code, a body), log-uniform
    tool_output_tokens: tuple[int, int] = (200, 4000)  # log-uniform, stratified
    truncate_rate: float = 0.1  # truncations per turn (at least one when possible)
    truncate_min_tokens: int = 1000  # only outputs this large get truncated
    truncate_keep_lines: int = 1  # lines a truncated output keeps
    interrupt_rate: float = 0.34  # of the user messages after the task, the share that interrupt
    min_context: int = 40_000  # the last request reaches at least this many tokens

    @classmethod
    def small(cls) -> SessionShape:
        """A short session for CPU smoke runs (a few hundred tokens per turn)."""
        return cls(
            system_tokens=300,
            n_tools=(3, 4),
            task_tokens=(20, 60),
            attachment_tokens=(50, 150),
            user_tokens=(10, 40),
            user_every=(2, 3),
            reasoning_tokens=(20, 60),
            preface_tokens=(0, 10),
            call_tokens=(10, 60),
            tool_output_tokens=(40, 200),
            truncate_rate=0.25,
            truncate_min_tokens=60,
            min_context=0,
        )


@dataclass(slots=True)
class TraceTurn:
    """One request of a session and the answer its turn scripts."""

    index: int
    edit: str  # one of EDITS
    prompt_ids: list[int]  # [T] the whole rendered request
    anchors: list[int]  # token offsets of Prompt.anchors, sorted, deduplicated
    diverge_at: int  # longest common prefix with any earlier prompt + generated tokens
    diverge_from: int  # the earlier turn sharing that prefix (-1: none)
    deepest_anchor: int  # see the module docstring
    generated_ids: list[int]  # the scripted answer's tokens (cut short when interrupted)
    tool: str | None  # the tool called (None when the turn was interrupted)
    reasoning_tokens: int
    tool_output_tokens: int  # of this turn's output (it appears in the next request)
    cut: bool = False  # generation interrupted mid-reasoning
    truncated_turn: int | None = None  # tool_output_truncated: whose output shrank

    @property
    def min_prefill(self) -> int:
        """Tokens to prefill when every matched token is reused (an attention-only model)."""
        return len(self.prompt_ids) - min(self.diverge_at, len(self.prompt_ids) - 1)

    @property
    def anchor_prefill(self) -> int:
        """Tokens to prefill when recurrent state resumes from the deepest anchor."""
        return len(self.prompt_ids) - self.deepest_anchor


@dataclass(slots=True)
class AgentTrace:
    """A generated session: its turns in order, and how it was built."""

    kind: str
    seed: int
    shape: SessionShape
    turns: list[TraceTurn]
    tools: list[str]
    system_tokens: int  # the rendered system turn
    attachment_tokens: int
    render_s: float  # wall time of the rendering (ChatFormat with its prefix cache)

    @property
    def final_context(self) -> int:
        return len(self.turns[-1].prompt_ids)

    def to_json(self, ids: bool = True) -> dict:
        """A JSON-ready dict; `ids=False` leaves out the token ids (results files)."""
        drop = () if ids else ("prompt_ids", "generated_ids")
        turns = []
        for t in self.turns:
            row = {k: v for k, v in dataclasses.asdict(t).items() if k not in drop}
            row |= {"prompt_tokens": len(t.prompt_ids), "generated_tokens": len(t.generated_ids)}
            turns.append(row)
        head = {k: getattr(self, k) for k in ("kind", "seed", "tools", "system_tokens")}
        return head | {
            "attachment_tokens": self.attachment_tokens,
            "render_s": self.render_s,
            "final_context": self.final_context,
            "edits": {e: sum(t.edit == e for t in self.turns) for e in EDITS},
            "shape": dataclasses.asdict(self.shape),
            "turns": turns,
        }

    def summary(self) -> str:
        lines = [
            f"{self.kind} session, seed {self.seed}: {len(self.turns)} turns, {len(self.tools)} "
            f"tools, system {self.system_tokens} tokens, attachment {self.attachment_tokens}, "
            f"final context {self.final_context}, rendered in {self.render_s:.2f} s",
            f"{'turn':>4} {'prompt':>7} {'new':>6} {'diverge':>7} {'anchor':>7} {'output':>6} "
            f"{'reason':>6}  edit",
        ]
        for t in self.turns:
            lines.append(
                f"{t.index:4d} {len(t.prompt_ids):7d} {len(t.prompt_ids) - t.diverge_at:6d} "
                f"{t.diverge_at:7d} {t.deepest_anchor:7d} {t.tool_output_tokens:6d} "
                f"{t.reasoning_tokens:6d}  {t.edit}{' (cut)' if t.cut else ''}"
            )
        return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def demo_tokenizer() -> Tokenizer:
    from freetoken_agent.demo_model import ensure_demo_model

    return Tokenizer.from_dir(ensure_demo_model())


def generate_session(
    kind: str,
    seed: int,
    turns: int = 20,
    shape: SessionShape | None = None,
    tokenizer: Tokenizer | None = None,
) -> AgentTrace:
    """A deterministic session of `turns` requests (same arguments, same tokens)."""
    if kind not in KINDS:
        raise ValueError(f"unknown session kind {kind!r}; choose one of {', '.join(KINDS)}")
    if turns < 1:
        raise ValueError(f"a session needs at least one turn, got {turns}")
    builder = _Builder(kind, seed, turns, shape or SessionShape(), tokenizer or demo_tokenizer())
    return builder.build()


class _Builder:
    def __init__(self, kind: str, seed: int, turns: int, shape: SessionShape, tok: Tokenizer):
        self.kind, self.seed, self.n, self.shape, self.tok = kind, seed, turns, shape, tok
        self.fmt = ChatFormat(tok)

    def rng(self, *key: object) -> random.Random:
        # One stream per purpose: resizing the attachment changes nothing else.
        return random.Random(":".join(map(str, (self.kind, self.seed, *key))))

    def count(self, text: str) -> int:
        return count_tokens(self.tok, text)

    def text(self, rng: random.Random, style: str, n_tokens: int, lo: int = 0, hi: int = 0):
        """(text, tokens) on this session's tokenizer: see agent_text.text_of."""
        return text_of(self.tok, rng, style, n_tokens, lo, hi)

    def build(self) -> AgentTrace:
        sh = self.shape
        rng = self.rng("tools")
        names = rng.sample(sorted(TOOLS[self.kind]), min(rng.randint(*sh.n_tools), 12))
        bare = self.fmt.render([SystemMessage("")], [self.schema(n, 0) for n in names], False)
        budget = max(0, (3 * sh.system_tokens // 4 - len(bare)) // len(names))
        tools = [self.schema(name, budget) for name in names]
        empty = self.fmt.render([SystemMessage("")], tools, add_generation_prompt=False)
        room = max(sh.system_tokens - len(empty), 1)  # instructions fill the rest
        system = SystemMessage(self.text(self.rng("system"), "prose", room)[0])
        norm = normalize_tools(tools)
        t0 = time.perf_counter()
        turns, histories, answers = self.plan(names, system)
        task = self.text(self.rng("task"), "prose", self.rng("task").randint(*sh.task_tokens))[0]
        style = "code" if self.kind == "coding" else "prose"
        want = _log_uniform(self.rng("attachment"), *sh.attachment_tokens)
        for _ in range(4):  # grow the attachment until the last request reaches min_context
            attach, attach_tokens = self.text(self.rng("attachment"), style, want)
            first = UserMessage(f"{task}\n\n```\n{attach}\n```")
            for history in histories:
                history[1] = first
            last = self.fmt.template(norm).render(
                to_template_messages(histories[-1]), tools=norm, add_generation_prompt=True
            )
            deficit = sh.min_context - self.count(last)
            if deficit <= 0:
                break
            want = attach_tokens + deficit + 64
        else:
            raise RuntimeError(f"could not reach min_context={sh.min_context} tokens")
        self.render(turns, histories, answers, tools)
        render_s = time.perf_counter() - t0
        head = len(self.fmt.render([system], tools, add_generation_prompt=False))
        return AgentTrace(self.kind, self.seed, sh, turns, names, head, attach_tokens, render_s)

    def schema(self, name: str, budget: int) -> dict:
        """An OpenAI tool schema; its descriptions take about `budget` tokens."""
        rng = self.rng("schema", name)
        params = [p.lstrip("*") for p in TOOLS[self.kind][name][1]]

        def describe(n_tokens: int) -> str:  # exactly n_tokens: 44 descriptions add up
            ids = self.tok.encode(self.text(rng, "prose", n_tokens)[0].replace("\n", " "))
            return self.tok.backend.decode(ids[:n_tokens])

        props = {
            p: {
                "type": "integer" if p in INTEGER_PARAMS else "string",
                "description": describe(budget // (2 * len(params))),
            }
            for p in params
        }
        parameters = {"type": "object", "properties": props, "required": [params[0]]}
        function = {"name": name, "description": describe(budget // 2), "parameters": parameters}
        return {"type": "function", "function": function}

    def plan(self, names: list[str], system: SystemMessage):
        """(turns without tokens, the history each sends, the answer each scripts): every edit
        decided, nothing rendered. history[1], the first user message, is a placeholder."""
        sh, n = self.shape, self.n
        rng = self.rng("plan")
        user_turns = [0]
        while user_turns[-1] + (gap := rng.randint(*sh.user_every)) < n:
            user_turns.append(user_turns[-1] + gap)
        later = user_turns[1:]
        n_int = min(len(later) - 1, max(1, round(sh.interrupt_rate * len(later))))
        interrupted = set(rng.sample(later, max(n_int, 0)))
        eligible = [k for k in range(2, n) if k not in user_turns]
        n_trunc = min(len(eligible), max(1, round(sh.truncate_rate * n)))
        truncations = set(rng.sample(eligible, n_trunc))
        # Stratified log-uniform output sizes: band i of n, bands shuffled.
        bands = list(range(n))
        rng.shuffle(bands)
        lo, hi = sh.tool_output_tokens
        sizes = [round(lo * (hi / lo) ** ((b + rng.random()) / n)) for b in bands]

        history: list[Message] = [system, UserMessage("")]
        outputs: dict[int, tuple[int, int]] = {}  # turn -> (history index, tokens)
        turns, histories, answers = [], [], []
        pending = 0  # truncations whose turn found no candidate yet
        for k in range(n):
            turn, answer = self.answer(k, names, cut=k + 1 in interrupted)
            if k in later:
                turn.edit = "interrupted" if k in interrupted else "reasoning_stripped"
                r = self.rng("user", k)
                said = self.text(r, "prose", r.randint(*sh.user_tokens))[0]
                history.append(UserMessage(("Stop, wait. " if k in interrupted else "") + said))
            elif k in truncations or pending:
                pending += k in truncations
                j = self.truncate(k, history, outputs)
                if j is not None:
                    turn.edit, turn.truncated_turn = "tool_output_truncated", j
                    pending -= 1
            histories.append(list(history))
            answers.append(answer)
            history.append(answer)
            if not turn.cut:
                call = answer.tool_calls[0]
                out_style = TOOLS[self.kind][call.name][0]
                output, turn.tool_output_tokens = self.text(
                    self.rng("output", k), out_style, sizes[k], lo, hi
                )
                history.append(ToolResult(call.id, output, name=call.name))
                outputs[k] = (len(history) - 1, turn.tool_output_tokens)
            turns.append(turn)
        return turns, histories, answers

    def truncate(self, k: int, history: list[Message], outputs: dict) -> int | None:
        """Shrink one earlier output (two or more requests old, large) in place; its turn."""
        big = self.shape.truncate_min_tokens
        candidates = [j for j, (_, n) in outputs.items() if j <= k - 2 and n >= big]
        if not candidates:
            return None
        j = self.rng("truncate", k).choice(candidates)
        at, _ = outputs.pop(j)
        old = history[at]
        head = old.content.split("\n")[: self.shape.truncate_keep_lines]
        omitted = old.content.count("\n") + 1 - len(head)
        short = "\n".join([*head, f"[... {omitted} more lines truncated to save context ...]"])
        history[at] = ToolResult(old.tool_call_id, short, name=old.name)
        return j

    def answer(self, k: int, names: list[str], cut: bool) -> tuple[TraceTurn, AssistantMessage]:
        """Turn k's record (tokens still empty) and the answer it scripts."""
        rng = self.rng("answer", k)
        # Bounded by the shape's range: the last prose line alone can overshoot by ~100 tokens,
        # and joining lines by spaces retokenizes (a CI run saw 707 against 600).
        bounds = self.shape.reasoning_tokens
        reasoning = self.text(rng, "prose", rng.randint(*bounds), *bounds)[0]
        reasoning = reasoning.replace("\n", " ")
        if cut:  # the user stopped it mid-thought: part of the reasoning, no call
            parts = reasoning.split(" ")
            reasoning = " ".join(parts[: max(1, int(len(parts) * rng.uniform(0.2, 0.8)))])
            msg = AssistantMessage("", reasoning)
        else:
            name = rng.choice(names)
            args: dict[str, object] = {}
            for p in TOOLS[self.kind][name][1]:
                if p in INTEGER_PARAMS:
                    args[p] = rng.randint(1, 400)
                elif p.startswith("*"):  # code to write, a message body: sized in tokens
                    n = _log_uniform(rng, *self.shape.call_tokens)
                    style = "code" if self.kind == "coding" else "prose"
                    args[p[1:]] = self.text(rng, style, n)[0]
                else:
                    args[p] = f"{ident(rng)}/{ident(rng)}.py" if p == "path" else words(rng, 3)
            preface = ""
            if rng.random() < 0.7:  # some turns call the tool without a word
                preface = self.text(rng, "prose", rng.randint(*self.shape.preface_tokens))[0]
            msg = AssistantMessage(preface, reasoning, [ToolCall(f"call_{k}", name, args)])
        turn = TraceTurn(k, "none", [], [], 0, -1, 0, [], None if cut else name, 0, 0, cut)
        turn.reasoning_tokens = self.count(reasoning)
        return turn, msg

    def render(self, turns: list[TraceTurn], histories, answers, tools: list[dict]) -> None:
        """Fill each turn's tokens, anchors and divergence, in order."""
        norm = normalize_tools(tools)
        template = self.fmt.template(norm)
        sent: list[tuple[list[int], frozenset[int]]] = []  # prompt + generated, prompt anchors
        for turn, history, answer in zip(turns, histories, answers, strict=True):
            prompt = self.fmt.render(history, tools)
            ids = turn.prompt_ids = prompt.token_ids
            turn.anchors = sorted({a.offset for a in prompt.anchors})
            for j, (seq, seen) in enumerate(sent):
                shared = common_prefix(seq, ids)
                if shared > turn.diverge_at:
                    turn.diverge_at, turn.diverge_from = shared, j
                deep = [a for a in turn.anchors if a <= shared and a in seen]
                turn.deepest_anchor = max([turn.deepest_anchor, *deep])
            # The answer as the model writes it: the render with it, past the prompt, up to and
            # including its end-of-turn marker (cut: up to where the reasoning stopped).
            answered = to_template_messages([*history, answer])
            full = template.render(answered, tools=norm, add_generation_prompt=False)
            if not full.startswith(prompt.text):
                raise RuntimeError(f"turn {turn.index}: the template moved text before the answer")
            gen = full[len(prompt.text) :]
            end = gen.index(answer.reasoning) + len(answer.reasoning) if turn.cut else None
            gen = gen[: end or gen.index("<|im_end|>") + len("<|im_end|>")]
            # A model emits its answer token by token: tokenized alone, whatever the next
            # request's tokenization of the same text (both end at markers, so they agree).
            turn.generated_ids = self.tok.encode(gen)
            sent.append((ids + turn.generated_ids, frozenset(turn.anchors)))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(max(lo, 1)), math.log(max(hi, 1)))))
