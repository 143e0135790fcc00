"""The web page in a real browser: headless Chromium against a real uvicorn server.

Chromium (Debian's `chromium`, installed by tools/test.sh) is driven over the DevTools
protocol, with the `websockets` client: the page's own turns run over a WebSocket, which
Chromium's one-shot `--screenshot` / `--dump-dom` modes do not wait for (their virtual time
runs ahead of socket traffic), so the test waits for the page to say it is done
(`body[data-finished]`), then reads its DOM and takes a screenshot. The screenshot is decoded
here (zlib and numpy; no imaging library is installed) and checked for what the turn drew: the
user's and the assistant's bubbles, text, the filled side panel.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import random
import string
import struct
import subprocess
import tempfile
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

WIDTH, HEIGHT = 1200, 900
USER_BUBBLE = (0xE8, 0xF0, 0xFE)  # the page's .user background
ASSISTANT_BUBBLE = (0xF3, 0xF3, 0xF3)  # .assistant
ASIDE = (0xFA, 0xFA, 0xFA)  # the side panel


class Browser:
    """Headless Chromium and one page of it, driven over the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        self.proc = subprocess.Popen(
            [
                "chromium",
                "--headless=new",
                "--no-sandbox",  # tests run as root in CI containers
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",  # the chosen port lands in DevToolsActivePort
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            assert self.proc.poll() is None, "chromium exited at start"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.05)
        port, path = port_file.read_text().split()[:2]
        self._exit = contextlib.ExitStack()
        self.ws = self._exit.enter_context(
            connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=30)
        )
        self._ids = itertools.count(1)
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.page(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH,
            height=HEIGHT,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """One DevTools command; events arriving meanwhile are skipped."""
        n = next(self._ids)
        message: dict[str, Any] = {"id": n, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == n:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.call(method, self.session, **params)

    def eval(self, expression: str) -> Any:
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.05)

    def type_and_enter(self, text: str) -> None:
        """Types into the message box as a user would: focus, text, the Enter key."""
        self.eval('document.getElementById("text").focus()')
        self.page("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            self.page(
                "Input.dispatchKeyEvent",
                type=kind,
                key="Enter",
                code="Enter",
                windowsVirtualKeyCode=13,
            )

    def screenshot(self) -> bytes:
        return base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.proc.wait(timeout=15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=15)
            self._exit.close()


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server(model_dir)  # keyless on 127.0.0.1: local Host names only, as served


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with tempfile.TemporaryDirectory(prefix="ft-chromium-") as profile:
        chrome = Browser(Path(profile))
        try:
            yield chrome
        finally:
            chrome.close()


# --- reading what the page shows ----------------------------------------------------------


# What the page's script put into the DOM: the log's bubbles and the side tables' rows.
READ_PAGE = """(() => {
  const part = (m, sel) => { const n = m.querySelector(sel); return n ? n.textContent : null; };
  const rows = (id) => Object.fromEntries(Array.from(document.querySelectorAll(`#${id} tr`))
    .map((tr) => [tr.dataset.key, tr.cells[1].textContent]));
  return {
    bubbles: Array.from(document.querySelectorAll("#log > .msg")).map((m) => ({
      kind: m.classList[1], text: m.textContent, reasoning: part(m, ":scope > .reasoning"),
      content: part(m, ":scope > span"), meta: part(m, ":scope > .meta"),
    })),
    usage: rows("usage"),
    memory: rows("memory"),
  };
})()"""


def read_page(browser: Browser) -> dict[str, Any]:
    return browser.eval(READ_PAGE)


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB(A) PNG as a [H, W, C] uint8 array; checks the format on the way."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (size,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + size]
        assert (
            zlib.crc32(kind + body)
            == struct.unpack(">I", data[pos + 8 + size : pos + 12 + size])[0]
        )
        pos += 12 + size
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    assert len(raw) == height * (stride + 1)
    out = np.zeros((height, stride), np.uint8)
    prev = bytearray(stride)
    for y in range(height):
        kind, row = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        if kind == 2:  # Up: vectorised, the common case
            row = bytearray(
                (np.frombuffer(row, np.uint8) + np.frombuffer(prev, np.uint8)).tobytes()
            )
        elif kind in (1, 3, 4):  # Sub, Average, Paeth: each byte depends on the one before
            for i in range(stride):
                a = row[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                if kind == 1:
                    pred = a
                elif kind == 3:
                    pred = (a + b) >> 1
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                row[i] = (row[i] + pred) & 0xFF
        else:
            assert kind == 0, f"unknown PNG filter {kind}"
        out[y] = np.frombuffer(row, np.uint8)
        prev = row
    return out.reshape(height, width, bpp)[:, :, :3]


def color_mask(pixels: np.ndarray, rgb: tuple[int, int, int]) -> np.ndarray:
    return np.all(pixels == np.array(rgb, np.uint8), axis=-1)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(n)
    )


# --- the tests ------------------------------------------------------------------------------


def test_page_runs_two_turns_and_draws_them(server, browser, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    first, second = _words(rng, rng.randint(2, 5)), _words(rng, rng.randint(2, 5))
    max_tokens = rng.randint(4, 10)
    # No ?session=: the page's own, where ?send= starts the turn (test_page_watches... checks
    # that it does not on a session the link names).
    query = urllib.parse.urlencode({"send": first, "max_tokens": max_tokens, "temperature": 0})
    browser.page("Page.navigate", url=f"{server.base}/?{query}")
    browser.wait_for('document.body?.dataset.finished === "1"')
    sid = browser.eval('document.getElementById("sid").value')
    # The autostart text left the URL, so a reload would not send it again.
    assert "send=" not in browser.eval("location.search")
    browser.type_and_enter(second)
    browser.wait_for('document.body?.dataset.finished === "2"')
    assert browser.eval("document.body?.dataset.state") == "ready"

    shown = read_page(browser)
    live = server.state.hub.get(sid)
    history = live.history  # what the server kept: the ground truth
    assert [m.content for m in history[::2]] == [first, second]
    users = [b for b in shown["bubbles"] if b["kind"] == "user"]
    replies = [b for b in shown["bubbles"] if b["kind"] == "assistant"]
    assert [b["text"] for b in users] == [first, second]
    assert [b["content"] for b in replies] == [m.content for m in history[1::2]]
    assert [b["reasoning"] for b in replies] == [m.reasoning or "" for m in history[1::2]]
    assert all("prompt tokens" in b["meta"] for b in replies)

    usage = shown["usage"]  # the last turn's figures, as the page shows them
    stats = live.session.turn_stats[-1]
    assert int(usage["prompt"]) == int(usage["reused"]) + int(usage["prefilled"])
    assert int(usage["reused"]) == stats["reused_tokens"] > 0  # turn 2 reused turn 1
    assert 0 < int(usage["generated"]) <= max_tokens
    assert usage["exact"] == "true" and usage["anchor before the edit"] != "-"
    memory = shown["memory"]
    assert int(memory["KV pages"]) > 0 and 0 <= int(memory["free"]) <= int(memory["KV pages"])

    png = browser.screenshot()
    pixels = decode_png(png)
    assert pixels.shape == (HEIGHT, WIDTH, 3)
    # Not blank: many colours (antialiased text), and the regions the turn filled in.
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    user, assistant = color_mask(pixels, USER_BUBBLE), color_mask(pixels, ASSISTANT_BUBBLE)
    assert user.sum() > 2 * 20_000 and assistant.sum() > 2 * 20_000  # two bubbles each
    panel = np.nonzero(color_mask(pixels, ASIDE).mean(axis=0) > 0.5)[0]  # mostly-panel columns
    assert panel.max() == WIDTH - 1 and len(panel) > 200  # the side panel, on the right
    assert np.nonzero(user.any(axis=0))[0].max() < panel.min()  # bubbles left of the panel
    rows = np.nonzero(user.any(axis=1))[0]  # two bubbles: two runs of rows
    assert (np.diff(rows) > 1).sum() == 1, "expected two separate user bubbles"
    dark = (pixels.sum(axis=-1) < 200).sum()  # text ink
    assert dark > 2000
    nothing_held(server.state.service)


def test_page_watches_a_session_an_api_client_drives(server, browser, rng_seed, nothing_held):
    """The page open on an id; an OpenAI client sends `X-Session-Id: id`: the page shows it.
    The link's ?send= text waits in the message box: a link names a session (the agent's)
    whose history it must not write into without the user's Enter."""
    rng = random.Random(rng_seed)
    sid = f"watch-{rng_seed:x}"
    bait = _words(rng, rng.randint(2, 4))
    query = urllib.parse.urlencode({"session": sid, "send": bait})
    browser.page("Page.navigate", url=f"{server.base}/?{query}")
    browser.wait_for('document.body?.dataset.state === "ready"')
    assert browser.eval('document.getElementById("text").value') == bait
    assert server.state.hub.get(sid).turns == 0  # not sent
    question = _words(rng, rng.randint(2, 6))
    r = httpx.post(
        server.base + "/v1/chat/completions",
        headers={"X-Session-Id": sid},
        json={"messages": [{"role": "user", "content": question}],
              "max_tokens": rng.randint(3, 8), "temperature": 0},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    browser.wait_for('document.body?.dataset.finished === "1"')
    shown = read_page(browser)
    assert [b["text"] for b in shown["bubbles"] if b["kind"] == "user"] == [question]
    [reply] = [b for b in shown["bubbles"] if b["kind"] == "assistant"]
    assert reply["content"] == (r.json()["choices"][0]["message"]["content"] or "")
    assert int(shown["usage"]["generated"]) == r.json()["usage"]["completion_tokens"]
    # The tab remembers the session it watched: a link without ?session= lands there, and its
    # text waits too (it would go into the agent's session, with the key the tab keeps).
    bait = _words(rng, rng.randint(2, 4))
    query = urllib.parse.urlencode({"send": bait})
    browser.page("Page.navigate", url=f"{server.base}/?{query}")
    browser.wait_for('document.body?.dataset.state === "ready"')
    assert browser.eval('document.getElementById("sid").value') == sid
    assert browser.eval('document.getElementById("text").value') == bait
    assert server.state.hub.get(sid).turns == 1  # the API client's only
    nothing_held(server.state.service)
