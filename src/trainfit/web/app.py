"""The local web calculator: a small JSON API over the library, and one static page that draws it.

Every answer is the CLI's ``--json`` object for the same inputs (``report_json``, ``infer_json``, the catalog
commands' JSON): one schema, one version, and no arithmetic in the browser. Endpoints:

=====================  =========================================================================
``GET /api/models``    the catalog (``trainfit models --json``); ``?q=llama 8b`` filters it
``GET /api/gpus``      ``trainfit gpus --json``
``GET /api/formats``   ``trainfit formats --json``
``GET /api/precision`` ``trainfit precision --gpu ID --json`` (``?gpu=ID``)
``/api/estimate``      ``trainfit estimate ... --json`` (GET: query string; POST: a JSON object)
``/api/infer``         ``trainfit infer ... --json``
``POST /api/config``   checks a pasted config.json: its row as ``/api/models`` lists it, or the error
``/api/plan``          ``trainfit plan --json`` (ranked plans; ``alloc_conf`` as ``--alloc-conf``; the run fields
                       ``precision``, ``batch``, ``finetune``… as its baseline flags)
``POST /api/plan/export`` the files ``trainfit plan --export DIR`` writes, for plan ``rank`` (1 = the top plan)
``/api/jobs``          trace runs: POST starts one, GET ``/api/jobs/ID`` polls, DELETE cancels
=====================  =========================================================================

Options are the CLI's flags with underscores (``grad_accum``), read from the commands' signatures
(:mod:`trainfit.web.options`). A user error is a 400 whose body is ``{"error": "<the CLI's one line>"}``;
request bodies over :data:`MAX_BODY_BYTES` get a 413 before they are read. Analytic and rule-of-thumb answers
are computed in a worker thread and memoised per distinct request (the library is deterministic), so a page
that toggles back to a view it has seen gets it at once; trace and measure runs go through
:mod:`trainfit.web.jobs`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from trainfit.errors import ConfigError, TrainfitError
from trainfit.report.json import model_row
from trainfit.web.jobs import JobBusyError, Jobs
from trainfit.web.options import MAX_CONFIG_BYTES, estimate_inputs, infer_inputs, plan_inputs, resolve_model
from trainfit.web.payloads import formats_payload, gpus_payload, models_payload, precision_payload

#: The largest request body the server reads: a pasted config.json plus the options.
MAX_BODY_BYTES = MAX_CONFIG_BYTES + 64 * 1024

#: Methods that run for seconds: they run as jobs (the others are answered in the request).
SLOW_METHODS = ("trace", "measure")

#: Distinct requests whose answers are memoised.
CACHE_SIZE = 512

STATIC_DIR = Path(str(resources.files("trainfit.web") / "static"))


class RequestError(Exception):
    """A request the API refuses before the library sees it (size, JSON, method)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def one_line(message: str) -> str:
    """The CLI's one-line form of an error message (``trainfit.cli.app.fail``)."""
    return " ".join(message.split())


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": one_line(message)}, status_code=status)


def plotly_js() -> Path | None:
    """The plotly.js bundle that the ``plotly`` wheel ships (``plotly/package_data/plotly.min.js``)."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


async def read_body(request: Request) -> dict[str, Any]:
    """A POST's JSON object, read up to :data:`MAX_BODY_BYTES`; a GET's query string."""
    if request.method == "GET":
        return dict(request.query_params)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(
            413, f"request body is {int(declared) // 1024} KiB, over the {MAX_BODY_BYTES // 1024} KiB limit"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(413, f"request body is over the {MAX_BODY_BYTES // 1024} KiB limit")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise RequestError(400, "request body is not a JSON object") from None
    if not isinstance(data, dict):
        raise RequestError(400, "request body is not a JSON object")
    return data


def _method(raw: dict[str, Any]) -> str:
    return str(raw.get("method") or "analytic")


def _estimate_json(raw: dict[str, Any], allow_hub: bool, progress: Any = None) -> dict[str, Any]:
    from trainfit.estimate import estimate
    from trainfit.report.json import report_json
    from trainfit.result import Method

    spec, kwargs = estimate_inputs(raw, allow_hub=allow_hub)
    options: dict[str, object] | None = None
    if kwargs["method"] in (Method.TRACE, Method.MEASURE):
        options = {"modules": False} if kwargs["method"] is Method.TRACE else {}
        if progress is not None:
            options["progress"] = progress
    return report_json(estimate(spec, method_options=options, **kwargs))


def _infer_json(raw: dict[str, Any], allow_hub: bool, progress: Any = None) -> dict[str, Any]:
    from trainfit.infer import infer
    from trainfit.report.infer import infer_json

    spec, kwargs = infer_inputs(raw, allow_hub=allow_hub)
    return infer_json(infer(spec, progress=progress, **kwargs))


def _plan_json(raw: dict[str, Any], allow_hub: bool, progress: Any = None) -> dict[str, Any]:
    from trainfit.planner.api import plan
    from trainfit.report.plan import plan_json

    spec, kwargs = plan_inputs(raw, allow_hub=allow_hub)
    return plan_json(plan(spec, **kwargs)) | {"exported": []}  # as `trainfit plan --json` without --export


def _plan_export_json(raw: dict[str, Any], allow_hub: bool, progress: Any = None) -> dict[str, Any]:
    """The files ``trainfit plan --export DIR`` writes (name → text), for the plan ranked ``rank`` (1-based)."""
    from trainfit.export import export_files, export_plan
    from trainfit.planner.api import plan
    from trainfit.report.plan import export_check

    options = dict(raw)
    rank = options.pop("rank", 1)
    if isinstance(rank, bool) or not isinstance(rank, int | str) or not str(rank).strip().isdigit():
        raise ConfigError(f"rank must be a whole number ≥ 1 (1 = the top plan), not '{str(rank)[:40]}'")
    rank = int(str(rank).strip())
    spec, kwargs = plan_inputs(options, allow_hub=allow_hub)
    result = plan(spec, **kwargs)
    if not result.plans:
        raise ConfigError("nothing fits within the usable memory: no plan to export (see /api/plan's needs)")
    if not 1 <= rank <= len(result.plans):
        raise ConfigError(
            f"rank {rank} is out of range: there are {len(result.plans)} plan(s), ranked 1 to {len(result.plans)}"
        )
    return {
        "schema_version": 1,
        "rank": rank,
        # launch.sh exports the allocator the plan's estimate simulated, as `trainfit plan --export` writes it
        "files": export_files(
            export_plan(
                spec,
                result.plans[rank - 1].strategy,
                alloc_conf=result.plans[rank - 1].alloc_conf,
                **export_check(result, kwargs["gpu"], kwargs["headroom"]),
            )
        ),
    }


COMPUTE = {"estimate": _estimate_json, "infer": _infer_json}
QUICK = {**COMPUTE, "plan": _plan_json, "plan_export": _plan_export_json}


@lru_cache(maxsize=CACHE_SIZE)
def _quick(kind: str, key: str, allow_hub: bool) -> str:
    """The JSON text of a quick answer, memoised by the request's canonical JSON."""
    return json.dumps(QUICK[kind](json.loads(key), allow_hub))


