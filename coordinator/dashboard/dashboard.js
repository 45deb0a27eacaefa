// Leasehold's dashboard: polls the coordinator's read-only JSON API and
// follows /api/events; draws the pool map and its charts on plain canvases
// (two line charts need no chart library, and the page must work offline).
// Every text from the coordinator goes in through textContent, never as HTML.
"use strict";

const state = {
  status: null,
  history: [],          // [unix_ms, [occupancy of each device]]
  jobs: new Map(),      // id -> summary (as /api/jobs lists it)
  selected: 0,          // job id whose curves are shown (0: pick one)
  userSelected: false,
  detail: null,         // /api/jobs/{selected}
  lossPoints: new Map(),  // job id -> Map(global_step -> loss)
};

// ---- formatting ----
function fmtBytes(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return (i ? b.toFixed(b < 10 ? 2 : 1) : b) + " " + units[i];
}
function fmtRate(x) { return x >= 1e6 ? (x / 1e6).toFixed(2) + "M" : x >= 1e3 ? (x / 1e3).toFixed(1) + "k" : x.toFixed(0); }
function fmtAge(ms) { return ms < 1000 ? ms + " ms" : (ms / 1000).toFixed(1) + " s"; }
function colorOf(name, region) {
  let h = 0;
  for (const c of name) h = (h * 31 + c.codePointAt(0)) >>> 0;
  h = Math.round(h * 137.508);  // golden angle: names one letter apart get far-apart hues
  return `hsl(${h % 360}, ${region ? 45 : 65}%, ${region ? 62 : 50}%)`;
}
// What a lease's holder is called in the map and its legend.
function holderName(l) {
  return l.holder === "region" ? "region " + l.agent : l.holder === "fenced" ? l.agent + " (fenced)" : l.holder === "renewing" ? l.agent + " (renewing)" : l.agent;
}
const kDeviceColors = ["#1f6fd1", "#d1591f", "#2a9d4b", "#9b3fc4", "#c4a000", "#1fa5b5", "#b5314f", "#6b6b6b"];
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

// ---- fetching ----
async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}
function connected(ok) {
  const c = document.getElementById("connection");
  c.textContent = ok ? "live" : "coordinator unreachable";
  c.className = ok ? "good" : "bad";
}

async function pollStatus() {
  try {
    state.status = await getJSON("/api/status");
    connected(true);
    state.history.push([Date.now(), state.status.devices.map(d => d.occupancy)]);
    const cutoff = Date.now() - 10 * 60 * 1000;
    while (state.history.length && state.history[0][0] < cutoff) state.history.shift();
    renderStatus();
  } catch (e) {
    connected(false);
  }
}

async function loadHistory() {
  try {
    const h = await getJSON("/api/history");
    state.history = h.samples.map(s => [s[0], s[1]]).concat(state.history);  // [t, [occupancy...]]
  } catch (e) { /* the live samples still come */ }
}

async function pollJobs() {
  try {
    const list = await getJSON("/api/jobs?newest=50");
    state.jobs = new Map(list.map(j => [j.id, j]));
    for (const j of list) noteProgress(j);
    renderJobs();
    await refreshDetail();
  } catch (e) { /* status polling reports the connection */ }
}

function followEvents() {
  if (!window.EventSource) return;
  const es = new EventSource("/api/events");
  es.onmessage = m => {
    const ev = JSON.parse(m.data);
    if (!ev.job) return;
    state.jobs.set(ev.job.id, ev.job);
    noteProgress(ev.job);
    renderJobs();
    if (ev.job.id === state.selected) renderCurves();
  };
}

const kMaxPoints = 2000;  // per job; past it every other point goes

function noteProgress(job) {
  const p = job.progress;
  if (!p || !p.global_step || typeof p.loss !== "number") return;  // NaN arrives as null
  if (!state.lossPoints.has(job.id)) state.lossPoints.set(job.id, new Map());
  const points = state.lossPoints.get(job.id);
  points.set(p.global_step, p.loss);
  if (points.size > kMaxPoints) {
    let i = 0;
    for (const step of [...points.keys()]) if (i++ % 2) points.delete(step);
  }
}

