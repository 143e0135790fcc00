"""The web page's HTML and script (served by ui.py). A Python string so that it installs with
the package without package-data settings."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>FreeToken session</title>
<style>
  body { font: 14px/1.45 system-ui, sans-serif; margin: 0; display: flex; height: 100vh; }
  main { flex: 1; display: flex; flex-direction: column; min-width: 0; }
  aside { width: 280px; border-left: 1px solid #ddd; padding: 12px; overflow: auto;
          background: #fafafa; font-size: 12px; }
  header { padding: 8px 12px; border-bottom: 1px solid #ddd; display: flex; gap: 6px;
           flex-wrap: wrap; align-items: center; }
  #log { flex: 1; overflow: auto; padding: 12px; }
  footer { border-top: 1px solid #ddd; padding: 8px 12px; display: flex; gap: 6px; }
  textarea { flex: 1; height: 3.5em; font: inherit; }
  input { font: inherit; }
  .msg { margin: 8px 0; padding: 8px 10px; border-radius: 8px; white-space: pre-wrap;
         word-break: break-word; }
  .user { background: #e8f0fe; }
  .assistant { background: #f3f3f3; }
  .tool { background: #fff7e0; font-family: ui-monospace, monospace; font-size: 12px; }
  .reasoning { color: #777; font-style: italic; }
  .call { font-family: ui-monospace, monospace; font-size: 12px; background: #fff;
          border: 1px solid #ddd; border-radius: 6px; padding: 4px 6px; margin-top: 4px; }
  .meta { color: #888; font-size: 11px; margin-top: 4px; }
  .error { color: #b00020; }
  table { border-collapse: collapse; width: 100%; }
  td { padding: 2px 4px; border-bottom: 1px solid #eee; }
  td:last-child { text-align: right; font-family: ui-monospace, monospace; }
  #status { font-size: 12px; color: #555; }
</style>
</head>
<body>
<main>
  <header>
    <label>session <input id="sid" size="16"></label>
    <label>API key <input id="key" type="password" size="12" placeholder="(none)"></label>
    <button id="connect">connect</button>
    <label>max tokens <input id="maxtok" type="number" value="256" min="1" style="width:5em">
    </label>
    <label>temperature <input id="temp" type="number" value="0.7" step="0.1" min="0" max="2"
      style="width:4em"></label>
    <span id="status">not connected</span>
  </header>
  <div id="log"></div>
  <footer>
    <textarea id="text" placeholder="Message (Enter sends, Shift+Enter: new line)"></textarea>
    <button id="send" disabled>send</button>
    <button id="cancel" disabled>cancel</button>
  </footer>
</main>
<aside>
  <b>Memory</b>
  <table id="memory"></table>
  <p><b>Last turn</b></p>
  <table id="usage"></table>
</aside>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let ws = null, turn = null, running = false;
// URL parameters: ?session=ID joins that session; &send=TEXT puts TEXT in the message box and
// sends it once connected, but only on a session this page load made up (no ?session=, none
// remembered by the tab): a link from any site may open this page, and must not put words into
// a session it names or the tab last watched (an agent's, with the key the tab keeps); there
// the text waits for the user's Enter. &max_tokens=N and &temperature=T preset those.
const params = new URLSearchParams(location.search);
let pending = params.get("send");
const named = params.has("session") || sessionStorage.getItem("ft-sid") !== null;
$("sid").value = params.get("session") || sessionStorage.getItem("ft-sid") ||
  "ui-" + Math.random().toString(36).slice(2, 8);
$("key").value = sessionStorage.getItem("ft-key") || "";
if (params.get("max_tokens")) $("maxtok").value = params.get("max_tokens");
if (params.get("temperature")) $("temp").value = params.get("temperature");
// The page's state for scripts and tests: connecting | ready | running | closed, plus how many
// turns finished while it watched.
let finished = 0;
function state(name) { document.body.dataset.state = name; }

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}
function add(node) { $("log").appendChild(node); $("log").scrollTop = 1e9; return node; }
function setRunning(on) {
  running = on; $("send").disabled = on || !ws; $("cancel").disabled = !on;
  if (ws) state(on ? "running" : "ready");
}
function table(id, rows) {
  const t = $(id); t.textContent = "";
  for (const [k, v] of rows) {
    const tr = el("tr"); tr.dataset.key = k;
    tr.appendChild(el("td", "", k)); tr.appendChild(el("td", "", v));
    t.appendChild(tr);
  }
}
const mb = (b) => b === undefined ? "-" : (b / 1e6).toFixed(2) + " MB";

function newTurn(userText) {
  if (userText) add(el("div", "msg user", userText));
  const box = add(el("div", "msg assistant"));
  const reasoning = box.appendChild(el("div", "reasoning"));
  const content = box.appendChild(el("span"));
  turn = { box, reasoning, content, calls: {} };
}
function ensureTurn() { if (!turn) newTurn(null); return turn; }

function showHistory(history) {
  $("log").textContent = "";
  for (const m of history) {
    if (m.role === "user") add(el("div", "msg user", m.content));
    else if (m.role === "tool") add(el("div", "msg tool", "tool result: " + m.content));
    else if (m.role === "assistant") {
      const box = add(el("div", "msg assistant"));
      if (m.reasoning_content) box.appendChild(el("div", "reasoning", m.reasoning_content));
      box.appendChild(el("span", "", m.content || ""));
      for (const c of m.tool_calls || [])
        box.appendChild(el("div", "call", c.function.name + "(" + c.function.arguments + ")"));
    } else add(el("div", "msg", m.role + ": " + m.content));
  }
}

function onEvent(e) {
  switch (e.type) {
    case "session":
      showHistory(e.history); setRunning(e.running);
      $("status").textContent = "session " + e.id + ", " + e.turns + " turn(s)";
      // The server's hello says whether the session is free: the time to send a ?send= text
      // (once; it leaves the URL too, so a reload does not send it again).
      if (pending && !e.running) {
        $("text").value = pending; pending = null;
        if (!named) send();
        params.delete("send"); history.replaceState(null, "", "?" + params.toString());
      }
      break;
    case "start": newTurn(e.user); setRunning(true); break;
    case "reasoning": ensureTurn().reasoning.textContent += e.text; break;
    case "content": ensureTurn().content.textContent += e.text; break;
    case "tool_call": {
      const t = ensureTurn();
      if (e.phase === "start") {
        const div = t.box.appendChild(el("div", "call", e.name + "("));
        const args = div.appendChild(el("span")); div.appendChild(document.createTextNode(")"));
        t.calls[e.index] = args;
      } else if (e.phase === "arguments" && t.calls[e.index]) {
        t.calls[e.index].textContent += e.text;
      } else if (e.phase === "end" && t.calls[e.index]) {
        t.calls[e.index].textContent = JSON.stringify(e.arguments);
      }
      break;
    }
    case "tool_result": add(el("div", "msg tool", "tool result (" + (e.name || e.tool_call_id) +
      "): " + e.content)); break;
    case "warning": ensureTurn().box.appendChild(el("div", "meta", "warning: " + e.message));
      break;
    case "usage":
      ensureTurn().box.appendChild(el("div", "meta",
        e.prompt_tokens + " prompt tokens (" + e.reused_tokens + " reused, " +
        e.prefilled_tokens + " prefilled), " + e.completion_tokens + " generated, " +
        e.finish_reason));
      table("usage", [["prompt", e.prompt_tokens], ["reused", e.reused_tokens],
        ["prefilled", e.prefilled_tokens], ["generated", e.completion_tokens],
        ["finish", e.finish_reason], ["exact", e.exact],
        ["shared prefix", e.first_divergence ?? "-"],
        ["anchor before the edit", e.anchor ? e.anchor.kind + " @ " + e.anchor.offset : "-"]]);
      break;
    case "memory":
      table("memory", [["KV pages", e.kv_pages], ["free", e.kv_pages_free],
        ["cached (radix)", e.kv_pages_cached], ["page size", e.page_size],
        ["context", e.max_model_len], ["KV", mb(e.kv_bytes)], ["dense weights",
        mb(e.dense_bytes)], ["experts", mb(e.expert_bytes)],
        ["placement", (e.experts || {}).placement], ["slots", (e.experts || {}).slots ?? "-"],
        ["miss rate", (e.experts || {}).miss_rate ?? "-"]]);
      break;
    case "error": add(el("div", "msg error", "error: " + e.message)); break;
    case "done":
      if (e.turn !== null && e.turn !== undefined) document.body.dataset.finished = ++finished;
      setRunning(false); turn = null; break;
  }
}

function connect() {
  if (ws) ws.close();
  const sid = $("sid").value.trim(), key = $("key").value;
  sessionStorage.setItem("ft-sid", sid); sessionStorage.setItem("ft-key", key);
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const url = scheme + "://" + location.host + "/v1/sessions/" + encodeURIComponent(sid) + "/ws";
  const protocols = key ? ["freetoken", "bearer." + key] : ["freetoken"];
  // A reconnect closes the old socket; its late events must not touch the new one's state.
  const sock = new WebSocket(url, protocols);
  ws = sock;
  $("status").textContent = "connecting..."; state("connecting");
  sock.onopen = () => {
    if (ws !== sock) return;
    $("status").textContent = "connected"; setRunning(false);
  };
  sock.onmessage = (m) => { if (ws === sock) onEvent(JSON.parse(m.data)); };
  sock.onclose = (c) => {
    if (ws !== sock) return;
    $("status").textContent = "closed" + (c.reason ? ": " + c.reason : " (" + c.code + ")");
    ws = null; setRunning(false); state("closed");
  };
}

function send() {
  const text = $("text").value;
  if (!ws || running || !text.trim()) return;
  ws.send(JSON.stringify({
    type: "send", append: true, messages: [{ role: "user", content: text }],
    sampling: { max_tokens: Number($("maxtok").value) || 256,
      temperature: Number($("temp").value) || 0 },
  }));
  $("text").value = ""; setRunning(true);
}

$("connect").onclick = connect;
$("send").onclick = send;
$("cancel").onclick = () => ws && ws.send(JSON.stringify({ type: "cancel" }));
$("text").addEventListener("keydown", (k) => {
  if (k.key === "Enter" && !k.shiftKey) { k.preventDefault(); send(); }
});
connect();
</script>
</body>
</html>
"""
