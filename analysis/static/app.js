// tensortape serve: the page.  Reads /api/, draws with chart.js.  Every string
// from a store (layer names, paths, events) goes in as textContent: text, never HTML.
"use strict";

const $ = id => document.getElementById(id);
const S = { runs: [], run: 0, kind: null, stat: "abs_max", rank: null, start: null, stop: null,
            filter: "", sort: "exec", map: null, geo: null, sel: null, cmp: null, cmpGeo: null,
            metric: "stat_rel", cmpLayer: null, seen: "", busy: false };
const LOG = new Set(["std", "abs_max", "norm", "rms"]);   // drawn on a log axis
const EVOLUTION = ["mean", "std", "min", "max", "abs_max", "norm", "rms", "zero_frac", "nonfinite"];

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

async function api(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined) q.set(k, v);
  const r = await fetch(`/api/${path}?${q}`);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function fail(where, e) {
  const c = $(where).querySelector(".caption") || $(where);
  c.textContent = `could not load: ${e.message}`;
}

function bytes(n) {
  if (n === null || n === undefined) return "?";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

// --- the run -------------------------------------------------------------------------
function statusText() {
  return S.runs.map((r, i) => {
    const steps = r.steps ? `steps ${r.steps[0]}–${r.steps[1]} (${r.step_count})` : "no steps yet";
    return `${S.runs.length > 1 ? (i ? "B: " : "A: ") : ""}${r.path} — ${r.status} · ${steps} · ` +
      `${r.layers.length} layers · kinds ${r.kinds.join(", ")} · ranks ${r.ranks.join(", ")} · ` +
      `${bytes(r.size_bytes)} · ${r.events} non-finite events`;
  }).join("\n");
}

function eventText(ev, run) {
  if (!ev) return `no non-finite values in ${run.path}`;
  let t = `first non-finite: step ${ev.step}, layer ${ev.layer} (${ev.kind}, ${ev.phase}, rank ${ev.rank}): ` +
    `${ev.nan} NaN, ${ev.posinf} +Inf, ${ev.neginf} -Inf` +
    (ev.same_step ? `; ${ev.same_step} more at that step` : "");
  if (ev.replay_lines) t += "\nreplay: " + ev.replay_lines.join("\n");
  return t;
}

function fillSelect(sel, values, current) {
  const had = Array.from(sel.options).map(o => o.value).join("\n");
  if (had !== values.map(String).join("\n")) {
    sel.replaceChildren(...values.map(v => { const o = el("option", String(v)); o.value = v; return o; }));
  }
  sel.value = current;
}

async function loadRuns() {
  S.runs = await api("runs");
  const run = S.runs[S.run];
  if (S.kind === null || !run.kinds.includes(S.kind)) S.kind = run.kinds.includes("activations") ? "activations" : run.kinds[0];
  if (S.rank === null) S.rank = run.ranks[0];
  $("status").textContent = statusText();
  const ev = run.first_nonfinite;
  $("first-nonfinite").textContent = S.runs.length < 2 ? eventText(ev, run) :   // whose event: A's, B's
    S.runs.map((r, i) => `${i ? "B" : "A"}: ${r.path}\n${eventText(r.first_nonfinite, r)}`).join("\n");
  $("first-nonfinite").classList.toggle("found", S.runs.some(r => r.first_nonfinite));
  $("jump").hidden = !ev;
  fillSelect($("run"), S.runs.map((r, i) => i), S.run);
  Array.from($("run").options).forEach((o, i) => { o.textContent = `${i ? "B" : "A"}: ${S.runs[i].name}`; });
  $("run-choice").hidden = S.runs.length < 2;
  fillSelect($("kind"), run.kinds, S.kind);
  fillSelect($("stat"), run.map_stats, S.stat);
  fillSelect($("rank"), run.ranks, S.rank);
  $("rank-choice").hidden = run.ranks.length < 2;
  return S.runs.map(r => `${r.status}|${r.steps}|${r.events}`).join(";");
}

// --- a heat map: geometry, drawing, pointer --------------------------------------------
function globRe(glob) {
  const re = glob.replace(/[.+^${}()|\\]/g, "\\$&").replace(/\*/g, ".*").replace(/\?/g, ".");
  return new RegExp(`^${re}$`);
}

function peak(row) {
  let p = -Infinity;
  for (const v of row) { const x = Chart.num(v); if (isFinite(x)) p = Math.max(p, x); }
  return p;
}

function rowsOf(m) {
  let rows = m.layers.map((_, i) => i);
  if (S.filter) {
    const re = globRe(S.filter);
    rows = rows.filter(i => re.test(m.layers[i]));
  }
  if (S.sort === "peak") {
    const bad = i => m.nonfinite[i].some(b => b);
    rows.sort((a, b) => (bad(b) - bad(a)) || (peak(m.values[b]) - peak(m.values[a])));
  }
  return rows;
}

function plotWidth(area) {
  return Math.max(100, Math.floor(area.clientWidth - 270));
}

function drawHeat(m, ids, marks) {
  const rows = rowsOf(m), cols = m.step_lo.length;
  const area = $(ids.area) || $(ids.canvas).closest(".heat");
  const W = plotWidth(area);
  const rowH = Math.max(3, Math.min(18, Math.floor(560 / Math.max(1, rows.length))));
  const cellW = cols ? W / cols : W;
  const scale = Chart.logScale(rows.map(r => m.values[r]));
  const cells = marks.map(mk => ({ row: rows.indexOf(m.layers.indexOf(mk.layer)), col: colOf(m, mk.step), mk }))
    .filter(c => c.row >= 0 && c.col >= 0);
  Chart.heatmap($(ids.canvas), m, rows, cellW, rowH, scale, cells);
  const labels = $(ids.labels);
  labels.replaceChildren(...rows.map(r => {
    const d = el("div", m.layers[r]);
    d.style.height = d.style.lineHeight = rowH + "px";
    d.style.fontSize = Math.min(12, Math.max(rowH - 2, 1)) + "px";
    d.title = m.layers[r];
    return d;
  }));
  labels.style.visibility = rowH >= 7 ? "visible" : "hidden";
  const axis = $(ids.axis);
  const every = Math.max(1, Math.ceil(cols / 8));
  axis.replaceChildren();
  for (let c = 0; c < cols; c += every) {
    const s = el("span", String(m.step_lo[c]));
    s.style.left = (c * cellW) + "px";
    axis.appendChild(s);
  }
  const wrap = $(ids.canvas).parentElement;
  wrap.querySelectorAll(".mark").forEach(e => e.remove());
  for (const c of cells) {               // the marked cells, for people and for tests
    const d = el("div", "", "mark");
    d.dataset.testid = c.mk.testid;
    d.dataset.layer = c.mk.layer;
    d.dataset.step = c.mk.step;
    Object.assign(d.style, { left: c.col * cellW + "px", top: c.row * rowH + "px",
                             width: Math.max(1, cellW) + "px", height: rowH + "px" });
    d.setAttribute("data-testid", c.mk.testid);
    wrap.appendChild(d);
  }
  legend($(ids.legend), scale, m.stat || `|${m.metric}|`, !!m.metric);
  return { rows, rowH, cellW, cols, m };
}

function legend(box, scale, what, compare) {
  const c = el("canvas");
  const ctx = Chart.fit(c, 120, 10);
  for (let x = 0; x < 120; x++) { ctx.fillStyle = Chart.viridis(x / 119); ctx.fillRect(x, 0, 1, 10); }
  const sw = (color, text) => { const s = el("span"); const k = el("span", "", "swatch"); k.style.background = color; s.append(k, text); return s; };
  const [dark, bright] = compare ? [" (small difference)", " (large difference)"] : ["", ""];
  box.replaceChildren(el("span", `${what} (log): ${Chart.short(scale.lo)}${dark}`), c, el("span", Chart.short(scale.hi) + bright),
    sw(Chart.COLORS.nonfinite, compare ? "non-finite (NaN or Inf in either run): different" : "non-finite"),
    sw(Chart.COLORS.zero, compare ? "no difference (0)" : "zero"),
    sw(Chart.COLORS.absent, compare ? "not compared" : "not recorded"));
}

function colOf(m, step) {
  for (let c = 0; c < m.step_lo.length; c++) if (m.step_lo[c] <= step && step <= m.step_hi[c]) return c;
  return -1;
}

function cellAt(geo, ev) {
  const r = ev.target.getBoundingClientRect();
  const x = ev.clientX - r.left, y = ev.clientY - r.top;
  const col = Math.floor(x / geo.cellW), i = Math.floor(y / geo.rowH);
  if (!geo || col < 0 || col >= geo.cols || i < 0 || i >= geo.rows.length) return null;
  return { row: geo.rows[i], col, x };
}

function tip(geo, ev, extra) {
  const c = cellAt(geo, ev), t = $("tooltip");
  if (!c) { t.hidden = true; return; }
  const m = geo.m, lo = m.step_lo[c.col], hi = m.step_hi[c.col];
  const steps = lo === hi ? `step ${lo}` : `steps ${lo}–${hi} (the largest of them)`;
  const v = m.values[c.row][c.col];
  t.textContent = `${m.layers[c.row]}\n${steps}\n${m.stat || m.metric} = ${v}` +
    (m.nonfinite[c.row][c.col] ? "\nnon-finite values here" : "") + (extra || "");
  t.hidden = false;
  t.style.left = (ev.clientX + 14) + "px";
  t.style.top = (ev.clientY + 14) + "px";
}

function pointer(canvasId, geoOf, onClick, onZoom) {
  const cv = $(canvasId), brush = $(canvasId + "-brush");
  let down = null;
  cv.addEventListener("mousemove", ev => {
    const geo = geoOf();
    if (!geo) return;
    tip(geo, ev);
    if (down && brush) {
      const c = cellAt(geo, ev);
      const x = c ? c.x : down.x;
      Object.assign(brush.style, { left: Math.min(x, down.x) + "px", width: Math.abs(x - down.x) + "px" });
      brush.hidden = false;
    }
  });
  cv.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  cv.addEventListener("mousedown", ev => { const g = geoOf(); down = g && cellAt(g, ev); });
  window.addEventListener("mouseup", ev => {
    if (!down) return;
    const geo = geoOf(), start = down;
    down = null;
    if (brush) brush.hidden = true;
    const end = ev.target === cv ? cellAt(geo, ev) : null;
    if (end && onZoom && Math.abs(end.x - start.x) > 6 && end.col !== start.col) {
      const a = Math.min(start.col, end.col), b = Math.max(start.col, end.col);
      onZoom(geo.m.step_lo[a], geo.m.step_hi[b] + 1);
    } else if (end) onClick(geo.m.layers[end.row], end.col);
  });
}

// --- the map of one run ---------------------------------------------------------------------
async function loadMap() {
  const run = S.runs[S.run];
  const m = await api("map", { run: S.run, kind: S.kind, stat: S.stat, rank: S.rank, start: S.start,
                               stop: S.stop, width: plotWidth($("map-area")) });
  S.map = m;
  drawMap();
  const agg = m.step_lo.length && m.steps_in_window > m.step_lo.length;
  const span = m.step_lo.length ? `steps ${m.step_lo[0]}–${m.step_hi[m.step_hi.length - 1]}` : "no steps";
  const unplaced = m.unplaced_events ? `; ${m.unplaced_events} non-finite events this store did not keep are not shown` : "";
  $("map-title").textContent = `${m.stat} of ${m.kind}, rank ${m.rank}, ${span} ` +
    `(${m.steps_in_window} steps in ${m.step_lo.length} columns${agg ? ", each the largest of its steps" : ""}${unplaced}) — ${run.name}`;
  for (const [id, v] of [["start", S.start], ["stop", S.stop]]) {     // empty: the whole run, as the title says
    $(id).placeholder = v === null && m.steps ? String(id === "start" ? m.steps[0] : m.steps[1]) : "";
  }
  $("map").dataset.first = m.step_lo.length ? m.step_lo[0] : "";
  $("map").dataset.last = m.step_hi.length ? m.step_hi[m.step_hi.length - 1] : "";
}

function drawMap() {
  if (!S.map) return;
  const ev = S.runs[S.run].first_nonfinite, marks = [];
  if (ev && ev.kind === S.map.kind && ev.rank === S.map.rank) marks.push({ layer: ev.layer, step: ev.step, testid: "first-nonfinite-cell" });
  if (S.sel) marks.push({ layer: S.sel.layer, step: S.sel.step, testid: "selected-cell" });
  S.geo = drawHeat(S.map, { canvas: "map", labels: "map-labels", axis: "map-axis", legend: "map-legend", area: "map-area" }, marks);
}

// A column of several steps: the step that holds its largest value (its first non-finite one).
async function pickStep(layer, col) {
  const m = S.map, lo = m.step_lo[col], hi = m.step_hi[col];
  if (lo === hi) return lo;
  const st = await api("stats", { run: S.run, layer, kind: S.kind, rank: S.rank, start: lo, stop: hi + 1 });
  const bad = st.step.findIndex((s, i) => st.nan[i] + st.posinf[i] + st.neginf[i] > 0);
  if (m.nonfinite[m.layers.indexOf(layer)][col] && bad >= 0) return st.step[bad];
  const key = S.stat === "nonfinite" ? "nan" : S.stat;
  let best = 0;
  st[key].forEach((v, i) => { if (Chart.num(v) > Chart.num(st[key][best]) || !isFinite(Chart.num(st[key][best]))) best = i; });
  return st.step[best];
}

async function select(layer, step) {
  S.sel = { layer, step };
  drawMap();
  await Promise.all([showHistogram(layer, step), showEvolution(layer, step)]);
}

async function showHistogram(layer, step) {
  const box = $("histogram");
  try {
    const h = await api("histogram", { run: S.run, layer, kind: S.kind, step, rank: S.rank });
    const finite = h.counts.reduce((a, b) => a + b, 0);
    box.querySelector(".caption").textContent = h.absent ? `${layer} did not run at step ${step}` :
      `${layer} (${h.kind}) at step ${step}: ${finite} finite values in ${h.counts.length} bins; ` +
      `NaN ${h.nan} · +Inf ${h.posinf} · -Inf ${h.neginf}`;
    box.dataset.step = step;
    box.dataset.layer = layer;
    box.dataset.nan = h.nan;
    const cv = box.querySelector("canvas");
    cv.dataset.ticks = JSON.stringify(Chart.bars(cv, h, { width: 560, height: 220 }));
  } catch (e) { fail("histogram", e); }
}

function series(st, key) {
  if (key !== "nonfinite") return st[key];
  return st.step.map((_, i) => Math.max(0, st.nan[i]) + Math.max(0, st.posinf[i]) + Math.max(0, st.neginf[i]));
}

async function showEvolution(layer, step) {
  const box = $("evolution");
  try {
    const st = await api("stats", { run: S.run, layer, kind: S.kind, rank: S.rank, start: S.start, stop: S.stop, width: 280 });
    const bad = st.step.filter((s, i) => st.nan[i] + st.posinf[i] + st.neginf[i] > 0);
    box.querySelector(".caption").textContent = `${layer} (${S.kind}), every statistic; the dashed line is step ${step}` +
      (st.step.length && st.step.length < (st.step_hi[st.step_hi.length - 1] - st.step[0] + 1) ? " (each point the largest of its steps)" : "");
    const grid = box.querySelector(".grid");
    grid.replaceChildren(...EVOLUTION.map(k => {
      const c = el("canvas");
      c.dataset.stat = k;
      c.dataset.yticks = JSON.stringify(Chart.lines(c, [{ x: st.step, y: series(st, k), color: Chart.COLORS.lines[0] }],
                  { title: k, marker: step, bad, width: 280, height: 130, log: LOG.has(k) }));
      return c;
    }));
  } catch (e) { fail("evolution", e); }
}

async function loadScalars() {
  const box = $("scalars");
  try {
    const sc = await api("scalars", { run: S.run });
    const names = Object.keys(sc).filter(k => k !== "step" && k !== "nonfinite");
    const bad = Object.values(sc.nonfinite || {}).reduce((a, b) => a + b.length, 0);
    box.querySelector(".caption").textContent = sc.step.length ? `${names.length} scalars over ${sc.step.length} steps` +
      (bad ? `; ${bad} non-finite values logged (pink dotted lines)` : "") : "no scalars recorded";
    box.querySelector(".grid").replaceChildren(...(sc.step.length ? names : []).map(k => {
      const c = el("canvas");
      const bad = (sc.nonfinite || {})[k] || [];          // logged NaN/Inf: pink dotted lines
      c.dataset.name = k;
      c.dataset.bad = JSON.stringify(bad);
      Chart.lines(c, [{ x: sc.step, y: sc[k], color: Chart.COLORS.lines[1] }], { title: k, width: 380, height: 150, marker: S.sel && S.sel.step, bad, badLines: true });
      return c;
    }));
  } catch (e) { fail("scalars", e); }
}

// --- two runs ------------------------------------------------------------------------------------
async function loadCompare() {
  if (S.runs.length < 2) return;
  $("compare").hidden = false;
  $("compare-title").textContent = `B (${S.runs[1].path}) against A (${S.runs[0].path})`;
  fillSelect($("metric"), ["stat_rel", "delta_abs_max", "delta_std", "delta_norm", "delta_mean", "delta_nan"], S.metric);
  try {
    const c = await api("compare-map", { kind: S.kind, rank: S.rank, metric: S.metric, start: S.start, stop: S.stop,
                                         width: plotWidth($("compare").querySelector(".heat")) });
    S.cmp = c;
    const fd = c.first_divergence;
    $("first-divergence").textContent = fd ? `first divergence (${c.kind}, rtol ${c.rtol}): step ${fd.step}, layer ${fd.layer}`
      : `no divergence in ${c.kind} (rtol ${c.rtol})`;
    $("first-divergence").classList.toggle("found", !!fd);
    S.cmpGeo = drawHeat(c, { canvas: "compare-map", labels: "compare-labels", axis: "compare-axis", legend: "compare-legend" },
                        fd ? [{ layer: fd.layer, step: fd.step, testid: "first-divergence-cell" }] : []);
    const key = fd ? `${c.kind}|${fd.layer}` : c.kind;
    if (S.cmpFirst !== key) { S.cmpFirst = key; S.cmpLayer = fd ? fd.layer : c.layers[0]; }
    if (S.cmpLayer) await compareEvolution(S.cmpLayer);
  } catch (e) { $("first-divergence").textContent = `could not compare: ${e.message}`; }
}

async function compareEvolution(layer) {
  S.cmpLayer = layer;
  const box = $("compare-evolution");
  const key = S.stat;
  try {
    const both = await Promise.all([0, 1].map(run => api("stats", { run, layer, kind: S.kind, rank: S.rank, start: S.start, stop: S.stop, width: 600 })));
    const fd = S.cmp && S.cmp.first_divergence;
    box.querySelector(".caption").textContent = `${layer} (${S.kind}): ${key} in A (blue) and B (orange)` +
      (fd && fd.layer === layer ? `; the dashed line is the first divergence, step ${fd.step}` : "");
    Chart.lines(box.querySelector("canvas"), both.map((st, i) => ({ x: st.step, y: series(st, key), color: Chart.COLORS.lines[i] })),
                { title: key, width: 900, height: 200, marker: fd && fd.layer === layer ? fd.step : null, log: LOG.has(key) });
  } catch (e) { box.querySelector(".caption").textContent = `could not load: ${e.message}`; }
}

// --- controls and the live run -----------------------------------------------------------------------
async function refresh() {
  await loadMap();
  await loadCompare();
}

function guard(f) {
  return async (...a) => {
    try { await f(...a); } catch (e) { $("map-title").textContent = `could not load: ${e.message}`; }
  };
}

// [start, stop) as the API takes it; the fields show the first and the last step, both shown.
function zoomTo(start, stop) {
  S.start = start; S.stop = stop;
  $("start").value = start === null ? "" : start;
  $("stop").value = stop === null ? "" : stop - 1;
  return refresh();
}

function wire() {
  const change = (id, f) => $(id).addEventListener("change", guard(async () => { f($(id).value); await refresh(); }));
  change("kind", v => { S.kind = v; });
  change("stat", v => { S.stat = v; });
  change("rank", v => { S.rank = +v; });
  change("metric", v => { S.metric = v; });
  $("run").addEventListener("change", guard(async () => { S.run = +$("run").value; S.sel = null; await loadRuns(); await loadMap(); await loadScalars(); }));
  $("filter").addEventListener("input", () => { S.filter = $("filter").value.trim(); drawMap(); if (S.cmp) S.cmpGeo = drawHeat(S.cmp, { canvas: "compare-map", labels: "compare-labels", axis: "compare-axis", legend: "compare-legend" }, []); });
  $("sort").addEventListener("change", () => { S.sort = $("sort").value; drawMap(); });
  const int = id => $(id).value === "" ? null : parseInt($(id).value, 10);
  $("zoom").addEventListener("click", guard(() => zoomTo(int("start"), int("stop") === null ? null : int("stop") + 1)));
  $("all-steps").addEventListener("click", guard(() => zoomTo(null, null)));
  $("zoom-out").addEventListener("click", guard(() => {
    const m = S.map, r = S.runs[S.run].steps;
    if (!m || !m.step_lo.length || !r) return zoomTo(null, null);
    const a = m.step_lo[0], b = m.step_hi[m.step_hi.length - 1] + 1, w = (b - a) * 2;
    const lo = Math.max(r[0], a - w), hi = b + w;
    return zoomTo(lo <= r[0] ? null : lo, hi > r[1] ? null : hi);
  }));
  $("jump").addEventListener("click", guard(async () => {
    const ev = S.runs[S.run].first_nonfinite;
    S.kind = ev.kind; S.rank = ev.rank;
    fillSelect($("kind"), S.runs[S.run].kinds, S.kind);
    fillSelect($("rank"), S.runs[S.run].ranks, S.rank);
    const r = S.runs[S.run].steps;
    let lo = ev.step - 20, hi = ev.step + 20;          // 41 steps around it, inside the run
    if (lo < r[0]) { hi += r[0] - lo; lo = r[0]; }
    if (hi > r[1]) { lo = Math.max(r[0], lo - (hi - r[1])); hi = r[1]; }
    await zoomTo(lo <= r[0] ? null : lo, hi >= r[1] ? null : hi + 1);
    await select(ev.layer, ev.step);
  }));
  pointer("map", () => S.geo, guard(async (layer, col) => select(layer, await pickStep(layer, col))), guard(zoomTo));
  pointer("compare-map", () => S.cmpGeo, guard(compareEvolution), guard(zoomTo));
  let resized = null;
  window.addEventListener("resize", () => { clearTimeout(resized); resized = setTimeout(guard(refresh), 200); });
}

async function poll() {
  if (!S.busy) {
    S.busy = true;
    try {
      const seen = await loadRuns();
      if (seen !== S.seen) { S.seen = seen; await refresh(); }
    } catch (e) { $("status").textContent = `lost the server: ${e.message}`; }
    S.busy = false;
  }
  setTimeout(poll, 1000);
}

async function main() {
  wire();
  try {
    S.seen = await loadRuns();
    await refresh();
    await loadScalars();
    document.body.dataset.ready = "1";
  } catch (e) { $("status").textContent = `could not load: ${e.message}`; }
  setTimeout(poll, 1000);
}

main();
