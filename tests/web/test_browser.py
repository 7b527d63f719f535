"""The page in a real Chromium (Debian's ``chromium`` package, driven by Playwright through ``executable_path``).

One server and one browser for the module (one per worker under pytest-xdist: each test sets up its own view).
Every expected value comes from the JSON API on the same server: the page must show what the API says (the API
equals the CLI: tests/web/test_api.py). Skips, saying why, where Playwright or a chromium binary is missing
(``.ci/run`` installs chromium with apt-get).

The main view's screenshot is kept under pytest's tmp dir; with ``TRAINFIT_README_SCREENSHOT=1`` it is also
written to ``docs/web.png`` (the README's picture).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")

from trainfit.arch.catalog import catalog_config  # noqa: E402
from trainfit.web.app import create_app  # noqa: E402

ROOT = Path(__file__).parents[2]
GIB = 2**30


def _chromium() -> str | None:
    for name in (os.environ.get("TRAINFIT_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    return None


CHROMIUM = _chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (apt-get install chromium, or set TRAINFIT_CHROMIUM)"
)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


@pytest.fixture(scope="module")
def page(base_url: str) -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="light")
        pg = context.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.errors = errors
        yield pg
        browser.close()
    assert not errors, errors


def api(base_url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as res:
            return json.load(res)
    except urllib.error.HTTPError as exc:
        return json.load(exc)


def settle(page: Any, before: int) -> None:
    """Wait until the page has finished an update started after ``before`` updates."""
    page.wait_for_function(
        "n => window.trainfit && window.trainfit.ready && !window.trainfit.busy && window.trainfit.updates > n",
        arg=before,
        timeout=20_000,
    )


def updates(page: Any) -> int:
    return int(page.evaluate("window.trainfit ? window.trainfit.updates : 0"))


def goto(page: Any, url: str) -> None:
    page.goto(url)
    settle(page, 0)


def chart(page: Any) -> dict[str, Any]:
    return dict(
        page.evaluate(
            """() => { const gd = document.getElementById('chart');
            return { traces: (gd.data || []).map(t => ({meta: t.meta, x: t.x, ids: t.ids || null, y: t.y,
                                                       customdata: t.customdata})),
                     lines: ((gd.layout || {}).shapes || []).map(s => ({name: s.name, y: s.y0})),
                     notes: ((gd.layout || {}).annotations || []).map(a => a.text) }; }"""
        )
    )


#: app.js ``MAX_RANK_ENTRIES``: more rank entries than this and the chart draws three
MAX_RANK_ENTRIES = 6


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def assert_chart_is(page: Any, want: dict[str, Any], kind: str = "estimate") -> None:
    """The stacked bars hold exactly each phase's non-zero components, in bytes (customdata) and GiB (height), and
    the bytes that must fit (per rank when ranks differ)."""
    drawn = chart(page)["traces"]
    bars: list[tuple[str, int]] = []
    musts: list[int] = []
    for t in drawn:
        for y, b in zip(t["y"], t["customdata"], strict=True):
            assert y * GIB == pytest.approx(b, rel=1e-12)
            if t["meta"] == "required":
                musts.append(b)
            elif b:
                bars.append((t["meta"], b))
    ranks = want.get("ranks") or []
    if len(ranks) > MAX_RANK_ENTRIES:  # app.js shownRanks: rank 0's, the worst and the lightest (first of equals)
        worst = max(ranks, key=lambda r: r["peak_bytes"])
        light = min(ranks, key=lambda r: r["peak_bytes"])
        ranks = [r for r in ranks if r is worst or r is light or 0 in r["ranks"]]
    if len(ranks) > 1:
        groups = [r["phases"] for r in ranks]
        required = [r["required_bytes"] for r in ranks if "required_bytes" in r]
    else:
        groups = [want["phases"]]
        fit = want.get("fit") if kind == "infer" else want
        required = [fit["required_bytes"]] if fit and "required_bytes" in fit else []
    expected = [(c, b) for phases in groups for p in phases.values() for c, b in p["components"].items() if b]
    assert sorted(bars) == sorted(expected)
    assert musts == required
    if len(groups) == 1:  # one bar per phase: each bar is its phase's (ids: the phase; x: its label)
        for t in drawn:
            if t["meta"] == "required":
                continue
            for phase, b in zip(t["ids"], t["customdata"], strict=True):
                assert want["phases"][phase]["components"][t["meta"]] == b


def test_choose_a_model_and_a_gpu(page: Any, base_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    goto(page, base_url + "/")
    assert "Pick a model" in page.inner_text("#status")
    n = updates(page)
    page.fill("#model-search", "qwen2.5-7b")
    page.select_option("#gpu", "a100-sxm-80gb")
    settle(page, n)
    want = api(base_url, "/api/estimate", {"model": "qwen2.5-7b", "gpu": "a100-sxm-80gb"})
    verdict = page.inner_text("#verdict")
    assert verdict.startswith("Fits on a100-sxm-80gb" if want["fits"] else "Does not fit on a100-sxm-80gb")
    assert gib(want["required_bytes"]) in verdict and gib(want["usable_bytes"]) in verdict
    assert_chart_is(page, want)
    capacity = next(g for g in api(base_url, "/api/gpus")["gpus"] if g["id"] == "a100-sxm-80gb")["memory_bytes"]
    lines = {line["name"]: line["y"] * GIB for line in chart(page)["lines"]}
    assert lines["a100-sxm-80gb capacity"] == pytest.approx(capacity, rel=1e-12)
    assert lines["after headroom"] == pytest.approx(want["usable_bytes"], rel=1e-12)
    rule = api(base_url, "/api/estimate", {"model": "qwen2.5-7b", "gpu": "a100-sxm-80gb", "method": "rule-of-thumb"})
    assert gib(rule["nvidia_smi_estimate_bytes"]) in page.inner_text("#compare")
    for s in want["suggestions"] + want["fixes"]:
        assert " ".join(s["flags"]) in page.inner_text("#suggestions")
    rows = page.locator("#comparison tbody tr")
    assert rows.count() == len(want["comparison"]) > 0
    for i, d in enumerate(want["comparison"]):
        cells = rows.nth(i).locator("td").all_inner_texts()
        assert cells[:3] == [d["term"], gib(d["rule_of_thumb_bytes"]), gib(d["analytic_bytes"])]
    shot = tmp_path_factory.mktemp("web") / "main-view.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def test_the_readme_command_as_a_link(page: Any, base_url: str) -> None:
    """The README's first command, as a link: the page says what the API (and so the CLI) says."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("python3 -m venv") and "trainfit estimate" in x)
    args = line.split("trainfit estimate ", 1)[1].split()
    query: dict[str, Any] = {"model": args[0]}
    for flag, value in zip(args[1::2], args[2::2], strict=True):
        query[flag.removeprefix("--").replace("-", "_")] = value
    goto(page, base_url + "/?" + urllib.parse.urlencode(query))
    want = api(base_url, "/api/estimate", query)
    verdict = page.inner_text("#verdict")
    assert verdict.startswith("Fits on" if want["fits"] else "Does not fit on")
    assert f"needs {gib(want['required_bytes'])} of {gib(want['usable_bytes'])} usable" in verdict
    assert_chart_is(page, want)
    if os.environ.get("TRAINFIT_README_SCREENSHOT") == "1":
        page.screenshot(path=str(ROOT / "docs" / "web.png"))


