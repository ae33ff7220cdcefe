// The operator console: cluster snapshot over /ws/console/, worker cards, live charts, timeline,
// and audited actions (drain, terminate, autoscaler bounds) through the console's JSON endpoints.

import { ApiError, api, el, fieldErrors, formatBytes, formatMs, formatTime, formatUsd, showMessage, wsUrl } from "./common.js";
import { timeChart } from "./charts.js";

const $ = (id) => document.getElementById(id);
const HISTORY_POINTS = 600; // 10 minutes at the default 1 s push interval

const state = {
  snapshot: null,
  history: { t: [], active: [], suspended: [], queued: [], live: [], target: [], minGpus: [], maxGpus: [], worst: [], p99: [], slo: [], cost: [] },
  charts: {},
  cards: new Map(),
  sessionRows: new Map(),
  timelineSignature: "",
  socket: null,
  attempt: 0,
  configDirty: false,
};

function message(text, kind = "error") {
  showMessage($("console-message"), text, kind);
}

function fmtMoney(value) {
  return value === null || value === undefined ? "–" : `${formatUsd(value)}/h`;
}

// --- History and charts -------------------------------------------------------------------------

function record(snapshot) {
  const h = state.history;
  const t = Date.parse(snapshot.at) / 1000;
  if (h.t.length && t <= h.t[h.t.length - 1]) return false;
  h.t.push(t);
  h.active.push(snapshot.sessions.active);
  h.suspended.push(snapshot.sessions.suspended);
  h.queued.push(snapshot.sessions.queued);
  h.live.push(snapshot.budget.live);
  h.target.push(snapshot.budget.target);
  h.minGpus.push(snapshot.budget.min_gpus);
  h.maxGpus.push(snapshot.budget.max_gpus);
  h.worst.push(snapshot.latency.worst_ms);
  h.p99.push(snapshot.latency.p99_ms);
  h.slo.push(snapshot.latency.slo_ms);
  h.cost.push(snapshot.cost_rate_per_hour);
  for (const key of Object.keys(h)) if (h[key].length > HISTORY_POINTS) h[key].shift();
  return true;
}

function chartData() {
  const h = state.history;
  return {
    sessions: [h.t, h.active, h.suspended, h.queued],
    budget: [h.t, h.live, h.target, h.minGpus, h.maxGpus],
    latency: [h.t, h.worst, h.p99, h.slo],
    cost: [h.t, h.cost],
  };
}

function buildCharts() {
  const data = chartData();
  const count = (u, v) => (v === null || v === undefined ? "–" : String(v));
  state.charts.sessions = timeChart($("chart-sessions"), {
    data: data.sessions,
    yLabel: "sessions",
    series: [
      { label: "active", value: count, stepped: true },
      { label: "suspended", value: count, stepped: true },
      { label: "queued", value: count, stepped: true },
    ],
  });
  state.charts.budget = timeChart($("chart-budget"), {
    data: data.budget,
    yLabel: "GPUs",
    series: [
      { label: "live workers", value: count, stepped: true },
      { label: "autoscaler target", value: count, stepped: true, dash: [6, 4] },
      { label: "min", value: count, stepped: true, dash: [2, 4], color: "#9aa3ad" },
      { label: "max", value: count, stepped: true, dash: [2, 4], color: "#5b6570" },
    ],
  });
  state.charts.latency = timeChart($("chart-latency"), {
    data: data.latency,
    yLabel: "ms",
    series: [
      { label: "worst", value: (u, v) => formatMs(v), color: "#b3261e", spanGaps: false },
      { label: "p99", value: (u, v) => formatMs(v), color: "#2457c5", spanGaps: false },
      { label: "SLO", value: (u, v) => formatMs(v), color: "#1f7a3f", dash: [6, 4] },
    ],
  });
  state.charts.cost = timeChart($("chart-cost"), {
    data: data.cost,
    yLabel: "$/h",
    series: [{ label: "cost rate", value: (u, v) => fmtMoney(v), stepped: true }],
  });
}

function updateCharts() {
  const data = chartData();
  for (const [name, chart] of Object.entries(state.charts)) chart.setData(data[name]);
}

// --- Summary, workers, sessions, timeline -------------------------------------------------------

