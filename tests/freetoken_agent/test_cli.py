"""The `freetoken` command line, run as a user would (a subprocess, the demo checkpoint)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "FREETOKEN_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}


def _run(
    args: list[str], env: dict, stdin: str = "", cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freetoken_agent.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=cwd,
    )


def test_demo_says_weights_are_random_and_generates(env):
    done = _run(["demo", "--device", "cpu", "--max-tokens", "16", "--seed", "3"], env)
    assert done.returncode == 0, done.stderr
    assert "random weights" in done.stderr
    assert "16 tokens" in done.stderr and "finish: length" in done.stderr
    assert done.stdout.strip()  # the streamed text


def _stop_window(text: str) -> str | None:
    """A 2-character stop string from the second half of `text`: printable and without
    spaces, which argv would mangle (a random model can emit NUL or control characters)."""
    for i in range(len(text) // 2, len(text) - 1):
        window = text[i : i + 2]
        if window.isprintable() and not any(c.isspace() for c in window):
            return window
    return None


def test_generate_is_reproducible_with_a_seed_and_honours_stop(env, rng_seed):
    args = ["generate", "Once upon a time", "--device", "cpu", "--max-tokens", "24"]
    # The embedded model may end its answer at once (seed 2154043346 gave "W" and an end of
    # text): the next seeds are tried until an answer has room for a stop string.
    for seed in map(str, range(rng_seed, rng_seed + 8)):
        first = _run([*args, "--seed", seed], env)
        second = _run([*args, "--seed", seed], env)
        assert first.returncode == 0 and first.stdout == second.stdout
        text = first.stdout.rstrip("\n")
        stop = _stop_window(text)
        if stop is not None:
            break
    assert stop is not None, f"8 seeds from {rng_seed}: no answer with a stop window"
    stopped = _run([*args, "--seed", seed, "--stop", stop], env)
    assert stopped.returncode == 0
    # The CLI ends its output with a newline; the text before the stop may end with one too
    # (seed 2661033761), which that strip takes as well.
    assert stopped.stdout.rstrip("\n") == text[: text.index(stop)].rstrip("\n")
    assert "finish: stop" in stopped.stderr


def test_generate_without_a_seed_samples_afresh_each_run(env, rng_seed):
    """No --seed: each run draws its own (as llama.cpp and Ollama do), so sampled replies
    differ between runs; 40 tokens at temperature 1 from a random model never repeat."""
    prompt = "".join(random.Random(rng_seed).choices(string.ascii_lowercase, k=12))
    args = ["generate", prompt, "--device", "cpu", "--max-tokens", "40", "--temperature", "1"]
    # llama.cpp's --seed -1 means the same
    seed = random.Random(rng_seed).choice([[], ["--seed", "-1"], ["--seed", "-7"]])
    runs = [_run([*args, "--top-p", "1", *seed], env) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout != runs[1].stdout


def test_chat_keeps_history_and_exits(env):
    args = ["chat", "--device", "cpu", "--max-tokens", "8"]
    done = _run(args, env, stdin="hello\nagain\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("model> ") == 2
    reports = [line for line in done.stderr.splitlines() if "tokens, first after" in line]
    assert len(reports) == 2
    assert "reused 0" in reports[0] and "reused 0" not in reports[1]  # turn 2 reuses turn 1


def test_bad_model_path_is_a_clear_error(env, tmp_path):
    done = _run(["generate", "hi", "--model", str(tmp_path / "nope"), "--device", "cpu"], env)
    assert done.returncode == 2
    assert "no config.json" in done.stderr


def test_a_hub_id_or_a_gguf_file_is_told_what_to_give(env, tmp_path, rng_seed):
    """A vLLM or Ollama user's habits: a repo id (nothing is downloaded: say how to fetch
    it), a GGUF file (not read): one line each, exit 2, in the folder the test runs from."""
    rng = random.Random(rng_seed)
    repo = f"org{rng.randrange(999)}/Model-{rng.randrange(99)}B"
    gguf = tmp_path / f"m{rng.randrange(99)}.gguf"
    gguf.write_bytes(b"GGUF")
    for name, says in ((repo, "never downloads"), (str(gguf), "GGUF files are not read")):
        done = _run(["generate", "hi", "--model", name, "--device", "cpu"], env, cwd=tmp_path)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    done = _run(["serve", "--port", "abc"], env)
    assert done.returncode == 2 and "invalid port value" in done.stderr, done.stderr


def test_chat_commands_and_unknown_ones_never_reach_the_model(env, rng_seed):
    """/help lists the commands, a mistyped /command is refused (it was sent to the model as
    a message), /bye leaves; a path and a doubled slash are messages."""
    rng = random.Random(rng_seed)
    typo = "/" + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8)))
    lines = ["/help", typo, "/usr/bin/env", "//etc", "/bye", "never read"]
    done = _run(["chat", "--device", "cpu", "--max-tokens", "3"], env, stdin="\n".join(lines))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("model> ") == 2  # the path and "/etc"; nothing after /bye
    assert "/reset clears the history" in done.stderr
    assert f"unknown command {typo}; /help lists them" in done.stderr


def test_engine_flags_reach_the_engine_config(monkeypatch, rng_seed):
    """--memory-reserve-gb, --fixed-memory, --overlap-schedule, --no-double-buffer,
    --checkpoints and --thinking-budget become EngineConfig options at load; left out, none is
    set."""
    import argparse

    from freetoken_agent import cli_engine
    from freetoken_agent.engine.engine import Engine

    rng = random.Random(rng_seed)
    seen = {}
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, path, **kw: seen.update(kw)))
    parser = argparse.ArgumentParser()
    cli_engine.add_engine_args(parser)
    gb = 0.5 + (rng_seed % 100) / 10
    mode = rng.choice(["anchors", "none", f"positional:{rng.randint(1, 4096)}"])
    budget = rng.randint(0, 4096)
    seqs, batched = rng.randint(1, 256), rng.randint(16, 16384)
    cli_engine.load_engine(parser.parse_args(["--model", ".", "--memory-reserve-gb", str(gb),
                           "--fixed-memory", "--overlap-schedule", "--no-double-buffer",
                           "--checkpoints", mode, "--thinking-budget", str(budget),
                           "--max-num-seqs", str(seqs),
                           "--max-batched-tokens", str(batched)]))  # fmt: skip
    assert seen["memory_reserve"] == int(gb * 1e9) and seen["follow_free_memory"] is False
    assert seen["overlap_schedule"] is True and seen["double_buffer"] is False
    assert seen["checkpoints"] == mode and seen["thinking_budget"] == budget
    assert seen["max_num_seqs"] == seqs and seen["max_batched_tokens"] == batched
    seen.clear()
    cli_engine.load_engine(parser.parse_args(["--model", "."]))
    options = {"memory_reserve", "follow_free_memory", "overlap_schedule", "double_buffer"}
    options |= {"checkpoints", "thinking_budget", "max_num_seqs", "max_batched_tokens"}
    assert not options & set(seen)


def test_the_ablation_and_checkpoint_flags_load_an_engine(env, rng_seed):
    """The options the flags set are ones Engine.load takes: a demo run with both."""
    mode = random.Random(rng_seed).choice(["none", "positional:64"])
    args = ["generate", "hi", "--device", "cpu", "--max-tokens", "2", "--no-double-buffer"]
    done = _run([*args, "--checkpoints", mode], env)
    assert done.returncode == 0, done.stderr


def test_bench_help_lists_every_benchmark_and_each_has_its_options(env, rng_seed):
    """`freetoken bench --help` is the benchmarks' list (argparse used to answer it with an
    empty usage line), and `freetoken bench NAME --help` that benchmark's options."""
    from freetoken_agent.bench.__main__ import BENCHES

    done = _run(["bench", "--help"], env)
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in BENCHES), done.stdout
    name = random.Random(rng_seed).choice(sorted(BENCHES))
    done = _run(["bench", name, "--help"], env)
    assert done.returncode == 0, done.stderr
    assert f"usage: freetoken bench {name}" in done.stdout
    assert _run(["bench", "no-such-bench"], env).returncode == 2


