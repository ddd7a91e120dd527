"""A real uvicorn server in a thread for the server tests (tests/test_serve.py, tests/test_serve_agent.py)."""

from __future__ import annotations

import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_app(app, on_stop=None):
    """uvicorn over the ASGI `app` on a free port in a thread -> (base url, stop()); stop() also calls on_stop()."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started, "the server did not start"

    def stop():
        srv.should_exit = True
        thread.join(10)
        if on_stop is not None:
            on_stop()
    return f"http://127.0.0.1:{port}", stop
