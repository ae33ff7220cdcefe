// The interactive generation page: start a session, watch it stream, steer it.
// Commands (create, prompt, pause, resume, end) go through the REST API; the WebSocket carries the
// live stream (chunks and status) only, so every command gets a plain HTTP answer with field errors.

import { ApiError, api, el, fieldErrors, formatMs, formatTime, showMessage, wsUrl } from "./common.js";
import { MsePlayer, StreamPlayer, WebRtcPlayer } from "./player.js";
import { parseChunkFrame } from "./protocol.js";

const $ = (id) => document.getElementById(id);
const MAX_BACKOFF_MS = 10000;
const SPARK_LENGTH = 40;

// H.264 is asked for only where MSE can play it. The workers' x264 encodes in its default High
// profile (the init segment's MIME is e.g. avc1.64001E at 832x480, avc1.64000A at 64x64), so the
// probe names that family; the MIME that actually arrives is checked again before it is played.
const H264_PROBE = 'video/mp4; codecs="avc1.64001F"';

const page = {
  session: null,
  socket: null,
  models: [],
  latencies: [],
  lastChunk: null,
  framesShown: 0,
  // "auto" (H.264 where MSE can play it), "webrtc" or "jpeg": the select, first set from ?codec= on the URL.
  codecChoice: ["jpeg", "webrtc"].includes(new URLSearchParams(location.search).get("codec"))
    ? new URLSearchParams(location.search).get("codec")
    : "auto",
  codec: "jpeg", // what the socket asks for: "h264" or "jpeg"
  transport: "socket", // how the pictures come: on the socket, or over WebRTC (H.264 only)
  codecNote: "",
  // Glass to glass: per chunk, wall-clock ms (epoch) from its encode finishing on the worker (the
  // header's generated_at) to its arrival here and to its first frame on screen. The worker and
  // this page read the same clock only on one machine (bench_glass); across machines the figure
  // carries their clock offset.
  arrivals: new Map(), // index → {generatedAt, receivedAt}
  glass: [], // {index, codec, arrivalMs, glassMs}, the newest GLASS_KEPT
};
const GLASS_KEPT = 1000;

// Each player reports its state while it is the one the socket feeds (`player`, set by usePlayer;
// still null while the first one is constructed).
let player = null;
let msePlayer = null; // made on first use: it owns a MediaSource
let rtcPlayer = null; // made on first use: it owns a peer connection
// STUN/TURN servers (WEBRTC_ICE_SERVERS), rendered into the page.
const ICE_SERVERS = JSON.parse($("webrtc-ice-servers")?.textContent || "[]");
const jpegPlayer = new StreamPlayer($("video"), {
  onState: (p) => player !== null && player === jpegPlayer && renderPlayback(p),
  onPresented: (index, time) => player === jpegPlayer && recordGlass(index, time),
});

function mseSupported() {
  return Boolean(window.MediaSource && window.MediaSource.isTypeSupported?.(H264_PROBE));
}

// Which codec to ask the server for, and why (shown beside the stats).
function chooseCodec() {
  if (page.codecChoice === "jpeg") return { codec: "jpeg", note: "(chosen)" };
  if (page.codecChoice === "webrtc") {
    if (window.RTCPeerConnection) return { codec: "h264", note: "", transport: "webrtc" };
    const fallback = mseSupported() ? "h264" : "jpeg";
    return { codec: fallback, note: "(this browser has no WebRTC)" };
  }
  if (!mseSupported()) return { codec: "jpeg", note: "(this browser cannot play H.264 through Media Source Extensions)" };
  return { codec: "h264", note: "" };
}