async function refreshDetail() {
  if (!state.userSelected || !state.jobs.has(state.selected)) {
    // Follow the newest running job, else the newest job.
    const all = [...state.jobs.values()];
    const running = all.filter(j => j.state === "running");
    const pick = (running.length ? running : all).at(-1);
    state.selected = pick ? pick.id : 0;
    state.userSelected = false;
  }
  if (!state.selected) { state.detail = null; renderCurves(); return; }
  const job = state.jobs.get(state.selected);
  if (state.detail && state.detail.id === state.selected && job.state !== "running" &&
      state.detail.state === job.state) { renderCurves(); return; }
  const asked = state.selected;
  try {
    const d = await getJSON("/api/jobs/" + asked);
    if (asked !== state.selected) return;  // another job was picked meanwhile
    state.detail = d;
    noteProgress(d);
  } catch (e) { if (asked === state.selected) state.detail = null; }
  renderCurves();
}

// ---- rendering ----
function renderStatus() {
  const s = state.status, devices = s.devices;
  const names = [...new Set(devices.map(d => d.device_name))].join(", ");
  document.getElementById("device").textContent =
    `${devices.length} device${devices.length === 1 ? "" : "s"} (${devices.length ? devices[0].backend : "?"}: ${names})`;
  const running = [...state.jobs.values()].filter(j => j.state === "running").length;
  document.getElementById("summary").textContent =
    `${s.agents.length} agents · ${s.leases.length} leases · ${running} jobs running · up ${Math.round(s.uptime_seconds)} s`;
  const used = devices.reduce((n, d) => n + d.used_bytes, 0), size = devices.reduce((n, d) => n + d.size_bytes, 0);
  document.getElementById("pool-figures").textContent =
    `${fmtBytes(used)} of ${fmtBytes(size)} leased` + (devices.length > 1 ? ` on ${devices.length} devices` : "");

  // One map per device: its leases and regions from offset 0 to its end.
  const pools = document.getElementById("pool");
  pools.replaceChildren();
  const owners = new Map();
  for (const p of devices) {
    const block = el("div", undefined, "device-pool");
    block.append(el("div",
      `device ${p.device} · ${p.device_name}${p.uuid ? " · " + p.uuid : ""} — ` +
      `${fmtBytes(p.used_bytes)} of ${fmtBytes(p.size_bytes)} leased (${(100 * p.occupancy).toFixed(1)}%), ` +
      `${p.free_blocks} free blocks, largest ${fmtBytes(p.largest_free_bytes)}, ${p.agents} agents`,
      "device-title"));
    const bar = el("div", undefined, "pool-bar");
    bar.dataset.device = p.device;
    for (const l of s.leases.filter(l => l.device === p.device)) {
      const region = l.holder === "region", name = holderName(l);
      const d = el("div", undefined, "lease" + (region ? " region" : ""));
      d.style.left = (100 * l.offset / p.size_bytes) + "%";
      d.style.width = (100 * l.size / p.size_bytes) + "%";
      d.style.background = colorOf(l.agent, region);
      d.title = `${name}: lease ${l.id}, ${fmtBytes(l.size)} at ${fmtBytes(l.offset)} of device ${p.device}`;
      bar.appendChild(d);
      const o = owners.get(name) || { bytes: 0, color: colorOf(l.agent, region) };
      o.bytes += l.size;
      owners.set(name, o);
    }
    const scale = el("div", undefined, "pool-scale");
    scale.append(el("span", "0"), el("span", fmtBytes(p.size_bytes)));
    block.append(bar, scale);
    pools.appendChild(block);
  }
  pools.dataset.leases = s.leases.length;
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  for (const [name, o] of [...owners].sort()) {
    const item = el("span", `${name} ${fmtBytes(o.bytes)}`);
    item.style.setProperty("--c", o.color);
    legend.appendChild(item);
  }
  const free = el("span", `free ${fmtBytes(devices.reduce((n, d) => n + d.free_bytes, 0))}`);
  free.style.setProperty("--c", "#dfe3ea");
  legend.appendChild(free);

  const body = document.querySelector("#agents tbody");
  body.replaceChildren();
  for (const a of s.agents) {
    const tr = el("tr");
    tr.append(el("td", a.name), el("td", a.device), el("td", a.state, "state-" + a.state), el("td", fmtBytes(a.leased_bytes)),
              el("td", a.lease_count), el("td", a.job_id ? "#" + a.job_id : "–"),
              el("td", fmtAge(a.last_heartbeat_ms_ago)));
    body.appendChild(tr);
  }
  drawChart(document.getElementById("occupancy"),
            devices.map((d, i) => ({
              points: state.history.filter(([t, o]) => Array.isArray(o) && i < o.length).map(([t, o]) => [t, 100 * o[i]]),
              color: kDeviceColors[i % kDeviceColors.length],
            })),
            { ymin: 0, ymax: 100, yfmt: v => v.toFixed(0) + "%", xfmt: t => new Date(t).toLocaleTimeString() });
}