def test_a_knob_updates_the_chart_and_the_url(page: Any, base_url: str) -> None:
    goto(page, base_url + "/?model=qwen2.5-7b&gpu=a100-sxm-80gb")
    before = chart(page)
    n = updates(page)
    page.select_option("select[name=checkpointing]", "full")
    page.fill("input[name=batch]", "4")
    settle(page, n)
    want = api(
        base_url, "/api/estimate", {"model": "qwen2.5-7b", "gpu": "a100-sxm-80gb", "checkpointing": "full", "batch": 4}
    )
    assert_chart_is(page, want)
    assert chart(page) != before
    assert "checkpointing=full" in page.url and "batch=4" in page.url
    # A bad value: the API's one line, next to the field.
    n = updates(page)
    page.fill("input[name=batch]", "0")
    settle(page, n)
    bad = api(
        base_url, "/api/estimate", {"model": "qwen2.5-7b", "gpu": "a100-sxm-80gb", "checkpointing": "full", "batch": 0}
    )
    assert page.inner_text('.err[data-for="batch"]') == bad["error"]
    assert page.inner_text("#verdict") == "" and chart(page)["traces"] == [], "no stale answer beside an error"
    n = updates(page)
    page.fill("input[name=batch]", "4")
    settle(page, n)
    assert page.inner_text('.err[data-for="batch"]') == ""


