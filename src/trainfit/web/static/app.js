// trainfit serve: the page. It reads the form, asks the JSON API, and draws the answer.
// No memory arithmetic here: every number is a field of the API's JSON (the CLI's --json); the page only
// formats bytes as GiB. The state lives in the URL's query string (a pasted config in its #fragment).
"use strict";

const GIB = 2 ** 30;
// One colour per component, none of them the grey of the "must fit" bar.
const COLORS = ["#2f6fdd", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#9c755f", "#76b7b2", "#edc948", "#ff9da7",
  "#4e79a7", "#8cd17d", "#d37295", "#a0cbe8"];
const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
const form = $("#form");

// Defaults of the form; only values that differ go into the URL.
const DEFAULTS = {};
const TEXT_DEFAULTS = { workload: "training", tab: "memory" };
let gpuList = [];
let pastedConfig = null; // text of a pasted config.json
let seq = 0; // request counter: answers to stale requests are dropped
let activeJob = null;

// For tests and the curious: the last answer, and whether an update is pending.
window.trainfit = { last: null, lastRule: null, lastRequest: null, ready: false, updates: 0, busy: true,
  plans: null, plansRequest: null, plansBusy: false, plansUpdates: 0 };

function gib(bytes) {
  return (bytes / GIB).toFixed(2) + " GiB";
}

function workload() {
  return $("input[name=workload]:checked").value;
}

function fields() {
  // Every named control, as strings (checkboxes: "true"/"false").
  const out = {};
  for (const el of $$("input[name], select[name]", form)) {
    if (el.type === "radio") continue;
    out[el.name] = el.type === "checkbox" ? String(el.checked) : el.value.trim();
  }
  out.workload = workload();
  return out;
}

// The API request for the current form (names are the CLI's flags with underscores).
function request() {
  const f = fields();
  const req = {};
  const model = pastedConfig ? { config: pastedConfig } : { model: f.model };
  Object.assign(req, model);
  const put = (name, value) => {
    if (value !== "" && value !== undefined && value !== DEFAULTS[name]) req[name] = value;
  };
  if (f.gpu) req.gpu = f.gpu;
  if (f.workload === "inference") {
    if (f.i_batch !== DEFAULTS.i_batch) req.batch = f.i_batch;
    for (const k of ["prompt", "new_tokens", "dtype", "kv_dtype", "cache", "server"]) put(k, f[k]);
    if (f.i_tp) req.tp = f.i_tp;
    put("method", f.i_method);
    put("gpus", f.gpus);
    if (f.simulate_allocator === "true") req.simulate_allocator = true;
    return { kind: "infer", body: req };
  }
  for (const k of ["batch", "seq", "grad_accum", "precision", "optimizer", "checkpointing", "attention", "headroom",
    "gpus", "sharding", "tp", "pp", "microbatches", "pp_schedule", "offload", "engine", "method", "loss", "head",
    "num_labels", "alloc_conf", "host_memory_gib"]) put(k, f[k]);
  for (const k of ["sequence_parallel", "optimizer_in_backward", "activation_offload", "paged_optimizer"]) {
    if (f[k] === "true") req[k] = true;
  }
  Object.assign(req, software(f));
  if (f.workload === "finetune") {
    req.finetune = f.finetune;
    for (const k of ["lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "adapter_dtype", "base_dtype", "freeze"]) {
      put(k, f[k]);
    }
    if (f.dora === "true") req.dora = true;
    if (f.double_quant === "false") req.double_quant = false;
  }
  return { kind: "estimate", body: req };
}

// ---- URL state -------------------------------------------------------------------------------------------

function saveUrl() {
  const f = fields();
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(f)) {
    const def = k in DEFAULTS ? DEFAULTS[k] : TEXT_DEFAULTS[k] ?? "";
    if (v !== def && !(k === "model" && pastedConfig)) q.set(k, v);
  }
  const tab = $("[role=tab][aria-selected=true]").dataset.tab;
  if (tab !== "memory") q.set("tab", tab);
  const pb = $("#plan-batch").value.trim();
  if (pb !== $("#plan-batch").defaultValue) q.set("plan_batch", pb);
  if ($("#plan-lora").checked) q.set("plan_allow", "lora,qlora");
  const hash = pastedConfig ? "#config=" + encodeURIComponent(pastedConfig) : "";
  history.replaceState(null, "", "?" + q.toString() + hash);
}

function loadUrl() {
  const q = new URLSearchParams(location.search);
  for (const [k, v] of q) {
    if (k === "workload") {
      const r = $(`input[name=workload][value="${CSS.escape(v)}"]`);
      if (r) r.checked = true;
      continue;
    }
    const el = form.elements.namedItem(k);
    if (!el || el instanceof RadioNodeList) continue;
    if (el.type === "checkbox") el.checked = v === "true";
    else el.value = v;
  }
  if (location.hash.startsWith("#config=")) {
    pastedConfig = decodeURIComponent(location.hash.slice(8));
    $("#config").value = pastedConfig;
    $("#config-box").open = true;
  }
  if (q.has("plan_batch")) $("#plan-batch").value = q.get("plan_batch");
  $("#plan-lora").checked = q.get("plan_allow") === "lora,qlora";
  // links from before the two tabs shared the form's Host GiB/node field
  if (q.has("plan_host_memory_gib") && !q.has("host_memory_gib")) $("#host").value = q.get("plan_host_memory_gib");
  selectTab(q.get("tab") || "memory", false);
}

