"""``trainfit serve``: the local web calculator (:mod:`trainfit.web.app`) on uvicorn. Opens nothing by itself.

Binds 127.0.0.1 unless ``--host`` says otherwise (then warns: the page has no authentication). Without the
``web`` extra it prints one line naming the install command and exits 2, like every user error.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

import typer

from trainfit.errors import ConfigError, DependencyError

DEFAULT_PORT = 8765


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_cmd(
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = DEFAULT_PORT,
    host: Annotated[str, typer.Option("--host", help="Address to bind (default: this machine only).")] = "127.0.0.1",
    open_browser: Annotated[bool, typer.Option("--open", help="Open the page in a browser once serving.")] = False,
    allow_hub: Annotated[
        bool, typer.Option("--allow-hub", help="Let the page name Hugging Face Hub ids (fetches their config.json).")
    ] = False,
) -> None:
    r"""Serve the memory calculator as a local web page (needs the web extra: pip install 'trainfit\[web]').

    Examples:

      trainfit serve

      trainfit serve --port 9000 --open
    """
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise DependencyError("trainfit serve needs the web extra: pip install 'trainfit[web]'") from None
    from trainfit.cli.common import warn
    from trainfit.web.app import create_app

    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    if not _is_loopback(host):
        warn(f"serving on {host}: anyone who can reach this address can use the page (it has no login)")
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    typer.echo(f"trainfit serve: {url}  (Ctrl+C stops)")
    config = uvicorn.Config(create_app(allow_hub=allow_hub), host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    if open_browser:
        import threading
        import time
        import webbrowser

        def open_when_up() -> None:
            for _ in range(100):
                if server.started:
                    webbrowser.open(url)
                    return
                time.sleep(0.1)

        threading.Thread(target=open_when_up, daemon=True).start()
    server.run()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)