function usePlayer(codec, note, transport = "socket") {
  page.codec = codec;
  page.codecNote = note;
  page.transport = transport;
  const webrtc = transport === "webrtc";
  if (webrtc && !rtcPlayer) {
    rtcPlayer = new WebRtcPlayer($("rtc-video"), {
      iceServers: ICE_SERVERS,
      onState: (p) => player !== null && player === rtcPlayer && renderPlayback(p),
      onError: fallBackFromWebRtc,
      onPresented: (index, time) => player === rtcPlayer && recordGlass(index, time),
    });
  }
  if (codec === "h264" && !webrtc && !msePlayer) {
    msePlayer = new MsePlayer($("mse-video"), {
      onState: (p) => player !== null && player === msePlayer && renderPlayback(p),
      onError: fallBackToJpeg,
      onPresented: (index, time) => player === msePlayer && recordGlass(index, time),
    });
  }
  player = webrtc ? rtcPlayer : codec === "h264" ? msePlayer : jpegPlayer;
  $("video").hidden = codec !== "jpeg";
  $("mse-video").hidden = codec !== "h264" || webrtc;
  $("rtc-video").hidden = !webrtc;
  if ((codec !== "h264" || webrtc) && msePlayer) msePlayer.reset(); // releases its MediaSource
  if (!webrtc && rtcPlayer) rtcPlayer.reset(); // closes its peer connection
  renderCodec();
}

function renderCodec() {
  const h264 = page.transport === "webrtc" ? "H.264 (WebRTC)" : "H.264 (MSE)";
  $("stat-codec").textContent = page.codec === "h264" ? h264 : "JPEG";
  $("codec-note").textContent = page.codecNote;
  $("codec-choice").value = page.codecChoice;
}

// MSE refused the stream (a SourceBuffer error, a decode error, a MIME it cannot play): the same
// session continues as JPEG frames on the canvas, over a new socket that asks for them.
function fallBackToJpeg(reason) {
  if (page.codec !== "h264") return;
  usePlayer("jpeg", "(H.264 playback failed: fell back)");
  message(`H.264 playback failed (${reason}); switched to JPEG frames.`, "warning");
  if (page.session) openSession(page.session, { pushUrl: false });
}

// WebRTC brought no picture (no connection, or none presented within its timeout after the server
// sent one, or the server refused the signalling): the same session continues on the socket, as
// H.264 through MSE where the browser can, else JPEG.
function fallBackFromWebRtc(reason) {
  if (page.transport !== "webrtc") return;
  const codec = mseSupported() ? "h264" : "jpeg";
  usePlayer(codec, "(WebRTC failed: fell back to the socket)");
  message(`WebRTC playback failed (${reason}); the stream continues over the socket.`, "warning");
  if (page.session) openSession(page.session, { pushUrl: false });
}

// --- The session WebSocket, reconnecting with capped exponential backoff --------------------------

class SessionSocket {
  constructor(sessionId, handlers) {
    this.sessionId = sessionId;
    this.handlers = handlers;
    this.attempt = 0;
    this.closed = false;
    this.ws = null;
    this.timer = null;
    this.lastHeardAt = performance.now();
    // A dead network often closes nothing: the socket just goes quiet. While the session should
    // be streaming, silence longer than `handlers.silenceLimitMs()` counts as a lost connection.
    this.watchdog = setInterval(() => this.checkSilence(), 1000);
    this.open();
  }

  checkSilence() {
    const ws = this.ws;
    const limit = this.handlers.silenceLimitMs();
    if (!ws || ws.readyState !== WebSocket.OPEN || !limit) return;
    if (performance.now() - this.lastHeardAt < limit) return;
    this.ws = null; // whatever this socket does from now on is ignored
    ws.close();
    this.handlers.onClose({ code: 1006, reason: "", silent: true });
  }