// ---- API -------------------------------------------------------------------------------------------------

async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  const res = await fetch(path, init);
  const data = await res.json();
  if (!res.ok) throw Object.assign(new Error(data.error || res.statusText), { status: res.status });
  return data;
}

// ---- errors next to their field ----------------------------------------------------------------------------

function clearErrors() {
  for (const el of $$(".err")) el.textContent = "";
  $("#error").textContent = "";
  for (const el of $$(".invalid")) el.classList.remove("invalid");
}

// Library names that are not the form's (the message says "batch must be ...", the form calls it micro-batch).
const ALIASES = { micro_batch: "batch", seq_len: "seq", world_size: "gpus" };

function fieldOf(message) {
  const infer = workload() === "inference";
  const flag = message.match(/--([a-z][a-z0-9-]*)/);
  const word = message.match(/^([a-z][a-z_]*)\b/);
  let name = flag ? flag[1].replace(/-/g, "_") : word ? ALIASES[word[1]] || word[1] : null;
  if (name && infer && (name === "batch" || name === "tp")) name = "i_" + name;
  if (name && $(`.err[data-for="${name}"]`)) return name;
  if (pastedConfig) return "config";
  return /model/i.test(message) ? "model" : null;
}

// An error replaces the answer: a chart of the previous inputs next to it would mislead.
function clearAnswer() {
  window.trainfit.last = null;
  $("#verdict").textContent = "";
  $("#verdict").className = "verdict";
  $("#host-verdict").textContent = "";
  $("#host-verdict").className = "verdict";
  for (const id of ["#trains", "#compare", "#suggestions", "#warnings", "#outside"]) $(id).textContent = "";
  if (typeof Plotly !== "undefined") Plotly.purge("chart");
}

function showError(message) {
  clearAnswer();
  $("#error").textContent = message;
  const field = fieldOf(message);
  const slot = field && $(`.err[data-for="${field}"]`);
  if (slot) {
    slot.textContent = message;
    const input = form.elements.namedItem(field);
    if (input && !(input instanceof RadioNodeList)) input.classList.add("invalid");
    if (field === "config") $("#config-box").open = true;
  }
}

// ---- rendering -----------------------------------------------------------------------------------------------

function cssVar(name) {
  return getComputedStyle(document.body).getPropertyValue(name).trim();
}

// Short phase names on a phone, where the labels would collide.
const SHORT = { forward: "fwd", backward: "bwd", "optimizer-step": "opt", prefill: "prefill", decode: "decode" };

function phaseLabel(phase) {
  return window.innerWidth < 600 ? SHORT[phase] || phase : phase;
}

// The rank entries a chart draws: all of them when few; else (DeepSpeed ZeRO-1/2 over many ranks, an entry per
// partition layout) rank 0's, the worst and the lightest — the JSON keeps them all.
const MAX_RANK_ENTRIES = 6;
function shownRanks(ranks) {
  if (ranks.length <= MAX_RANK_ENTRIES) return ranks;
  const worst = ranks.reduce((a, b) => (b.peak_bytes > a.peak_bytes ? b : a));
  const light = ranks.reduce((a, b) => (b.peak_bytes < a.peak_bytes ? b : a));
  const zero = ranks.find((r) => r.ranks.includes(0));
  return ranks.filter((r) => r === zero || r === worst || r === light);
}

// [0, 1, 2, 4, 6, 7] → "0–2, 4, 6–7" (more than three runs: "n ranks").
function rankRanges(list) {
  const runs = [];
  for (const r of [...list].sort((a, b) => a - b)) {
    const last = runs[runs.length - 1];
    if (last && r === last[1] + 1) last[1] = r;
    else runs.push([r, r]);
  }
  if (runs.length > 3) return `${list.length} ranks`;
  return runs.map(([a, b]) => (a === b ? `${a}` : `${a}–${b}`)).join(", ");
}

