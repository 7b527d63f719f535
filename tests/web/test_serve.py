"""``trainfit serve``: needs the web extra (one line and exit 2 without it), binds loopback by default, warns
otherwise, prints its URL and opens a browser only when asked. The server itself is replaced by a stand-in."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from trainfit.cli.app import main

uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record the uvicorn config instead of serving; mark the server as started."""
    calls: list[Any] = []

    def run(self: Any) -> None:
        self.started = True
        calls.append(self.config)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return calls


def test_without_the_web_extra_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "starlette", None)  # import starlette -> ImportError
    with pytest.raises(SystemExit) as exc:
        main(["serve"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: trainfit serve needs the web extra: pip install 'trainfit[web]'"


def test_default_binds_loopback_and_opens_nothing(
    ran: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opened: list[str] = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    main(["serve"])
    out = capsys.readouterr()
    assert "http://127.0.0.1:8765" in out.out and "warning" not in out.err
    assert ran[0].host == "127.0.0.1" and ran[0].port == 8765
    assert opened == []


def test_other_hosts_warn_and_open_opens(
    ran: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opened: list[str] = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    main(["serve", "--host", "0.0.0.0", "--port", "9000", "--open", "--allow-hub"])
    out = capsys.readouterr()
    assert "http://0.0.0.0:9000" in out.out
    assert "warning" in out.err and "0.0.0.0" in out.err
    assert ran[0].app.state.allow_hub is True
    for _ in range(50):  # the browser opens from a thread once the server has started
        if opened:
            break
        import time

        time.sleep(0.02)
    assert opened == ["http://0.0.0.0:9000"]


def test_a_bad_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", "70000"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --port must be in 1..65535, got 70000"
