"""The `freetoken` command: demo, generate, chat, serve, convert, verify, calibrate, bench.

    freetoken demo                         build (once) and run the tiny random demo model
    freetoken generate --model DIR "text"  one completion, streamed to stdout
    freetoken chat --model DIR             an interactive chat that keeps its KV across turns
    freetoken serve [--model DIR]          OpenAI-compatible API, session WebSocket, web page
    freetoken convert HF_DIR OUT_DIR       write a checkpoint as FTW expert banks
    freetoken verify FTW_DIR               check the expert rows and dense weights' checksums
    freetoken calibrate [--model DIR]      measure the bandwidths the q* split uses
    freetoken bench ...                    benchmarks (see `freetoken bench --help`)

`--model demo` (the default) means the embedded demo checkpoint. Statistics go to stderr so
that stdout carries only the generated text. Ctrl-C stops a reply: `generate` then exits with
130, `chat` returns to its prompt (where Ctrl-C or Ctrl-D leaves), as llama.cpp and Ollama do.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
from pathlib import Path

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.cli_chat import CHAT_COMMANDS, chat_loop
from freetoken_agent.cli_engine import (
    add_engine_args,
    load_engine,
    model_path,
    positive,
    sampling_seed,
)
from freetoken_agent.cli_reply import as_text, chat_ids, failed, report, stream_reply
from freetoken_agent.engine.sampling_params import SamplingParams, SamplingParamsError
from freetoken_agent.help_format import DefaultsHelpFormatter


def port(text: str) -> int:  # (named so: argparse's refusal says "invalid port value")
    number = int(text)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1-65535)")
    return number


def _origin(text: str) -> str:
    from freetoken_agent.integrations.server.browser_guard import normal_origin

    try:
        return normal_origin(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling's mass")
    p.add_argument("--top-k", type=int, default=0, help="the k likeliest tokens only (0: all)")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed; left out or negative, a random one each run (llama.cpp's -1, "
        "Ollama's default), so sampled replies differ between runs: give one to repeat a run",
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
          "top_k": "--top-k", "seed": "--seed", "stop": "--stop"}  # fmt: skip


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags, checked before the model loads (minutes for a big one): a bad
    value is an argparse error naming its flag."""
    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=sampling_seed(args),
            stop=args.stop,
        )
    except SamplingParamsError as e:
        field, text = e.problems[0]
        flag = _FLAGS.get(field, field)
        print(f"freetoken: error: argument {flag}: {text}", file=sys.stderr)
        raise SystemExit(2) from None  # as argparse refuses a flag


def _tokenizer_needed(engine, args: argparse.Namespace, what: str) -> None:
    if engine.tokenizer is None:
        print(f"freetoken: error: {what} needs the model's tokenizer, and {args.model} has "
              "no tokenizer.json", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)


def _prompt_text(args: argparse.Namespace) -> str:
    """generate's prompt: the argument, or standard input for `-` or none with text piped in
    (read before the model loads, which may take minutes)."""
    if args.prompt is not None and args.prompt != "-":
        return as_text(args.prompt)
    if args.prompt is None and sys.stdin.isatty():
        raise SystemExit("freetoken: error: give a prompt, or pipe one in (`... | freetoken "
                         "generate -`)")  # fmt: skip
    data = sys.stdin.buffer.read()
    if not data.strip():  # said now, not after the model loads
        raise SystemExit("freetoken: error: the prompt on standard input is empty")
    return data.decode("utf-8", "replace")


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    prompt = _prompt_text(args)
    engine = load_engine(args)
    _tokenizer_needed(engine, args, "generate")
    if args.chat:
        prompt = chat_ids(ChatFormat(engine.tokenizer), [{"role": "user", "content": prompt}])
    stats = stream_reply(engine, prompt, sampling)[1]
    if stats["finish"] == "interrupted":
        return 130  # the shell's code for Ctrl-C
    report(stats, engine)
    return failed(stats) or 0