  open() {
    clearTimeout(this.timer);
    this.timer = null;
    this.handlers.onConnection(this.attempt ? "reconnecting" : "connecting");
    const transport = this.handlers.transport();
    const query = `?codec=${this.handlers.codec()}${transport === "webrtc" ? "&transport=webrtc" : ""}`;
    const ws = new WebSocket(wsUrl(`/ws/sessions/${this.sessionId}/${query}`));
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    ws.onopen = () => {
      if (this.ws !== ws) return;
      this.attempt = 0;
      this.lastHeardAt = performance.now();
      this.handlers.onConnection("live");
      this.handlers.onOpen?.(this);
    };
    ws.onmessage = (event) => {
      if (this.ws !== ws) return;
      this.lastHeardAt = performance.now();
      if (typeof event.data === "string") {
        let message;
        try {
          message = JSON.parse(event.data);
        } catch {
          this.handlers.onProtocolError("the server sent a message that is not JSON");
          return;
        }
        this.handlers.onMessage(message);
      } else {
        let chunk;
        try {
          chunk = parseChunkFrame(event.data);
        } catch (err) {
          this.handlers.onProtocolError(err.message);
          return;
        }
        this.handlers.onChunk(chunk);
      }
    };
    ws.onclose = (event) => {
      if (this.ws !== ws) return;
      this.ws = null;
      if (!this.closed) this.handlers.onClose(event);
    };
  }

  get waiting() {
    return this.timer !== null;
  }

  get live() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  retryIn() {
    // 0.5 s, 1 s, 2 s … capped at 10 s, ±20 % so many clients do not reconnect in lockstep.
    const base = Math.min(MAX_BACKOFF_MS, 500 * 2 ** this.attempt);
    const delay = Math.round(base * (0.8 + 0.4 * Math.random()));
    this.attempt += 1;
    this.timer = setTimeout(() => this.open(), delay);
    return delay;
  }

  // One JSON message to the server (WebRTC signalling), on the socket that is open now.
  send(message) {
    if (this.live) this.ws.send(JSON.stringify(message));
  }

  reconnectNow() {
    if (this.waiting) this.open();
  }

  close() {
    this.closed = true;
    clearInterval(this.watchdog);
    clearTimeout(this.timer);
    this.timer = null;
    if (this.ws) this.ws.close(1000);
    this.ws = null;
  }
}

// --- Rendering --------------------------------------------------------------------------------

const STATE_TEXT = {
  queued: (s) => (s.queue_position ? `Queued — position ${s.queue_position}` : "Queued — waiting for a GPU"),
  executing: (s) => (s.activity === "idle" ? "Executing (pausing…)" : "Executing"),
  suspended: (s) =>
    s.activity !== "idle"
      ? "Suspended — resuming…"
      : s.idle_reason === "no_viewers"
        ? "Paused — nobody was watching (watching resumes it)"
        : "Paused — parked in host memory",
  migrating: () => "Migrating to another GPU",
  terminated: (s) => (s.reason ? `Ended — ${endReasonText(s.reason)}` : "Ended"),
};

// A depart event's reason ("user", "operator:NAME", "admin:NAME", "idle_timeout", "queue full (100
// waiting)" …) in words.
function endReasonText(reason) {
  if (reason === "user") return "you ended it";
  if (reason === "idle_timeout") return "nobody watched it for the idle timeout";
  if (reason.startsWith("operator") || reason.startsWith("admin")) return "an operator ended it";
  return `refused or ended by the platform: ${reason}`;
}

function renderSession() {
  const s = page.session;
  $("session-bar").hidden = !s;
  $("controls").hidden = !s;
  $("latency").hidden = !s;
  $("latency-spark").hidden = !s;
  if (!s) return;
  const badge = $("session-state");
  badge.dataset.state = s.status;
  badge.dataset.activity = s.activity;
  const stateText = (STATE_TEXT[s.status] || ((x) => x.status))(s);
  // A live region: rewrite it only when it changes, or screen readers repeat it at every chunk.
  if (badge.textContent !== stateText) badge.textContent = stateText;
  const where = [];
  if (s.worker) where.push(`on ${s.worker}`);
  where.push(`${s.chunks_generated ?? 0} chunks`);
  where.push(`${s.model} ${s.resolution || `${s.width}x${s.height}`} @ ${s.fps} fps`);
  $("session-where").textContent = where.join(" · ");
  const ended = s.status === "terminated";
  $("pause-button").disabled = ended || s.activity === "idle";
  $("resume-button").disabled = ended || s.activity === "active";
  $("terminate-button").disabled = ended;
  $("prompt-submit").disabled = ended;
  $("new-prompt").disabled = ended;
  if (!page.framesShown) {
    $("player-overlay").hidden = false;
    $("player-overlay").textContent = ended
      ? `This session has ended${s.reason ? ` (${endReasonText(s.reason)})` : ""}.`
      : `${badge.textContent}…`;
  }
  for (const item of document.querySelectorAll("#session-list li")) {
    if (item.dataset.session === s.id) {
      item.setAttribute("aria-current", "true");
      const listBadge = item.querySelector(".badge");
      if (listBadge) {
        listBadge.dataset.state = s.status;
        listBadge.textContent = s.status;
      }
      const meta = item.querySelector(".session-meta");
      if (meta) meta.textContent = sessionMeta(s);
    } else {
      item.removeAttribute("aria-current");
    }
  }
}

