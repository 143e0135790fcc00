"""Running the app under uvicorn, with the binding rules `freetoken serve` enforces.

A server reachable from other machines must not be open to them: binding anything but a
loopback address needs an API key. A keyless local server additionally accepts only local Host
names (see browser_guard.py: DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from types import FrameType
from typing import Any

import uvicorn

from freetoken_agent.integrations.server.app import create_app
from freetoken_agent.integrations.server.browser_guard import LOCAL_HOSTS
from freetoken_agent.integrations.server.limits import DEFAULT_MAX_BODY


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse a non-loopback bind without a key (ValueError with what to do)."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"refusing to serve on {host!r} without an API key: anyone who can reach that "
            "address could use the model. Pass --api-key KEY (or set FREETOKEN_API_KEY), or "
            "bind 127.0.0.1"
        )


def check_port(host: str, port: int) -> None:
    """Refuse a port another program listens on (ValueError naming it), by binding it once as
    uvicorn will (SO_REUSEADDR): uvicorn finds out only after the model has loaded, which for
    a real checkpoint is minutes."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot serve on {host!r}: {e}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(
                f"cannot serve on {host}:{port}: {e.strerror or e} (is another server running "
                "there? pick another port with --port)"
            ) from None


class ClosingServer(uvicorn.Server):
    """uvicorn's Server whose first exit signal (Ctrl-C, SIGTERM) also ends the running turns,
    by releasing the engine service the app holds (its last holder closes it): each stream
    ends at once, in-band, as an aborted reply, and the connections close. uvicorn alone
    waited out its graceful timeout (5 s) while they went on generating, then cancelled each
    stream's task: a traceback a stream in the log and a cut body (a connection error) for
    every client. A second Ctrl-C still forces the exit. A service the app does not hold (the
    caller's) is left to its owner."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        state = getattr(getattr(self.config.app, "state", None), "server", None)
        if first and state is not None and state.owns_service:
            state.owns_service = False  # released here: not again at the app's shutdown
            # In a thread: the signal handler returns at once (closing joins the engine's).
            threading.Thread(
                target=state.service.release, name="freetoken-close", daemon=True
            ).start()


def make_server(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    *,
    log_level: str = "info",
    max_body_bytes: int = DEFAULT_MAX_BODY,
    **app_options: Any,
) -> uvicorn.Server:
    """A uvicorn Server for the app (call `.run()`; set `.should_exit` to stop it)."""
    check_bind(host, api_key)
    if api_key is None and "allowed_hosts" not in app_options:
        app_options["allowed_hosts"] = (*LOCAL_HOSTS, host.strip("[]"))
    app = create_app(engine, api_key=api_key, max_body_bytes=max_body_bytes, **app_options)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ws_max_size=max_body_bytes,
        timeout_graceful_shutdown=5,
    )
    return ClosingServer(config)


def serve(engine: Any, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
    """Serve until interrupted."""
    make_server(engine, host, port, **options).run()