class _Live:
    """A `freetoken` subprocess whose stdout is read as it comes (a thread gathers it), for
    tests that act mid-run: Ctrl-C (SIGINT, as a terminal sends it), a reader that leaves."""

    def __init__(self, args: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "freetoken_agent.cli", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            # A terminal's child takes Ctrl-C; one started from a shell in the background
            # ignores it, which the child would inherit.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.out = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read1(4096):
            self.out += chunk

    def wait_for(self, text: bytes, after: int = 0, timeout: float = 120) -> int:
        """Wait until `text` appears in stdout past offset `after`; where it ends."""
        deadline = time.monotonic() + timeout
        while (at := self.out.find(text, after)) < 0:
            assert self.proc.poll() is None, (self.out, self.proc.stderr.read())
            assert time.monotonic() < deadline, f"no {text!r} in {bytes(self.out)!r}"
            time.sleep(0.02)
        return at + len(text)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def finish(self) -> tuple[int, str]:
        """(exit code, stderr) once it exits."""
        err = self.proc.communicate(timeout=120)[1]
        self._reader.join(10)
        return self.proc.returncode, err.decode(errors="replace")


# Greedy from this prompt, the demo model writes on for thousands of tokens: still running
# when the test acts.
_LONG = ["Hi", "--device", "cpu", "--temperature", "0", "--max-tokens", "100000"]


def test_ctrl_c_stops_generate_quietly_with_130(env, rng_seed):
    live = _Live(["generate", *_LONG], env)
    live.wait_for(b"", after=random.Random(rng_seed).randint(1, 400))  # some text is out
    live.proc.send_signal(signal.SIGINT)
    rc, err = live.finish()
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_ctrl_c_in_chat_stops_the_reply_and_a_second_one_at_the_prompt_leaves(env, rng_seed):
    rng = random.Random(rng_seed)
    live = _Live(["chat", *_LONG[1:]], env)
    live.send("Hi\n")
    at = live.wait_for(b"model> ")
    live.wait_for(b"", after=at + rng.randint(1, 400))
    live.proc.send_signal(signal.SIGINT)
    live.wait_for(b"you> ", after=at)  # the reply stopped; the chat is back at its prompt
    time.sleep(rng.uniform(0, 0.5))
    live.proc.send_signal(signal.SIGINT)
    rc, err = live.finish()
    assert rc == 130, err
    assert "finish: interrupted" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_chat_goes_on_when_its_history_outgrows_the_context(env, rng_seed):
    rng = random.Random(rng_seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(40)]
    lines = [words[0], " ".join(words), "/reset", words[1], "/exit"]
    args = ["chat", "--device", "cpu", "--max-tokens", "8", "--max-model-len", "64"]
    done = _run(args, env, stdin="\n".join(lines) + "\n")
    assert done.returncode == 0, done.stderr
    assert "no longer fits the context" in done.stderr and "/reset clears" in done.stderr
    reports = [line for line in done.stderr.splitlines() if "tokens, first after" in line]
    assert len(reports) == 2  # the first message and the one after /reset were answered


def _random_flags(rng: random.Random) -> list[tuple[list[str], str]]:
    """(command line, what the error names) for flag values out of range."""
    negative = str(-rng.randint(1, 10**4))
    zero = rng.choice(["0", "-0", "0.0"])
    return [
        (["generate", "x", "--device", rng.choice(["foo", "cuda:x", "gpu"])], "--device"),
        (["generate", "x", "--max-model-len", rng.choice([negative, "0"])], "--max-model-len"),
        (["chat", "--gpu-budget-gb", zero], "--gpu-budget-gb"),
        (["serve", "--port", str(rng.randint(65536, 10**6))], "--port"),
        (["serve", "--max-body-mb", rng.choice([negative, zero])], "--max-body-mb"),
        (["calibrate", "--hidden", rng.choice([negative, "0"])], "--hidden"),
        (["calibrate", "--inter", negative], "--inter"),
        (["demo", "--model", "x"], "--model"),  # demo runs its own model
        (["chat", "--thinking-budget", rng.choice([negative, "1.5", "x"])], "--thinking-budget"),
        (
            ["generate", "x", "--checkpoints", rng.choice(["positional", "positional:0", "all"])],
            "--checkpoints",
        ),  # fmt: skip
        (
            ["serve", "--allowed-origin", rng.choice(["localhost:5173", "http://h/app"])],
            "--allowed-origin",
        ),  # fmt: skip
    ]


def test_bad_flag_values_are_refused_before_anything_runs(env, rng_seed):
    for args, flag in _random_flags(random.Random(rng_seed)):
        done = _run(args, env)
        assert done.returncode == 2, (args, done.stderr)
        assert flag in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)


