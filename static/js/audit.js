// The audit page: cost, latency and one-shot jobs over a chosen time range, from the audit endpoints,
// with CSV export.

import { ApiError, api, el, fieldErrors, formatMs, formatTime, formatUsd, showMessage } from "./common.js";
import { color, timeChart } from "./charts.js";

const $ = (id) => document.getElementById(id);
const state = { charts: {}, cost: null, latency: null, jobs: null, migrations: null, scaling: null };

function message(text, kind = "error") {
  showMessage($("audit-message"), text, kind);
}

// datetime-local works in local time without a zone; the API takes ISO-8601 instants.
function toLocalInput(date) {
  const pad = (n) => String(n).padStart(2, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())}T${pad(date.getHours())}:${pad(date.getMinutes())}`;
}

function fromLocalInput(value) {
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? null : date;
}

function setRange(spanSeconds, bucket) {
  const end = new Date(Math.ceil(Date.now() / 60000) * 60000);
  $("range-end").value = toLocalInput(end);
  $("range-start").value = toLocalInput(new Date(end.getTime() - spanSeconds * 1000));
  $("range-bucket").value = bucket;
}

function params() {
  const errors = {};
  const start = fromLocalInput($("range-start").value);
  const end = fromLocalInput($("range-end").value);
  if (!start) errors.start = "enter a date and time";
  if (!end) errors.end = "enter a date and time";
  if (start && end && start >= end) errors.end = "must be after the start";
  const slo = $("range-slo").value.trim();
  if (slo !== "" && !(Number(slo) > 0)) errors.slo_ms = "must be a positive number";
  if (Object.keys(errors).length) return { errors };
  const query = { start: start.toISOString(), end: end.toISOString(), bucket: $("range-bucket").value };
  if (slo !== "") query.slo_ms = slo;
  return { query };
}

function qs(query, extra = {}) {
  return new URLSearchParams({ ...query, ...extra }).toString();
}

function showFieldErrors(errors) {
  for (const node of document.querySelectorAll("#range-form .field-error")) node.textContent = "";
  for (const node of document.querySelectorAll("#range-form [aria-invalid]")) node.removeAttribute("aria-invalid");
  const inputFor = { start: "range-start", end: "range-end", bucket: "range-bucket", slo_ms: "range-slo" };
  for (const [field, text] of Object.entries(errors)) {
    const node = $(`range-${field}-error`);
    if (node) node.textContent = text;
    if (inputFor[field]) $(inputFor[field]).setAttribute("aria-invalid", "true");
  }
}

async function load() {
  const { query, errors } = params();
  showFieldErrors(errors || {});
  if (errors) {
    message("Please correct the time range.");
    return;
  }
  message("");
  history.replaceState(null, "", `?${qs(query)}`);
  $("export-cost").href = `/api/audit/cost/?${qs(query, { format: "csv" })}`;
  $("export-latency").href = `/api/audit/latency/?${qs(query, { format: "csv" })}`;
  const jobQuery = { start: query.start, end: query.end, bucket: query.bucket };
  $("export-jobs").href = `/api/audit/jobs/?${qs(jobQuery, { format: "csv" })}`;
  $("totals").setAttribute("aria-busy", "true");
  $("range-submit").disabled = true;
  const window_ = { after: query.start, before: query.end, limit: 1 };
  try {
    const [cost, latency, jobs, migrations, scaling] = await Promise.all([
      api(`/api/audit/cost/?${qs(query)}`),
      api(`/api/audit/latency/?${qs(query)}`),
      api(`/api/audit/jobs/?${qs(jobQuery)}`),
      api(`/api/migrations/?${qs(window_)}`),
      api(`/api/scaling-actions/?${qs(window_)}`),
    ]);
    Object.assign(state, { cost, latency, jobs, migrations: migrations.count, scaling: scaling.count, query });
    render();
  } catch (err) {
    if (err instanceof ApiError && err.status === 400) showFieldErrors(fieldErrors(err.body));
    message(`The audit could not be loaded: ${err instanceof ApiError ? err.message : err}`);
  } finally {
    $("totals").setAttribute("aria-busy", "false");
    $("range-submit").disabled = false;
  }
}

// One row per group (GPU type or region): its GPU-hours, cost and share of the range's cost.
function shareRows(groups, totalCost) {
  const names = Object.keys(groups).sort();
  if (!names.length) return [el("tr", {}, el("td", { colspan: "4", class: "muted", text: "No GPU time in this range." }))];
  return names.map((name) => {
    const f = groups[name];
    return el(
      "tr",
      {},
      el("th", { scope: "row", text: name }),
      el("td", { class: "num", text: (Number(f.gpu_seconds) / 3600).toFixed(3) }),
      el("td", { class: "num", text: formatUsd(f.cost_usd) }),
      el("td", { class: "num", text: totalCost ? `${((Number(f.cost_usd) / totalCost) * 100).toFixed(1)} %` : "–" }),
    );
  });
}

// One row per region a chunk was generated in (its worker's): chunks, worst chunk, SLO pass rate.
function latencyRegionRows(groups) {
  const names = Object.keys(groups).sort();
  if (!names.length) return [el("tr", {}, el("td", { colspan: "4", class: "muted", text: "No chunks in this range." }))];
  return names.map((name) => {
    const t = groups[name];
    return el(
      "tr",
      {},
      el("th", { scope: "row", text: name }),
      el("td", { class: "num", text: t.count }),
      el("td", { class: "num", text: formatMs(t.max_ms) }),
      el("td", { class: "num", text: t.slo_pass_rate === null ? "–" : `${(t.slo_pass_rate * 100).toFixed(1)} %` }),
    );
  });
}

function render() {
  const { cost, latency } = state;
  const gpuSeconds = Number(cost.totals.gpu_seconds);
  $("totals-range").textContent = `${formatTime(cost.start)} – ${formatTime(cost.end)}, per ${cost.bucket}`;
  $("total-gpu-hours").textContent = (gpuSeconds / 3600).toFixed(3);
  $("total-gpu-hours").dataset.gpuSeconds = String(gpuSeconds);
  $("total-cost").textContent = formatUsd(cost.totals.cost_usd);
  $("total-cost").dataset.costUsd = String(cost.totals.cost_usd);
  $("total-chunks").textContent = String(latency.totals.count);
  $("total-slo").textContent =
    latency.totals.slo_pass_rate === null ? "–" : `${(latency.totals.slo_pass_rate * 100).toFixed(2)} %`;
  $("total-slo").title = `chunks within ${formatMs(latency.slo_ms)} (source: ${latency.source})`;
  $("total-max").textContent = formatMs(latency.totals.max_ms);
  $("total-migrations").textContent = String(state.migrations);
  $("total-scaling").textContent = String(state.scaling);

  const totalCost = Number(cost.totals.cost_usd);
  $("bytype-rows").replaceChildren(...shareRows(cost.totals.by_gpu_type, totalCost));
  $("byregion-rows").replaceChildren(...shareRows(cost.totals.by_region, totalCost));
  $("latency-region-rows").replaceChildren(...latencyRegionRows(latency.totals.by_region));
  $("latency-rows").replaceChildren(
    ...(latency.buckets.length
      ? latency.buckets.map((b) =>
          el(
            "tr",
            {},
            el("th", { scope: "row", text: formatTime(b.start) }),
            el("td", { class: "num", text: b.count }),
            el("td", { class: "num", text: formatMs(b.p50_ms) }),
            el("td", { class: "num", text: formatMs(b.p95_ms) }),
            el("td", { class: "num", text: formatMs(b.p99_ms) }),
            el("td", { class: "num", text: formatMs(b.max_ms) }),
            el("td", { class: "num", text: b.count ? `${((b.slo_passed / b.count) * 100).toFixed(1)} %` : "–" }),
          ),
        )
      : [el("tr", {}, el("td", { colspan: "7", class: "muted", text: "No chunks in this range." }))]),
  );
  renderJobs(state.jobs);
  renderCharts(Object.keys(cost.totals.by_gpu_type).sort());
}

function seconds(value) {
  return value === null || value === undefined ? "–" : formatMs(value * 1000);
}

function percent(rate) {
  return rate === null || rate === undefined ? "–" : `${(rate * 100).toFixed(1)} %`;
}

function renderJobs(jobs) {
  $("jobs-totals").textContent = `(${jobs.totals.count} ended, SLO met ${percent(jobs.totals.slo_attainment)})`;
  $("job-audit-rows").replaceChildren(
    ...(jobs.buckets.length
      ? jobs.buckets.map((b) =>
          el(
            "tr",
            {},
            el("th", { scope: "row", text: formatTime(b.start) }),
            el("td", { class: "num", text: b.count }),
            el("td", { class: "num", text: b.done }),
            el("td", { class: "num", text: seconds(b.wait_p50_s) }),
            el("td", { class: "num", text: seconds(b.latency_p50_s) }),
            el("td", { class: "num", text: seconds(b.latency_p95_s) }),
            el("td", { class: "num", text: seconds(b.latency_p99_s) }),
            el("td", { class: "num", text: percent(b.slo_attainment) }),
          ),
        )
      : [el("tr", {}, el("td", { colspan: "8", class: "muted", text: "No jobs ended in this range." }))]),
  );
}

const STEP_S = { minute: 60, hour: 3600, day: 86400 };

// Every bucket start in [start, end): the server lists only buckets with data, and a chart that
// joined the listed ones would draw a line across empty hours. Buckets are UTC-aligned (date_trunc).
function bucketGrid(start, end, bucket) {
  const step = STEP_S[bucket];
  const first = Math.floor(Date.parse(start) / 1000 / step) * step;
  const last = Date.parse(end) / 1000;
  const xs = [];
  for (let t = first; t < last && xs.length < 20000; t += step) xs.push(t);
  return xs;
}

function renderCharts(types) {
  const { cost, latency } = state;
  const xs = bucketGrid(cost.start, cost.end, cost.bucket);
  const xRange = [xs[0], Date.parse(cost.end) / 1000];
  const costAt = new Map(cost.buckets.map((b) => [Date.parse(b.start) / 1000, b]));
  const latencyAt = new Map(latency.buckets.map((b) => [Date.parse(b.start) / 1000, b]));
  const costData = [
    xs,
    xs.map((t) => Number(costAt.get(t)?.cost_usd ?? 0)),
    ...types.map((type) => xs.map((t) => Number(costAt.get(t)?.by_gpu_type[type]?.cost_usd ?? 0))),
  ];
  const latencyData = [
    xs,
    ...["p50_ms", "p95_ms", "p99_ms", "max_ms"].map((k) => xs.map((t) => latencyAt.get(t)?.[k] ?? null)),
    xs.map(() => latency.slo_ms),
  ];
  for (const chart of Object.values(state.charts)) chart.destroy();
  const dollars = (u, v) => formatUsd(v);
  state.charts.cost = timeChart($("chart-cost"), {
    data: costData,
    xRange,
    yLabel: "$ per bucket",
    series: [
      { label: "total", value: dollars, color: "#1b1f24", stepped: true },
      ...types.map((t, i) => ({ label: t, value: dollars, color: color(i + 1), stepped: true })),
    ],
  });
  const ms = (u, v) => formatMs(v);
  const sparse = latency.buckets.length < 30;
  state.charts.latency = timeChart($("chart-latency"), {
    data: latencyData,
    xRange,
    yLabel: "ms",
    series: [
      { label: "p50", value: ms, color: color(3), points: sparse, spanGaps: false },
      { label: "p95", value: ms, color: color(2), points: sparse, spanGaps: false },
      { label: "p99", value: ms, color: color(0), points: sparse, spanGaps: false },
      { label: "max", value: ms, color: color(4), points: sparse, spanGaps: false },
      { label: "SLO", value: ms, color: "#5b6570", dash: [6, 4] },
    ],
  });
}

$("range-form").addEventListener("submit", (event) => {
  event.preventDefault();
  load();
});
for (const button of document.querySelectorAll("[data-span]")) {
  button.addEventListener("click", () => {
    setRange(Number(button.dataset.span), button.dataset.bucket);
    load();
  });
}

const initial = new URLSearchParams(location.search);
if (initial.get("start") && initial.get("end")) {
  $("range-start").value = toLocalInput(new Date(initial.get("start")));
  $("range-end").value = toLocalInput(new Date(initial.get("end")));
  if (initial.get("bucket")) $("range-bucket").value = initial.get("bucket");
  if (initial.get("slo_ms")) $("range-slo").value = initial.get("slo_ms");
} else {
  setRange(3600, "minute");
}
load();

window.streamserveAudit = state;