function renderSummary(s) {
  $("stat-active").textContent = s.sessions.active;
  $("stat-suspended").textContent = s.sessions.suspended;
  $("stat-queued").textContent = s.sessions.queued;
  $("stat-budget").textContent = `${s.budget.live} / ${s.budget.target ?? "–"}`;
  const slo = s.latency.slo_ms;
  $("stat-worst").textContent = s.latency.count ? formatMs(s.latency.worst_ms) : "no chunks";
  $("stat-worst").classList.toggle("bad", s.latency.worst_ms !== null && s.latency.worst_ms > slo);
  $("stat-p99").textContent = s.latency.count ? formatMs(s.latency.p99_ms) : "–";
  $("stat-p99").classList.toggle("bad", s.latency.p99_ms !== null && s.latency.p99_ms > slo);
  $("stat-slo").textContent =
    formatMs(slo) + (s.latency.slo_pass_rate !== null ? ` · ${(s.latency.slo_pass_rate * 100).toFixed(1)} % met` : "");
  $("stat-cost").textContent = fmtMoney(s.cost_rate_per_hour);
  $("console-updated").textContent = formatTime(s.at);
  $("console-updated").setAttribute("datetime", s.at);
}

// Put ``node`` right after ``cursor`` (first when null), touching the DOM only when it is elsewhere:
// a moved node is detached for a moment, which would drop a click or focus on it.
function placeAfter(parent, cursor, node) {
  const expected = cursor ? cursor.nextElementSibling : parent.firstElementChild;
  if (expected !== node) parent.insertBefore(node, expected);
}

function loadLevel(ratio) {
  if (ratio === null || ratio === undefined) return "ok";
  if (ratio > 1) return "over";
  return ratio > 0.8 ? "high" : "ok";
}

const STATUS_WORDS = {
  provisioning: "Provisioning (booting, loading the model)",
  ready: "Ready",
  draining: "Draining (no new sessions)",
  released: "Released",
  failed: "Failed",
};

function workerCard(worker) {
  const card = el("article", { class: "worker-card", role: "listitem", "aria-labelledby": `worker-${worker.id}-name` });
  card.innerHTML = `
    <h3><span id="worker-${worker.id}-name"></span> <span class="badge" data-field="status"></span></h3>
    <dl>
      <dt>GPU</dt><dd data-field="gpu"></dd>
      <dt>Stage role</dt><dd data-field="stage-role"></dd>
      <dt>Sessions</dt><dd data-field="sessions"></dd>
      <dt>Load / K</dt><dd data-field="load"></dd>
    </dl>
    <div class="meter" role="meter" aria-valuemin="0" data-field="meter"><span></span></div>
    <dl>
      <dt>Utilisation</dt><dd data-field="util"></dd>
      <dt>Memory</dt><dd data-field="memory"></dd>
      <dt>Power</dt><dd data-field="power"></dd>
      <dt>Price</dt><dd data-field="price"></dd>
      <dt>Heartbeat</dt><dd data-field="heartbeat"></dd>
      <dt>Scale-out</dt><dd data-field="phases"></dd>
    </dl>
    <button type="button" class="danger small" data-field="drain">Drain</button>`;
  card.querySelector(`#worker-${worker.id}-name`).textContent = worker.name;
  card.querySelector('[data-field="drain"]').addEventListener("click", () => drainWorker(card.dataset.id, card.dataset.name));
  return card;
}

// Stage roles (docs/stages.md): E encodes prompts, D diffuses, C decodes.
const STAGE_WORDS = {
  EDC: "EDC (whole pipeline)",
  ED: "ED (encode + diffuse)",
  DC: "DC (diffuse + decode)",
  D: "D (diffuse)",
  E: "E (shared encoder)",
  C: "C (decoder)",
};

const SOURCE_WORDS = { peer: "peer GPU", host_cache: "host cache", disk: "local disk", init: "seeded init" };

// requested → process up → weights complete (by source) → ready, in seconds from the request; a
// loading worker shows when the scale plan expects it ready.
function phasesText(w) {
  const p = w.phases || {};
  const s = (v) => (v === null || v === undefined ? null : `${v.toFixed(1)} s`);
  const parts = [];
  if (s(p.process_up_s)) parts.push(`up ${s(p.process_up_s)}`);
  if (s(p.weights_complete_s)) {
    const from = SOURCE_WORDS[w.weights_source] || w.weights_source || "?";
    parts.push(`weights ${s(p.weights_complete_s)} from ${from}`);
  }
  if (s(p.ready_s)) parts.push(`ready ${s(p.ready_s)}`);
  else if (s(p.expected_ready_s)) parts.push(`expected ready ${s(p.expected_ready_s)}`);
  return parts.length ? parts.join(" · ") : "–";
}

