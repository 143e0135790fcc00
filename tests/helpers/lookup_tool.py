"""A tool whose forced call always ends within a few tokens (its one argument is at most six
characters, nothing else allowed): the n-choices tests force it on every choice."""

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string", "maxLength": 6}},
            "required": ["q"],
            "additionalProperties": False,  # the call must end within max_tokens
        },
    },
}
