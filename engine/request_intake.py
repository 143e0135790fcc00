"""A request checked and built before it enters the engine's tables (Engine.submit).

Every check that can refuse a request runs here, before the request takes anything (a grammar,
a place in the scheduler's queues), so bad input raises InvalidRequestError naming the problem
and can never disturb other requests. What comes out are plain objects: the Request the
Scheduler will own and the OutputState that turns its tokens into text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from freetoken_agent.engine.logits_processors import check_logit_bias
from freetoken_agent.engine.output_state import OutputState
from freetoken_agent.engine.outputs import (
    InvalidRequestError,
    InvalidSamplingParams,
    ThinkingBudgetError,
)
from freetoken_agent.engine.prompt_input import Prompt, encode_prompt, snapshot_plan, token_ids
from freetoken_agent.engine.request import Recurrence, Request
from freetoken_agent.engine.request_outcomes import stop_strings
from freetoken_agent.engine.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    not_sampling_params,
)
from freetoken_agent.engine.thinking_budget import ThinkingMarkers


@dataclass(slots=True, frozen=True)
class RequestIntake:
    """What a request is checked against: the engine's tokenizer, vocabulary and context, its
    think-block markers and default budget, and the recurrent memory (hybrid models)."""

    tokenizer: object | None  # engine/text/tokenizer.Tokenizer; None: ids only
    vocab_size: int
    max_model_len: int
    thinking: ThinkingMarkers | None  # None: the model writes no think blocks
    default_budget: int | None  # EngineConfig.thinking_budget
    recurrence: Recurrence | None  # None: no recurrent layers, nothing to checkpoint
    kept_specials: frozenset[int]  # special tokens kept in the text (text/markers.py)

    def build(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams | None,
        *,
        use_prefix_cache: bool,
        anchors: Sequence[int],
        anchor_tokens: Sequence[int],
        score: bool,
        prompt_echoed: bool = False,
    ) -> tuple[Request, OutputState]:
        """The request and its output state; raises InvalidRequestError (or a subclass) for
        bad input. `score`: logits at every position, nothing sampled (Engine.score)."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(not_sampling_params(sampling))
        try:  # checked again, as a copy of its own: a field set after construction (sp.seed =
            # 2**70) was only met inside the step, failing every request batched beside it,
            # and one set while the request runs would change it midway
            sampling = dataclasses.replace(sampling)
        except SamplingParamsError as e:
            raise InvalidSamplingParams(e) from None
        if sampling.stop and self.tokenizer is None:  # they are matched in the decoded text
            raise InvalidRequestError(
                "stop strings need the model's tokenizer (tokenizer.json) to read the output, "
                "which this model folder lacks; give stop_token_ids instead"
            )
        ids = encode_prompt(prompt, self.tokenizer, self.vocab_size, self.max_model_len)
        check_logit_bias(sampling, self.vocab_size)
        sampling = self._with_default_budget(sampling)
        if sampling.thinking_token_budget is not None and self.thinking is None:
            raise ThinkingBudgetError(
                "thinking_token_budget: this model's vocabulary has no <think> and </think> "
                "tokens, so it writes no think block a budget could end"
            )
        plan = snapshot_plan(ids, anchors, self.recurrence)
        markers = frozenset(token_ids(anchor_tokens, "anchor_tokens are token ids"))
        # Score and prompt_logprobs requests need the logits of every prompt position, which
        # a cached prefix never computes (prompt_logprobs.py).
        reuse = use_prefix_cache and not score and sampling.prompt_logprobs is None
        req = Request(request_id, ids, sampling, use_prefix_cache=reuse)
        req.score_only = score
        if sampling.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        if self.recurrence is not None and req.use_prefix_cache:
            req.snapshot_plan = plan
            req.anchor_tokens = markers
        output = OutputState(
            self.tokenizer,
            stop_strings(sampling),
            context=ids,
            keep_special=self.kept_specials,
            min_tokens=sampling.min_tokens,
            include_stop=sampling.include_stop_str_in_output,
            show_cut=prompt_echoed,
        )
        return req, output

    def _with_default_budget(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with the engine's default thinking budget when it sets no budget of its
        own and the model thinks in blocks (the caller's object is left as it is)."""
        default = self.default_budget
        if default is None or sampling.thinking_token_budget is not None or self.thinking is None:
            return sampling
        return dataclasses.replace(sampling, thinking_token_budget=default)