function renderPool(pool) {
  if (!pool) return;
  const models = pool.models || [];
  const rows = models.map((m) =>
    el(
      "tr",
      {},
      el("td", { text: m.model }),
      el("td", { text: String(m.gpu_copies) }),
      el("td", { text: `${m.host_copies} / ${pool.host_copies_bound}` }),
      el("td", { text: String(m.loading) }),
      el("td", {
        text: m.copies.map((c) => `${c.holder} (${c.kind}, ${c.state}${c.address ? ` @ ${c.address}` : ""})`).join(", "),
      }),
    ),
  );
  $("pool-models").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "5", class: "muted", text: "No copies registered." }))]),
  );
  const caches = pool.host_caches || [];
  $("pool-caches").textContent = caches.length
    ? caches
        .map((c) => `${c.name} @ ${c.host}: ${formatBytes(c.used_bytes)} / ${formatBytes(c.capacity_bytes)}${c.pinned ? " pinned" : ""}`)
        .join(" · ")
    : "No live host cache.";
}

function gpusText(region) {
  const types = new Set([...Object.keys(region.gpus_by_type), ...Object.keys(region.gpu_limits)]);
  if (!types.size) return "0";
  return [...types]
    .sort()
    .map((t) => `${t} ${region.gpus_by_type[t] || 0}${t in region.gpu_limits ? ` / ${region.gpu_limits[t]}` : ""}`)
    .join(", ");
}

function renderRegions(regions, origins) {
  if (!regions) return;
  const rows = regions.map((r) =>
    el(
      "tr",
      {},
      el("td", { text: r.name }),
      el("td", { text: gpusText(r) }),
      el("td", { class: "num", text: `${r.load} / ${r.slots}` }),
      el("td", { class: "num", text: String(r.sessions) }),
      el("td", { class: "num", text: fmtMoney(r.cost_rate_per_hour) }),
      el("td", { class: "num", text: String(r.price_multiplier) }),
      el("td", { class: "num", text: `${r.moves_out} / ${r.moves_in}` }),
      el("td", { class: "num", text: `${r.move_saving_ms} / ${r.move_switch_cost_ms} ms` }),
    ),
  );
  $("region-rows").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "8", class: "muted", text: "No region." }))]),
  );
  // Forecast against actual: each origin's load now and the router's forecast for the next slot.
  $("region-origins").textContent = (origins || []).length
    ? origins.map((o) => `${o.origin}: load ${o.load}, forecast ${o.forecast === null ? "–" : o.forecast}`).join(" · ")
    : "No user origins configured.";
}

function renderTenants(tenants) {
  if (!tenants) return;
  const pct = (x) => (x === null ? "–" : `${(x * 100).toFixed(1)} %`);
  const rows = tenants.map((t) =>
    el(
      "tr",
      {},
      el("td", { text: t.name }),
      el("td", { class: "num", text: `${t.weight} (${pct(t.weight_share)})` }),
      el("td", { class: "num", text: `${t.sessions} / ${t.queued}` }),
      el("td", { class: "num", text: String(t.jobs_queued) }),
      el("td", { class: "num", text: String(t.gpu_seconds_5m) }),
      el("td", { class: "num", text: pct(t.share_5m) }),
    ),
  );
  $("tenant-rows").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "6", class: "muted", text: "No tenant." }))]),
  );
}

