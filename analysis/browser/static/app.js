// tensortape serve: the page.  Reads /api/, draws the heat maps with heat.js and the
// charts with charts.js (uPlot).  Its state (runs, kind, statistic, filter, zoom, the
// selected cell) lives in the URL: a link shows the same view.  Every string from a
// store (layer names, paths, events) goes in as textContent: text, never HTML.
"use strict";

const $ = id => document.getElementById(id);
const S = { runs: [], run: 0, kind: null, stat: "abs_max", rank: null, start: null, stop: null,
            filter: "", sort: "exec", rows: "auto", scale: "linear", metric: "stat_rel",
            sel: null, map: null, geo: null, cmp: null, cmpGeo: null, cmpLayer: null, seen: "",
            busy: false, asked: 0 };
const URL_KEYS = ["run", "kind", "stat", "rank", "filter", "sort", "rows", "start", "stop", "scale",
                  "metric", "layer", "step"];
const LOG = new Set(["std", "abs_max", "norm", "rms"]);      // a log axis where they span decades
const FAST = ["abs_max", "std", "norm", "rms", "nonfinite"];  // from the map's grains
const SLOW = ["mean", "min", "max", "zero_frac"];             // from the rows
const LABEL_W = 260, READABLE = 14;                           // labels' width; a readable row

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

// A query value as UTF-8, a lone surrogate (a layer's name may hold one) as its own three
// bytes, which the server decodes back: URLSearchParams would send U+FFFD instead.
function enc(s) {
  let out = "";
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i), pair = c >= 0xD800 && c <= 0xDBFF && i + 1 < s.length &&
      (s.charCodeAt(i + 1) & 0xFC00) === 0xDC00;
    if (pair) { out += encodeURIComponent(s.slice(i, i + 2)); i++; }
    else if ((c & 0xF800) === 0xD800)
      out += [0xE0 | (c >> 12), 0x80 | ((c >> 6) & 0x3F), 0x80 | (c & 0x3F)]
        .map(b => "%" + b.toString(16).toUpperCase()).join("");
    else out += encodeURIComponent(s[i]);
  }
  return out;
}

// A query value back from ``enc``'s bytes (and any browser's): UTF-8, where the three bytes
// of a lone surrogate are that code unit (URLSearchParams would read U+FFFD).
function dec(s) {
  const bytes = [];
  for (let i = 0; i < s.length; i++) {
    if (s[i] === "%" && /^[0-9a-fA-F]{2}$/.test(s.slice(i + 1, i + 3))) {
      bytes.push(parseInt(s.slice(i + 1, i + 3), 16)); i += 2;
    } else bytes.push(...new TextEncoder().encode(s[i] === "+" ? " " : s[i]));
  }
  const text = (a, b) => new TextDecoder().decode(new Uint8Array(bytes.slice(a, b)));
  let out = "", from = 0;
  for (let i = 0; i + 2 < bytes.length; i++)
    if (bytes[i] === 0xED && bytes[i + 1] >= 0xA0 && bytes[i + 1] <= 0xBF && (bytes[i + 2] & 0xC0) === 0x80) {
      out += text(from, i) + String.fromCharCode(0xD000 | ((bytes[i + 1] & 0x3F) << 6) | (bytes[i + 2] & 0x3F));
      i += 2; from = i + 1;
    }
  return out + text(from, bytes.length);
}

function query(params) {
  return Object.entries(params).filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => `${k}=${enc(String(v))}`).join("&");
}