def test_a_link_reproduces_the_view(page: Any, base_url: str) -> None:
    goto(page, base_url + "/?model=qwen2.5-7b&gpu=a100-sxm-80gb")
    n = updates(page)
    page.select_option("select[name=optimizer]", "adamw-8bit")
    page.check("input[name=workload][value=finetune]")
    settle(page, n)
    url, verdict, drawn = page.url, page.inner_text("#verdict"), chart(page)
    assert "optimizer=adamw-8bit" in url and "workload=finetune" in url
    other = page.context.new_page()
    try:
        goto(other, url)
        assert other.inner_text("#verdict") == verdict
        assert chart(other) == drawn
    finally:
        other.close()


def test_a_pasted_config(page: Any, base_url: str) -> None:
    goto(page, base_url + "/?gpu=t4")
    page.click("#config-box summary")
    broken = '{"model_type": "llama", "hidden_size": 896,'
    n = updates(page)
    page.fill("#config", broken)
    page.click("#config-use")
    settle(page, n)
    want = api(base_url, "/api/estimate", {"config": broken, "gpu": "t4"})["error"]
    assert page.inner_text('.err[data-for="config"]') == want
    assert page.inner_text("#verdict") == ""
    good = json.dumps(catalog_config("qwen2.5-0.5b"))
    n = updates(page)
    page.fill("#config", good)
    page.click("#config-use")
    settle(page, n)
    want = api(base_url, "/api/estimate", {"config": good, "gpu": "t4"})
    assert page.inner_text('.err[data-for="config"]') == ""
    assert_chart_is(page, want)
    assert "#config=" in page.url


def test_inference_and_the_formats_tab(page: Any, base_url: str) -> None:
    goto(page, base_url + "/?model=llama-3.1-8b&gpu=l4")
    n = updates(page)
    page.check("input[name=workload][value=inference]")
    settle(page, n)
    want = api(base_url, "/api/infer", {"model": "llama-3.1-8b", "gpu": "l4"})
    verdict = page.inner_text("#verdict")
    assert verdict.startswith("Fits on l4" if want["fit"]["fits"] else "Does not fit on l4")
    assert gib(want["fit"]["required_bytes"]) in verdict
    assert f"largest batch {want['capacity']['max_batch']}" in verdict
    assert_chart_is(page, want, "infer")
    page.click("#tab-formats")
    page.wait_for_selector("#formats-table tbody tr")
    formats = api(base_url, "/api/formats")
    assert page.locator("#formats-table tbody tr").count() == len(formats["formats"]) + len(formats["integer_formats"])
    advice = api(base_url, "/api/precision?gpu=l4")["recommendation"]
    page.wait_for_selector("#advice b")
    assert page.inner_text("#advice b") == advice["precision"]
    assert "tab=formats" in page.url


