// Shared helpers for StreamServe pages: JSON requests with the CSRF token, and error messages a
// person can act on for every failure the API can return.

export class ApiError extends Error {
  constructor(status, body, message) {
    super(message);
    this.name = "ApiError";
    this.status = status; // 0: the request never reached the server
    this.body = body;
  }
}

export function csrfToken() {
  const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  return match ? decodeURIComponent(match[1]) : "";
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const init = {
    method,
    credentials: "same-origin",
    headers: { Accept: "application/json" },
    signal,
  };
  if (method !== "GET" && method !== "HEAD") {
    init.headers["X-CSRFToken"] = csrfToken();
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, null, "Could not reach the server. Check your connection and try again.");
  }
  const type = response.headers.get("Content-Type") || "";
  let data = null;
  if (type.includes("application/json")) {
    try {
      data = await response.json();
    } catch {
      data = null;
    }
  }
  if (!response.ok) throw new ApiError(response.status, data, describeStatus(response.status, data));
  return data;
}

// Field errors as {field: "message"} from a DRF/Django 400 body.
export function fieldErrors(body) {
  const out = {};
  if (!body || typeof body !== "object") return out;
  for (const [field, value] of Object.entries(body)) {
    if (field === "detail") continue;
    out[field] = Array.isArray(value) ? value.join(" ") : typeof value === "object" ? JSON.stringify(value) : String(value);
  }
  return out;
}

export function describeStatus(status, body) {
  const detail = body && typeof body.detail === "string" ? body.detail : "";
  switch (status) {
    case 400: {
      const fields = fieldErrors(body);
      const parts = Object.entries(fields).map(([f, m]) => (f === "non_field_errors" ? m : `${f}: ${m}`));
      return parts.length ? `Please correct: ${parts.join("; ")}` : detail || "The request was not valid.";
    }
    case 401:
      return "You are not logged in (or your login expired). Log in again to continue.";
    case 403:
      return detail && !/credentials/i.test(detail)
        ? `Not allowed: ${detail}`
        : "You don't have permission to do that. If your login expired, reload the page.";
    case 404:
      return "Not found: it was deleted or belongs to another account.";
    case 405:
      return "The server does not accept that action here.";
    case 409:
      return detail || "That conflicts with the current state; refresh and try again.";
    case 429:
      return "Too many requests; wait a moment and try again.";
    default:
      if (status >= 500) return `The server failed (${status}). Try again in a moment.`;
      return detail || `The request failed (${status}).`;
  }
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// A message area: role="alert" for errors (announced at once), role="status" for the rest.
export function showMessage(container, text, kind = "error") {
  container.replaceChildren();
  if (!text) {
    container.hidden = true;
    return;
  }
  container.hidden = false;
  container.className = `alert alert-${kind}`;
  container.setAttribute("role", kind === "error" ? "alert" : "status");
  container.append(text);
  if (/log in/i.test(text) && /not logged in|expired/i.test(text)) {
    container.append(" ", el("a", { href: `/accounts/login/?next=${encodeURIComponent(location.pathname + location.search)}`, text: "Log in" }));
  }
}

export function formatMs(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "–";
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

// Money with the precision its size needs: three significant digits below a dollar ($0.002,
// $0.0123: a GPU-minute can cost a tenth of a cent, which toFixed(2) shows as $0.00), cents up to
// $1,000 ($12.34), whole dollars above ($1,234). At least two decimals below $1,000, as for cents.
export function formatUsd(value) {
  if (value === null || value === undefined || value === "") return "–";
  const amount = Number(value);
  if (!Number.isFinite(amount)) return "–";
  const size = Math.abs(amount);
  let decimals = 2;
  if (size >= 1000) decimals = 0;
  else if (size > 0 && size < 1) decimals = Math.min(20, 2 - Math.floor(Math.log10(size)));
  return new Intl.NumberFormat("en-US", {
    style: "currency",
    currency: "USD",
    minimumFractionDigits: Math.min(decimals, 2),
    maximumFractionDigits: decimals,
  }).format(amount);
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(value >= 10 || unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function formatTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return d.toLocaleString(undefined, { hour12: false });
}

export function wsUrl(path) {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return `${proto}//${location.host}${path}`;
}