async function api(path, params) {
  const r = await fetch(`/api/${path}?${query(params || {})}`);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function caption(id, text) { $(id).querySelector(".caption").textContent = text; }

function bytes(n) {
  if (n === null || n === undefined) return "?";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

// --- the URL: the page's state ------------------------------------------------------------
function readURL() {
  const pairs = location.search.slice(1).split("&").filter(Boolean)
    .map(p => (p.includes("=") ? [p.slice(0, p.indexOf("=")), p.slice(p.indexOf("=") + 1)] : [p, ""]));
  const got = new Map(pairs.reverse().map(([k, v]) => [dec(k), dec(v)]));     // the first of a key
  const q = { get: k => (got.has(k) ? got.get(k) : null) };
  const int = k => (q.get(k) === null || q.get(k) === "" ? null : parseInt(q.get(k), 10));
  if (q.get("run") !== null) S.run = int("run") || 0;
  for (const k of ["kind", "stat", "filter", "sort", "rows", "scale", "metric"]) if (q.get(k) !== null) S[k] = q.get(k);
  S.rank = int("rank"); S.start = int("start"); S.stop = int("stop");
  const layer = q.get("layer"), step = int("step");
  return layer !== null && step !== null ? { layer, step } : null;
}

function writeURL() {
  const v = { run: S.run || null, kind: S.kind, stat: S.stat, rank: S.rank, filter: S.filter || null,
              sort: S.sort === "exec" ? null : S.sort, rows: S.rows === "auto" ? null : S.rows,
              start: S.start, stop: S.stop, scale: S.scale === "linear" ? null : S.scale,
              metric: S.runs.length > 1 ? S.metric : null,
              layer: S.sel && S.sel.layer, step: S.sel && S.sel.step };
  const q = query(Object.fromEntries(URL_KEYS.map(k => [k, v[k]])));    // a name as ``enc`` sends it
  history.replaceState(null, "", `${location.pathname}${q ? "?" + q : ""}`);
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

function fillSelect(sel, values, current, labels) {
  const had = Array.from(sel.options).map(o => o.value).join("\n");
  if (had !== values.map(String).join("\n")) {
    sel.replaceChildren(...values.map((v, i) => { const o = el("option", labels ? labels[i] : String(v)); o.value = v; return o; }));
  }
  sel.value = current;
}

async function loadRuns() {
  S.runs = await api("runs");
  if (!(S.run >= 0 && S.run < S.runs.length)) S.run = 0;
  const run = S.runs[S.run];
  if (S.kind === null || !run.kinds.includes(S.kind)) S.kind = run.kinds.includes("activations") ? "activations" : run.kinds[0];
  if (S.rank === null || !run.ranks.includes(S.rank)) S.rank = run.ranks[0];
  if (!run.map_stats.includes(S.stat)) S.stat = "abs_max";
  $("status").textContent = statusText();
  const ev = run.first_nonfinite;
  $("first-nonfinite").textContent = S.runs.length < 2 ? eventText(ev, run) :   // whose event: A's, B's
    S.runs.map((r, i) => `${i ? "B" : "A"}: ${r.path}\n${eventText(r.first_nonfinite, r)}`).join("\n");
  $("first-nonfinite").classList.toggle("found", S.runs.some(r => r.first_nonfinite));
  $("jump").hidden = !ev;
  fillSelect($("run"), S.runs.map((r, i) => i), S.run, S.runs.map((r, i) => `${i ? "B" : "A"}: ${r.name}`));
  $("run-choice").hidden = S.runs.length < 2;
  fillSelect($("kind"), run.kinds, S.kind);
  fillSelect($("stat"), run.map_stats, S.stat);
  fillSelect($("rank"), run.ranks, S.rank);
  $("rank-choice").hidden = run.ranks.length < 2;
  for (const id of ["filter", "sort", "rows", "scale"]) $(id).value = S[id];
  return S.runs.map(r => `${r.status}|${r.steps}|${r.events}`).join(";");
}

// --- a heat map: rows, geometry, labels, pointer ---------------------------------------------
function globRe(glob) {
  const re = glob.replace(/[.+^${}()|\\]/g, "\\$&").replace(/\*/g, ".*").replace(/\?/g, ".");
  return new RegExp(`^${re}$`);
}

function peak(row) {
  let p = -Infinity;
  for (const v of row) { const x = Heat.num(v); if (isFinite(x)) p = Math.max(p, x); }
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
  return Math.max(100, Math.floor(area.clientWidth - LABEL_W - 16));
}

// Rows fit in 560 px where they are at least READABLE px each; past that (100 and more
// layers) each row is READABLE px and the map scrolls, unless "fit" is asked (labels hidden).
function rowHeight(n) {
  const fit = Math.max(1, Math.min(18, Math.floor(560 / Math.max(1, n))));
  if (S.rows === "fit" || (S.rows === "auto" && fit >= READABLE)) return fit;
  return Math.max(fit, READABLE);
}

function drawHeat(m, ids, marks, fixed) {
  const rows = rowsOf(m), cols = m.step_lo.length;
  const area = $(ids.area);
  const W = plotWidth(area);
  const rowH = rowHeight(rows.length);
  const cellW = cols ? W / cols : W;
  const scale = Heat.logScale(rows.map(r => m.values[r]), fixed);
  const cells = marks.map(mk => ({ row: rows.indexOf(m.layers.indexOf(mk.layer)), col: Heat.colOf(m, mk.step), mk }))
    .filter(c => c.row >= 0 && c.col >= 0);
  Heat.map($(ids.canvas), m, rows, cellW, rowH, scale, cells.map(c => ({ row: c.row, col: c.col })));
  const shown = rowH >= 7, chars = Math.floor((LABEL_W - 8) / (0.6 * Math.min(12, rowH - 2)));
  const labels = $(ids.labels);
  labels.replaceChildren(...rows.map(r => {
    const d = el("div", shown ? Heat.fitName(m.layers[r], chars) : "");
    d.style.height = d.style.lineHeight = rowH + "px";
    d.style.fontSize = Math.min(12, Math.max(rowH - 2, 1)) + "px";
    d.title = m.layers[r];
    d.dataset.layer = m.layers[r];
    return d;
  }));
  area.querySelector(".scroll").classList.toggle("scrolls", rows.length * rowH > 600);
  $(ids.note).textContent = shown ? (rows.length * rowH > 600 ? `${rows.length} layers: scroll the map (or filter them, or rows: fit all)` : "")
    : `${rows.length} layers in ${rowH}-px rows: labels hidden (rows: readable shows them; hover a row for its name)`;
  Heat.stepAxis($(ids.axis), m, cellW);
  const wrap = $(ids.canvas).parentElement;
  wrap.querySelectorAll(".mark").forEach(e => e.remove());
  for (const c of cells) {               // the marked cells, for people and for tests
    const d = el("div", "", "mark");
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
  const ctx = Heat.fit(c, 120, 10);
  for (let x = 0; x < 120; x++) { ctx.fillStyle = Heat.viridis(x / 119); ctx.fillRect(x, 0, 1, 10); }
  const sw = (color, text) => { const s = el("span"); const k = el("span", "", "swatch"); k.style.background = color; s.append(k, text); return s; };
  const [dark, bright] = compare ? [" (small difference)", " (large difference)"] : ["", ""];
  box.replaceChildren(el("span", `${what} (log): ${Heat.short(scale.lo)}${dark}`), c, el("span", Heat.short(scale.hi) + bright),
    sw(Heat.COLORS.nonfinite, compare ? "non-finite (NaN or Inf in either run): different" : "non-finite"),
    sw(Heat.COLORS.zero, compare ? "no difference (0)" : "zero"),
    sw(Heat.COLORS.absent, compare ? "not compared" : "not recorded"));
}

function cellAt(geo, ev) {
  const r = ev.target.getBoundingClientRect();
  const x = ev.clientX - r.left, y = ev.clientY - r.top;
  const col = Math.floor(x / geo.cellW), i = Math.floor(y / geo.rowH);
  if (!geo || col < 0 || col >= geo.cols || i < 0 || i >= geo.rows.length) return null;
  return { row: geo.rows[i], col, x };
}

function tip(text, ev) {
  const t = $("tooltip");
  if (!text) { t.hidden = true; return; }
  t.textContent = text;
  t.hidden = false;
  t.style.left = (ev.clientX + 14) + "px";
  t.style.top = (ev.clientY + 14) + "px";
}

function cellText(geo, c) {
  const m = geo.m, lo = m.step_lo[c.col], hi = m.step_hi[c.col];
  const steps = lo === hi ? `step ${lo}` : `steps ${lo}–${hi} (the largest of them)`;
  return `${m.layers[c.row]}\n${steps}\n${m.stat || m.metric} = ${m.values[c.row][c.col]}` +
    (m.nonfinite[c.row][c.col] ? "\nnon-finite values here" : "");
}

function pointer(canvasId, geoOf, onClick, onZoom) {
  const cv = $(canvasId), brush = $(canvasId + "-brush");
  let down = null;
  cv.addEventListener("mousemove", ev => {
    const geo = geoOf();
    if (!geo) return;
    const c = cellAt(geo, ev);
    tip(c && cellText(geo, c), ev);
    if (down && brush) {
      const x = c ? c.x : down.x;
      Object.assign(brush.style, { left: Math.min(x, down.x) + "px", width: Math.abs(x - down.x) + "px" });
      brush.hidden = false;
    }
  });
  cv.addEventListener("mouseleave", () => tip(null));
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
    $(id).value = v === null ? "" : (id === "stop" ? v - 1 : v);
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
  S.geo = drawHeat(S.map, { canvas: "map", labels: "map-labels", axis: "map-axis", legend: "map-legend",
                            area: "map-area", note: "map-note" }, marks);
}

// A column of several steps: the step that holds its largest value (its first non-finite one).
async function pickStep(layer, col) {
  const m = S.map, lo = m.step_lo[col], hi = m.step_hi[col];
  if (lo === hi) return lo;
  const st = await api("stats", { run: S.run, layer, kind: S.kind, rank: S.rank, start: lo, stop: hi + 1,
                                  stats: `${S.stat},nonfinite` });
  const bad = st.step.findIndex((s, i) => st.column_nonfinite[i]);
  if (m.nonfinite[m.layers.indexOf(layer)][col] && bad >= 0) return st.step[bad];
  let best = 0;
  st[S.stat].forEach((v, i) => { if (Heat.num(v) > Heat.num(st[S.stat][best]) || !isFinite(Heat.num(st[S.stat][best]))) best = i; });
  return st.step[best];
}

async function select(layer, step) {
  S.sel = { layer, step };
  writeURL();
  drawMap();
  const asked = ++S.asked;              // a later click wins: an older answer is dropped
  await Promise.all([showHistogram(layer, step, asked), showEvolution(layer, step, asked)]);
  await showDistribution(layer, step, asked);
}

async function showHistogram(layer, step, asked) {
  const box = $("histogram");
  try {
    const h = await api("histogram", { run: S.run, layer, kind: S.kind, step, rank: S.rank, scale: S.scale });
    if (asked !== S.asked) return;
    const zeros = h.masses.map(m => `${m.count.toLocaleString()} exactly ${m.value} (${(100 * m.count / h.total).toFixed(1)}%, the dashed line: no density)`);
    caption("histogram", h.absent ? `${layer} did not run at step ${step}` :
      `${layer} (${h.kind}) at step ${step}: ${h.total.toLocaleString()} finite values in ${h.bars.lo.length} bars` +
      (zeros.length ? `; ${zeros.join("; ")}` : "") + `; NaN ${h.nan} · +Inf ${h.posinf} · -Inf ${h.neginf}` +
      `\n${h.ylabel} over ${h.xlabel}` +
      (h.bulk ? "\nmost values are in three bars: the symlog scale shows the bulk" : ""));
    box.dataset.step = step;
    box.dataset.layer = layer;
    box.dataset.nan = h.nan;
    box.dataset.scale = h.scale;
    Charts.histogram(box.querySelector(".chart"), h, { width: 560, height: 250, title: "" });
    Charts.nonfinite(box.querySelector(".side"), [h.nan, h.posinf, h.neginf]);
  } catch (e) { caption("histogram", `could not load: ${e.message}`); }
}

// The evolution: the map's statistics first (from its grains, at once on a long run), then
// the others (read from the rows), each chart filled as its numbers come.
async function showEvolution(layer, step, asked) {
  const box = $("evolution"), grid = box.querySelector(".grid");
  const q = { run: S.run, layer, kind: S.kind, rank: S.rank, start: S.start, stop: S.stop, width: 280 };
  grid.replaceChildren(...[...FAST, ...SLOW].map(k => { const d = el("div", "", "chart"); d.dataset.stat = k; return d; }));
  let agg = false;
  const draw = st => {
    const bad = st.step.filter((s, i) => st.column_nonfinite[i]);
    agg = agg || st.step.some((s, i) => st.step_hi[i] > s);
    for (const k of Object.keys(st)) {
      const d = grid.querySelector(`[data-stat="${k}"]`);
      if (!d) continue;
      Charts.lines(d, [{ x: st.step, y: st[k], label: k }], { title: k === "nonfinite" ? "NaN + Inf count" : k,
        marker: step, bad: k === "nonfinite" ? [] : bad, width: 280, height: 130, log: LOG.has(k) });
    }
    caption("evolution", `${layer} (${S.kind}), every statistic; the dashed line is step ${step}` +
      (agg ? "; each point the largest of its steps" : "") +
      (bad.length ? "; pink ticks: columns with NaN/Inf, where the statistics cover only the finite values (not drawn)" : ""));
  };
  try {
    caption("evolution", `${layer}: reading…`);
    const fast = await api("stats", { ...q, stats: FAST.join(",") });
    if (asked !== S.asked) return;
    draw(fast);
    box.dataset.layer = layer;
    box.dataset.step = step;
    const slow = await api("stats", { ...q, stats: SLOW.join(",") });
    if (asked !== S.asked) return;
    draw(slow);
    box.dataset.complete = `${layer}|${step}`;
  } catch (e) { caption("evolution", `could not load: ${e.message}`); }
}

async function showDistribution(layer, step, asked) {
  const box = $("distribution"), cv = box.querySelector("canvas");
  try {
    caption("distribution", `${layer}: reading its histograms…`);
    const W = plotWidth($("map-area"));
    const d = await api("distribution", { run: S.run, layer, kind: S.kind, rank: S.rank, start: S.start, stop: S.stop,
                                          width: W, scale: S.scale });
    if (asked !== S.asked) return;
    if (!d.row_lo.length && !d.step_lo.length) { caption("distribution", `${layer}: no histograms in this window`); return; }
    box.querySelector(".dist").hidden = false;
    const geo = Heat.distribution(cv, d, W, 260, step);
    S.dist = { d, geo };
    const agg = d.steps_in_window > d.step_lo.length;
    caption("distribution", `${layer} (${S.kind}): its histograms over steps ${d.step_lo[0]}–${d.step_hi[d.step_hi.length - 1]}` +
      `${agg ? ", each column the sum of its steps' counts" : ""}; colour: density per ` +
      `${d.scale === "linear" ? "unit of value" : "decade of |value|"} (log colour scale ${Heat.short(geo.scale.lo)} – ${Heat.short(geo.scale.hi)}); ` +
      `rows below: exact zeros, NaN, +Inf, -Inf; the dashed line is step ${step}`);
    valueAxis($("distribution-axis"), d, geo);
    Heat.stepAxis($("distribution-steps"), d, geo.cellW);
    box.dataset.layer = layer;
    box.dataset.step = step;
  } catch (e) { caption("distribution", `could not load: ${e.message}`); }
}

function valueAxis(axis, d, geo) {
  axis.replaceChildren();
  const inv = t => t;            // linear: the drawn coordinate is the value
  const ticks = d.ticks ? d.ticks : Heat.ticks(geo.tLo, geo.tHi, 5).map(t => ({ t, label: Heat.short(inv(t)) }));
  for (const t of ticks) {
    const y = geo.y(t.t);
    if (y < -1 || y > geo.top + 1) continue;
    const s = el("span", t.label);
    s.style.top = (y - 7) + "px";
    axis.appendChild(s);
  }
  geo.names.forEach((k, i) => {
    const s = el("span", { zeros: "exactly 0", nan: "NaN", posinf: "+Inf", neginf: "-Inf" }[k]);
    s.style.top = (geo.top + 4 + i * geo.strip - 1) + "px";
    axis.appendChild(s);
  });
}

function distributionTip(ev) {
  if (!S.dist) return;
  const { d, geo } = S.dist, r = ev.target.getBoundingClientRect();
  const x = ev.clientX - r.left, y = ev.clientY - r.top, c = Math.floor(x / geo.cellW);
  if (c < 0 || c >= geo.cols) return tip(null);
  const steps = d.step_lo[c] === d.step_hi[c] ? `step ${d.step_lo[c]}` : `steps ${d.step_lo[c]}–${d.step_hi[c]}`;
  if (y > geo.top) {
    const k = geo.names[Math.floor((y - geo.top - 4) / geo.strip)];
    if (!k) return tip(null);
    return tip(`${steps}\n${{ zeros: "exactly 0", nan: "NaN", posinf: "+Inf", neginf: "-Inf" }[k]}: ${d[k][c].toLocaleString()} values`, ev);
  }
  const i = d.row_t_lo.findIndex((lo, k) => geo.y(Heat.num(d.row_t_hi[k])) <= y && y <= geo.y(Heat.num(lo)));
  if (i < 0) return tip(`${steps}\nno values here`, ev);
  tip(`${steps}\n[${Heat.short(Heat.num(d.row_lo[i]))}, ${Heat.short(Heat.num(d.row_hi[i]))})\n` +
      `density ${d.density[i][c]} of ${d.finite[c].toLocaleString()} finite values`, ev);
}

async function loadScalars() {
  const box = $("scalars");
  try {
    const sc = await api("scalars", { run: S.run });
    const series = sc.series || {}, once = new Set(sc.once || []);
    const names = Object.keys(series).filter(k => !once.has(k));
    const bad = Object.values(sc.nonfinite || {}).reduce((a, b) => a + b.length, 0);
    caption("scalars", sc.step.length ? `${names.length} scalars over ${sc.step.length} steps` +
      (once.size ? `, ${once.size} logged once (the table)` : "") +
      (bad ? `; ${bad} non-finite values logged (pink dotted lines)` : "") : "no scalars recorded");
    box.querySelector(".grid").replaceChildren(...names.map(k => {
      const d = el("div", "", "chart");
      const nonfinite = (sc.nonfinite || {})[k] || [];          // logged NaN/Inf: pink dotted lines
      d.dataset.name = k;
      d.dataset.bad = JSON.stringify(nonfinite);
      Charts.lines(d, [{ x: series[k].step, y: series[k].value, label: k, color: Charts.LINES[1] }],
                   { title: k, width: 380, height: 150, marker: S.sel && S.sel.step, bad: nonfinite, badLines: true });
      return d;
    }));
    const table = box.querySelector("table");
    table.replaceChildren(...[...once].map(k => {
      const tr = el("tr");
      tr.append(el("td", k), el("td", String(series[k].value[0])), el("td", `step ${series[k].step[0]}`));
      return tr;
    }));
    table.hidden = !once.size;
  } catch (e) { caption("scalars", `could not load: ${e.message}`); }
}

// --- two runs ------------------------------------------------------------------------------------
async function loadCompare() {
  if (S.runs.length < 2) return;
  $("compare").hidden = false;
  $("compare-title").textContent = `B (${S.runs[1].path}) against A (${S.runs[0].path})`;
  fillSelect($("metric"), ["stat_rel", "delta_abs_max", "delta_std", "delta_norm", "delta_mean", "delta_nan"], S.metric);
  if (!S.cmp) $("first-divergence").textContent = "comparing the two runs: their statistics, and every full tensor both hold…";
  try {
    const c = await api("compare-map", { kind: S.kind, rank: S.rank, metric: S.metric, start: S.start, stop: S.stop,
                                         width: plotWidth($("compare-area")) });
    S.cmp = c;
    const fd = c.first_divergence, p = c.pending;
    $("first-divergence").textContent = (fd ? `first divergence (${c.kind}, rtol ${c.rtol}): step ${fd.step}, layer ${fd.layer}`
      : `no divergence in ${c.kind} (rtol ${c.rtol})`) +
      (p ? ` in the statistics so far; comparing the full tensors both runs hold: ${p.done} of ${p.of ?? "?"} layers…` +
          (p.covered ? ` (${p.covered} compared)` : "") : "");
    $("first-divergence").classList.toggle("found", !!fd);
    $("compare-unlike").textContent = c.unlike.length ? `not alike: ${c.unlike.join("; ")}; only the shared layers whose shapes agree are compared` : "";
    $("compare-unlike").hidden = !c.unlike.length;
    $("compare").dataset.pending = p ? `${p.done}/${p.of ?? "?"}` : "";
    drawCompare();
    const key = fd ? `${c.kind}|${fd.layer}` : c.kind, moved = S.cmpFirst !== key;
    if (moved) { S.cmpFirst = key; S.cmpLayer = fd ? fd.layer : c.layers[0]; }
    clearTimeout(S.cmpPoll);     // the map is whole; the full tensors' answer is asked for until it is
    if (p) S.cmpPoll = setTimeout(loadCompare, 500);
    if (S.cmpLayer && (moved || !p)) await compareEvolution(S.cmpLayer);
  } catch (e) { $("first-divergence").textContent = `could not compare: ${e.message}`; }
}

function drawCompare() {
  const c = S.cmp, fd = c.first_divergence;
  S.cmpGeo = drawHeat(c, { canvas: "compare-map", labels: "compare-labels", axis: "compare-axis", legend: "compare-legend",
                           area: "compare-area", note: "compare-note" },
                      fd ? [{ layer: fd.layer, step: fd.step, testid: "first-divergence-cell" }] : [],
                      { lo: 1e-7, hi: 1 });      // as the PNG: only 0 is "no difference", 1 is dark
}

async function compareEvolution(layer) {
  S.cmpLayer = layer;
  const box = $("compare-evolution");
  const key = S.stat;
  try {
    const both = await Promise.all([0, 1].map(run => api("stats", { run, layer, kind: S.kind, rank: S.rank, start: S.start,
                                                                    stop: S.stop, width: 600, stats: key })));
    const fd = S.cmp && S.cmp.first_divergence;
    box.querySelector(".caption").textContent = `${layer} (${S.kind}): ${key} in A (blue) and B (orange)` +
      (fd && fd.layer === layer ? `; the dashed line is the first divergence, step ${fd.step}` : "");
    Charts.lines(box.querySelector(".chart"), both.map((st, i) => ({ x: st.step, y: st[key], label: i ? "B" : "A", color: Charts.LINES[i] })),
                 { title: key, width: 900, height: 200, marker: fd && fd.layer === layer ? fd.step : null, log: LOG.has(key) });
  } catch (e) { box.querySelector(".caption").textContent = `could not load: ${e.message}`; }
}

// --- controls and the live run -----------------------------------------------------------------------
async function refresh() {
  writeURL();
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
  return refresh();
}

function redraw() {
  writeURL();
  drawMap();
  if (S.cmp) drawCompare();
}

function wire() {
  const change = (id, f) => $(id).addEventListener("change", guard(async () => { f($(id).value); await refresh(); }));
  change("kind", v => { S.kind = v; S.sel = null; });
  change("stat", v => { S.stat = v; });
  change("rank", v => { S.rank = +v; S.sel = null; });
  change("metric", v => { S.metric = v; });
  $("run").addEventListener("change", guard(async () => { S.run = +$("run").value; S.sel = null; await loadRuns(); await refresh(); await loadScalars(); }));
  $("filter").addEventListener("input", () => { S.filter = $("filter").value.trim(); redraw(); });
  $("sort").addEventListener("change", () => { S.sort = $("sort").value; redraw(); });
  $("rows").addEventListener("change", () => { S.rows = $("rows").value; redraw(); });
  $("scale").addEventListener("change", guard(async () => {
    S.scale = $("scale").value;
    writeURL();
    if (S.sel) { const asked = ++S.asked; await showHistogram(S.sel.layer, S.sel.step, asked); await showDistribution(S.sel.layer, S.sel.step, asked); }
  }));
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
  $("copy-link").addEventListener("click", () => {
    writeURL();
    $("link").value = location.href;
    $("link").hidden = false;
    $("link").select();
  });
  pointer("map", () => S.geo, guard(async (layer, col) => select(layer, await pickStep(layer, col))), guard(zoomTo));
  pointer("compare-map", () => S.cmpGeo, guard(compareEvolution), guard(zoomTo));
  const dist = $("distribution").querySelector("canvas");
  dist.addEventListener("mousemove", distributionTip);
  dist.addEventListener("mouseleave", () => tip(null));
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
  const wanted = readURL();
  wire();
  try {
    S.seen = await loadRuns();
    await refresh();
    if (wanted && S.map && S.map.layers.includes(wanted.layer)) await select(wanted.layer, wanted.step);
    await loadScalars();
    document.body.dataset.ready = "1";
  } catch (e) { $("status").textContent = `could not load: ${e.message}`; }
  setTimeout(poll, 1000);
}

main();