def test_zero_ranks_beyond_six_show_rank_0_the_worst_and_the_lightest(page: Any, base_url: str) -> None:
    """DeepSpeed ZeRO-2 over 64 ranks: an entry per partition layout in the JSON, three drawn, and the chart says so."""
    query = {"model": "llama-3.1-8b", "gpu": "h100-sxm-80gb", "gpus": "64", "sharding": "zero2"}
    goto(page, base_url + "/?" + urllib.parse.urlencode(query))
    want = api(base_url, "/api/estimate", query)
    assert len(want["ranks"]) > MAX_RANK_ENTRIES
    assert_chart_is(page, want)
    notes = chart(page)["notes"]
    assert f"rank 0, the worst and the lightest of {len(want['ranks'])} rank groups (all in the JSON)" in notes


def test_pipeline_ranks(page: Any, base_url: str) -> None:
    query = {"model": "llama-3.1-70b", "gpu": "h100-sxm-80gb", "gpus": "16", "tp": "4", "pp": "4", "microbatches": "8"}
    goto(page, base_url + "/?" + urllib.parse.urlencode(query))
    want = api(base_url, "/api/estimate", query)
    assert len(want["ranks"]) > 1
    assert_chart_is(page, want)
    # each stage's bars name the micro-batches it holds in flight, and the page says where the NCCL figure comes from
    labels = {x for t in chart(page)["traces"] for x in t["x"]}
    for r in want["ranks"]:
        n = r["pipeline"]["in_flight_microbatches"]
        shown = str(int(n)) if n == int(n) else str(n)  # as JavaScript prints a number
        assert any(f"· {shown} in flight" in x for x in labels), (r["ranks"], labels)
    outside = page.locator("#outside").inner_text()
    assert want["overhead"]["nccl_basis"] in outside and "Outside PyTorch's allocator" in outside


def test_phone_width_and_dark_mode(page: Any, base_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    def background() -> list[int]:
        rgb = page.evaluate("getComputedStyle(document.body).backgroundColor")
        return [int(v) for v in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3]]

    goto(page, base_url + "/?model=llama-3.1-8b&gpu=rtx-4090&workload=finetune")
    light = background()
    page.set_viewport_size({"width": 390, "height": 844})
    page.emulate_media(color_scheme="dark")
    n = updates(page)
    page.reload()
    settle(page, min(n, 0))
    assert sum(background()) < sum(light) / 3, "prefers-color-scheme: dark gives a dark page"
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), "no sideways scrolling"
    want = api(base_url, "/api/estimate", {"model": "llama-3.1-8b", "gpu": "rtx-4090", "finetune": "lora"})
    assert_chart_is(page, want)
    page.screenshot(path=str(tmp_path_factory.mktemp("web") / "phone-dark.png"), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 900})
    page.emulate_media(color_scheme="light")