def test_os_errors_and_a_closed_pipe_are_one_line_not_a_traceback(env, tmp_path):
    from freetoken_agent.demo_model import ensure_demo_model

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    src = ensure_demo_model(tmp_path / "cache")
    done = _run(["convert", str(src), str(blocker / "out")], env)  # NotADirectoryError
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("freetoken: error: ")
    proc = subprocess.Popen(
        [sys.executable, "-m", "freetoken_agent.cli", "generate", *_LONG[:-1], "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.read(8)
    proc.stdout.close()  # the reader leaves, as `| head` does
    err = proc.communicate(timeout=120)[1].decode(errors="replace")
    assert proc.returncode == 1 and "Traceback" not in err, err


def test_calibrate_with_a_model_records_the_dtype_it_loads_in(env, monkeypatch):
    from freetoken_agent.engine.config import read_config
    from freetoken_agent.engine.experts import calibration
    from freetoken_agent.engine.models.registry import spec_from_config

    done = _run(["calibrate", "--model", "demo"], env)
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv("FREETOKEN_CACHE", env["FREETOKEN_CACHE"])
    spec = spec_from_config(read_config(next(Path(env["FREETOKEN_CACHE"]).glob("demo-*"))))
    assert calibration.cached(spec.hidden_size, spec.moe_intermediate_size, spec.dtype)


def test_chat_without_a_chat_template_says_so_before_the_first_message(env, tmp_path):
    from freetoken_agent.demo_model import ensure_demo_model

    model = tmp_path / "plain"
    shutil.copytree(ensure_demo_model(tmp_path / "cache"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    done = _run(["chat", "--model", str(model), "--device", "cpu"], env, stdin="hello\n")
    assert done.returncode != 0 and "you> " not in done.stdout
    assert "needs a chat template" in done.stderr and "freetoken generate" in done.stderr


def test_serve_without_the_server_packages_names_the_install(env):
    """`freetoken serve` where starlette is not installed (a plain `pip install -e .`): one
    line naming the extra to install, not a traceback."""
    code = (
        "import sys; sys.modules['starlette'] = None; sys.argv = ['freetoken', 'serve']; "
        "from freetoken_agent.cli import main; sys.exit(main())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert 'pip install -e ".[integrations]"' in done.stderr and "starlette" in done.stderr


def test_a_one_token_answer_reports_no_decode_rate(env, rng_seed):
    done = _run(["generate", "Hi", "--device", "cpu", "--max-tokens", "1",
                 "--seed", str(rng_seed % 1000)], env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1 tokens" in done.stderr and "nan" not in done.stderr, done.stderr


def test_chat_prompts_carry_one_bos(env, tmp_path, rng_seed):
    """`generate --chat` on a model whose template writes its bos and whose tokenizer adds one
    to a raw prompt (Llama/Mistral): the prompt has that bos once (rendered text sent as a
    string got a second)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
    from mistral_tokenizer import CONFIG, mistral_v3_backend
    from tiny_models import make_tiny

    rng = random.Random(rng_seed)
    tok = mistral_v3_backend()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    config = {**CONFIG, "add_bos_token": True, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    make_tiny("mixtral", tmp_path, rng_seed, vocab_size=tok.get_vocab_size())
    words = " ".join(rng.choice(["hello", "there", "quick", "answer"]) for _ in range(4))
    done = _run(["generate", words, "--model", str(tmp_path), "--device", "cpu", "--chat",
                 "--max-tokens", "1"], env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    want = tok.encode(f"<s>[INST] {words} [/INST]", add_special_tokens=False).ids
    assert want.count(tok.token_to_id("<s>")) == 1
    assert f"prefilled {len(want)} " in done.stderr, done.stderr


def test_chat_on_a_hybrid_model_reuses_the_history_each_turn(env, tmp_path, rng_seed):
    """`freetoken chat` on a hybrid model whose template re-renders the last reply differently
    (Qwen3.5's drops the generation prompt's `<think>`): each turn diverges before the last
    prompt's end, so without the chat's anchors every turn prefilled the whole history (the
    engine's only checkpoints were prompt ends). Each later turn now reuses most of it."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
    from hybrid_chat import make_hybrid_chat

    rng = random.Random(rng_seed)
    make_hybrid_chat(tmp_path, rng_seed, qwen3_5=True)
    lines = [" ".join(rng.choice(["alpha", "file", "read", "cache"]) for _ in range(12))
             for _ in range(3)]  # fmt: skip
    done = _run(["chat", "--model", str(tmp_path), "--device", "cpu", "--max-tokens", "6",
                 "--system", "be brief"], env, stdin="\n".join(lines) + "\n/exit\n")  # fmt: skip
    assert done.returncode == 0, done.stderr
    totals = [
        tuple(int(n) for n in line.split("prefilled ")[1].split(" prompt")[0].split(" / reused "))
        for line in done.stderr.splitlines()
        if "tokens, first after" in line or "no token" in line
    ]  # (prefilled, reused) so far, after each turn
    assert len(totals) == 3, done.stderr
    (p1, r1), (p2, r2), (p3, r3) = totals
    assert r1 == 0 and r2 > 0 and r3 > r2, totals
    assert p3 - p2 < r3 - r2, totals  # the third turn prefilled less than it reused


def test_every_command_option_states_its_default():
    """`freetoken CMD --help` states each option's default (the sampling defaults, 0.7 and
    0.95, differ from SamplingParams' 1.0 and 1.0 and were nowhere to be read)."""
    import argparse

    from freetoken_agent import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            assert action.help, (name, action.option_strings)
            shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else (
                str(action.default))  # fmt: skip
            assert f"default: {shown or 'none'})" in text or "default" in action.help.lower(), (
                name, action.option_strings)  # fmt: skip


def test_serve_refuses_a_model_without_a_tokenizer_before_it_says_serving(env, tmp_path, rng_seed):
    import socket

    from tiny_models import make_tiny

    make_tiny("qwen3_moe", tmp_path / "m", rng_seed)  # weights and config only
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    done = _run(["serve", "--model", str(tmp_path / "m"), "--device", "cpu", "--port", port], env)
    assert done.returncode == 2, done.stderr
    assert "tokenizer" in done.stderr and "serving" not in done.stderr, done.stderr
    assert "chat template" not in done.stderr.splitlines()[-1]


def test_generate_reads_a_piped_prompt_as_it_reads_the_argument(env, rng_seed):
    """`... | freetoken generate -` (or no prompt at all with text piped in): a prompt too long
    for a command line; the same reply as the prompt given as the argument."""
    rng = random.Random(rng_seed)
    words = " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(30))
    args = ["--device", "cpu", "--max-tokens", "6", "--temperature", "0"]
    given = _run(["generate", words, *args], env)
    assert given.returncode == 0, given.stderr
    for way in (["-"], []):
        piped = _run(["generate", *way, *args], env, stdin=words)
        assert piped.returncode == 0, piped.stderr
        assert piped.stdout == given.stdout
    empty = _run(["generate", *args], env, stdin=rng.choice(["", " \n"]))
    assert empty.returncode != 0 and "standard input is empty" in empty.stderr
    assert "loading" not in empty.stderr and "demo" not in empty.stderr  # refused before


def test_a_ctrl_c_while_the_package_imports_ends_the_command_quietly(monkeypatch, capsys):
    """The console script's entry (freetoken_launch, outside the package) guards the package's
    import, which loads torch for seconds: a Ctrl-C then exits 130 with an empty line on
    stderr, as one during a command does, not with the import's traceback."""
    import importlib.abc

    import freetoken_launch

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "freetoken_agent.cli":
                raise KeyboardInterrupt  # what Ctrl-C raises wherever the import is
            return None

    monkeypatch.delitem(sys.modules, "freetoken_agent.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    assert freetoken_launch.main() == 130
    assert capsys.readouterr().err == "\n"


def test_the_console_script_is_the_guarded_entry():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "freetoken"]
    assert script.value == "freetoken_launch:main"  # as installed, not only as written
    assert script.load().__module__ == "freetoken_launch"
