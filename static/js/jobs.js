// The jobs page: submit one-shot image/video jobs through the REST API, follow them over the
// /ws/jobs/ socket (queued with position, running step i/n, paused, done, failed), and show the
// results as a gallery. The socket only carries changes; the list comes from GET /api/jobs/.

import { api, el, fieldErrors, formatTime, showMessage, wsUrl } from "./common.js";

const $ = (id) => document.getElementById(id);
const jobs = new Map(); // id → the job as the API or the socket last described it
let models = [];
let socket = null;
let retry = 0;
let connectedBefore = false;

function stateText(job) {
  switch (job.state) {
    case "queued":
      return job.position ? `Queued — #${job.position} in line` : "Queued";
    case "running":
      return `Running — step ${job.step ?? job.steps_done ?? 0} of ${job.steps}`;
    case "paused":
      return `Paused at step ${job.step ?? job.steps_done ?? 0} of ${job.steps} (streams come first)`;
    case "done":
      return "Done";
    case "failed":
      return `Failed — ${job.error || "no reason given"}`;
    default:
      return "Cancelled";
  }
}

function resultNode(job) {
  if (job.state !== "done" || !job.result_url) return null;
  if (job.kind === "video") {
    return el("video", { src: job.result_url, controls: true, loop: true, muted: true, class: "result", "aria-label": job.prompt });
  }
  return el("img", { src: job.result_url, alt: job.prompt, class: "result", loading: "lazy" });
}

function render(job) {
  const inFlight = ["queued", "running", "paused"].includes(job.state);
  const step = job.step ?? job.steps_done ?? 0;
  const card = el(
    "li",
    { class: "card job", id: `job-${job.id}`, dataset: { state: job.state } },
    el("div", { class: "row between" },
      el("span", { class: "badge", dataset: { state: job.state }, text: stateText(job) }),
      inFlight ? el("button", { type: "button", class: "small danger", text: "Cancel", onclick: () => cancel(job.id) }) : null),
    resultNode(job),
    inFlight && job.state !== "queued"
      ? el("progress", { max: job.steps, value: step, "aria-label": `step ${step} of ${job.steps}` })
      : null,
    el("p", { class: "prompt", text: job.prompt || "" }),
    el("p", { class: "muted small", text: `${job.kind} · ${job.model || ""} ${job.resolution || ""}${job.kind === "video" ? ` · ${job.frames} frames` : ""} · submitted ${formatTime(job.submitted_at)}` }),
    job.result_url ? el("a", { href: job.result_url, download: "", text: "Download" }) : null,
  );
  const old = $(`job-${job.id}`);
  if (old) old.replaceWith(card);
  else $("gallery").prepend(card);
  $("gallery-empty").hidden = jobs.size > 0;
}

// How far a description of a job has got: queued, then running or paused at a step, then ended.
const STAGES = { queued: 1, running: 2, paused: 2, done: 3, failed: 3, cancelled: 3 };

function progressOf(job) {
  return [STAGES[job.state] ?? 0, job.step ?? 0];
}

function isBehind(incoming, known) {
  const [a, b] = [progressOf(incoming), progressOf(known)];
  return a[0] < b[0] || (a[0] === b[0] && a[1] < b[1]);
}

function update(message) {
  // Descriptions reach the page out of order: the POST's answer, API reads and socket messages
  // broadcast by several processes. One behind what the page already shows (an image's "running,
  // step 0" answered after its "done") only fills in what the page lacks; it never undoes progress.
  const id = message.job || message.id;
  const incoming = { ...message, id };
  if (incoming.step === undefined && incoming.steps_done !== undefined) incoming.step = incoming.steps_done;
  const known = jobs.get(id);
  const job = known && isBehind(incoming, known) ? { ...incoming, ...known } : { ...(known || {}), ...incoming };
  jobs.set(id, job);
  if (job.prompt === undefined) {
    // A socket message carries the state only: the rest comes from the API.
    api(`/api/jobs/${id}/`).then((full) => update(full)).catch(() => {});
    return;
  }
  render(job);
}

// The newest page of the user's jobs, newest on top (cards are prepended, so oldest first).
async function loadJobs() {
  const page = await api("/api/jobs/");
  for (const job of [...page.results].reverse()) update(job);
}

async function cancel(id) {
  try {
    update(await api(`/api/jobs/${id}/cancel/`, { method: "POST" }));
  } catch (err) {
    showMessage($("page-message"), err.message);
  }
}

function connect() {
  socket = new WebSocket(wsUrl("/ws/jobs/"));
  socket.onopen = () => {
    retry = 0;
    $("connection-state").textContent = "Live";
    // The socket replays only jobs still in flight: one that ended while it was down is read again.
    if (connectedBefore) loadJobs().catch((err) => showMessage($("page-message"), err.message));
    connectedBefore = true;
  };
  socket.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.type === "job") update(message);
    else if (message.type === "error") showMessage($("page-message"), message.detail);
  };
  socket.onclose = () => {
    $("connection-state").textContent = "Reconnecting…";
    const delay = Math.min(10_000, 500 * 2 ** retry) * (0.8 + Math.random() * 0.4);
    retry += 1;
    setTimeout(connect, delay);
  };
}

function fillResolutions() {
  const model = models.find((m) => m.name === $("job-model").value);
  $("job-resolution").replaceChildren(
    ...(model ? model.resolutions : []).map((r) => el("option", { value: r, text: r, selected: r === model.default_resolution })),
  );
}

async function loadModels() {
  models = (await api("/api/models/")).filter((m) => m.served !== false);
  $("job-model").replaceChildren(...models.map((m) => el("option", { value: m.name, text: m.name, selected: m.default })));
  fillResolutions();
  $("job-submit").disabled = models.length === 0;
}

function clearErrors(form) {
  for (const node of form.querySelectorAll(".field-error")) node.textContent = "";
  for (const input of form.querySelectorAll("[aria-invalid]")) input.removeAttribute("aria-invalid");
}

async function submit(event) {
  event.preventDefault();
  const form = event.target;
  clearErrors(form);
  showMessage($("page-message"), "");
  const kind = form.elements.kind.value;
  const body = { kind, prompt: $("job-prompt").value, model: $("job-model").value, resolution: $("job-resolution").value };
  const numbers = { steps: "job-steps", slo_s: "job-slo", priority: "job-priority", seed: "job-seed" };
  if (kind === "video") numbers.frames = "job-frames";
  for (const [field, id] of Object.entries(numbers)) {
    if ($(id).value !== "") body[field] = Number($(id).value);
  }
  $("job-submit").disabled = true;
  try {
    update(await api("/api/jobs/", { method: "POST", body }));
  } catch (err) {
    for (const [field, text] of Object.entries(fieldErrors(err.body))) {
      const line = $(`job-${field}-error`);
      if (line) line.textContent = text;
      const input = form.querySelector(`[name="${field}"]`);
      if (input) input.setAttribute("aria-invalid", "true");
    }
    showMessage($("page-message"), err.message);
  } finally {
    $("job-submit").disabled = false;
  }
}

function showKind() {
  $("frames-field").hidden = $("job-form").elements.kind.value !== "video";
}

async function main() {
  $("job-form").addEventListener("submit", submit);
  $("job-model").addEventListener("change", fillResolutions);
  for (const radio of document.querySelectorAll('input[name="kind"]')) radio.addEventListener("change", showKind);
  try {
    await loadModels();
    await loadJobs();
  } catch (err) {
    showMessage($("page-message"), err.message);
  }
  connect();
}

main();