function renderConnection(kind, text) {
  const node = $("connection-state");
  node.dataset.kind = kind;
  if (node.textContent !== text) node.textContent = text;
}

function renderPlayback(p) {
  page.framesShown = p.framesShown;
  if (p.framesShown) $("player-overlay").hidden = true;
  $("stat-buffer").textContent = `${p.bufferedFrames} frame${p.bufferedFrames === 1 ? "" : "s"}`;
  const words = { idle: "waiting", buffering: "buffering", playing: "playing", stalled: "waiting for the next chunk" };
  let word = words[p.state] || p.state;
  if (p.state !== "playing" && page.session?.activity === "idle") word = "paused";
  if (p.state === "playing" && p.rate > 1.05) word = `playing at ${(1 / p.rate).toFixed(2)}×`; // matching a slow stream
  $("stat-playback").textContent = `${word}${p.stalls ? ` · ${p.stalls} stall${p.stalls === 1 ? "" : "s"}` : ""}`;
  const surface = page.transport === "webrtc" ? $("rtc-video") : page.codec === "h264" ? $("mse-video") : $("video");
  surface.dataset.framesShown = String(p.framesShown);
  surface.dataset.chunk = p.shownChunkIndex ?? "";
}

// `time` is on the performance.now() clock; the wall clock now minus its age is when it happened.
function recordGlass(index, time) {
  const arrival = page.arrivals.get(index);
  if (!arrival) return;
  page.arrivals.delete(index);
  const presentedAt = Date.now() - (performance.now() - time);
  const glassMs = presentedAt - arrival.generatedAt;
  page.glass.push({ index, codec: page.codec, transport: page.transport, arrivalMs: arrival.receivedAt - arrival.generatedAt, glassMs });
  if (page.glass.length > GLASS_KEPT) page.glass.shift();
  $("stat-glass").textContent = formatMs(glassMs);
}

function renderChunkStats(header) {
  $("stat-chunk").textContent = `#${header.index}`;
  $("stat-generation").textContent = formatMs(header.generation_ms);
  $("stat-delivery").textContent = formatMs(header.delivery_ms);
  $("stat-batch").textContent = header.batch_size ? `${header.batch_size} on ${header.worker}` : header.worker || "–";
  page.latencies.push(header.generation_ms);
  if (page.latencies.length > SPARK_LENGTH) page.latencies.shift();
  drawSpark();
}

function drawSpark() {
  const canvas = $("latency-spark");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const values = page.latencies;
  if (!values.length) return;
  const top = Math.max(...values) * 1.1 || 1;
  const barWidth = width / SPARK_LENGTH;
  ctx.fillStyle = getComputedStyle(canvas).color;
  values.forEach((v, i) => {
    const h = Math.max(1, (v / top) * (height - 2));
    ctx.fillRect(i * barWidth + 1, height - h, barWidth - 2, h);
  });
}

function message(text, kind = "error") {
  showMessage($("page-message"), text, kind);
}

function describe(err) {
  return err instanceof ApiError ? err.message : `Something went wrong: ${err.message || err}`;
}