function renderWorkers(workers) {
  const container = $("workers");
  const seen = new Set();
  let cursor = null;
  for (const w of workers) {
    seen.add(String(w.id));
    let card = state.cards.get(String(w.id));
    if (!card) {
      card = workerCard(w);
      state.cards.set(String(w.id), card);
    }
    placeAfter(container, cursor, card);
    cursor = card;
    card.dataset.id = w.id;
    card.dataset.name = w.name;
    card.dataset.status = w.status;
    const field = (name) => card.querySelector(`[data-field="${name}"]`);
    field("status").textContent = STATUS_WORDS[w.status] || w.status;
    field("status").dataset.state = w.status;
    field("gpu").textContent = `${w.gpu_type} · ${w.device}${w.host ? ` @ ${w.host}` : ""}`;
    let encoder = w.encoder ? ` · encoder queue ${w.encoder.queue ?? "?"}, ${w.encoder.served ?? "?"} served` : "";
    const source = w.encoder_source;
    if (source) {
      encoder += source.worker ? ` · encoder ${source.worker}` : " · no encoder yet";
      if (source.wait) encoder += ` · waiting: ${source.wait}`;
      const f = source.failover;
      if (f) encoder += ` · failover ${f.from || "?"} → ${f.to || "?"} (${f.status})`;
    }
    field("stage-role").textContent = `${STAGE_WORDS[w.stage_role] || w.stage_role}${encoder}`;
    const jobs = w.jobs && (w.jobs.running || w.jobs.paused) ? ` · jobs: ${w.jobs.running} running, ${w.jobs.paused} paused` : "";
    field("sessions").textContent = `${w.sessions} executing${w.parked ? ` · ${w.parked} parked in host memory` : ""}${jobs}`;
    field("load").textContent = `${w.load} / ${w.capacity}`;
    const meter = field("meter");
    const ratio = w.load_ratio ?? 0;
    meter.setAttribute("aria-valuemax", String(w.capacity));
    meter.setAttribute("aria-valuenow", String(w.load));
    meter.setAttribute("aria-label", `load ${w.load} of K=${w.capacity}`);
    meter.dataset.level = loadLevel(w.load_ratio);
    meter.firstElementChild.style.width = `${Math.min(100, ratio * 100)}%`;
    field("util").textContent = w.utilization_pct === null ? "–" : `${w.utilization_pct.toFixed(0)} %`;
    field("memory").textContent =
      w.memory_used_bytes === null && !w.memory_bytes ? "–" : `${formatBytes(w.memory_used_bytes)} / ${formatBytes(w.memory_bytes)}`;
    field("power").textContent = w.power_watts === null ? "–" : `${w.power_watts.toFixed(0)} W${w.temperature_c !== null ? ` · ${w.temperature_c.toFixed(0)} °C` : ""}`;
    field("price").textContent = fmtMoney(w.price_per_hour);
    field("heartbeat").textContent = w.last_heartbeat ? formatTime(w.last_heartbeat) : "never";
    field("phases").textContent = phasesText(w);
    const drain = field("drain");
    drain.hidden = w.status !== "ready";
    drain.setAttribute("aria-label", `Drain ${w.name}`);
  }
  for (const [id, card] of state.cards) {
    if (!seen.has(id)) {
      card.remove();
      state.cards.delete(id);
    }
  }
  if (!workers.length && !container.querySelector(".muted")) {
    container.append(el("p", { class: "muted", text: "No GPU workers. The autoscaler provisions them as sessions arrive." }));
  } else if (workers.length) {
    container.querySelector(":scope > p.muted")?.remove();
  }
}

// Rows are keyed by session and updated in place: chunk counters change every second, and a row
// rebuilt under the pointer would swallow the operator's click on its Terminate button.
function sessionRow(s) {
  const cell = (field, attrs = {}) => el("td", { ...attrs, dataset: { field } });
  const row = el(
    "tr",
    { dataset: { session: s.id } },
    el("td", {}, el("code", { title: s.id, text: s.id.slice(0, 8) }), el("div", { class: "muted small", text: `${s.model} ${s.resolution}` })),
    el("td", { text: s.tenant && s.tenant !== "default" ? `${s.owner} (${s.tenant})` : s.owner }),
    el("td", {}, el("span", { class: "badge small", dataset: { field: "status" } }), el("div", { class: "muted small", dataset: { field: "activity" } })),
    cell("worker"),
    cell("load", { class: "num" }),
    cell("chunks", { class: "num" }),
    el(
      "td",
      {},
      el("button", {
        type: "button",
        class: "danger small",
        dataset: { session: s.id },
        "aria-label": `Terminate session ${s.id.slice(0, 8)} of ${s.owner}`,
        text: "Terminate",
        onclick: () => terminateSession(s.id),
      }),
    ),
  );
  return row;
}