def cmd_chat(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    engine = load_engine(args)
    _tokenizer_needed(engine, args, "chat")
    if not engine.tokenizer.has_chat_template:
        # Said now, not after the first message.
        raise SystemExit(
            f"freetoken: error: chat needs a chat template and {args.model} has none (no "
            "chat_template in tokenizer_config.json, no chat_template.jinja): add one, or "
            f"complete plain text with `freetoken generate --model {args.model} TEXT`"
        )
    return chat_loop(engine, sampling, args.system)


def cmd_demo(args: argparse.Namespace) -> int:
    args.model = "demo"
    sampling = _sampling(args)
    engine = load_engine(args)
    messages = [{"role": "user", "content": as_text(args.prompt)}]
    prompt = chat_ids(ChatFormat(engine.tokenizer, enable_thinking=False), messages)
    print(f"[freetoken] prompt: {args.prompt!r}", file=sys.stderr)
    stats = stream_reply(engine, prompt, sampling)[1]
    report(stats, engine)
    if (code := failed(stats)) is not None:
        return code
    mem = engine.stats()["memory"]
    print(
        f"[freetoken] {engine.spec.arch} on {engine.loaded.device}: "
        f"{mem['expert_bytes'] / 1e6:.2f} MB experts, {mem['kv_pages']} KV pages "
        f"of {mem['page_size']} tokens",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # The server lives in integrations/ (Starlette, uvicorn): imported here only, so the other
    # commands run without those packages.
    try:
        from freetoken_agent.integrations.server.serve import check_bind, check_port, serve
    except ImportError as e:
        raise SystemExit(
            f"freetoken serve needs the server's packages ({e.name} is missing): "
            'pip install -e ".[integrations]" (or freetoken-agent[integrations])'
        ) from None

    check_bind(args.host, args.api_key)  # before loading: a refused bind costs nothing
    check_port(args.host, args.port)
    engine = load_engine(args)
    if getattr(engine, "tokenizer", None) is None:  # said before "serving", not after
        engine.close()
        raise ValueError(
            "the server needs a model folder with a tokenizer (tokenizer.json); this one has "
            "none, so `freetoken generate` with token ids is all it can run"
        )
    model_id = "freetoken-demo" if args.model == "demo" else Path(args.model).resolve().name
    print(
        f"[freetoken] serving {model_id} on http://{args.host}:{args.port} "
        f"(web page at /, OpenAI API at /v1, auth {'on' if args.api_key else 'off'})",
        file=sys.stderr,
    )
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None and not tokenizer.chat_template_sources:
        print(
            "[freetoken] this model has no chat template (a base model): the chat routes "
            "refuse histories; POST /v1/completions serves plain text",
            file=sys.stderr,
        )
    serve(
        engine,
        args.host,
        args.port,
        api_key=args.api_key,
        model_id=model_id,
        max_body_bytes=int(args.max_body_mb * 2**20),
        log_level=args.log_level,
        allowed_origins=args.allowed_origin,
        model_aliases=args.model_alias,
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from freetoken_agent.engine.weights.ftw import convert

    out = convert(args.src, args.dst)
    print(f"[freetoken] wrote FTW checkpoint {out} (banks read back, checksums match)",
          file=sys.stderr)  # fmt: skip
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from freetoken_agent.engine.config import read_config
    from freetoken_agent.engine.models.registry import spec_from_config
    from freetoken_agent.engine.weights import ftw
    from freetoken_agent.engine.weights.ftw_dense import file_problem

    folder = Path(args.dir)
    if not ftw.is_ftw(folder):
        raise FileNotFoundError(f"no {ftw.MANIFEST} in {folder}: not an FTW checkpoint")
    # The copied files first: a damaged config.json is said as the damage it is, not as a
    # config that does not parse (read_manifest checks the manifest itself below).
    checked = False  # the dense file and the copied files, read once (the dense file is GBs)
    with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
        problem = file_problem(folder, json.loads((folder / ftw.MANIFEST).read_text()))
        checked = True
        if problem is not None:
            print(f"freetoken: error: {problem}; convert it again", file=sys.stderr)
            return 1
    spec = spec_from_config(read_config(folder))
    files = {b: e["file"] for b, e in ftw.read_manifest(folder, spec)["banks"].items()}
    bad = ftw.bad_rows(folder, spec, progress=True)
    for bank, rows in bad.items():
        for lid in rows:  # lid = moe layer * n_experts + expert
            layer, expert = spec.moe_layers[lid // spec.n_experts], lid % spec.n_experts
            print(f"{files[bank]} row {lid} (layer {layer}, expert {expert}): bad checksum")
    n_bad, n_rows = sum(map(len, bad.values())), len(bad) * spec.n_moe_layers * spec.n_experts
    if n_bad:
        print(f"freetoken: error: {n_bad} of {n_rows} expert rows in {folder} fail their "
              "checksum: the checkpoint is damaged, convert it again", file=sys.stderr)  # fmt: skip
        return 1
    if not checked:  # (the manifest did not read as one above: read_manifest said why)
        problem = file_problem(folder, ftw.read_manifest(folder, spec))
        if problem is not None:
            print(f"freetoken: error: {problem}; convert it again", file=sys.stderr)
            return 1
    print(f"[freetoken] {folder}: all {n_rows} expert rows, the dense weights and the files "
          "beside them match their checksums", file=sys.stderr)  # fmt: skip
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from freetoken_agent.engine.config import parse_dtype, read_config
    from freetoken_agent.engine.experts import calibration
    from freetoken_agent.engine.models.registry import spec_from_config

    if args.model:
        spec = spec_from_config(read_config(model_path(args.model)))
        hidden, inter = spec.hidden_size, spec.moe_intermediate_size
        # The entry loading the model looks up is keyed by the dtype it runs in: its own
        # unless --dtype (Engine.load's `parse_dtype(dtype) or spec.dtype`).
        dtype = parse_dtype(args.dtype) or spec.dtype
    else:
        hidden, inter = args.hidden, args.inter
        dtype = parse_dtype(args.dtype) or torch.bfloat16
    cal = calibration.calibrate(hidden, inter, dtype)
    pcie_note = "" if torch.cuda.is_available() else " (no CUDA device: a default, not measured)"
    name = str(dtype).removeprefix("torch.")
    print(
        f"[freetoken] expert {hidden}x{inter} {name} ({cal.expert_bytes / 2**20:.1f} MiB): "
        f"B_P (pinned host-to-device) {cal.pcie / 1e9:.1f} GB/s{pcie_note}, "
        f"B_H (CPU experts, 1 token) {cal.cpu / 1e9:.1f} GB/s, "
        f"CPU knee {cal.knee:.1f} tokens an expert, fill copies on {cal.copy_programs} "
        f"programs{pcie_note and ' (the default)'}; saved to {calibration.cache_file()}",
        file=sys.stderr,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from freetoken_agent.bench.__main__ import main as bench_main

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the tiny random demo model (built once, cached)")
    demo.add_argument("--prompt", default="Write a haiku about GPUs.", help="the user message")
    add_engine_args(demo, model=False)
    _add_sampling_args(demo, max_tokens=48)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="one completion, streamed to stdout")
    gen.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help="the prompt text; - (or none, with text piped in) reads it from standard input, "
        "for prompts too long for a command line (`freetoken generate - < prompt.txt`)",
    )
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat", help="interactive chat; KV is reused across turns", epilog=CHAT_COMMANDS
    )
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser(
        "serve", help="OpenAI-compatible API, WebSocket session stream and a web page"
    )
    srv.add_argument("--host", default="127.0.0.1", help="bind address (others need --api-key)")
    srv.add_argument("--port", type=port, default=8000, help="port to listen on")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("FREETOKEN_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' (default: $FREETOKEN_API_KEY)",
    )
    srv.add_argument(
        "--max-body-mb", type=positive(float), default=4.0, help="request size limit (MiB)"
    )
    srv.add_argument(
        "--allowed-origin",
        action="append",
        type=_origin,
        default=[],
        metavar="ORIGIN",
        help="a web page on another origin that may call the server from a browser, as "
        "scheme://host[:port] (an agent UI on its dev server); repeat for several",
    )
    srv.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name a request's `model` may use for the served model (a client that "
        "cannot be told this one: Claude Code's claude-... names); repeat for several",
    )
    srv.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's (uvicorn's) log level",
    )
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    conv = sub.add_parser("convert", help="write an HF folder as FTW (expert banks by lid)")
    conv.add_argument("src", help="HF model folder (safetensors)")
    conv.add_argument("dst", help="new folder for the FTW checkpoint")
    conv.set_defaults(func=cmd_convert)

    ver = sub.add_parser("verify", help="check an FTW folder's expert rows and dense weights")
    ver.add_argument("dir", help="FTW checkpoint folder (`freetoken convert` wrote it)")
    ver.set_defaults(func=cmd_verify)

    cal = sub.add_parser(
        "calibrate",
        help="measure B_P, B_H and the CPU's knee for the q* split (cached)",
        description="Measure what the adaptive policy's q* split reads: B_P (pinned "
        "host-to-device bytes/s), B_H (CPU expert bytes/s at one token), the CPU's knee and "
        "the fill copy's fastest grid. Entries are kept per machine (GPU and CPU model), "
        "expert shape and dtype, in calibration.json under $FREETOKEN_CACHE (default "
        "~/.cache/freetoken); a model whose entry is missing runs on defaults, with a warning.",
    )
    cal.add_argument("--model", default=None, help="take the expert shape and dtype from this "
                     "model (an entry is per shape and dtype)")  # fmt: skip
    positive_int = positive(int)
    cal.add_argument(
        "--hidden", type=positive_int, default=2048, help="expert input width (no --model)"
    )
    cal.add_argument("--inter", type=positive_int, default=768, help="expert width (no --model)")
    cal.add_argument(
        "--dtype", default=None, help="default: the model's as it loads, else bfloat16"
    )
    cal.set_defaults(func=cmd_calibrate)

    bench = sub.add_parser(
        "bench", help="benchmarks: `freetoken bench` lists them, `freetoken bench NAME --help`"
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="NAME [options]")
    bench.set_defaults(func=cmd_bench)
    for command in sub.choices.values():  # every option's help states its default
        command.formatter_class = DefaultsHelpFormatter
    return parser


def replace_what_stdout_cannot_encode() -> None:
    """A reply's characters that stdout's encoding cannot hold (a latin-1 locale, a file on
    Windows' cp1252, PYTHONIOENCODING=ascii) print as "?": strict, the first of them raised
    UnicodeEncodeError and ended the command mid-reply."""
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="replace")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    replace_what_stdout_cannot_encode()
    try:
        if argv[:1] == ["bench"]:
            # The benchmarks parse their own options: argparse would take `freetoken bench
            # --help` for its own (an empty usage line) instead of the list of benchmarks.
            return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt as e:  # Ctrl-C outside a reply (loading, at the chat prompt)
        signum = getattr(e, "signum", None)  # SIGTERM/SIGHUP mid-convert (ftw.Terminated)
        print(f"freetoken: {e}" if signum else "", file=sys.stderr)
        return 128 + (signum or signal.SIGINT)
    except BrokenPipeError:
        # The reader left (`| head`). As CPython's docs advise: stdout to devnull, so that the
        # interpreter's flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError, NotImplementedError) as e:  # OSError: a folder not writable
        print(f"freetoken: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