function renderJobs() {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren();
  const jobs = [...state.jobs.values()].sort((a, b) => b.id - a.id).slice(0, 50);
  for (const j of jobs) {
    const tr = el("tr");
    if (j.id === state.selected) tr.className = "selected";
    const p = j.progress;
    const frac = p && p.total_steps ? p.global_step / p.total_steps : (j.state === "succeeded" ? 1 : 0);
    const progress = el("td");
    const bar = el("span", undefined, "bar"), fill = el("i");
    fill.style.width = (100 * frac).toFixed(1) + "%";
    bar.appendChild(fill);
    progress.append(bar, p ? `epoch ${p.epoch}/${p.epochs}` : "");
    const rate = j.state === "running" && p ? p.samples_per_second : j.samples_per_second;
    // The state, and under it why a job waits or why it ended as it did.
    const st = el("td", undefined, "state-" + j.state);
    st.append(el("span", j.state));
    const why = j.state === "queued" ? j.waiting_for
              : j.state === "failed" || j.state === "cancelled" ? j.reason : "";
    if (why) {
      const w = el("small", why, "why");
      st.title = why;
      st.append(w);
    }
    const interrupted = Object.values(j.interruptions || {}).reduce((a, b) => a + b, 0);
    const intr = el("td", interrupted ? String(interrupted) : "–");
    if (interrupted) {
      intr.title = Object.entries(j.interruptions).map(([c, n]) => `${n} ${c.replaceAll("_", " ")}`).join(", ");
    }
    tr.append(el("td", "#" + j.id), el("td", j.name), el("td", j.submitted_by || "–"), st, intr,
              el("td", j.agent || "–"), progress, el("td", rate ? fmtRate(rate) : "–"));
    tr.onclick = () => { state.selected = j.id; state.userSelected = true; state.detail = null; refreshDetail(); renderJobs(); };
    body.appendChild(tr);
  }
}