function showFieldErrors(prefix, err) {
  for (const node of document.querySelectorAll(`[id^="${prefix}"][id$="-error"]`)) node.textContent = "";
  if (!(err instanceof ApiError) || err.status !== 400) return false;
  let shown = false;
  for (const [field, text] of Object.entries(fieldErrors(err.body))) {
    const node = $(`${prefix}${field}-error`);
    if (node) {
      node.textContent = text;
      const input = $(`${prefix}${field}`);
      if (input) input.setAttribute("aria-invalid", "true");
      shown = true;
    }
  }
  return shown;
}

function clearInvalid(form) {
  for (const input of form.querySelectorAll("[aria-invalid]")) input.removeAttribute("aria-invalid");
}

// --- Socket events ----------------------------------------------------------------------------

const SOCKET_ERRORS = {
  bad_message: "The server did not understand a message",
  rejected: "The server rejected the request",
  not_allowed: "Not allowed",
  terminated: "The session has ended",
};

// Error frames that mean this socket cannot carry WebRTC for this page (webrtc_unavailable: no media
// process answered the offer): fall back to the socket.
const WEBRTC_ERRORS = ["bad_sdp", "bad_candidate", "bad_signal", "bad_transport", "webrtc_unavailable"];

const socketHandlers = {
  codec() {
    return page.codec;
  },
  transport() {
    return page.transport;
  },
  onOpen(socket) {
    // Each socket offers afresh: the server's peer connection lives and dies with its socket.
    if (page.transport === "webrtc" && player === rtcPlayer) {
      rtcPlayer.connect((msg) => socket.send(msg)).catch((err) => fallBackFromWebRtc(`the offer failed: ${err.message}`));
    }
  },
  silenceLimitMs() {
    // Only while chunks should be flowing: executing for an active user. Eight chunks' worth of
    // video (at least 4 s) is far beyond generation jitter, migrations included.
    const s = page.session;
    if (!s || s.status !== "executing" || s.activity !== "active") return 0;
    return Math.max(4000, 8 * player.chunkMs);
  },
  onConnection(kind) {
    if (kind === "live") {
      renderConnection("live", "Live");
      if (page.reconnectNotice) message("Reconnected — the stream continues at the next chunk.", "info");
      page.reconnectNotice = false;
    } else if (kind === "connecting") {
      renderConnection("connecting", "Connecting…");
    } else {
      renderConnection("connecting", "Reconnecting…");
    }
  },
  onMessage(msg) {
    if (msg.type === "status") {
      Object.assign(page.session, {
        status: msg.status,
        activity: msg.activity ?? page.session.activity,
        queue_position: msg.queue_position ?? null,
        worker: msg.worker ?? null,
        chunks_generated: msg.chunks_generated ?? page.session.chunks_generated,
        // Why it ended (terminated only): e.g. refused by admission control when the queue is full.
        reason: msg.reason ?? page.session.reason ?? null,
        // Why it is idle when nobody paused it ("no_viewers": a viewer connecting resumes it).
        idle_reason: msg.idle_reason ?? null,
      });
      renderSession();
      if (msg.status === "terminated") endWithReason(page.session.id);
    } else if (msg.type === "prompt") {
      $("prompt-status").textContent = `Now generating “${msg.text}” from chunk ${msg.from_chunk}.`;
    } else if (msg.type === "skipped") {
      // The server dropped a chunk this connection was too slow to take (bounded outbox).
      page.skippedChunks = (page.skippedChunks || 0) + 1;
      $("stat-chunk").textContent = `#${msg.index} skipped (${page.skippedChunks} so far)`;
    } else if (String(msg.type).startsWith("webrtc.")) {
      if (page.transport !== "webrtc") return;
      if (msg.type === "webrtc.chunk" && msg.generated_at) {
        // "Arrival" for WebRTC: the chunk's first picture left the web process (this frame says so).
        page.arrivals.set(msg.index, { generatedAt: msg.generated_at * 1000, receivedAt: Date.now() });
        for (const old of page.arrivals.keys()) if (old < msg.index - 16) page.arrivals.delete(old);
      }
      rtcPlayer.handleMessage(msg);
      if (msg.type === "webrtc.chunk" && page.session && msg.session === page.session.id) {
        page.session.chunks_generated = Math.max(page.session.chunks_generated || 0, msg.index + 1);
        if (msg.worker) page.session.worker = msg.worker;
        renderChunkStats(msg);
        renderSession();
      }
    } else if (msg.type === "error" && page.transport === "webrtc" && WEBRTC_ERRORS.includes(msg.code)) {
      fallBackFromWebRtc(msg.detail || msg.code);
    } else if (msg.type === "error") {
      const what = SOCKET_ERRORS[msg.code] || `Stream error (${msg.code})`;
      message(msg.detail ? `${what}: ${msg.detail}` : `${what}.`);
    }
  },
  onChunk({ header, frames }) {
    if (!page.session || header.session !== page.session.id) return;
    if ((header.codec || "jpeg") !== page.codec) return; // sent before a fallback took effect
    if (header.generated_at) {
      page.arrivals.set(header.index, { generatedAt: header.generated_at * 1000, receivedAt: Date.now() });
      for (const old of page.arrivals.keys()) if (old < header.index - 16) page.arrivals.delete(old);
    }
    page.session.chunks_generated = Math.max(page.session.chunks_generated || 0, header.index + 1);
    if (header.worker) page.session.worker = header.worker;
    renderChunkStats(header);
    renderSession();
    const codec = page.codec;
    player.pushChunk(header, frames).catch(() => {
      // An H.264 failure is reported once, by the fallback (onError), not once per chunk.
      if (codec === "jpeg") message(`Chunk ${header.index} could not be decoded; skipped.`);
    });
  },
  onProtocolError(text) {
    message(`The stream sent something unreadable (${text}); skipped.`);
  },
  async onClose(event) {
    const socket = page.socket;
    renderConnection("down", "Disconnected");
    // Ask the API why: it answers 401/404/terminated plainly where a socket close code cannot.
    try {
      const fresh = await api(`/api/sessions/${socket.sessionId}/`);
      if (page.socket !== socket) return;
      page.session = fresh;
      renderSession();
      if (fresh.status === "terminated") {
        endWithReason(fresh.id);
        return;
      }
    } catch (err) {
      if (page.socket !== socket) return;
      if (err instanceof ApiError && [401, 403, 404].includes(err.status)) {
        endStream(err.message);
        return;
      }
    }
    const delay = socket.retryIn();
    page.reconnectNotice = true;
    let why = "the connection was lost";
    if (event.silent) why = "nothing arrived for several seconds";
    else if (event.code >= 4000 && event.code < 5000) why = `the server closed the stream (${event.code}${event.reason ? `: ${event.reason}` : ""})`;
    renderConnection("down", `Reconnecting in ${(delay / 1000).toFixed(1)} s (attempt ${socket.attempt})`);
    message(`Live stream interrupted: ${why}. Reconnecting automatically…`, "warning");
  },
};

