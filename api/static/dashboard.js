// gpujobs dashboard: plain JavaScript, no build step. Every API call sends the token from localStorage as Bearer.
"use strict";

const TOKEN_KEY = "gpujobs.token";
const TERMINAL = ["succeeded", "failed", "cancelled"];
const POLL_MS = 1000;
const JOBS_SHOWN = 200;  // the jobs list's length; a note says when older jobs exist
const EVENTS_SHOWN = 200;  // a job page's events table; a note says when it holds fewer than the run's events
const main = document.getElementById("main");
let timer = null;        // the current view's polling timer
let view = 0;            // bumped on every navigation: stale polls of a previous view draw nothing

class Unauthorized extends Error {}

async function api(path) {
  return (await apiPage(path)).body;
}

// A list route's answer and whether its limit cut it (the X-Has-More header): no list stops without saying so.
function auth() { return { Authorization: "Bearer " + localStorage.getItem(TOKEN_KEY) }; }

async function apiPage(path) {
  const response = await fetch(path, { headers: auth() });
  if (response.status === 401) throw new Unauthorized("the token was refused: sign in again");
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return { body, more: response.headers.get("X-Has-More") === "true" };
}

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function ago(ts) {
  if (!ts) return "";
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 90 ? `${s.toFixed(0)} s ago` : s < 5400 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

function when(ts) { return ts ? new Date(ts * 1000).toLocaleString() : ""; }
function gib(bytes) { return bytes == null ? "?" : (bytes / 2 ** 30).toFixed(1) + " GiB"; }
function done(job) { return job.rows.succeeded + job.rows.failed; }

// A fine-tune's training tok/s: the whole run's once it ended (as `gpujobs status` and `adapters show` give it),
// else the last logged step's, which can be many times the run's.
function trainingRate(job) {
  const run = TERMINAL.includes(job.state) ? ((job.metrics || {}).training || {}).train_tokens_per_s : null;
  return run != null ? run : (job.training || {}).tokens_per_s;
}

function rate(job) {
  if (job.kind === "finetune") {  // training throughput; a fine-tune generates no tokens
    const r = trainingRate(job);
    return r != null ? `${r} training tok/s` : "";
  }
  if (job.live && job.live.tokens_per_s) return `${job.live.tokens_per_s} tok/s`;
  if (job.metrics && job.metrics.output_tok_s != null) return `${job.metrics.output_tok_s} tok/s`;
  return "";
}

// Progress coloured by outcome: succeeded rows blue while the job runs, green once it succeeded, grey once it
// failed or was cancelled; failed rows red. A job whose every row failed is a red bar, never a blue one.
function bar(job) {
  const total = job.rows.total, pct = n => (total ? (100 * n) / total : 0).toFixed(1);
  const ok = job.state === "succeeded" ? "ok-done" : TERMINAL.includes(job.state) || job.state === "cancelling" ? "ok-ended" : "ok-live";
  return `<span class="bar" title="${job.rows.succeeded} succeeded, ${job.rows.failed} failed, ${job.rows.pending} pending">` +
    `<span class="seg ${ok}" style="width:${pct(job.rows.succeeded)}%"></span>` +
    `<span class="seg bad" style="width:${pct(job.rows.failed)}%"></span></span>`;
}

// The job's adapter: a generation job's (what its spec names), or the one a fine-tune trains (its own id).
function adapterOf(job) {
  if (job.kind === "finetune") return job.id;
  return (job.spec || {}).adapter || "";
}

// A dash that says why a figure is missing.
function dash(why) { return `<span title="${esc(why)}">—</span> <small class="muted why">${esc(why)}</small>`; }

// A line chart as inline SVG: points [{x, y}], axis labels, min/max on the axes.
function chart(title, points, xLabel, yLabel) {
  const w = 520, h = 200, pad = 40;
  if (!points.length) return `<div class="chart"><b>${esc(title)}</b><p class="muted">no points yet</p></div>`;
  const xs = points.map(p => p.x), ys = points.map(p => p.y);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys) || 1;
  const sx = x => pad + ((x - x0) / (x1 - x0 || 1)) * (w - 2 * pad);
  const sy = y => h - pad + (-(y - y0) / (y1 - y0 || 1)) * (h - 2 * pad);
  const path = points.map((p, i) => `${i ? "L" : "M"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" ");
  const dots = points.length < 60 ? points.map(p => `<circle cx="${sx(p.x).toFixed(1)}" cy="${sy(p.y).toFixed(1)}" r="2"/>`).join("") : "";
  return `<div class="chart"><b>${esc(title)}</b>
    <svg width="${w}" height="${h}" role="img" aria-label="${esc(title)}">
      <line x1="${pad}" y1="${h - pad}" x2="${w - pad}" y2="${h - pad}" stroke="#999"/>
      <line x1="${pad}" y1="${pad}" x2="${pad}" y2="${h - pad}" stroke="#999"/>
      <text x="${pad}" y="${h - pad + 14}" font-size="10">${esc(+x0.toFixed(2))}</text>
      <text x="${w - pad}" y="${h - pad + 14}" font-size="10" text-anchor="end">${esc(+x1.toFixed(2))} ${esc(xLabel)}</text>
      <text x="${pad - 4}" y="${pad}" font-size="10" text-anchor="end">${esc(+y1.toFixed(3))}</text>
      <text x="${pad - 4}" y="${h - pad}" font-size="10" text-anchor="end">${esc(+y0.toFixed(3))}</text>
      <text x="${pad}" y="${pad - 8}" font-size="10">${esc(yLabel)}</text>
      <path d="${path}" fill="none" stroke="#2f80ed" stroke-width="1.5"/><g fill="#2f80ed">${dots}</g>
    </svg></div>`;
}

// Throughput as the API gives it: consecutive intervals from the run's start to its end (a live run's to its last
// whole interval), each drawn as a flat step at its rate, and a dashed line at the run's average (the intervals'
// time-weighted mean): for a finished job the very figure of its tokens/s card. A run of one interval (under a
// second or two) draws that one step.
function throughputChart(tp, ended) {
  const title = "Throughput over time", w = 520, h = 200, pad = 40;
  if (!tp.rows) return `<div class="chart" id="throughput"><b>${title}</b><p class="muted">no rows finished in this run yet</p></div>`;
  const steps = tp.points.map(p => ({ x0: p.t - tp.start, x1: p.t - tp.start + p.seconds, y: p.tokens_per_s }));
  const seconds = tp.end - tp.start, average = tp.tokens_per_s;
  const x1 = seconds, y1 = Math.max(average, ...steps.map(p => p.y)) || 1, shown = +seconds.toFixed(3);
  const sx = x => pad + (x / (x1 || 1)) * (w - 2 * pad), sy = y => h - pad - (y / y1) * (h - 2 * pad);
  const path = steps.map((p, i) => `${i ? "V" : "M" + sx(p.x0).toFixed(1) + ","}${sy(p.y).toFixed(1)} H${sx(p.x1).toFixed(1)}`).join(" ");
  const note = steps.length === 1 ? `<p class="muted" id="throughput-note">one interval: the run was too short to show a change over time</p>` : "";
  return `<div class="chart" id="throughput" data-intervals="${steps.length}"><b>${title}</b>
    <svg width="${w}" height="${h}" role="img" aria-label="${title}">
      <line x1="${pad}" y1="${h - pad}" x2="${w - pad}" y2="${h - pad}" stroke="#999"/>
      <line x1="${pad}" y1="${pad}" x2="${pad}" y2="${h - pad}" stroke="#999"/>
      <text x="${pad}" y="${h - pad + 14}" font-size="10">0</text>
      <text x="${w - pad}" y="${h - pad + 14}" font-size="10" text-anchor="end">${esc(shown)} s</text>
      <text x="${pad - 4}" y="${pad}" font-size="10" text-anchor="end">${esc(+y1.toFixed(1))}</text>
      <text x="${pad - 4}" y="${h - pad}" font-size="10" text-anchor="end">0</text>
      <text x="${pad}" y="${pad - 8}" font-size="10">output tokens/s</text>
      <path d="${path}" fill="none" stroke="#2f80ed" stroke-width="1.5"/>
      <line x1="${pad}" x2="${w - pad}" y1="${sy(average).toFixed(1)}" y2="${sy(average).toFixed(1)}" stroke="#6e7781" stroke-dasharray="4 3"/>
    </svg><p class="muted">${ended ? "run average" : "average so far"} <b id="throughput-average">${esc(+average.toFixed(2))}</b> tok/s over ${esc(shown)} s</p>${note}</div>`;
}

// --- views ---------------------------------------------------------------------------------------------------

function signin(message) {
  clearInterval(timer);
  document.getElementById("signout").hidden = true;
  main.innerHTML = document.getElementById("signin-template").innerHTML;
  document.getElementById("signin-error").textContent = message || "";
  document.getElementById("signin-form").addEventListener("submit", async event => {
    event.preventDefault();
    localStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
    try {
      await api("/jobs?limit=1");
    } catch (err) {
      localStorage.removeItem(TOKEN_KEY);
      document.getElementById("signin-error").textContent = err.message;
      return;
    }
    if (location.hash === "#/signout" || !location.hash) location.hash = "#/jobs"; else route();
  });
}

async function jobsView(v) {
  const { body: jobs, more } = await apiPage(`/jobs?limit=${JOBS_SHOWN}`);
  if (v !== view) return;
  main.innerHTML = `<h2>Jobs</h2><table id="jobs"><thead><tr><th>job</th><th>state</th><th>progress</th>
    <th>throughput</th><th>owner</th><th>model</th><th>created</th></tr></thead><tbody>` +
    jobs.map(j => `<tr data-job="${esc(j.id)}"><td><a href="#/jobs/${esc(j.id)}">${esc(j.id)}</a> ${esc(j.name || "")}</td>
      <td class="state ${esc(j.state)}">${esc(j.state)}</td>
      <td>${bar(j)} <span class="done">${done(j)}</span>/${j.rows.total}${j.rows.failed ? ` (${j.rows.failed} failed)` : ""}</td>
      <td>${esc(rate(j))}</td><td>${esc(j.owner)}</td><td>${esc(j.model)}${adapterOf(j) && j.kind !== "finetune" ? `<br><small class="muted">adapter ${esc(adapterOf(j))}</small>` : ""}</td><td>${esc(ago(j.created_at))}</td></tr>`).join("") +
    `</tbody></table>` + (jobs.length ? "" : `<p class="muted">No jobs yet: <code>gpujobs submit …</code></p>`) +
    (more ? `<p class="muted" id="jobs-more">The newest ${JOBS_SHOWN} jobs are shown; older ones exist:
      <code>gpujobs list --limit 1000</code>, or <code>GET /jobs?limit=1000&amp;state=…</code></p>` : "");
}

const jobState = { id: null, run: null, events: [], after: 0, throughputAt: 0, throughput: null, withInput: false, note: "" };

// A job's page shows its current run (a retry starts a new one): its events, its throughput, its loss curve.
async function jobView(v, id) {
  const job = await api(`/jobs/${encodeURIComponent(id)}`);
  if (jobState.id !== id || jobState.run !== job.run) {
    Object.assign(jobState, { id, run: job.run, events: [], after: 0, throughputAt: 0, throughput: null, ended: false, note: "" });
  }
  for (let more = true; more;) {  // every page of new events, not only the first
    const page = await apiPage(`/jobs/${encodeURIComponent(id)}/events?after=${jobState.after}&limit=5000&run=${job.run}`);
    jobState.events.push(...page.body);
    if (page.body.length) jobState.after = page.body[page.body.length - 1].id;
    more = page.more && page.body.length > 0;
  }
  const ended = TERMINAL.includes(job.state);
  if (job.kind !== "finetune" && (Date.now() - jobState.throughputAt > 3000 || !jobState.throughput || (ended && !jobState.ended))) {
    jobState.throughput = await api(`/jobs/${encodeURIComponent(id)}/throughput`);
    jobState.throughputAt = Date.now();
    jobState.ended = ended;  // the last read after the end covers the whole run
  }
  if (v !== view) return;
  // one point per step, the newest: a resumed fine-tune logs the steps after its checkpoint again
  const byStep = new Map();
  jobState.events.filter(e => e.data && typeof e.data.loss === "number")
    .forEach((e, i) => byStep.set(typeof e.data.step === "number" ? e.data.step : i, e.data.loss));
  const loss = [...byStep].sort((a, b) => a[0] - b[0]).map(([x, y]) => ({ x, y }));
  const live = job.live || {};
  const cards = job.kind === "finetune" ? trainingCards(job) : generationCards(job, live);
  const charts = job.kind === "finetune" ? chart("Training loss", loss, "step", "loss")
    : throughputChart(jobState.throughput, ended) + (loss.length ? chart("Training loss", loss, "step", "loss") : "");
  const adapter = adapterOf(job) ? ` · ${job.kind === "finetune" ? "trains adapter" : "adapter"} <span id="job-adapter">${esc(adapterOf(job))}</span>` : "";
  const runNote = job.run > 1 ? ` · run <span id="job-run">${esc(job.run)}</span> (earlier runs: <code>gpujobs status ${esc(job.id)} --all-runs</code>)` : "";
  main.innerHTML = `<h2>${esc(job.id)} <span class="state ${esc(job.state)}" id="job-state">${esc(job.state)}</span></h2>
    <p class="muted">${esc(job.kind)} · ${esc(job.model)}${adapter} · owner ${esc(job.owner)} · created ${esc(when(job.created_at))}${runNote}</p>
    ${job.error ? `<p class="error">${esc(job.error)}</p>` : ""}
    <div class="cards">${cards}</div>
    <div class="charts">${charts}</div>
    ${job.kind === "finetune" ? "" : downloads(job)}
    <h3>Events</h3><table id="events"><thead><tr><th>time</th><th>level</th><th>kind</th><th>message</th></tr></thead><tbody>` +
    jobState.events.slice(-EVENTS_SHOWN).reverse().map(e => `<tr><td>${esc(when(e.ts))}</td><td>${esc(e.level)}</td><td>${esc(e.kind)}</td>
      <td><pre>${esc(e.message)}</pre></td></tr>`).join("") + `</tbody></table>` +
    (jobState.events.length > EVENTS_SHOWN ? `<p class="muted" id="events-more">The newest ${EVENTS_SHOWN} of this run's
      ${jobState.events.length} events are shown: <code>gpujobs events ${esc(job.id)}</code> prints every one.</p>` : "");
}

// A live job's rates are over the last minute; a finished job's are its run's averages (metrics, as `gpujobs status`
// prints them), and its ETA a dash that says it finished.
function generationCards(job, live) {
  const m = job.metrics || {}, ended = TERMINAL.includes(job.state);
  const figure = (value, unit) => value != null ? esc(value) + unit
    : dash(ended ? "not measured: the job ended before a row ran" : job.started_at ? "no rows finished yet" : "not started yet");
  const over = ended ? "run average" : "last minute";
  const eta = ended ? dash(job.state === "succeeded" ? "finished" : job.state) : live.eta_s != null ? esc(live.eta_s) + " s"
    : dash(job.started_at ? "no rows finished in the last minute" : "not started yet");
  return `<div class="card">rows done<b><span id="job-done">${done(job)}</span> / <span id="job-total">${job.rows.total}</span></b>${bar(job)}</div>
      <div class="card">failed<b id="job-failed">${job.rows.failed}</b></div>
      <div class="card">tokens/s <small class="muted">${over}</small><b id="job-rate">${figure(ended ? m.output_tok_s : live.tokens_per_s, "")}</b></div>
      <div class="card">rows/s <small class="muted">${over}</small><b id="job-rows-rate">${figure(ended ? m.rows_per_s : live.rows_per_s, "")}</b></div>
      <div class="card">ETA<b id="job-eta">${eta}</b></div>
      <div class="card">output tokens<b>${job.tokens.completion}</b></div>`;
}

// Results as `gpujobs results` gives them: JSONL and CSV in input order, and the failed rows (JSONL); also while
// the job runs. Fetched with the token (a plain link would carry none) and saved from memory: for very large
// results use the CLI, which streams them to a file.
function downloads(job) {
  return `<h3>Results</h3><p id="downloads">
    <button data-download="jsonl" id="download-jsonl">JSONL</button>
    <button data-download="csv" id="download-csv">CSV</button>
    <button data-download="errors" id="download-errors">failed rows (JSONL)</button>
    <label><input type="checkbox" id="with-input"${jobState.withInput ? " checked" : ""}> with each row's prompt</label>
    <span class="muted" id="download-note">${esc(jobState.note)}</span>
    <br><small class="muted">the same as <code>gpujobs results ${esc(job.id)}</code> (<code>--format csv</code>, <code>--errors</code>, <code>--with-input</code>)</small></p>`;
}

async function download(id, what) {
  const params = new URLSearchParams({ format: what === "csv" ? "csv" : "jsonl", errors: String(what === "errors") });
  if (jobState.withInput) params.set("with_input", "true");
  const response = await fetch(`/jobs/${encodeURIComponent(id)}/results?${params}`, { headers: auth() });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error((body.error && body.error.message) || response.statusText);
  }
  const blob = await response.blob();
  const named = (response.headers.get("Content-Disposition") || "").match(/filename="([^"]+)"/);
  const link = Object.assign(document.createElement("a"), { href: URL.createObjectURL(blob), download: named ? named[1] : `${id}.${params.get("format")}` });
  document.body.appendChild(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60000);
  return `${link.download} saved (${blob.size} bytes)`;
}

main.addEventListener("click", event => {
  const button = event.target.closest("[data-download]");
  if (!button || !jobState.id) return;
  jobState.note = "downloading …";
  download(jobState.id, button.dataset.download).then(note => { jobState.note = note; }, err => { jobState.note = err.message; })
    .finally(() => { const el = document.getElementById("download-note"); if (el) el.textContent = jobState.note; });
});
main.addEventListener("change", event => { if (event.target.id === "with-input") jobState.withInput = event.target.checked; });

// A fine-tune generates nothing: its cards are training's (the job's `training`: the current run's last step).
function trainingCards(job) {
  const t = job.training || {};
  const loss = t.loss ?? t.train_loss;
  return `<div class="card">step<b><span id="job-step">${esc(t.step ?? 0)}</span> / ${esc(t.max_steps ?? "?")}</b></div>
      <div class="card">epoch<b id="job-epoch">${t.epoch != null ? esc(t.epoch.toFixed(2)) : ""}</b></div>
      <div class="card">loss<b id="job-loss">${loss != null ? esc(loss.toFixed(4)) : ""}</b></div>
      <div class="card">training tok/s<b id="job-train-rate">${esc(trainingRate(job) ?? "")}</b></div>
      <div class="card">ETA<b id="job-eta">${t.eta_s != null ? esc(t.eta_s) + " s"
        : dash(TERMINAL.includes(job.state) ? (job.state === "succeeded" ? "finished" : job.state) : "after the first steps")}</b></div>`;
}

async function workersView(v) {
  const workers = await api("/workers");
  if (v !== view) return;
  // state is the API's (online, lost, offline), the same word `gpujobs workers` and /metrics use
  main.innerHTML = `<h2>Workers</h2><table id="workers"><thead><tr><th>worker</th><th>state</th><th>restarts</th><th>host</th><th>slice</th>
    <th>GPUs</th><th>heartbeat</th><th>shard</th><th>stopped</th></tr></thead><tbody>` +
    workers.map(w => {
      const used = Object.fromEntries(((w.capabilities || {}).gpu_memory || []).map(g => [g.index, g]));
      const gpus = (w.gpus || []).map(g => `${esc(g.index)}: ${esc(g.name)} (${gib(used[g.index] && used[g.index].reserved_bytes)} / ${gib(g.memory_bytes)}, cc ${esc(g.compute_capability)})`);
      const stopped = w.state === "offline"
        ? `${w.exit_code == null ? "stopped" : "exit " + w.exit_code} ${ago(w.stopped_at || w.heartbeat_at)}${w.reason ? ": " + w.reason : ""}` : "";
      return `<tr><td>${esc(w.name)}</td><td class="state ${esc(w.state)}">${esc(w.state)}</td><td>${esc(w.restarts || 0)}</td><td>${esc(w.host)}</td>
        <td>${esc(w.slice || "cpu")}</td><td>${gpus.join("<br>") || "CPU"}</td><td>${esc(ago(w.heartbeat_at))}</td>
        <td>${esc(w.current_shard_id ?? "")}</td><td>${esc(stopped)}</td></tr>`;
    }).join("") + `</tbody></table>`;
}

// --- routing -------------------------------------------------------------------------------------------------

function route() {
  clearInterval(timer);
  view += 1;
  const v = view, hash = location.hash || "#/jobs";
  if (hash === "#/signout") { localStorage.removeItem(TOKEN_KEY); return signin(); }
  if (!localStorage.getItem(TOKEN_KEY)) return signin();
  document.getElementById("signout").hidden = false;
  const match = hash.match(/^#\/jobs\/(.+)$/);
  const draw = match ? () => jobView(v, decodeURIComponent(match[1])) : hash === "#/workers" ? () => workersView(v) : () => jobsView(v);
  const tick = () => draw().catch(err => {
    if (err instanceof Unauthorized) { localStorage.removeItem(TOKEN_KEY); signin(err.message); }
    else if (v === view) {
      if (!document.getElementById("view-error")) main.insertAdjacentHTML("afterbegin", `<p class="error" id="view-error"></p>`);
      document.getElementById("view-error").textContent = err.message;
    }
  });
  tick();
  timer = setInterval(tick, match ? POLL_MS : 2 * POLL_MS);
}

// `gpujobs dashboard` opens /dashboard#code=CODE: the code leaves the address bar and this history entry at once,
// then it is traded (in a POST body, never a URL) for the token, kept like a pasted one. A code works once, for a
// minute (api/dashboard.py says why it is done this way).
async function signinWithCode() {
  const match = location.hash.match(/^#code=([A-Za-z0-9_-]+)$/);
  if (!match) return null;
  history.replaceState(null, "", location.pathname + "#/jobs");
  const response = await fetch("/dashboard/session", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ code: match[1] }),
  });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) return (body.error && body.error.message) || response.statusText;
  localStorage.setItem(TOKEN_KEY, body.token);
  return null;
}

window.addEventListener("hashchange", route);
signinWithCode().then(
  refused => { if (refused) { localStorage.removeItem(TOKEN_KEY); signin(refused); } else route(); },
  err => signin(err.message),
);
