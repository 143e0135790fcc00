"""Elastic memory over HTTP: GET /v1/memory, POST /v1/memory/budget.

`GET /v1/memory` returns the engine's memory figures (split, checkpoints, elastic budget) and
the latest changes of the split (`?last=N`, default 100). `POST /v1/memory/budget` with
`{"bytes": N}` or `{"gb": X}` sets the GPU budget while serving; the engine applies it at its
next safe point (at once when idle), preempting rather than failing requests if it must. It
answers `{"budget": the budget taken, "requested": the bytes asked for, "elastic": ...}`: a
budget above the ceiling the arena reserved (EngineConfig.gpu_ceiling) is taken as that
ceiling. A budget the engine cannot take (not elastic, below its fixed bytes) is a 400 that
says why.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from freetoken_agent.engine.outputs import InvalidRequestError, shown_number
from freetoken_agent.integrations.server.errors import (
    BadParam,
    invalid_response,
    parse_json_body,
    unexpected_error_response,
)

MAX_TRACE = 4096


async def get_memory(request: Request) -> JSONResponse:
    state = request.app.state.server
    try:
        last = int(request.query_params.get("last", 100))
    except ValueError:
        return invalid_response(BadParam("last: an integer number of records", "last"))
    last = max(1, min(last, MAX_TRACE))
    stats = await asyncio.to_thread(state.service.stats)
    trace = await asyncio.to_thread(state.service.memory_trace, last)
    return JSONResponse(
        {
            "memory": stats.get("memory"),
            "elastic": stats.get("elastic"),
            "checkpoints": stats.get("checkpoints"),
            "trace": trace,
        }
    )


async def set_budget(request: Request) -> JSONResponse:
    state = request.app.state.server
    try:
        body = parse_json_body(await request.body())
        nbytes = _budget_bytes(body)
        elastic = await asyncio.to_thread(state.service.set_gpu_budget, nbytes)
    except InvalidRequestError as e:
        return invalid_response(e)
    except Exception as e:  # noqa: BLE001 - still an OpenAI error object, the connection kept
        return unexpected_error_response(e, "set the GPU budget")
    # (An engine that is not elastic refused above: its figures are always there.)
    return JSONResponse({"budget": elastic["budget"], "requested": nbytes, "elastic": elastic})


def _budget_bytes(body) -> int:
    if not isinstance(body, dict) or len(set(body) & {"bytes", "gb"}) != 1 or len(body) != 1:
        raise BadParam('send exactly one of {"bytes": <int>} or {"gb": <number>}')
    key, value = next(iter(body.items()))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BadParam(f"{key}: the budget must be a positive number", key)
    if value > 1 << 50:
        raise BadParam(f"{key}: {shown_number(value)} is not a plausible GPU budget", key)
    return int(value if key == "bytes" else value * 1e9)


routes = [
    Route("/v1/memory", get_memory, methods=["GET"]),
    Route("/v1/memory/budget", set_budget, methods=["POST"]),
]