def test_plans_tab_and_a_download(page: Any, base_url: str, tmp_path: Path) -> None:
    """The Plans tab shows /api/plan's ranked plans; a row's button downloads /api/plan/export's files."""
    goto(page, base_url + "/?model=qwen2.5-0.5b&gpu=rtx-4090&seq=1024&tab=plans")
    page.wait_for_function("() => window.trainfit.plansUpdates > 0 && !window.trainfit.plansBusy", timeout=20_000)
    body = {"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "gpus": "1", "seq": "1024", "global_batch": "8"}
    assert page.evaluate("window.trainfit.plansRequest") == body, "the tab asks for the form's model/GPU/GPUs/seq"
    want = api(base_url, "/api/plan", body)
    rows = page.locator("#plans-table tbody tr")
    assert rows.count() == len(want["plans"]) >= 2
    first = want["plans"][0]
    cells = [c.strip() for c in rows.nth(0).locator("th, td").all_inner_texts()]
    assert cells[:8] == [
        "1",
        str(first["gpus"]),
        gib(first["required_bytes"]),
        gib(first["margin_bytes"]),
        f"{first['step_seconds']:.2f}",
        f"{first['tokens_per_second']:,.0f}",
        f"{first['mfu']:.0%}",
        ", ".join(first["changes"]) or "(baseline)",
    ]
    with page.expect_download() as info:
        rows.nth(1).locator("button.download").click()
    saved = tmp_path / info.value.suggested_filename
    info.value.save_as(saved)
    assert saved.name.endswith("rank2.json")
    assert json.loads(saved.read_text()) == api(base_url, "/api/plan/export", {**body, "rank": 2})
    # The tab's knobs live in the URL: a link reproduces the table.
    page.fill("#plan-batch", "16")
    page.check("#plan-lora")
    page.wait_for_function(
        "() => !window.trainfit.plansBusy && (window.trainfit.plansRequest || {}).allow === 'lora,qlora'"
        " && window.trainfit.plansRequest.global_batch === '16'",
        timeout=20_000,
    )
    assert "plan_batch=16" in page.url and "plan_allow=lora%2Cqlora" in page.url and "tab=plans" in page.url
    want = api(base_url, "/api/plan", {**body, "global_batch": "16", "allow": "lora,qlora"})
    assert page.locator("#plans-table tbody tr").count() == len(want["plans"])


def test_plans_tab_plans_from_the_forms_run(page: Any, base_url: str) -> None:
    """The form's run (what the Memory tab estimates) is the plans' baseline: /api/plan gets its run fields, the
    table's changes are from it, and the status line says so."""
    run = "precision=fp32&checkpointing=full&batch=2&workload=finetune&finetune=lora&lora_rank=8"
    goto(page, base_url + f"/?model=qwen2.5-0.5b&gpu=rtx-4090&seq=1024&{run}&tab=plans")
    page.wait_for_function("() => window.trainfit.plansUpdates > 0 && !window.trainfit.plansBusy", timeout=20_000)
    body = page.evaluate("window.trainfit.plansRequest")
    assert {k: body.get(k) for k in ("precision", "checkpointing", "batch", "finetune", "lora_rank")} == {
        "precision": "fp32",
        "checkpointing": "full",
        "batch": "2",
        "finetune": "lora",
        "lora_rank": "8",
    }
    assert "method" not in body and "headroom" not in body, "only the run's fields"
    want = api(base_url, "/api/plan", body)
    assert want["baseline"]["precision"] == "fp32" and want["plans"]
    changes = page.locator("#plans-table tbody tr").nth(0).locator("td").nth(6).inner_text().strip()
    assert changes == (", ".join(want["plans"][0]["changes"]) or "(baseline)")
    assert "changes are from " + " ".join(want["baseline_flags"]) in page.locator("#plan-status").inner_text()
    # the Memory tab's run changes: so do the plans' changes
    page.select_option("select[name=precision]", "amp-bf16")
    page.wait_for_function(
        "() => !window.trainfit.plansBusy && !('precision' in (window.trainfit.plansRequest || {precision: 1}))",
        timeout=20_000,
    )


def test_plans_tab_passes_the_allocator(page: Any, base_url: str) -> None:
    """The form's Allocator field (``--alloc-conf``) reaches /api/plan, and the table is that answer."""
    goto(page, base_url + "/?model=qwen2.5-0.5b&gpu=rtx-4090&seq=1024&alloc_conf=expandable_segments%3ATrue&tab=plans")
    page.wait_for_function("() => window.trainfit.plansUpdates > 0 && !window.trainfit.plansBusy", timeout=20_000)
    body = page.evaluate("window.trainfit.plansRequest")
    assert body["alloc_conf"] == "expandable_segments:True"
    want = api(base_url, "/api/plan", body)
    assert all(p["alloc_conf"] == "expandable_segments:True" for p in want["plans"])
    assert page.locator("#plans-table tbody tr").count() == len(want["plans"]) >= 1


def test_plans_tab_holds_the_forms_host_limit(page: Any, base_url: str) -> None:
    """One Host GiB/node field, the form's, for both tabs: /api/plan gets it, the table is that answer, and typing a
    new limit re-plans. A link of the time when the Plans tab had its own field (``plan_host_memory_gib``) fills
    the form's."""
    where = "model=llama-3.2-3b&gpu=rtx-4090&gpus=2&seq=1024&tab=plans"
    goto(page, base_url + f"/?{where}&plan_host_memory_gib=16")
    page.wait_for_function("() => window.trainfit.plansUpdates > 0 && !window.trainfit.plansBusy", timeout=20_000)
    assert page.input_value("input[name=host_memory_gib]") == "16"
    assert "host_memory_gib=16" in page.url and "plan_host_memory_gib" not in page.url
    assert page.locator("#plan-host").count() == 0, "no second field to disagree with the first"
    body = page.evaluate("window.trainfit.plansRequest")
    assert body["host_memory_gib"] == "16"
    limited = api(base_url, "/api/plan", body)
    unlimited = api(base_url, "/api/plan", {k: v for k, v in body.items() if k != "host_memory_gib"})
    assert limited != unlimited, "the limit changes the answer, so the table can tell which it shows"
    assert page.locator("#plans-table tbody tr").count() == len(limited["plans"])
    assert page.evaluate("window.trainfit.plans") == limited
    page.fill("input[name=host_memory_gib]", "")
    page.wait_for_function(
        "() => !window.trainfit.plansBusy"
        " && !('host_memory_gib' in (window.trainfit.plansRequest || {host_memory_gib: 1}))",
        timeout=20_000,
    )
    assert page.evaluate("window.trainfit.plans") == unlimited


def test_savers_sac_and_adapter_knobs_reach_the_api(page: Any, base_url: str) -> None:
    """The knobs added with the CLI's flags: checkpointing sac, the memory savers, LoRA alpha/dropout, double
    quantisation — the page's request carries them and draws what the API answers for them."""
    goto(page, base_url + "/?model=llama-3.2-1b&gpu=l4")
    n = updates(page)
    page.select_option("select[name=checkpointing]", "sac")
    page.click("text=Memory savers and head")
    page.select_option("select[name=loss]", "chunked")
    page.check("input[name=optimizer_in_backward]")
    settle(page, n)
    body = {"model": "llama-3.2-1b", "gpu": "l4", "checkpointing": "sac", "loss": "chunked"}
    body["optimizer_in_backward"] = True
    assert page.evaluate("window.trainfit.lastRequest.body") == body
    assert_chart_is(page, api(base_url, "/api/estimate", body))
    assert "checkpointing=sac" in page.url and "optimizer_in_backward=true" in page.url
    n = updates(page)
    page.select_option("select[name=checkpointing]", "full")  # sac is refused with adapters (one line)
    page.check("input[value=finetune]")
    page.select_option("select[name=finetune]", "qlora")
    page.fill("input[name=lora_alpha]", "64")
    page.uncheck("input[name=double_quant]")
    settle(page, n)
    page.wait_for_function(
        "window.trainfit.lastRequest.body.double_quant === false && window.trainfit.lastRequest.body.lora_alpha"
    )
    sent = page.evaluate("window.trainfit.lastRequest.body")
    assert sent["finetune"] == "qlora" and sent["lora_alpha"] == "64" and sent["double_quant"] is False
    want = api(base_url, "/api/estimate", sent)
    for _ in range(100):  # the page's answer to that request, once it has arrived
        if page.evaluate("window.trainfit.last") == want:
            break
        page.wait_for_timeout(100)
    assert page.evaluate("window.trainfit.last") == want
    # what trains, counted as the CLI's header counts it (trainfit.units.fmt_count), under the verdict
    from trainfit.units import fmt_count

    trainable, params = want["trainable_params"], want["params"]
    share = f"{100 * trainable / params:.2f}%"
    assert page.inner_text("#trains") == f"{fmt_count(trainable)} of {fmt_count(params)} parameters train ({share})"
    n = updates(page)
    page.check("input[value=training]")
    settle(page, n)
    assert page.inner_text("#trains") == "", "full training: every weight trains, nothing to say"


def test_software_and_process_reach_the_estimate_and_the_plans(page: Any, base_url: str) -> None:
    """The Software and process fields (``--torch-version``, ``--cuda-version``, ``--build``, ``--warm-up``,
    ``--after``, several earlier runs separated by ";") reach /api/estimate and /api/plan; the chart and the table
    are those answers, and the answer is another than a fresh process's on the default releases."""
    after = "qwen2.5-0.5b --batch 2 --seq 512; gpt2 --batch 2 --seq 512"
    form = {"model": "llama-3.2-1b", "gpu": "h200-sxm-141gb", "seq": "1024"}
    process = {"torch_version": "2.11", "cuda_version": "12.8", "build": "on-device", "warm_up": "true"}
    goto(page, f"{base_url}/?{urllib.parse.urlencode({**form, **process, 'after': after})}")
    sent = page.evaluate("window.trainfit.lastRequest.body")
    assert {k: str(sent[k]).lower() for k in process} == process
    assert sent["after"] == [r.strip() for r in after.split(";")]
    want = api(base_url, "/api/estimate", sent)
    assert want["torch_version"] == "2.11" and len(want["history"]["after"]) == 2
    assert_chart_is(page, want)
    fresh = api(base_url, "/api/estimate", form)
    assert fresh["reserved_estimate_bytes"] != want["reserved_estimate_bytes"]
    page.click("[role=tab][data-tab=plans]")
    page.wait_for_function("() => window.trainfit.plansUpdates > 0 && !window.trainfit.plansBusy", timeout=60_000)
    body = page.evaluate("window.trainfit.plansRequest")
    assert {k: body[k] for k in ("torch_version", "cuda_version", "build", "warm_up", "after")} == {
        k: sent[k] for k in ("torch_version", "cuda_version", "build", "warm_up", "after")
    }
    plans = api(base_url, "/api/plan", body)
    assert plans["torch_version"] == "2.11" and plans["history"]["build"] == "on-device"
    assert page.locator("#plans-table tbody tr").count() == len(plans["plans"]) >= 1


def cli_text(query: dict[str, Any]) -> str:
    """``trainfit estimate``'s text for the request ``query`` (built as the API builds it), on one line."""
    from rich.console import Console

    from trainfit.estimate import estimate
    from trainfit.report.table import render
    from trainfit.web.options import estimate_inputs

    spec, kwargs = estimate_inputs(query, allow_hub=False)
    out = io.StringIO()
    render(Console(file=out, width=10_000, no_color=True), estimate(spec, **kwargs))
    return " ".join(out.getvalue().split())


def test_host_memory_per_node(page: Any, base_url: str) -> None:
    """The Host GiB/node field (``--host-memory-gib``): sent as ``host_memory_gib``, kept in the URL; the host line
    is the API's numbers in trainfit estimate's words; a limit below what the offloaded optimizer needs gives the
    "does not fit the host" state while the GPU's verdict stays, and the checked fixes the API returns for it."""
    run = {"model": "qwen2.5-0.5b", "gpu": "rtx-4090", "seq": "1024", "sharding": "zero2", "offload": "optimizer"}
    goto(page, base_url + "/?" + urllib.parse.urlencode(run))
    want = api(base_url, "/api/estimate", run)
    assert want["host_peak_bytes"] > 0 and "host_fits" not in want, "offload puts the optimizer on the host"
    host = page.inner_text("#host-verdict")
    assert host == f"Host memory per node: {gib(want['host_peak_bytes'])} (offloaded or paged: outside the device peak)"
    assert "h" + host[1:] in cli_text(run)  # the CLI says it in a note, lower case
    assert "host_memory_gib" not in page.evaluate("window.trainfit.lastRequest.body")

    # a small limit: the host does not hold the offloaded states; the GPU's verdict is unchanged
    n = updates(page)
    page.fill("input[name=host_memory_gib]", "1")
    settle(page, n)
    sent = page.evaluate("window.trainfit.lastRequest.body")
    assert sent == {**run, "host_memory_gib": "1"}
    assert "host_memory_gib=1" in page.url
    want = api(base_url, "/api/estimate", sent)
    assert want["host_fits"] is False and want["fits"] is True, "a host-only miss"
    assert want["host_peak_bytes"] > want["host_usable_bytes"]
    host = page.inner_text("#host-verdict")
    assert host == (
        f"Does not fit the host: needs {gib(want['host_peak_bytes'])} of CPU memory per node of "
        f"{gib(want['host_usable_bytes'])} usable (--host-memory-gib 1 − {want['headroom_fraction']:.0%} headroom), "
        f"short by {gib(-want['host_free_bytes'])}"
    )
    assert want["host_free_bytes"] == want["host_usable_bytes"] - want["host_peak_bytes"] < 0
    assert "DOES NOT FIT the host" + host.removeprefix("Does not fit the host") in cli_text(sent)
    assert "bad" in page.get_attribute("#host-verdict", "class").split()
    assert page.inner_text("#verdict").startswith("Fits on rtx-4090")
    # the checked fixes, asked for although the GPU fits (each keeps within the limit)
    assert want["fixes"], "the API searches fixes for a host-only miss"
    page.wait_for_function("() => Array.isArray((window.trainfit.last || {}).fixes)", timeout=20_000)
    assert page.evaluate("window.trainfit.last") == want
    suggestions = page.inner_text("#suggestions")
    assert suggestions.startswith("To make it fit")
    for fix in want["fixes"]:
        assert f"{fix['reason']}: {' '.join(fix['flags'])}" in suggestions

    # a link reproduces the view, the field's value included
    other = page.context.new_page()
    try:
        goto(other, page.url)
        assert other.input_value("input[name=host_memory_gib]") == "1"
        assert other.inner_text("#host-verdict") == host
    finally:
        other.close()

    # a limit that holds it: how much of the usable host memory the run takes
    n = updates(page)
    page.fill("input[name=host_memory_gib]", "1024")
    settle(page, n)
    want = api(base_url, "/api/estimate", {**run, "host_memory_gib": "1024"})
    assert want["host_fits"] is True
    host = page.inner_text("#host-verdict")
    assert host == (
        f"Host memory per node: {gib(want['host_peak_bytes'])} of {gib(want['host_usable_bytes'])} usable "
        "(--host-memory-gib less the headroom)"
    )
    assert host in cli_text({**run, "host_memory_gib": "1024"})
    assert "ok" in page.get_attribute("#host-verdict", "class").split()

    # without a GPU there is no verdict to hold it in: the API's one line, beside the field
    n = updates(page)
    page.select_option("#gpu", "")
    settle(page, n)
    bad = api(base_url, "/api/estimate", {k: v for k, v in {**run, "host_memory_gib": "1024"}.items() if k != "gpu"})
    assert page.inner_text('.err[data-for="host_memory_gib"]') == bad["error"]
    assert page.inner_text("#host-verdict") == ""

    # cleared: no limit, nothing sent, nothing in the URL
    n = updates(page)
    page.fill("input[name=host_memory_gib]", "")
    settle(page, n)
    assert "host_memory_gib" not in page.evaluate("window.trainfit.lastRequest.body")
    assert "host_memory_gib" not in page.url


def test_host_memory_no_checked_fix(page: Any, base_url: str) -> None:
    """A host-only miss that no checked fix mends (7B parameters offloaded, one L4): trainfit estimate's line saying
    so, under the host's not-fit state."""
    run = {"model": "qwen2.5-7b", "gpu": "l4", "seq": "1024", "sharding": "zero3", "offload": "optimizer+params"}
    run["host_memory_gib"] = "1"
    goto(page, base_url + "/?" + urllib.parse.urlencode(run))
    want = api(base_url, "/api/estimate", run)
    assert want["fits"] is True and want["host_fits"] is False and want["fixes"] == []
    assert page.inner_text("#host-verdict").startswith("Does not fit the host: needs ")
    line = "No checked fix (trainfit plan) fits within --host-memory-gib 1: trainfit plan with the same flags says what"
    line += " would."
    assert line in cli_text(run)
    assert line in page.inner_text("#suggestions")