def create_app(*, allow_hub: bool = False) -> Starlette:
    """The ASGI app. ``allow_hub``: let requests name Hugging Face Hub ids (a network fetch per new id)."""
    jobs = Jobs()

    def quick(kind: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            raw = await read_body(request)
            method = _method(raw)
            if method in SLOW_METHODS:
                return error(
                    400, f"--method {method} runs for seconds: start it as a job (POST /api/jobs with kind '{kind}')"
                )
            key = json.dumps(raw, sort_keys=True)
            text = await run_in_threadpool(_quick, kind, key, allow_hub)
            return Response(text, media_type="application/json")

        return endpoint

    async def models(request: Request) -> Response:
        return JSONResponse(models_payload(request.query_params.get("q", "")))

    async def gpus(request: Request) -> Response:
        return JSONResponse(gpus_payload())

    async def formats(request: Request) -> Response:
        return JSONResponse(formats_payload())

    async def precision(request: Request) -> Response:
        gpu = request.query_params.get("gpu", "")
        if not gpu:
            return error(400, "give ?gpu=ID (see /api/gpus): the server does not inspect its own devices")
        return JSONResponse(precision_payload(gpu))

    async def config(request: Request) -> Response:
        raw = await read_body(request)
        if request.method != "POST" or raw.get("config") in (None, ""):
            return error(400, 'POST a JSON object {"config": "<text of a config.json>"}')
        spec = resolve_model({"config": raw["config"], "config_name": raw.get("config_name")}, allow_hub=False)
        assert spec is not None  # required=True: a missing model is a 400 before this
        return JSONResponse({"schema_version": 1, "model": model_row(spec)})

    async def start_job(request: Request) -> Response:
        raw = await read_body(request)
        kind = str(raw.pop("kind", "estimate"))
        if kind not in COMPUTE:
            return error(400, f"unknown job kind '{kind[:40]}'; choose estimate or infer")
        raw.setdefault("method", "trace")
        compute = COMPUTE[kind]
        # Check the inputs now, so a typo is a 400 here rather than a failed job.
        (estimate_inputs if kind == "estimate" else infer_inputs)(raw, allow_hub=allow_hub)
        try:
            job = jobs.start(kind, lambda progress: compute(raw, allow_hub, progress))
        except JobBusyError as exc:
            return error(409, str(exc))
        return JSONResponse(job.to_json(), status_code=202)

    async def job(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        found = jobs.cancel(job_id) if request.method == "DELETE" else jobs.get(job_id)
        if found is None:
            return error(404, f"no job '{job_id[:40]}'")
        return JSONResponse(found.to_json())

    async def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html")

    async def plotly(request: Request) -> Response:
        path = plotly_js()
        if path is None:
            return Response(
                "document.title='plotly missing: pip install \"trainfit[web]\"';",
                media_type="text/javascript",
                status_code=404,
            )
        return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    async def favicon(request: Request) -> Response:
        return Response(status_code=204)

    async def on_trainfit_error(request: Request, exc: Exception) -> Response:
        return error(400, str(exc))

    async def on_request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return error(exc.status, str(exc))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error(exc.status_code, str(exc.detail))

    both = ["GET", "POST"]
    routes = [
        Route("/", index),
        Route("/favicon.ico", favicon),
        Route("/static/plotly.min.js", plotly),
        Route("/api/models", models),
        Route("/api/gpus", gpus),
        Route("/api/formats", formats),
        Route("/api/precision", precision),
        Route("/api/estimate", quick("estimate"), methods=both),
        Route("/api/infer", quick("infer"), methods=both),
        Route("/api/config", config, methods=both),
        Route("/api/plan", quick("plan"), methods=both),
        Route("/api/plan/export", quick("plan_export"), methods=["POST"]),
        Route("/api/jobs", start_job, methods=["POST"]),
        Route("/api/jobs/{job_id}", job, methods=["GET", "DELETE"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            TrainfitError: on_trainfit_error,
            RequestError: on_request_error,
            HTTPException: on_http_error,
        },
    )
    app.state.jobs = jobs
    app.state.allow_hub = allow_hub
    return app
