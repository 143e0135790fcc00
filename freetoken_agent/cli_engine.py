"""The `freetoken` commands' engine flags (demo, generate, chat, serve) and the load they
configure: model, device, dtype, placement policy, memory, context, scheduling, prefill
streaming and the hybrid models' checkpoints.

Flag values are checked as they are parsed: argparse names the flag, where a bad value would
otherwise end in a traceback from deep in the engine, or a 0 be taken for "not set".
"""

from __future__ import annotations

import argparse
import math
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

from freetoken_agent.engine.config import POLICIES
from freetoken_agent.engine.kv.checkpoint_mode import CheckpointMode


def model_path(name: str) -> Path:
    """`demo` is the embedded demo checkpoint (built once); anything else a folder (`~`
    expanded here: the shell leaves `--model=~/m` as it is)."""
    if name == "demo":
        from freetoken_agent.demo_model import DEMO_NOTICE, ensure_demo_model

        print(f"[freetoken] {DEMO_NOTICE}", file=sys.stderr)
        return ensure_demo_model()
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        raise ValueError(f"{name}: GGUF files are not read; give a Hugging Face model folder "
                         "(config.json and safetensors weights) or an FTW folder")  # fmt: skip
    if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise ValueError(
            f"no folder {name}: FreeToken never downloads models. Fetch it first, for "
            f"example `huggingface-cli download {name} --local-dir DIR`, then give DIR"
        )
    return path


def sampling_seed(args: argparse.Namespace) -> int | None:
    """--seed, a negative one read as llama.cpp reads -1: random each run (None)."""
    return None if args.seed is not None and args.seed < 0 else args.seed


def positive(kind: Callable[[str], float], zero: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            bound = "a finite number " + (">= 0" if zero else "> 0")
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value" names it
    return parse


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, cpu, cuda, cuda:N")
    return text


def _checkpoints(text: str) -> str:
    try:
        CheckpointMode.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_engine_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    if model:  # demo runs its own model
        p.add_argument("--model", default="demo", help="HF model folder, or 'demo' (default)")
    p.add_argument("--device", type=_device, default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: model's)")
    p.add_argument(
        "--policy",
        default="adaptive",
        choices=POLICIES,
        help="where offloaded experts' misses run: adaptive splits them between GPU fills and "
        "the CPU by measured bandwidth; transfer fetches all, cpu runs all on the CPU, static "
        "fixes the GPU's experts at load, gpu-fill copies each layer's misses from the pinned "
        "pool by GPU kernels (one CUDA graph a step), direct (experimental) has the MoE "
        "kernels read misses from the pinned pool, resident keeps every expert on the GPU",
    )
    p.add_argument(
        "--gpu-budget-gb",
        type=positive(float),
        default=None,
        help="GPU memory budget (GB, 10^9 bytes; default: free memory less the reserve)",
    )
    p.add_argument("--memory-reserve-gb", type=positive(float, zero=True), default=None,
                   help="GPU memory kept free for other programs (GB, 10^9 bytes; default: "
                   "1 GiB, i.e. 1.07); the "
                   "elastic budget shrinks when they take more and grows back after")  # fmt: skip
    p.add_argument(
        "--fixed-memory",
        action="store_true",
        help="do not follow free GPU memory (the budget moves only on request)",
    )
    p.add_argument(
        "--max-model-len", type=positive(int), default=None, help="cap the context length"
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive(int),
        default=None,
        help="requests decoded together (default: 32); later ones wait for a place, so "
        "several agents asking n choices each may want more (each takes KV for its context)",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=positive(int),
        default=None,
        help="tokens one step runs (prefill chunks and decodes; default: 2048): larger "
        "prefills faster, smaller keeps other streams' tokens coming during a long prefill",
    )
    p.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decode step before the last one's tokens are read (default: on)",
    )
    p.add_argument(
        "--no-double-buffer",
        action="store_true",
        help="prefill streams offloaded experts through one staging buffer instead of two, so "
        "a layer's copy no longer runs behind the previous layer's compute (the ablation)",
    )
    p.add_argument(
        "--thinking-budget",
        type=positive(int, zero=True),
        default=None,
        metavar="N",
        help="reasoning models: close the think block after N tokens and answer (requests "
        "may set their own thinking_token_budget; 0: no thinking; default: no limit)",
    )
    p.add_argument(
        "--checkpoints",
        type=_checkpoints,
        default=None,
        help="hybrid models: where recurrent state is checkpointed for reuse: 'anchors' (the "
        "history's turn, reasoning and tool boundaries; default), 'positional:N' (every N "
        "tokens) or 'none' (no reuse across requests)",
    )


def load_engine(args: argparse.Namespace):
    from freetoken_agent.engine.engine import Engine

    budget = int(args.gpu_budget_gb * 1e9) if args.gpu_budget_gb is not None else None
    options = {"max_model_len": args.max_model_len} if args.max_model_len is not None else {}
    if args.memory_reserve_gb is not None:
        options["memory_reserve"] = int(args.memory_reserve_gb * 1e9)
    if args.fixed_memory:
        options["follow_free_memory"] = False
    for name in ("max_num_seqs", "max_batched_tokens"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    if args.overlap_schedule is not None:
        options["overlap_schedule"] = args.overlap_schedule
    if args.no_double_buffer:
        options["double_buffer"] = False
    if args.checkpoints is not None:
        options["checkpoints"] = args.checkpoints
    if args.thinking_budget is not None:
        options["thinking_budget"] = args.thinking_budget
    if hasattr(args, "temperature") and sampling_seed(args) is None:
        # Commands that sample (demo, generate, chat): without --seed (or with -1), the
        # engine's generator (which unseeded requests draw from) starts anywhere, not at
        # EngineConfig's fixed 0.
        options["seed"] = secrets.randbits(31)
    path = model_path(args.model)
    try:
        return Engine.load(
            path,
            device=args.device,
            dtype=args.dtype,
            gpu_budget=budget,
            policy=args.policy,
            **options,
        )
    except RuntimeError as e:  # torch's (out of memory, no such device): the user's to fix
        raise SystemExit(f"freetoken: error: could not load {path}: {e}") from None