// Why a session ended: the status message says (``reason``); a session opened after it ended asks
// its depart event. The reason stays on the page (state badge and player), not only in a message.
async function endWithReason(sessionId) {
  endStream("The session has ended.");
  const reason = page.session?.reason || (await loadEndReason(sessionId));
  if (!reason || page.session?.id !== sessionId) return;
  if (reason === "user") message("You ended this session.", "info");
  else if (reason.startsWith("operator") || reason.startsWith("admin")) message("An operator ended this session.", "info");
  else if (reason === "idle_timeout") message("The session ended: nobody watched it for the idle timeout.", "info");
  else message(`The session has ended: ${reason}.`, "info");
}

async function loadEndReason(sessionId) {
  try {
    const first = await api(`/api/sessions/${sessionId}/events/?limit=1`);
    const last = await api(`/api/sessions/${sessionId}/events/?limit=1&offset=${Math.max(0, first.count - 1)}`);
    const event = last.results?.[0];
    if (!event || event.kind !== "depart" || page.session?.id !== sessionId) return null;
    page.session.reason = String(event.detail?.reason ?? "") || null;
    renderSession();
    return page.session.reason;
  } catch {
    return null; // the plain "Ended" already shown is enough
  }
}

function endStream(text) {
  if (page.socket) page.socket.close();
  page.socket = null;
  renderConnection("down", "Closed");
  if (text) message(text, "info");
  renderSession();
  loadSessions();
}

