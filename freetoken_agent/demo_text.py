"""The demo checkpoint's text: the tokenizer's training corpus and its chat template.

Kept apart from `demo_model.py` (the recipe) because it is data; changing either changes the
built checkpoint, so bump `demo_model.DEMO_VERSION` with it.
"""

# A few KB of English and code to train the demo tokenizer on. Any text works; this mixes
# prose, Python, JSON and shell so common words and code idioms get their own tokens.
CORPUS = """\
FreeToken serves mixture-of-experts language models on the machines people already own.
The experts live in host memory and the GPU keeps a cache of the ones used most often.
When a request arrives, the scheduler decides which tokens run in the next step, the runner
executes the layers, and the engine streams the new tokens back to the caller.
A prompt is split into turns: the system message, the user question, the assistant answer,
its reasoning, the tool calls it makes and the results those tools return.
Each boundary is an anchor, so an edited history only needs to be computed again from the
deepest anchor that did not change. This saves time on long agent sessions.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
It was the best of times, it was the worst of times; it was the age of wisdom.
Please summarize the following document in three sentences, then list the open questions.
What is the weather like in Paris today? It is sunny, with a high of 21 degrees.
Thank you! Could you also check the train times from London to Edinburgh tomorrow morning?
I will search the web for that and report back with the results in a short table.
The answer is 42, because six times seven is forty-two and the numbers add up.
Memory bandwidth limits decoding: every token reads the weights of the active experts once.
Prefill is different, since a long chunk touches nearly every expert of every layer.
def route(hidden, gate, top_k=2):
    logits = hidden @ gate.T
    weights, experts = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class ExpertCache:
    \"\"\"Keeps the most recently used experts on the device.\"\"\"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots: dict[int, int] = {}

    def lookup(self, layer: int, expert: int) -> int | None:
        return self.slots.get(layer * 128 + expert)


for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)

import json
import os
from pathlib import Path

data = json.loads(Path("config.json").read_text())
print(data["hidden_size"], data.get("num_experts", 0), os.getcwd())
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "train times London Edinburgh", "limit": 5}}
{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
 "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
 "required": ["path"]}}}
$ pip install freetoken-agent && freetoken demo --max-tokens 64
$ git status && git diff --stat && python -m pytest tests -q
# Notes
- Use `torch.no_grad()` when running inference.
- Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718 1e-6 0x1f 255.
- Punctuation: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? : ; , . ' " ` @ # $ _ \\\\
Hello, world! Bonjour le monde. Hola mundo. Hallo Welt. Ciao mondo.
The model thinks step by step before it answers, then calls a tool if it needs more facts.
Errors must name the problem clearly: a missing file, a bad argument, an unknown tool.
Tests draw fresh random inputs on every run and print the seed, so failures can be replayed.
The server binds to localhost by default and speaks the OpenAI chat completions protocol.
Streaming sends each text delta as soon as it is complete, never half of a character.
"""

# A Qwen3-style ChatML template: tools listed as JSON inside <tools></tools> in the system
# turn, assistant tool calls as <tool_call>{json}</tool_call>, tool results as user turns of
# <tool_response> blocks, reasoning inside <think></think> for turns after the last user query,
# and `enable_thinking=false` closing an empty think block in the generation prompt.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and message.content is string
    and not (message.content.startswith('<tool_response>')
             and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
{{- content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif not (message.role == 'system' and loop.first) %}
{{- raise_exception('unknown message role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
