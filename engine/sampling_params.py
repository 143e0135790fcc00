"""SamplingParams: how one request picks its tokens and when it stops.

Structured output: `json_schema` constrains the output to one JSON value matching the schema
(see `constrained.py`); `response_format` takes the OpenAI form and is turned into `json_schema`
here; `grammar` constrains it to a grammar in llguidance's Lark syntax (free text with strict
tool calls, integrations/strict_tools.py). Only a library-free structural check runs here
(SamplingParams is built everywhere, clients included); the grammar itself is compiled, and its
deeper errors reported, when the engine takes the request.

Logits processors (engine/logits_processors.py, the sampler's min_p): `logit_bias` (OpenAI),
`presence_penalty` and `frequency_penalty` (OpenAI: over the generated tokens),
`repetition_penalty` (HF and vLLM: over the prompt and the generated tokens), `min_p` (vLLM)
and `min_tokens` (vLLM: the end of the generation held back). Their defaults ask for nothing; a
logit_bias id outside the model's vocabulary is refused when the engine takes the request (only
the engine knows the vocabulary).

Log-probabilities: `logprobs` for the generated tokens (engine/token_logprobs.py),
`prompt_logprobs` for the prompt's (vLLM's; engine/prompt_logprobs.py). `thinking_token_budget`
(vLLM's) ends a think block after that many tokens (engine/thinking_budget.py). With the latter,
`max_tokens=0` is a prompt-only request (the legacy echo of max_tokens 0, which evaluation
harnesses send to score a text): it prefills, reports the entries and ends "length", no token
sampled. The engine takes it, rather than the server running max_tokens=1 and dropping the
token (vLLM's way): nothing is drawn to be thrown away or counted as generated. Without
prompt_logprobs, 0 would compute nothing for anyone: refused.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from freetoken_agent.engine.schema_checks import schema_of_response_format, schema_problems


class Constraint(NamedTuple):
    kind: str  # "json_schema" | "lark"
    spec: Any  # the schema (a dict) or the grammar's text
    # What its errors call it, where not its kind's name: "json_schema" for a grammar that
    # holds a JSON answer after the reasoning (the schema is the only part the caller wrote).
    name: str | None = None


# Stop strings are searched for in the new text of every generated token, on the engine thread
# (output_state.py): their number and length bound that work, which every other request waits
# for. OpenAI allows 4 stop strings; we allow more, but not without limit.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
GREEDY_TEMPERATURE = 1e-5  # temperatures below it decode greedily
MAX_LOGPROBS = 20  # top alternatives a token may report: OpenAI's top_logprobs limit
SEED_MIN, SEED_END = -(2**63), 2**64  # what torch.Generator.manual_seed accepts
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
# The repetition penalty's range: a logit is divided or multiplied by it in the logits' fp32,
# where a factor near 0 or 1e38 turns a finite logit into inf or NaN, which the sampler then
# reports as the model's fault. Useful values are ~0.8-1.5; these bounds are far outside them.
REPETITION_RANGE = (0.01, 100.0)
BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy's integers count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A real number that is not a bool (NaN passes here; the range checks refuse it)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class SamplingParamsError(ValueError):
    """SamplingParams' refusal: every problem found, joined by "; " (a problem's own text may
    hold one too), with the field each is about (`problems`: (field, text) pairs; `fields`),
    so a caller names its own parameter for it (the server's `param`) without reading the
    wording."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(text for _, text in problems))
        self.problems = tuple(problems)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.problems)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter (-1 too, as vLLM takes it: read as 0)
    top_p: float = 1.0
    seed: int | None = None  # a seeded request draws the same tokens whatever it is batched with
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text, but:)
    # vLLM's: the stop string that ended the output stays at the end of its text.
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # The output is exactly one JSON value valid against this schema; the request ends with
    # finish_reason "stop" right after its last character (or "length" if max_tokens cut it).
    # Stop strings and stop ids do not apply meanwhile: the grammar decides where it ends.
    json_schema: dict[str, Any] | None = None
    # OpenAI's form: {"type": "text"} | {"type": "json_object"} |
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
    response_format: dict[str, Any] | None = None
    # A grammar in llguidance's Lark syntax that the whole output follows (its docs/syntax.md);
    # the request ends when the grammar can take nothing more. Exclusive with json_schema.
    grammar: str | None = None
    # OpenAI's, over the tokens this request generated (not its prompt), count[t] times each:
    # logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF's and vLLM's, over the prompt's tokens and the generated ones: such a token's logit is
    # divided by it where positive, multiplied where negative. In REPETITION_RANGE; 1 = off.
    repetition_penalty: float = 1.0
    # vLLM's: after temperature, keep the tokens whose probability is at least min_p times the
    # row's largest. [0, 1]; 0 = off; no effect on greedy rows.
    min_p: float = 0.0
    # OpenAI's: token id -> bias in [-100, 100], added to its logit before anything else.
    logit_bias: dict[int, float] | None = None
    # Each generated token's log-probability under the model's raw distribution (log_softmax
    # of its logits before temperature, top-k/top-p, a grammar's mask or any other processing:
    # the model's view, not the sampler's; engine/token_logprobs.py). None: off; 0: the
    # sampled token's only; k in 1..MAX_LOGPROBS: also the k most likely tokens with theirs.
    logprobs: int | None = None
    # vLLM's: until this many tokens are generated, EOS and stop_token_ids cannot be sampled
    # (held back: engine/logits_processors.py) and stop strings do not end the request
    # (output_state.py). At most max_tokens; a grammar that can only end still ends it.
    min_tokens: int = 0
    # vLLM's: as `logprobs`, for each prompt token at the position before it (the first has
    # none); such a request reuses no cached prefix (engine/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    # The grammar ends the output with an answer it holds (a JSON answer after the reasoning:
    # integrations/reasoned_json.py): stop strings and stop ids do not apply, as under
    # json_schema. Only with `grammar`.
    grammar_holds_answer: bool = False
    # vLLM's: the most tokens a think block may take; then "\n</think>\n\n" is forced and the
    # model answers (engine/thinking_budget.py). None: no limit; 0: no thinking. Only for
    # models whose vocabulary has <think> and </think> (the engine refuses it otherwise).
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        # One stop string or one stop id may be given bare, as OpenAI's `stop` may.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if _is_int(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        if _is_int(self.top_k) and self.top_k == -1:  # vLLM's "no top-k", as 0 is
            self.top_k = 0
        problems: list[tuple[str, str]] = []  # (field, what is wrong with it)

        def refuse(field: str, text: str) -> None:
            problems.append((field, text))

        # bool is an int to Python: max_tokens=True must not mean 1. 0: prompt-only (above).
        fewest = 1 if self.prompt_logprobs is None else 0
        if not _is_int(self.max_tokens) or self.max_tokens < fewest:
            refuse(
                "max_tokens",
                "max_tokens must be a positive integer (0 only with prompt_logprobs), got "
                f"{self.max_tokens!r}",
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            refuse("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r:.40}")
        elif _is_int(self.max_tokens) and 0 <= self.max_tokens < self.min_tokens:
            refuse(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
            )
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            refuse(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            refuse(
                "top_k", f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            refuse("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        # The range torch.Generator.manual_seed takes: anything else failed inside the step,
        # and with it every request batched beside this one.
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed < SEED_END):
            refuse(
                "seed",
                f"seed must be an integer in [{SEED_MIN}, {SEED_END}) or None, got {self.seed!r}",
            )
        if not isinstance(self.stop, (list, tuple)) or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            refuse(
                "stop",
                f"stop must be a string or a list of non-empty strings, got {self.stop!r:.80}",
            )
        elif len(self.stop) > MAX_STOP_STRINGS:
            refuse(
                "stop",
                f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed "
                "(OpenAI allows 4)",
            )
        elif any(len(s) > MAX_STOP_CHARS for s in self.stop):
            i, long = next((i, s) for i, s in enumerate(self.stop) if len(s) > MAX_STOP_CHARS)
            refuse(
                "stop",
                f"stop[{i}] has {len(long)} characters; a stop string may have at most "
                f"{MAX_STOP_CHARS}",
            )
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
            not _is_int(t) or t < 0 for t in self.stop_token_ids
        ):
            refuse(
                "stop_token_ids",
                "stop_token_ids must be a list of token ids (integers >= 0), "
                f"got {self.stop_token_ids!r:.80}",
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                refuse(name, f"{name} must be a bool, got {getattr(self, name)!r:.40}")
        problems += self._processor_problems()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                refuse(
                    name,
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r:.40}",
                )
        problems += self._structured_output_problems()
        if problems:
            raise SamplingParamsError(problems)
        self._as_python_numbers()

    def _as_python_numbers(self) -> None:
        """numpy's numbers (accepted above) as Python's: torch takes no numpy integer where it
        wants an int (Generator.manual_seed(np.int64(7)) raised inside the step, failing
        every request batched beside this one)."""
        for name in ("max_tokens", "top_k", "seed", "min_tokens", "logprobs", "prompt_logprobs",
                     "thinking_token_budget"):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, int(value))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p"):  # fmt: skip
            setattr(self, name, float(getattr(self, name)))
        self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def _processor_problems(self) -> list[tuple[str, str]]:
        """The logits processors' fields: each in its documented range (NaN in none)."""
        problems = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                got = f"{value!r:.40}"
                problems.append((name, f"{name} must be in [-2, 2] (0: off), got {got}"))
        rep = self.repetition_penalty
        low, high = REPETITION_RANGE
        if not _is_real(rep) or not low <= rep <= high:
            text = f"repetition_penalty must be in [{low}, {high:g}] (1: off), got {rep!r:.40}"
            problems.append(("repetition_penalty", text))
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            problems.append(("min_p", f"min_p must be in [0, 1] (0: off), got {self.min_p!r:.40}"))
        problem = _logit_bias_problem(self.logit_bias)
        if problem is not None:
            problems.append(("logit_bias", problem))
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            text = f"thinking_token_budget must be an integer >= 0 or None, got {budget!r:.40}"
            problems.append(("thinking_token_budget", text))
        return problems

    def _structured_output_problems(self) -> list[tuple[str, str]]:
        if self.response_format is not None:
            try:
                schema = schema_of_response_format(self.response_format)
            except ValueError as e:
                return [("response_format", str(e))]
            if schema is not None and self.json_schema is not None and schema != self.json_schema:
                disagree = "json_schema and response_format disagree: give one of them"
                return [("response_format", disagree)]
            if schema is not None:
                self.json_schema = schema
        if not isinstance(self.grammar_holds_answer, bool) or (
            self.grammar_holds_answer and self.grammar is None
        ):
            got = f"{self.grammar_holds_answer!r:.40}"
            return [("grammar_holds_answer", f"grammar_holds_answer is true or false, and true "
                                             f"only with a grammar; got {got}")]  # fmt: skip
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                got = f"{self.grammar!r:.60}"
                return [("grammar", f"grammar must be a non-empty string (Lark syntax), got {got}")]
            if self.json_schema is not None:
                return [
                    ("grammar", "grammar and json_schema (or response_format) both given: give one")
                ]
        if self.json_schema is None:
            return []
        return [("json_schema", problem) for problem in schema_problems(self.json_schema)]

    @property
    def constraint(self) -> Constraint | None:
        """What constrains the output, if anything (engine/constrained.py compiles it)."""
        if self.grammar is not None:
            name = "json_schema" if self.grammar_holds_answer else None
            return Constraint("lark", self.grammar, name)
        if self.json_schema is not None:
            return Constraint("json_schema", self.json_schema)
        return None

    @property
    def stops_apply(self) -> bool:
        """Whether stop strings and stop ids end the request: not while a JSON schema holds
        the output, whose grammar decides where it ends (a stop string or id met inside the
        JSON cut it short, and the request ended "stop" with text that does not parse)."""
        return self.json_schema is None and not self.grammar_holds_answer

    def ends_with(self, token: int, eos_token_ids: frozenset[int]) -> bool:
        """Whether `token` ends the request by its id: a stop id (while stops apply) or EOS
        (unless ignore_eos). The ids min_tokens holds back are these (`end_ids`)."""
        return (self.stops_apply and token in self.stop_token_ids) or (
            not self.ignore_eos and token in eos_token_ids
        )

    def end_ids(self, eos_token_ids: frozenset[int]) -> list[int]:
        """Every id `ends_with` is true of, sorted."""
        ids = set(self.stop_token_ids) if self.stops_apply else set()
        return sorted(ids if self.ignore_eos else ids | eos_token_ids)

    @property
    def penalised(self) -> bool:
        """Whether a penalty applies: the request's token counts are kept on the device."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def processes_logits(self) -> bool:
        """Whether logits_processors.py touches this request's logits (bias, penalties, its
        end held back for min_tokens, or a thinking budget)."""
        return (
            bool(self.logit_bias)
            or self.penalised
            or self.min_tokens > 0
            or self.thinking_token_budget is not None
        )

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE logits / T overflow fp32 (vLLM's _SAMPLING_EPS is the same):
        # such a row is all but greedy anyway. top_k 1 is the argmax: an exact tie goes to the
        # lowest id (vLLM draws among tied ids), which only exactly equal logits can show.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def token_id_key(key: Any) -> int | None:
    """A logit_bias key written as a string of digits (JSON's, the OpenAI SDK's) as its token
    id; None when it is not one. At most 19 digits: int() refuses over 4,300 (an error no
    caller expects), and no vocabulary reaches 19."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
        return int(key)
    return None


def _logit_bias_problem(bias: Any) -> str | None:
    """What is wrong with a logit_bias (None: nothing). Its keys are token ids as integers (a
    JSON body's string keys are converted by the server); the vocabulary is the engine's check."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        return f"logit_bias must map token ids to biases, got {bias!r:.60}"
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            return f"logit_bias keys must be token ids (integers >= 0), got {token!r:.40}"
        if not _is_real(value) or not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            return f"logit_bias[{token}] must be a number in [-100, 100], got {value!r:.40}"
    return None


def not_sampling_params(value: object) -> str:
    """The refusal of something else given where a SamplingParams goes (a dict of its fields
    was read as a list of per-prompt params, failing on its keys)."""
    hint = " (SamplingParams(**that_dict) makes one)" if isinstance(value, dict) else ""
    return f"sampling must be a SamplingParams, got {type(value).__name__}{hint}"