// Bars: one per phase (per rank and phase when ranks differ), stacked by component, plus the bytes that must
// fit (the JSON's required bytes: per rank when ranks differ).
function bars(data, kind) {
  const stacks = []; // {x, components}
  const required = []; // {x, bytes}
  const must = window.innerWidth < 600 ? "must fit" : "must fit<br>(reserved + outside)";
  if (kind === "estimate" && data.ranks && data.ranks.length > 1) {
    for (const r of shownRanks(data.ranks)) {
      const first = r.ranks[0];
      const narrow = window.innerWidth < 600;
      const names = rankRanges(r.ranks);
      let who = narrow ? `r${names}` : names.endsWith("ranks") ? names : `${r.ranks.length === 1 ? "rank" : "ranks"} ${names}`;
      // a pipeline stage: the micro-batches it holds in flight (the JSON's ranks[].pipeline)
      if (r.pipeline && !narrow) who += ` · ${r.pipeline.in_flight_microbatches} in flight`;
      for (const [phase, p] of Object.entries(r.phases)) {
        stacks.push({ x: `${who}<br>${phaseLabel(phase)}`, id: `${first}:${phase}`, components: p.components });
      }
      if (r.required_bytes !== undefined) required.push({ x: `${who}<br>must fit`, bytes: r.required_bytes });
    }
  } else {
    for (const [phase, p] of Object.entries(data.phases)) {
      stacks.push({ x: phaseLabel(phase), id: phase, components: p.components });
    }
    const req = kind === "estimate" ? data.required_bytes : data.fit && data.fit.required_bytes;
    if (req !== undefined && req !== null) required.push({ x: must, bytes: req });
  }
  const cats = stacks.map((s) => s.x);
  const names = [];
  for (const s of stacks) for (const [c, b] of Object.entries(s.components)) if (b > 0 && !names.includes(c)) names.push(c);
  const traces = names.map((c) => {
    const bytes = stacks.map((s) => s.components[c] || 0);
    return {
      type: "bar", name: c.replace(/_/g, " "), meta: c, x: cats, ids: stacks.map((s) => s.id), y: bytes.map((b) => b / GIB), customdata: bytes,
      hovertemplate: "%{fullData.name}: %{y:.2f} GiB<extra>%{x}</extra>",
    };
  });
  if (required.length) {
    traces.push({
      type: "bar", name: "must fit (reserved + CUDA context)", meta: "required", x: required.map((r) => r.x),
      y: required.map((r) => r.bytes / GIB), customdata: required.map((r) => r.bytes),
      marker: { color: cssVar("--req") || "#888" }, hovertemplate: "needs %{y:.2f} GiB<extra>%{x}</extra>",
    });
  }
  return traces;
}

function lines(data, kind) {
  let capacity = null;
  let usable = null;
  let gpu = null;
  if (kind === "estimate" && data.gpu) {
    const g = gpuList.find((x) => x.id === data.gpu);
    capacity = g ? g.memory_bytes : null;
    usable = data.usable_bytes;
    gpu = data.gpu;
  } else if (kind === "infer" && data.fit) {
    capacity = data.fit.gpu_memory_bytes;
    usable = data.fit.usable_bytes;
    gpu = data.fit.gpu_id;
  }
  const out = { shapes: [], annotations: [] };
  const add = (bytes, label, color, dash) => {
    out.shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, y0: bytes / GIB, y1: bytes / GIB,
      line: { color, width: 2, dash }, name: label });
    out.annotations.push({ xref: "paper", x: 1, y: bytes / GIB, xanchor: "right", yanchor: "bottom",
      text: `${label}: ${gib(bytes)}`, showarrow: false, font: { color, size: 11 }, yshift: 1,
      bgcolor: cssVar("--bg") || "#fff", opacity: 0.9 });
  };
  if (capacity !== null) add(capacity, `${gpu} capacity`, cssVar("--bad") || "#c33", "solid");
  if (usable !== null && usable !== undefined && usable !== capacity) add(usable, "after headroom", cssVar("--warn") || "#c80", "dash");
  return out;
}

function drawChart(data, kind) {
  const traces = bars(data, kind);
  const l = lines(data, kind);
  if (kind === "estimate" && data.ranks && data.ranks.length > MAX_RANK_ENTRIES) {
    l.annotations.push({
      xref: "paper", yref: "paper", x: 1, y: 1, xanchor: "right", yanchor: "top", showarrow: false, font: { size: 11 },
      text: `rank 0, the worst and the lightest of ${data.ranks.length} rank groups (all in the JSON)`,
    });
  }
  const fg = cssVar("--fg") || "#222";
  const layout = {
    barmode: "stack", colorway: COLORS, shapes: l.shapes, annotations: l.annotations,
    margin: { t: 10, r: 10, b: 10, l: 55 }, height: 440,
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)", font: { color: fg },
    yaxis: { title: { text: "GiB" }, gridcolor: cssVar("--grid") || "#ddd", rangemode: "tozero" },
    xaxis: { automargin: true, tickangle: window.innerWidth < 600 ? -90 : "auto" },
    legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", traceorder: "normal" },
  };
  if (typeof Plotly === "undefined") {
    $("#chart").textContent = "chart library missing: pip install 'trainfit[web]'";
    return;
  }
  Plotly.react("chart", traces, layout, { displaylogo: false, responsive: true });
}

