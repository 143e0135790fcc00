"""Request.token_range: a window of prompt + output without building the whole sequence (a
decode step at 100k tokens of context had built and freed a 100k list for one token)."""

import random

from freetoken_agent.engine.request import Request
from freetoken_agent.engine.sampling_params import SamplingParams


def test_token_range_is_the_slice_of_prompt_and_output(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(200):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
        req = Request("r", prompt, SamplingParams())
        req.output_ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 30))]
        n = req.n_tokens
        start = rng.randrange(0, n + 1)
        end = rng.randrange(start, n + 3)  # past the end too, as a slice allows
        assert req.token_range(start, end) == req.tokens[start:end], (start, end, n)