// --- Commands ---------------------------------------------------------------------------------

function openSession(session, { pushUrl = true } = {}) {
  if (page.socket) page.socket.close();
  page.session = session;
  page.latencies = [];
  page.framesShown = 0;
  player.reset();
  player.configure({ width: session.width, height: session.height, fps: session.fps, framesPerChunk: session.frames_per_chunk });
  $("video").getContext("2d").clearRect(0, 0, session.width, session.height);
  for (const id of ["stat-chunk", "stat-generation", "stat-delivery", "stat-batch"]) $(id).textContent = "–";
  drawSpark();
  $("prompt-status").textContent = session.prompt ? `Prompt: “${session.prompt}”` : "";
  if (pushUrl) replaceUrl();
  renderSession();
  if (session.status === "terminated") {
    renderConnection("down", "Closed");
    loadEndReason(session.id);
    return;
  }
  page.socket = new SessionSocket(session.id, socketHandlers);
}

async function command(path, body) {
  const s = page.session;
  if (!s) return null;
  message("");
  try {
    return await api(`/api/sessions/${s.id}/${path}/`, { method: "POST", body });
  } catch (err) {
    message(describe(err));
    return null;
  }
}

async function applySessionCommand(path) {
  const updated = await command(path);
  if (updated && page.session && updated.id === page.session.id) {
    if (updated.status === "terminated" || !page.socket?.live) {
      page.session = updated;
    } else {
      // The live stream owns status, worker and queue position: a status frame sent after this
      // response was made may already have arrived, and the response must not roll it back.
      page.session.activity = updated.activity;
    }
    renderSession();
    if (updated.status === "terminated") endStream("You ended this session.");
  }
  loadSessions();
}

async function loadModels() {
  try {
    page.models = await api("/api/models/");
  } catch (err) {
    message(`Could not load the model list: ${describe(err)}`);
    return;
  }
  const select = $("start-model");
  // Models this deployment does not serve are listed but cannot be chosen (the API would refuse them).
  select.replaceChildren(
    ...page.models.map((m) =>
      el("option", {
        value: m.name,
        text: m.served === false ? `${m.name} — not served here` : `${m.name} — ${m.fps} fps`,
        disabled: m.served === false,
      }),
    ),
  );
  // The deployment's default (the trained demo model when served), else the first served model.
  const served = page.models.filter((m) => m.served !== false);
  const preferred = served.find((m) => m.default) || served[0];
  if (preferred) select.value = preferred.name;
  renderResolutions();
  $("start-submit").disabled = false;
}

function renderResolutions() {
  const model = page.models.find((m) => m.name === $("start-model").value);
  const select = $("start-resolution");
  if (!model) return;
  select.replaceChildren(...model.resolutions.map((r) => el("option", { value: r, text: r })));
  select.value = model.default_resolution;
  $("start-model-help").textContent = model.description;
}

function sessionMeta(s) {
  return `${s.model} ${s.resolution} · ${s.chunks_generated ?? 0} chunks · ${formatTime(s.created_at)}`;
}