function li(items, cls) {
  return items.length ? `<ul class="${cls}">${items.map((t) => `<li>${escapeHtml(t)}</li>`).join("")}</ul>` : "";
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function verdictText(data, kind) {
  if (kind === "infer") {
    const head = `${data.model}: peak ${gib(data.peak_bytes)} (${data.peak_phase}), weights ${gib(data.weights_bytes)}, KV cache ${gib(data.kv_cache_bytes)}`;
    if (!data.fit) return { cls: "", text: head + " — pick a GPU for a verdict" };
    const f = data.fit;
    const cap = data.capacity ? ` · largest batch ${data.capacity.max_batch}${data.capacity.max_batch_capped ? "+" : ""}, longest context ${data.capacity.max_context}${data.capacity.max_context_capped ? "+" : ""}` : "";
    const paged = data.paged ? ` · paged: ${data.paged.kv_blocks} KV blocks, ${data.paged.max_concurrent_tokens} tokens` : "";
    return f.fits
      ? { cls: "ok", text: `Fits on ${f.gpu_id}: needs ${gib(f.required_bytes)} of ${gib(f.usable_bytes)} usable (${gib(f.free_bytes)} free)${cap}${paged}` }
      : { cls: "bad", text: `Does not fit on ${f.gpu_id}: needs ${gib(f.required_bytes)}, ${gib(f.usable_bytes)} usable${cap}${paged}` };
  }
  const head = `${data.model.name} (${data.method}): peak ${gib(data.peak_bytes)} in ${data.phase}`;
  if (data.fits === undefined) return { cls: "", text: head + " — pick a GPU for a verdict" };
  const mb = data.max_micro_batch === null || data.max_micro_batch === undefined ? "" :
    data.max_micro_batch === 0 ? " · no micro-batch fits" :
    ` · largest micro-batch ${data.max_micro_batch}${data.max_micro_batch_capped ? "+" : ""}`;
  if (data.verdict === "fits-with-flushes") {
    const n = data.cache_flushes;
    return { cls: "warn", text: `Fits on ${data.gpu} with ${n} cache flush${n === 1 ? "" : "es"} (each an implicit empty_cache: slower steps): the uncapped reserve needs ${gib(data.required_bytes)}, ${gib(data.usable_bytes)} usable${mb ? mb + " without flushes" : ""}` };
  }
  return data.fits
    ? { cls: "ok", text: `Fits on ${data.gpu}: needs ${gib(data.required_bytes)} of ${gib(data.usable_bytes)} usable (${gib(data.free_bytes)} free)${mb}` }
    : { cls: "bad", text: `Does not fit on ${data.gpu}: needs ${gib(data.required_bytes)}, ${gib(data.usable_bytes)} usable${mb}` };
}

// A number of GiB as Python's ":g" prints it (the CLI's "--host-memory-gib 256").
function gibNumber(bytes) {
  return String(Number((bytes / GIB).toPrecision(6)));
}

// The host memory per node (trainfit estimate's text): under a Host GiB/node limit (--host-memory-gib) whether it
// fits, said first when it does not (as the CLI says it: fits and the verdict stay the GPU's); without a limit, the
// figure where the JSON has one (many GPUs). Nothing when nothing sits on the host.
function hostText(data) {
  const peak = data.host_peak_bytes;
  if (data.host_fits === false) {
    return { cls: "bad", text: `Does not fit the host: needs ${gib(peak)} of CPU memory per node of ` +
      `${gib(data.host_usable_bytes)} usable (--host-memory-gib ${gibNumber(data.host_memory_bytes)} − ` +
      `${pct(data.headroom_fraction)} headroom), short by ${gib(-data.host_free_bytes)}` };
  }
  if (!peak) return { cls: "", text: "" };
  if (data.host_usable_bytes !== undefined) {
    return { cls: "ok", text: `Host memory per node: ${gib(peak)} of ${gib(data.host_usable_bytes)} usable ` +
      "(--host-memory-gib less the headroom)" };
  }
  return { cls: "", text: `Host memory per node: ${gib(peak)} (offloaded or paged: outside the device peak)` };
}

// What sits outside PyTorch's allocator (the JSON's overhead), and where the NCCL figure comes from (many GPUs).
function outsideText(o) {
  if (!o) return "";
  const parts = [`CUDA context ${gib(o.cuda_context_bytes)}`, `kernels ${gib(o.kernel_images_bytes)}`];
  if (o.nccl_basis) parts.push(`NCCL ${gib(o.nccl_bytes)}: ${o.nccl_basis}`);
  return `Outside PyTorch's allocator: ${gib(o.outside_allocator_bytes)} (${parts.join("; ")})`;
}

// A count as trainfit.units.fmt_count prints it (6.74B, 124.44M, 12.30K).
function fmtCount(n) {
  for (const [div, suffix] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
    if (Math.abs(n) >= div) return (n / div).toFixed(2) + suffix;
  }
  return String(n);
}

// What trains, when not every weight does (adapters, --freeze): the share the CLI's header gives.
function trainsText(data, kind) {
  if (kind !== "estimate" || !(data.trainable_params < data.params)) return "";
  return `${fmtCount(data.trainable_params)} of ${fmtCount(data.params)} parameters train ` +
    `(${(100 * data.trainable_params / data.params).toFixed(2)}%)`;
}

function render(data, kind) {
  const v = verdictText(data, kind);
  const el = $("#verdict");
  el.className = "verdict " + v.cls;
  el.textContent = v.text;
  $("#trains").textContent = trainsText(data, kind);
  const h = kind === "estimate" ? hostText(data) : { cls: "", text: "" };
  $("#host-verdict").className = "verdict " + h.cls;
  $("#host-verdict").textContent = h.text;
  drawChart(data, kind);
  const sugg = [...(data.suggestions || []), ...(data.fixes || [])].map(
    (s) => (s.flags.length ? `${s.reason}: ${s.flags.join(" ")}` : s.reason));
  // searched (it does not fit the GPU or the host) and none keeps within the host limit: trainfit estimate's line
  const missed = data.fits === false || data.host_fits === false;
  if (kind === "estimate" && missed && data.host_memory_bytes !== undefined && Array.isArray(data.fixes) && !data.fixes.length) {
    sugg.push(`No checked fix (trainfit plan) fits within --host-memory-gib ${gibNumber(data.host_memory_bytes)}: ` +
      "trainfit plan with the same flags says what would.");
  }
  $("#suggestions").innerHTML = sugg.length ? "<h3>To make it fit</h3>" + li(sugg, "sugg") : "";
  $("#warnings").innerHTML = li(data.warnings || [], "warn");
  $("#outside").textContent = outsideText(data.overhead);
  if (kind === "infer") {
    $("#compare").textContent = `Rule of thumb (weights × 1.2): ${gib(data.rule_of_thumb_bytes)} · trainfit's nvidia-smi estimate: ${gib(data.nvidia_smi_estimate_bytes)}`;
  }
}

function renderRule(rule, data) {
  if (!rule) { $("#compare").textContent = ""; return; }
  if (rule.error) { $("#compare").textContent = `Rule of thumb: ${rule.error}`; return; }
  const range = rule.low_bytes !== undefined ? ` (range ${gib(rule.low_bytes)} – ${gib(rule.high_bytes)})` : "";
  const head = `Rule of thumb (the article's 12 B/param + activations + 1–2 GB): ` +
    `${gib(rule.nvidia_smi_estimate_bytes ?? rule.peak_bytes)}${range} · ${data.method}: nvidia-smi ${gib(data.nvidia_smi_estimate_bytes)}`;
  const rows = (data.comparison || []).map((d) =>
    `<tr><td>${escapeHtml(d.term)}</td><td class="num">${gib(d.rule_of_thumb_bytes)}</td>` +
    `<td class="num">${gib(d.analytic_bytes)}</td><td class="wrap">${escapeHtml(d.why)}</td></tr>`).join("");
  $("#compare").innerHTML = `<p>${escapeHtml(head)}</p>` + (rows
    ? `<div class="scroll"><table id="comparison"><thead><tr><th>term</th><th>rule of thumb</th><th>trainfit</th>` +
      `<th>why they differ</th></tr></thead><tbody>${rows}</tbody></table></div>`
    : "");
}

// ---- the update loop -------------------------------------------------------------------------------------------

function syncVisibility() {
  const w = workload();
  document.body.dataset.workload = w;
  for (const el of $$(".train-only")) el.hidden = w === "inference";
  for (const el of $$(".ft-only")) el.hidden = w !== "finetune";
  for (const el of $$(".infer-only")) el.hidden = w !== "inference";
}

async function update() {
  syncVisibility();
  saveUrl();
  const my = ++seq;
  const { kind, body } = request();
  window.trainfit.lastRequest = { kind, body };
  $("#api-link").href = `/api/${kind}?` + new URLSearchParams(pastedConfig ? {} : body).toString();
  clearErrors();
  if (!body.model && !body.config) {
    $("#status").textContent = "Pick a model to start.";
    window.trainfit.updates += 1;
    window.trainfit.busy = false;
    return;
  }
  if (body.method === "trace") return startJob(kind, body, my);
  $("#status").textContent = "…";
  try {
    const wantRule = kind === "estimate" && (body.method || "analytic") === "analytic";
    // The verdict first, without the planner's checked fixes (a search of its own); then, when it does not fit,
    // the same request with them — each response is the CLI's --json for those flags.
    const quick = wantRule && body.gpu && body.fixes === undefined ? { ...body, fixes: false } : body;
    let [data, rule] = await Promise.all([
      api(`/api/${kind}`, quick),
      wantRule ? api("/api/estimate", { ...body, method: "rule-of-thumb" }).catch((e) => ({ error: e.message })) : null,
    ]);
    if (my !== seq) return;
    window.trainfit.last = data;
    window.trainfit.lastRule = rule;
    render(data, kind);
    if (kind === "estimate") renderRule(rule, data);
    // not fitting the host (--host-memory-gib) asks for the fixes as not fitting the GPU does
    if (quick !== body && (data.fits === false || data.host_fits === false) && data.fixes === null) {
      $("#status").textContent = "checking fixes…";
      data = await api(`/api/${kind}`, body);
      if (my !== seq) return;
      window.trainfit.last = data;
      render(data, kind);
      renderRule(rule, data);
    }
    $("#status").textContent = "";
  } catch (e) {
    if (my !== seq) return;
    showError(e.message);
    $("#status").textContent = "";
  } finally {
    if (my === seq) { window.trainfit.updates += 1; window.trainfit.busy = false; }
  }
}

async function startJob(kind, body, my) {
  if (activeJob) { // one trace at a time: cancel the previous one and wait until it has stopped
    const previous = activeJob;
    activeJob = null;
    await fetch(`/api/jobs/${previous}`, { method: "DELETE" });
    $("#job").hidden = false;
    $("#job-msg").textContent = "cancelling the previous trace…";
    for (let i = 0; i < 600; i++) {
      const j = await api(`/api/jobs/${previous}`).catch(() => ({ state: "gone" }));
      if (j.state !== "running" || my !== seq) break;
      await new Promise((r) => setTimeout(r, 250));
    }
    if (my !== seq) return;
  }
  $("#job").hidden = false;
  $("#job-msg").textContent = "starting the trace…";
  try {
    const job = await api("/api/jobs", { ...body, kind });
    activeJob = job.id;
    for (;;) {
      await new Promise((r) => setTimeout(r, 400));
      if (my !== seq) return;
      const j = await api(`/api/jobs/${job.id}`);
      $("#job-bar").value = j.fraction;
      $("#job-msg").textContent = `${j.message} (${j.seconds.toFixed(0)} s)`;
      if (j.state === "running") continue;
      activeJob = null;
      $("#job").hidden = true;
      if (j.state === "done") { window.trainfit.last = j.result; render(j.result, kind); renderRule(null); }
      else if (j.state === "error") showError(j.error);
      else $("#status").textContent = "trace cancelled";
      return;
    }
  } catch (e) {
    $("#job").hidden = true;
    showError(e.message);
  } finally {
    if (my === seq) { window.trainfit.updates += 1; window.trainfit.busy = false; }
  }
}

let timer = null;
function soon() {
  window.trainfit.busy = true;
  clearTimeout(timer);
  timer = setTimeout(update, 200);
}

// The software and the process the run starts in (--torch-version, --cuda-version, --build, --warm-up, --after):
// the same fields for an estimate and for the plans. Several earlier runs are separated by ";".
function software(f) {
  const req = {};
  for (const k of ["torch_version", "cuda_version"]) if (f[k]) req[k] = f[k];
  if (f.build && f.build !== DEFAULTS.build) req.build = f.build;
  if (f.warm_up === "true") req.warm_up = true;
  const after = (f.after || "").split(";").map((r) => r.trim()).filter((r) => r);
  if (after.length) req.after = after;
  return req;
}

// ---- plans tab ----------------------------------------------------------------------------------------------------

// trainfit plan's baseline fields (cli.plan.BASELINE_FLAGS; a test holds the two lists together): the form's run
// as the Memory tab sends it, so that each plan's "changes" are from the run on the left.
const BASELINE_FIELDS = ["precision", "optimizer", "optimizer_impl", "checkpointing", "attention", "batch",
  "grad_accum", "sharding", "tp", "pp", "pp_schedule", "virtual_stages", "microbatches", "sequence_parallel",
  "offload", "engine", "reshard_after_forward", "sync_each_batch", "finetune", "lora_rank", "lora_alpha",
  "lora_targets", "lora_dropout", "dora", "adapter_dtype", "base_dtype", "double_quant", "freeze", "fp8", "loss",
  "optimizer_in_backward", "activation_offload", "paged_optimizer"];

function baseline() {
  const r = request();
  const out = {};
  if (r.kind !== "estimate") return out; // an inference form describes no training run
  for (const k of BASELINE_FIELDS) if (k in r.body) out[k] = r.body[k];
  return out;
}

// The /api/plan request for the form's model, GPU, GPU count, sequence, allocator, host memory per node, software,
// process and run (the baseline), and the tab's global batch.
function planRequest() {
  const f = fields();
  const req = pastedConfig ? { config: pastedConfig } : { model: f.model };
  if (f.gpu) req.gpu = f.gpu;
  if (f.gpus) req.gpus = f.gpus;
  if (f.seq) req.seq = f.seq;
  if (f.alloc_conf) req.alloc_conf = f.alloc_conf;
  Object.assign(req, software(f));
  Object.assign(req, baseline());
  const gb = $("#plan-batch").value.trim();
  if (gb) req.global_batch = gb;
  if ($("#plan-lora").checked) req.allow = "lora,qlora";
  if (f.host_memory_gib) req.host_memory_gib = f.host_memory_gib;
  return req;
}

function pct(x) {
  return (x * 100).toFixed(0) + "%";
}

let planSeq = 0;
async function loadPlans() {
  const my = ++planSeq;
  window.trainfit.plansBusy = true;
  const body = planRequest();
  $("#plan-error").textContent = "";
  $("#plans-table").innerHTML = "";
  $("#plan-needs").innerHTML = "";
  try {
    if (!body.model && !body.config) { $("#plan-status").textContent = "Pick a model to start."; return; }
    if (!body.gpu) { $("#plan-status").textContent = "Pick a GPU to plan for."; return; }
    $("#plan-status").textContent = "searching…";
    const data = await api("/api/plan", body);
    if (my !== planSeq) return;
    window.trainfit.plans = data;
    window.trainfit.plansRequest = body;
    $("#plan-status").textContent = `${data.objective}: ${data.candidates} candidates, ${data.estimates} estimates; ` +
      `global batch ${data.global_batch}, sequence ${data.seq_len}; changes are from ` +
      (data.baseline_flags.length ? data.baseline_flags.join(" ") : "trainfit estimate's defaults");
    if (!data.plans.length) {
      $("#plan-error").textContent = "nothing fits within the usable memory";
      const needs = data.needs.map((n) => `would fit with ${n}`);
      $("#plan-needs").innerHTML = li(needs, "sugg");
      return;
    }
    // host memory per node: a column when any plan offloads (trainfit plan's "host GiB/node")
    const host = data.plans.some((p) => p.host_peak_bytes > 0);
    const rows = data.plans.map((p, i) => `<tr><th>${i + 1}</th><td>${p.gpus}</td><td>${gib(p.required_bytes)}</td>` +
      `<td>${gib(p.margin_bytes)}</td>` + (host ? `<td>${gib(p.host_peak_bytes)}</td>` : "") +
      `<td>${p.step_seconds.toFixed(2)}</td>` +
      `<td>${Math.round(p.tokens_per_second).toLocaleString("en-US")}</td><td>${pct(p.mfu)}</td>` +
      `<td class="wrap">${escapeHtml(p.changes.join(", ") || "(baseline)")}</td>` +
      `<td><button type="button" class="download" data-rank="${i + 1}">Download configs</button></td></tr>`);
    $("#plans-table").innerHTML = "<thead><tr><th>#</th><th>GPUs</th><th>peak/GPU</th><th>margin</th>" +
      (host ? "<th>host/node</th>" : "") + "<th>step s</th>" +
      "<th>tokens/s</th><th>MFU</th><th>changes from the baseline</th><th></th></tr></thead><tbody>" + rows.join("") + "</tbody>";
  } catch (e) {
    if (my !== planSeq) return;
    window.trainfit.plans = null;
    $("#plan-status").textContent = "";
    $("#plan-error").textContent = e.message;
  } finally {
    if (my === planSeq) { window.trainfit.plansBusy = false; window.trainfit.plansUpdates = (window.trainfit.plansUpdates || 0) + 1; }
  }
}

// The chosen plan's exported files (/api/plan/export), saved as one JSON bundle by a normal browser download.
async function downloadPlan(rank) {
  const body = window.trainfit.plansRequest;
  try {
    const data = await api("/api/plan/export", { ...body, rank });
    const blob = new Blob([JSON.stringify(data, null, 2) + "\n"], { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    const who = (body.model || "config").replace(/[^A-Za-z0-9._-]+/g, "_");
    a.download = `trainfit-plan-${who}-${body.gpu}-rank${rank}.json`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10_000);
  } catch (e) {
    $("#plan-error").textContent = e.message;
  }
}

let planTimer = null;
function plansSoon() {
  window.trainfit.plansBusy = true;
  clearTimeout(planTimer);
  planTimer = setTimeout(loadPlans, 200);
}

// ---- formats tab ------------------------------------------------------------------------------------------------

function num(x) {
  if (x === null || x === undefined) return "–";
  if (Number.isInteger(x) && Math.abs(x) < 1e7) return String(x);
  if (Math.abs(x) >= 1e-3 && Math.abs(x) < 1e7) return x.toPrecision(3);
  return x.toExponential(2);
}

let formatsLoaded = false;
async function loadFormats() {
  const gpu = $("#gpu").value;
  $("#adv-gpu").textContent = gpu ? `for ${gpu}` : "(pick a GPU)";
  if (gpu) {
    try {
      const a = (await api(`/api/precision?gpu=${encodeURIComponent(gpu)}`)).recommendation;
      $("#advice").innerHTML = `<p class="verdict ok">Recommended: <b>${escapeHtml(a.precision)}</b>` +
        `${a.loss_scaling ? " + dynamic loss scaling (GradScaler)" : ""}</p>` + li(a.reasons, "") +
        (a.notes.length ? "<h3>Notes</h3>" + li(a.notes, "") : "") + `<pre>${escapeHtml(a.snippet)}</pre>`;
    } catch (e) { $("#advice").textContent = e.message; }
  } else $("#advice").textContent = "";
  if (formatsLoaded) return;
  const f = await api("/api/formats");
  const rows = f.formats.map((x) => `<tr><th>${escapeHtml(x.id)}</th><td>1/${x.exponent_bits}/${x.mantissa_bits}</td>` +
    `<td>${num(x.max_finite)}</td><td>${num(x.min_normal)}</td><td>${num(x.min_subnormal)}</td><td>${num(x.epsilon)}</td>` +
    `<td>${x.decimal_digits.toFixed(2)}</td><td class="wrap">${escapeHtml(x.used_for)}</td></tr>`);
  const ints = f.integer_formats.map((x) => `<tr><th>${escapeHtml(x.id)}</th><td>int</td><td>${x.max_value}</td>` +
    `<td>–</td><td>–</td><td>1 (step)</td><td>–</td><td class="wrap">${escapeHtml(x.used_for)}</td></tr>`);
  $("#formats-table").innerHTML = "<thead><tr><th>format</th><th>s/e/m</th><th>max finite</th><th>min normal</th>" +
    "<th>min sub</th><th>eps</th><th>digits</th><th>used for</th></tr></thead><tbody>" + rows.join("") + ints.join("") + "</tbody>";
  $("#edge-facts").innerHTML = f.edge_facts.map((e) => `<li><code>${escapeHtml(e.expression)}</code> — ${escapeHtml(e.explanation)}</li>`).join("");
  formatsLoaded = true;
}

function selectTab(tab, save = true) {
  for (const b of $$("[role=tab]")) b.setAttribute("aria-selected", String(b.dataset.tab === tab));
  for (const v of $$(".view")) v.hidden = v.id !== "view-" + tab;
  if (tab === "formats") loadFormats();
  if (tab === "plans") loadPlans();
  if (save) saveUrl();
}

// ---- wiring -----------------------------------------------------------------------------------------------------------

function useConfig(text) {
  window.trainfit.busy = true;
  pastedConfig = text && text.trim() ? text : null;
  if (!$("#view-plans").hidden) plansSoon();
  update();
}

async function init() {
  for (const el of $$("input[name], select[name]", form)) {
    if (el.type !== "radio") DEFAULTS[el.name] = el.type === "checkbox" ? String(el.checked) : el.value.trim();
  }
  DEFAULTS.model = "";
  const [models, gpus] = await Promise.all([api("/api/models"), api("/api/gpus")]);
  gpuList = gpus.gpus;
  $("#model-list").innerHTML = models.models.map((m) =>
    `<option value="${escapeHtml(m.id)}">${escapeHtml(m.model_type)} · ${(m.params / 1e9).toFixed(2)}B params</option>`).join("");
  const sel = $("#gpu");
  for (const g of gpuList) sel.add(new Option(`${g.id} (${(g.memory_bytes / GIB).toFixed(1)} GiB)`, g.id));
  loadUrl();
  form.addEventListener("input", (ev) => {
    if (ev.target.id === "config") return;
    if (ev.target.id === "model-search") { pastedConfig = null; }
    if (ev.target.id === "gpu" && !$("#view-formats").hidden) loadFormats();
    if (!$("#view-plans").hidden) plansSoon();
    soon();
  });
  form.addEventListener("change", (ev) => { if (ev.target.id !== "config") soon(); });
  for (const id of ["#plan-batch", "#plan-lora"]) {
    $(id).addEventListener("input", () => { saveUrl(); plansSoon(); });
    $(id).addEventListener("change", () => { saveUrl(); plansSoon(); });
  }
  $("#plans-table").addEventListener("click", (e) => {
    const b = e.target.closest("button.download");
    if (b) downloadPlan(Number(b.dataset.rank));
  });
  $("#config-use").addEventListener("click", () => useConfig($("#config").value));
  $("#config-clear").addEventListener("click", () => { $("#config").value = ""; useConfig(""); });
  const drop = $("#config");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("drag"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("drag"));
  drop.addEventListener("drop", async (e) => {
    e.preventDefault();
    drop.classList.remove("drag");
    const file = e.dataTransfer.files[0];
    if (!file) return;
    if (file.size > 256 * 1024) { showError(`${file.name} is too big for a config.json`); return; }
    drop.value = await file.text();
    useConfig(drop.value);
  });
  for (const b of $$("[role=tab]")) b.addEventListener("click", () => selectTab(b.dataset.tab));
  $("#job-cancel").addEventListener("click", () => { if (activeJob) fetch(`/api/jobs/${activeJob}`, { method: "DELETE" }); });
  $("#cli-line").addEventListener("click", (e) => {
    e.preventDefault();
    const { kind, body } = request();
    const args = Object.entries(body).filter(([k]) => k !== "model" && k !== "config")
      .map(([k, v]) => (v === true ? `--${k.replace(/_/g, "-")}` : `--${k.replace(/_/g, "-")} ${v}`));
    const line = `trainfit ${kind} ${body.model || "config.json"} ${args.join(" ")} --json`;
    navigator.clipboard?.writeText(line);
    $("#status").textContent = line;
  });
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => window.trainfit.last && update());
  window.trainfit.ready = true;
  await update();
}

init().catch((e) => showError(String(e.message || e)));
