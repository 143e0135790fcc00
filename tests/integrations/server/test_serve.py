"""`freetoken serve` and the real thing: uvicorn on a free port, the `openai` client, the
example script; the binding rules without binding anything."""

from __future__ import annotations

import importlib
import importlib.util
import random
import socket
import string
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from openai import OpenAI

from freetoken_agent import cli
from freetoken_agent.integrations.server import check_bind, make_server

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "openai_client.py"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::", "example.org"])
def test_serve_refuses_a_public_host_without_a_key(host, monkeypatch, capsys):
    def no_load(args):
        raise AssertionError("the engine must not load for a refused bind")

    monkeypatch.setattr(cli, "load_engine", no_load)
    monkeypatch.delenv("FREETOKEN_API_KEY", raising=False)
    assert cli.main(["serve", "--host", host]) == 2
    err = capsys.readouterr().err
    assert "without an API key" in err and "--api-key" in err and host in err


def test_bind_rules():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2", "[::1]"):
        check_bind(host, None)
    check_bind("0.0.0.0", "a-key")
    with pytest.raises(ValueError, match="without an API key"):
        check_bind("10.0.0.1", "")
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, "demo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _started(engine, **options):
    """(port, server, thread): uvicorn serving the app on a free local port, in a thread."""
    port = _free_port()
    server = make_server(engine, "127.0.0.1", port, log_level="warning", **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return port, server, thread


@pytest.fixture
def live_server(engine):
    """uvicorn serving the app on a free local port, in a thread; (base URL, key, server)."""
    key = "".join(random.choice(string.ascii_letters) for _ in range(20))
    port, server, thread = _started(engine, api_key=key)
    yield f"http://127.0.0.1:{port}", key, server
    server.should_exit = True
    thread.join(timeout=15)
    assert not thread.is_alive()


def test_openai_client_streams_from_a_real_server(live_server, rng_seed):
    base, key, _ = live_server
    client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    model = client.models.list().data[0].id
    words = " ".join(random.Random(rng_seed).choice(["cat", "sun", "bird", "tea"]) for _ in "abc")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": words}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": words}], max_tokens=6, temperature=0
    )
    assert whole.choices[0].message.content == streamed
    assert whole.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again

    wrong = OpenAI(base_url=base + "/v1", api_key=key + "x", max_retries=0)
    with pytest.raises(Exception) as refused:
        wrong.models.list()
    assert getattr(refused.value, "status_code", None) == 401


def test_the_example_script_runs_against_the_server(live_server, capsys):
    base, key, _ = live_server
    spec = importlib.util.spec_from_file_location("openai_client_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--base-url", base + "/v1", "--api-key", key]) == 0
    out = capsys.readouterr().out
    assert "tool call call_" in out and "get_weather(" in out and "[usage:" in out