function renderSessions(sessions) {
  const body = $("session-rows");
  const seen = new Set();
  let cursor = null;
  for (const s of sessions) {
    seen.add(s.id);
    let row = state.sessionRows.get(s.id);
    if (!row) {
      row = sessionRow(s);
      state.sessionRows.set(s.id, row);
    }
    placeAfter(body, cursor, row);
    cursor = row;
    const field = (name) => row.querySelector(`[data-field="${name}"]`);
    const badge = field("status");
    badge.dataset.state = s.status;
    badge.textContent = s.status + (s.queue_position ? ` #${s.queue_position}` : "");
    field("activity").textContent = s.activity + (s.idle_reason === "no_viewers" ? " · no viewers" : "");
    const where = s.worker || (s.host_worker ? `${s.host_worker} (host)` : "–");
    // Several regions: the session's region and its user's origin beside the worker.
    const route = s.region ? ` · ${s.region}${s.origin ? ` (from ${s.origin})` : ""}` : "";
    field("worker").textContent = where + route;
    field("load").textContent = s.load;
    field("chunks").textContent = s.chunks_generated;
  }
  for (const [id, row] of state.sessionRows) {
    if (!seen.has(id)) {
      row.remove();
      state.sessionRows.delete(id);
    }
  }
  let empty = body.querySelector("tr.empty");
  if (!sessions.length && !empty) {
    empty = el("tr", { class: "empty" }, el("td", { colspan: "7", class: "muted", text: "No live sessions." }));
    body.append(empty);
  } else if (sessions.length && empty) {
    empty.remove();
  }
}

function renderTimeline(items) {
  if (!items) return;
  const signature = JSON.stringify(items.map((i) => [i.kind, i.at, i.title]));
  if (signature === state.timelineSignature) return;
  state.timelineSignature = signature;
  $("timeline").replaceChildren(
    ...(items.length
      ? items.map((i) =>
          el(
            "li",
            { dataset: { kind: i.kind } },
            el("time", { datetime: i.at, text: `${formatTime(i.at)} · ${i.kind}` }),
            el("div", { class: "title", text: i.title }),
            el("div", { class: "detail", text: i.detail }),
          ),
        )
      : [el("li", { class: "muted", text: "Nothing yet." })]),
  );
}

function renderConfig(config) {
  if (state.configDirty) return; // do not overwrite what the operator is typing
  $("cfg-min_gpus").value = config.min_gpus;
  $("cfg-max_gpus").value = config.max_gpus;
  $("cfg-target_utilization").value = config.target_utilization ?? "";
}

// Jobs carry no actions on the console (owners cancel their own): the table is rebuilt each time.
function jobStateText(j) {
  if (j.state === "queued") return j.position ? `queued #${j.position}` : "queued";
  if (j.state === "running" || j.state === "paused") return `${j.state} ${j.steps_done}/${j.steps}`;
  return j.state;
}

function renderJobs(jobs) {
  if (!jobs) return;
  const counts = Object.entries(jobs.by_state).map(([name, n]) => `${n} ${name}`);
  $("job-counts").textContent = `${counts.join(" · ")} (ended: last hour)`;
  const rows = jobs.list.map((j) =>
    el(
      "tr",
      { dataset: { job: j.id } },
      el("td", {}, el("code", { title: j.id, text: j.id.slice(0, 8) }), el("div", { class: "muted small", text: `${j.kind} · ${j.model} ${j.resolution}${j.kind === "video" ? ` · ${j.frames} frames` : ""}` })),
      el("td", { text: j.owner }),
      el("td", {}, el("span", { class: "badge small", dataset: { state: j.state }, text: jobStateText(j) })),
      el("td", { text: j.worker || "–" }),
      el("td", { class: "num", text: j.priority }),
      el("td", { text: formatTime(j.deadline) }),
    ),
  );
  if (!rows.length) rows.push(el("tr", { class: "empty" }, el("td", { colspan: "6", class: "muted", text: "No jobs in flight." })));
  $("job-rows").replaceChildren(...rows);
}

function apply(snapshot) {
  // A periodic push may carry a snapshot older than the one a refresh just delivered.
  if (state.snapshot && Date.parse(snapshot.at) < Date.parse(state.snapshot.at)) return;
  state.snapshot = snapshot;
  renderSummary(snapshot);
  renderWorkers(snapshot.workers);
  renderSessions(snapshot.session_list);
  renderJobs(snapshot.jobs);
  renderRegions(snapshot.regions, snapshot.origins);
  renderTenants(snapshot.tenants);
  renderPool(snapshot.parameter_pool);
  renderTimeline(snapshot.timeline);
  renderConfig(snapshot.config);
  if (record(snapshot)) updateCharts();
}