function renderCurves() {
  const d = state.detail;
  const job = state.jobs.get(state.selected) || d;
  document.getElementById("job-title").textContent = job ? `#${job.id} ${job.name} (${job.state})` : "(none selected)";
  const figures = [];
  if (job && job.progress) {
    const p = job.progress;
    figures.push(`step ${p.global_step}/${p.total_steps}`,
                 `loss ${typeof p.loss === "number" ? p.loss.toFixed(4) : "NaN"}`);
  }
  if (d && d.id === state.selected && d.epochs.length) figures.push(`test accuracy ${(100 * d.epochs.at(-1).test_accuracy).toFixed(2)}%`);
  // A program job: what its PyTorch plug-in reported, and how it ended.
  const m = d && d.id === state.selected ? d.program_memory : null;
  if (m) {
    figures.push(`leased ${fmtBytes(m.leased_bytes)} (peak ${fmtBytes(m.peak_leased_bytes)})`,
                 `in use ${fmtBytes(m.in_use_bytes)}`,
                 `${m.allocations} allocations, ${m.cache_hits} cached, ${m.lease_requests} lease requests`);
    if (m.outside_pool_bytes) figures.push(`outside the pool ${fmtBytes(m.outside_pool_bytes)}`);
  }
  if (d && d.id === state.selected && d.spec && d.spec.program && d.exit_code >= 0) figures.push(`exit status ${d.exit_code}`);
  if (job && job.submitted_by) figures.unshift(`submitted by ${job.submitted_by}`);
  if (job && job.cancelled_by) figures.push(`cancelled by ${job.cancelled_by}`);
  document.getElementById("job-figures").textContent = figures.join(" · ");
  const steps = new Map(state.lossPoints.get(state.selected) || []);
  // Epoch means fill in what the page did not see live.
  const perEpoch = d && d.progress ? d.progress.steps_in_epoch : 0;
  if (d && d.id === state.selected && perEpoch) {
    for (const e of d.epochs) {
      if (typeof e.train_loss === "number" && !steps.has(e.epoch * perEpoch)) steps.set(e.epoch * perEpoch, e.train_loss);
    }
  }
  const loss = [...steps].sort((a, b) => a[0] - b[0]);
  drawChart(document.getElementById("loss"), [{ points: loss, color: "#c0392b" }],
            { yfmt: v => v.toFixed(2), xfmt: v => "step " + v });
  const acc = d && d.id === state.selected
    ? d.epochs.filter(e => typeof e.test_accuracy === "number").map(e => [e.epoch, 100 * e.test_accuracy]) : [];
  drawChart(document.getElementById("accuracy"), [{ points: acc, color: "#1e8a44" }],
            { yfmt: v => v.toFixed(1) + "%", xfmt: v => "epoch " + v, dots: true });
}

// A line chart on a canvas: axes, four grid lines, one line per series.
// canvas.dataset.points says how many points it drew (the browser test reads it).
function drawChart(canvas, series, opt) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * ratio; canvas.height = h * ratio;
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "11px system-ui, sans-serif";
  const all = series.flatMap(s => s.points);
  canvas.dataset.points = all.length;
  const L = 48, R = 8, T = 8, B = 20;
  g.strokeStyle = "#d8dce3"; g.fillStyle = "#6b7383";
  if (!all.length) { g.fillText("no data yet", L, T + 20); return; }
  // Loops, not Math.min(...all): spreading a long array overflows the stack.
  let x0 = Infinity, x1 = -Infinity, lo = Infinity, hi = -Infinity;
  for (const [x, y] of all) {
    x0 = Math.min(x0, x); x1 = Math.max(x1, x); lo = Math.min(lo, y); hi = Math.max(hi, y);
  }
  let y0 = opt.ymin ?? lo, y1 = opt.ymax ?? hi;
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const X = x => L + (w - L - R) * (x - x0) / (x1 - x0);
  const Y = y => h - B - (h - T - B) * (y - y0) / (y1 - y0);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    g.beginPath(); g.moveTo(L, Y(y)); g.lineTo(w - R, Y(y)); g.stroke();
    g.fillText(opt.yfmt(y), 2, Y(y) + 4);
  }
  g.fillText(opt.xfmt(x0), L, h - 5);
  const last = opt.xfmt(x1);
  g.fillText(last, w - R - g.measureText(last).width, h - 5);
  for (const s of series) {
    g.strokeStyle = s.color; g.fillStyle = s.color; g.lineWidth = 1.5;
    g.beginPath();
    s.points.forEach((p, i) => (i ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1]))));
    g.stroke();
    if (opt.dots || s.points.length === 1) {
      for (const p of s.points) { g.beginPath(); g.arc(X(p[0]), Y(p[1]), 2.5, 0, 2 * Math.PI); g.fill(); }
    }
  }
}

loadHistory().then(pollStatus);
pollJobs();
followEvents();
setInterval(pollStatus, 1000);
setInterval(pollJobs, 2000);
window.addEventListener("resize", () => { if (state.status) renderStatus(); renderCurves(); });