def test_the_example_script_says_when_no_server_answers(capsys):
    """Run before `freetoken serve`: one line saying so (it was a 40-line traceback)."""
    spec = importlib.util.spec_from_file_location("openai_client_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    base = f"http://127.0.0.1:{_free_port()}/v1"
    assert example.main(["--base-url", base]) == 1
    err = capsys.readouterr().err
    assert f"no server answers at {base}" in err and "freetoken serve" in err


def test_a_real_client_that_disconnects_aborts_its_request(live_server, engine):
    base, key, server = live_server
    service = server.config.app.state.server.service
    body = {
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
    deadline = time.monotonic() + 10
    while service.stats()["requests"]["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    with service.lock:
        assert not engine.has_unfinished()
        assert engine.stats()["tokens"]["generated"] < 900
        engine.check_integrity()


def test_serve_passes_its_model_aliases(monkeypatch, rng_seed):
    """`--model-alias` (repeatable) reaches the app: a client that sends another model name
    (Claude Code's claude-... names) is served by the one model."""
    # The package exports the function `serve` under the module's name: the module itself.
    serve_module = importlib.import_module("freetoken_agent.integrations.server.serve")
    rng = random.Random(rng_seed)
    aliases = [f"claude-{rng.getrandbits(32):x}" for _ in range(rng.randint(1, 3))]
    seen = {}
    engine = SimpleNamespace(tokenizer=SimpleNamespace(chat_template_sources={"default": "x"}))
    monkeypatch.setattr(cli, "load_engine", lambda args: engine)
    monkeypatch.setattr(serve_module, "serve", lambda engine, host, port, **kw: seen.update(kw))
    argv = ["serve", "--port", str(_free_port())]
    argv += [a for alias in aliases for a in ("--model-alias", alias)]
    assert cli.main(argv) == 0
    assert seen["model_aliases"] == aliases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_serve_refuses_a_port_in_use_before_loading(host, monkeypatch, capsys):
    """Another program listens on the port: refused before the model loads (uvicorn would
    find out only after a real checkpoint's minutes of loading), naming the port."""

    def no_load(args):
        raise AssertionError("the engine must not load for a port in use")

    monkeypatch.setattr(cli, "load_engine", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--host", host, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"{host}:{port}" in err and "--port" in err and "Traceback" not in err


@pytest.mark.parametrize("has_template", [False, True])
def test_serve_says_when_the_model_has_no_chat_template(has_template, monkeypatch, capsys):
    serve_module = importlib.import_module("freetoken_agent.integrations.server.serve")
    engine = type("E", (), {})()
    engine.tokenizer = type("T", (), {"chat_template_sources": {"default": "x"} if has_template
                                      else {}})()  # fmt: skip
    monkeypatch.setattr(cli, "load_engine", lambda args: engine)
    monkeypatch.setattr(serve_module, "serve", lambda *a, **kw: None)
    assert cli.main(["serve", "--port", str(_free_port())]) == 0
    said = "no chat template" in capsys.readouterr().err
    assert said != has_template


def test_serve_help_never_shows_the_api_key(monkeypatch, rng_seed):
    """The key's default is read from FREETOKEN_API_KEY: the help that states every option's
    default must not print it."""
    secret = f"key-{random.Random(rng_seed).getrandbits(64):x}"
    monkeypatch.setenv("FREETOKEN_API_KEY", secret)
    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).api_key == secret
    serve_parser = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    assert secret not in serve_parser.format_help()


def test_the_first_exit_signal_ends_running_streams_in_band(model_dir, rng_seed, caplog):
    """Ctrl-C with streams running: they end at once as aborted replies, in-band (a last
    chunk, then [DONE]), and the server stops. uvicorn alone let them generate through its 5 s
    graceful timeout, then cancelled each: a traceback a stream, a cut body for each client."""
    import signal

    from freetoken_agent import Engine

    rng = random.Random(rng_seed)
    engine = Engine.load(
        model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024
    )
    port, server, thread = _started(engine)
    deadline = time.monotonic() + 30
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    ends: dict[int, object] = {}
    chunks = {i: 0 for i in range(rng.randint(2, 4))}

    def stream(i: int) -> None:
        try:
            for chunk in client.chat.completions.create(
                model=client.models.list().data[0].id, stream=True, max_tokens=900,
                messages=[{"role": "user", "content": "x"}], extra_body={"ignore_eos": True},
            ):  # fmt: skip
                chunks[i] += 1
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    ends[i] = chunk.choices[0].finish_reason
        except Exception as e:  # noqa: BLE001 - what the client saw is the test's answer
            ends[i] = e

    readers = [threading.Thread(target=stream, args=(i,)) for i in chunks]
    for reader in readers:
        reader.start()
    while min(chunks.values()) < 3:  # every stream is generating
        assert time.monotonic() < deadline + 60, chunks
        time.sleep(0.02)
    signaled = time.monotonic()
    server.handle_exit(signal.SIGINT, None)
    for reader in readers:
        reader.join(timeout=30)
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - signaled < 4.5  # before uvicorn's 5 s
    assert all(ends.get(i) == "abort" for i in chunks), ends  # in-band, not a cut body
    assert all(chunks[i] < 900 for i in chunks)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