// --- Live updates --------------------------------------------------------------------------------

function connect() {
  const ws = new WebSocket(wsUrl("/ws/console/"));
  state.socket = ws;
  $("console-connection").textContent = state.attempt ? "Reconnecting…" : "Connecting…";
  ws.onopen = () => {
    state.attempt = 0;
    $("console-connection").textContent = "Live";
    if (state.hadError) message("Live updates are back.", "info");
    state.hadError = false;
  };
  ws.onmessage = (event) => {
    let msg;
    try {
      msg = JSON.parse(event.data);
    } catch {
      message("The console stream sent something unreadable.");
      return;
    }
    if (msg.type === "snapshot") apply(msg.snapshot);
    else if (msg.type === "error") message(`Live updates: ${msg.detail || msg.code}`, "warning");
  };
  ws.onclose = (event) => {
    if (state.socket !== ws) return;
    if (event.code === 4403) {
      $("console-connection").textContent = "Refused";
      message("The live console refused this login (staff only). Log in again with a staff account.");
      return;
    }
    const delay = Math.min(10000, 500 * 2 ** state.attempt) * (0.8 + 0.4 * Math.random());
    state.attempt += 1;
    state.hadError = true;
    $("console-connection").textContent = `Disconnected — retrying in ${(delay / 1000).toFixed(1)} s`;
    message("Live updates were interrupted; reconnecting automatically…", "warning");
    setTimeout(connect, delay);
  };
}

function refreshNow() {
  if (state.socket?.readyState === WebSocket.OPEN) state.socket.send(JSON.stringify({ type: "refresh" }));
}

// --- Actions ---------------------------------------------------------------------------------------

async function drainWorker(id, name) {
  if (!confirm(`Drain ${name}? It takes no new sessions; the scheduler moves its sessions away and releases it.`)) return;
  try {
    const result = await api(`/console/workers/${id}/drain/`, { method: "POST" });
    message(`${result.name} is ${result.status}.`, "info");
  } catch (err) {
    message(`Could not drain ${name}: ${err instanceof ApiError ? err.message : err}`);
  }
  refreshNow();
}

async function terminateSession(id) {
  if (!confirm(`Terminate session ${id.slice(0, 8)}? Its user's stream ends.`)) return;
  try {
    await api(`/console/sessions/${id}/terminate/`, { method: "POST" });
    message(`Session ${id.slice(0, 8)} terminated.`, "info");
  } catch (err) {
    message(`Could not terminate the session: ${err instanceof ApiError ? err.message : err}`);
  }
  refreshNow();
}

for (const input of $("config-form").querySelectorAll("input")) {
  input.addEventListener("input", () => {
    state.configDirty = true;
  });
}

$("config-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  for (const node of document.querySelectorAll('#config-form .field-error')) node.textContent = "";
  for (const node of document.querySelectorAll("#config-form [aria-invalid]")) node.removeAttribute("aria-invalid");
  const number = (id) => {
    const raw = $(id).value.trim();
    return raw === "" ? null : Number(raw);
  };
  const body = { min_gpus: number("cfg-min_gpus"), max_gpus: number("cfg-max_gpus"), target_utilization: number("cfg-target_utilization") };
  $("config-submit").disabled = true;
  try {
    const saved = await api("/console/config/", { method: "POST", body });
    state.configDirty = false;
    $("config-status").textContent =
      `Saved: ${saved.min_gpus}–${saved.max_gpus} GPUs, target utilisation ${saved.target_utilization ?? "adaptive"}.`;
    message("");
  } catch (err) {
    if (err instanceof ApiError && err.status === 400) {
      for (const [field, text] of Object.entries(fieldErrors(err.body))) {
        const node = $(`cfg-${field}-error`);
        if (node) {
          node.textContent = text;
          $(`cfg-${field}`).setAttribute("aria-invalid", "true");
        }
      }
    }
    $("config-status").textContent = "";
    message(`The autoscaler settings were not saved: ${err instanceof ApiError ? err.message : err}`);
  } finally {
    $("config-submit").disabled = false;
  }
  refreshNow();
});

const initial = JSON.parse($("console-snapshot").textContent);
buildCharts();
apply(initial);
connect();

// For the browser tests and the curious.
window.streamserveConsole = state;