async function loadSessions() {
  let data;
  try {
    data = await api("/api/sessions/?limit=20&ordering=-created_at");
  } catch (err) {
    $("session-list").replaceChildren(el("li", { class: "muted", text: `Could not load your sessions: ${describe(err)}` }));
    return;
  }
  const items = (data.results || []).map((s) =>
    el(
      "li",
      { dataset: { session: s.id }, "aria-current": page.session && page.session.id === s.id ? "true" : null },
      el(
        "button",
        { type: "button", class: "session-link", onclick: () => openSession(s) },
        el("span", { class: "session-prompt", text: s.prompt || "(no prompt)" }),
        el("span", { class: "badge small", dataset: { state: s.status }, text: s.status }),
        el("span", { class: "muted small session-meta", text: sessionMeta(s) }),
      ),
    ),
  );
  $("session-list").replaceChildren(...(items.length ? items : [el("li", { class: "muted", text: "No sessions yet." })]));
}

// The page's URL: the open session, and the codec when the user forced one.
function replaceUrl() {
  const params = new URLSearchParams();
  if (page.session) params.set("session", page.session.id);
  if (page.codecChoice !== "auto") params.set("codec", page.codecChoice);
  const query = params.toString();
  history.replaceState(null, "", query ? `?${query}` : location.pathname);
}

$("codec-choice").addEventListener("change", (event) => {
  page.codecChoice = event.currentTarget.value;
  const { codec, note, transport } = chooseCodec();
  usePlayer(codec, note, transport);
  replaceUrl();
  if (page.session) openSession(page.session, { pushUrl: false });
});

$("start-model").addEventListener("change", renderResolutions);

$("start-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = event.currentTarget;
  clearInvalid(form);
  message("");
  const body = {
    prompt: $("start-prompt").value,
    model: $("start-model").value,
    resolution: $("start-resolution").value,
  };
  const seed = $("start-seed").value.trim();
  if (seed !== "") body.seed = Number(seed);
  $("start-submit").disabled = true;
  try {
    const session = await api("/api/sessions/", { method: "POST", body });
    showFieldErrors("start-", null);
    openSession(session);
    loadSessions();
  } catch (err) {
    const shown = showFieldErrors("start-", err);
    message(shown ? "The session was not started: please correct the highlighted fields." : describe(err));
  } finally {
    $("start-submit").disabled = false;
  }
});

$("prompt-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  clearInvalid(event.currentTarget);
  $("new-prompt-error").textContent = "";
  const text = $("new-prompt").value;
  const s = page.session;
  if (!s) return;
  message("");
  try {
    const prompt = await api(`/api/sessions/${s.id}/prompts/`, { method: "POST", body: { text } });
    $("prompt-status").textContent = `Prompt accepted: “${prompt.text}” applies from chunk ${prompt.from_chunk}.`;
    $("new-prompt").value = "";
  } catch (err) {
    if (err instanceof ApiError && err.status === 400) {
      const errors = fieldErrors(err.body);
      $("new-prompt-error").textContent = errors.text || Object.values(errors).join(" ");
      $("new-prompt").setAttribute("aria-invalid", "true");
    }
    message(describe(err));
  }
});

$("pause-button").addEventListener("click", () => applySessionCommand("pause"));
$("resume-button").addEventListener("click", () => applySessionCommand("resume"));
$("terminate-button").addEventListener("click", () => {
  if (confirm("End this session? Its stream stops and it cannot be resumed.")) applySessionCommand("terminate");
});
$("sessions-refresh").addEventListener("click", loadSessions);
window.addEventListener("online", () => page.socket?.reconnectNow());
window.addEventListener("pagehide", () => page.socket?.close());

async function boot() {
  await loadModels();
  await loadSessions();
  const wanted = new URLSearchParams(location.search).get("session");
  if (wanted) {
    try {
      openSession(await api(`/api/sessions/${encodeURIComponent(wanted)}/`), { pushUrl: false });
    } catch (err) {
      message(`Could not open session ${wanted}: ${describe(err)}`);
    }
  }
  setInterval(() => {
    if (document.visibilityState === "visible") loadSessions();
  }, 20000);
}

{
  const { codec, note, transport } = chooseCodec();
  usePlayer(codec, note, transport);
}

// For the browser tests and the curious: the player's counters and the session the page shows.
window.streamserve = {
  page,
  get player() {
    return player;
  },
};
boot();
