"""The Starlette server: OpenAI-compatible routes, Anthropic's Messages API, the WebSocket
session stream, a web page.

    from freetoken_agent.integrations.server import create_app, serve
    app = create_app(engine, api_key=None)        # any ASGI server runs it
    serve(engine, host="127.0.0.1", port=8000)    # or `freetoken serve`

Module map: app (create_app, /health), openai_routes (/v1/chat/completions, /v1/completions,
/v1/models), anthropic_routes (/v1/messages, /v1/messages/count_tokens; anthropic_request and
anthropic_messages translate a body into a chat body, anthropic_format and anthropic_errors
write the replies), run_responses (a run served as a streamed or whole response, for both
APIs), sessions_ws (/v1/sessions/{id}/ws), ui + ui_page (the page at /), hub (live
Sessions by id and their watchers), turn_run (one turn in a worker thread, read on the event
loop), text_run (one text completion: a raw prompt straight to the engine), bridge (the
Session's engine: a cancellable request per turn), chat_request / text_request (body -> checked
request), foreign_fields (other APIs' fields: legacy functions, vLLM's extensions), tool_choice
(tools, forced calls, a call or the answer; parallel_tool_calls false stops a run at its first
call through integrations/one_call.py, shared with ChatFreeToken), reply / completion_format /
session_events (wire shapes), auth, browser_guard, limits (the safety middleware), errors, serve
(uvicorn, binding rules).
"""

from freetoken_agent.integrations.server.app import create_app
from freetoken_agent.integrations.server.serve import check_bind, make_server, serve

__all__ = ["check_bind", "create_app", "make_server", "serve"]
