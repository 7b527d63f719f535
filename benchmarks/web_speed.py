"""How fast the web API answers: each endpoint over real HTTP (uvicorn on a free local port), against the
library call alone for the same inputs, so the web layer's own cost shows.

Cold requests vary the micro-batch and forget the allocator simulations run before (the analytic method
memoises them on their inputs), so none is memoised; warm ones repeat a request (the API memoises analytic
answers per distinct request). The target (issue 13) is under 100 ms for analytic answers.
Usage: python benchmarks/web_speed.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import uvicorn

from trainfit.web.app import create_app
from trainfit.web.options import estimate_inputs, infer_inputs


def _serve() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}"


def _post(url: str, body: dict[str, Any] | None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as res:
        return json.load(res)


def _ms(fn: Callable[[int], object], repeat: int) -> tuple[float, float]:
    times = []
    for i in range(repeat):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    n = parser.parse_args().repeat
    base = _serve()
    _post(base + "/api/estimate", {"model": "gpt2"})  # imports, catalog parse

    from trainfit.analytic.events import forget_simulations
    from trainfit.estimate import estimate
    from trainfit.infer import infer

    def lib_estimate(body: dict[str, Any]) -> Callable[[int], object]:
        def run(i: int) -> object:
            forget_simulations()  # cold: nothing simulated before
            spec, kw = estimate_inputs({**body, "batch": i + 1}, allow_hub=False)
            return estimate(spec, **kw)

        return run

    def lib_infer(body: dict[str, Any]) -> Callable[[int], object]:
        def run(i: int) -> object:
            spec, kw = infer_inputs({**body, "batch": i + 1}, allow_hub=False)
            return infer(spec, **kw)

        return run

    def web(path: str, body: dict[str, Any] | None, vary: bool = True) -> Callable[[int], object]:
        def run(i: int) -> object:
            if vary:  # cold: the library's simulations of the same inputs (the same process) are forgotten
                forget_simulations()
            return _post(base + path, None if body is None else ({**body, "batch": i + 1} if vary else body))

        return run

    cases: list[tuple[str, Callable[[int], object] | None, Callable[[int], object]]] = [
        ("GET /api/models", None, lambda i: _post(base + "/api/models?q=llama", None)),
        ("GET /api/gpus", None, lambda i: _post(base + "/api/gpus", None)),
        ("GET /api/formats", None, lambda i: _post(base + "/api/formats", None)),
    ]
    for label, body in (
        ("llama-3.1-8b, no GPU", {"model": "llama-3.1-8b"}),
        ("llama-3.1-8b --gpu h100 (fit + batch search)", {"model": "llama-3.1-8b", "gpu": "h100-sxm-80gb", "seq": 512}),
        (
            "llama-3.1-70b --gpus 16 fsdp --gpu h100",
            {"model": "llama-3.1-70b", "gpus": 16, "sharding": "fsdp", "gpu": "h100-sxm-80gb"},
        ),
        (
            "llama-3.1-8b --gpu h100 --no-fixes (the page's verdict)",
            {"model": "llama-3.1-8b", "gpu": "h100-sxm-80gb", "seq": 512, "fixes": False},
        ),
        (
            "llama-3.2-1b --gpu h100 (fits: verdict + batch search)",
            {"model": "llama-3.2-1b", "gpu": "h100-sxm-80gb", "seq": 1024},
        ),
        (
            "llama-3.1-70b --gpus 16 fsdp --gpu h100 --no-fixes",
            {"model": "llama-3.1-70b", "gpus": 16, "sharding": "fsdp", "gpu": "h100-sxm-80gb", "fixes": False},
        ),
        ("rule of thumb, gpt2 --gpu t4", {"model": "gpt2", "method": "rule-of-thumb", "gpu": "t4"}),
    ):
        cases.append((f"estimate {label}", lib_estimate(body), web("/api/estimate", body)))
    cases.append(
        (
            "estimate, repeated request (memoised)",
            None,
            web("/api/estimate", {"model": "llama-3.1-8b", "gpu": "h100-sxm-80gb"}, vary=False),
        )
    )
    body = {"model": "llama-3.1-8b", "gpu": "l4", "prompt": 1024}
    cases.append(("infer llama-3.1-8b --gpu l4", lib_infer(body), web("/api/infer", body)))

    print(f"{'request':62} {'library ms':>16} {'HTTP ms':>16}   (median / max of {n})")
    for label, lib, http in cases:
        lib_t = "-" if lib is None else "{:7.1f} / {:6.1f}".format(*_ms(lib, n))
        med, worst = _ms(http, n)
        print(f"{label:62} {lib_t:>16} {med:7.1f} / {worst:6.1f}")


if __name__ == "__main__":
    main()
