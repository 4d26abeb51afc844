// tensortape's charts: a heat map, line charts and a bar chart on <canvas>.
// Hand-written (no npm here to vendor uPlot or ECharts, and the page must load
// nothing from the network); about 200 lines cover what the view draws.
// Every string drawn comes from the caller and is drawn with fillText: text, never HTML.
"use strict";

const Chart = (() => {
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const COLORS = { nonfinite: "#ff2d75", absent: "#e8e8e8", zero: "#2a0e3a", grid: "#ccc",
                   text: "#333", marker: "#000", lines: ["#1f6feb", "#e36209", "#2da44e", "#8250df"] };

  function viridis(t) {           // t in [0, 1]
    t = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i;
    const a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * f)).join(",")})`;
  }

  // A value as a number: the API's "nan", "inf" and "-inf" strings too.
  function num(v) {
    if (typeof v === "number") return v;
    if (v === "inf") return Infinity;
    if (v === "-inf") return -Infinity;
    return NaN;
  }

  // The canvas at its CSS size, scaled for the screen's pixels; returns its 2d context.
  function fit(canvas, cssW, cssH) {
    const dpr = window.devicePixelRatio || 1;
    canvas.style.width = cssW + "px";
    canvas.style.height = cssH + "px";
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);
    return ctx;
  }

  // A log colour scale over the positive finite values of a matrix.
  function logScale(rows) {
    let lo = Infinity, hi = -Infinity;
    for (const row of rows) for (const v of row) {
      const x = num(v);
      if (isFinite(x) && x > 0) { lo = Math.min(lo, x); hi = Math.max(hi, x); }
    }
    if (!isFinite(lo)) { lo = 1; hi = 10; }
    const a = Math.log10(lo), b = Math.log10(hi);
    return { lo, hi, color(v, bad) {
      const x = num(v);
      if (bad) return COLORS.nonfinite;
      if (Number.isNaN(x)) return COLORS.absent;
      if (!isFinite(x)) return COLORS.nonfinite;
      if (x <= 0) return COLORS.zero;
      return viridis(b > a ? (Math.log10(x) - a) / (b - a) : 0.5);
    } };
  }

  // The heat map: rows x cols cells of cellW x rowH; marks: [{row, col}] outlined.
  function heatmap(canvas, m, rows, cellW, rowH, scale, marks) {
    const cols = rows.length ? m.values[rows[0]].length : 0;
    const w = Math.max(1, cols * cellW), h = Math.max(1, rows.length * rowH);
    const ctx = fit(canvas, w, h);
    rows.forEach((r, i) => {
      const vals = m.values[r], bad = m.nonfinite[r];
      for (let c = 0; c < cols; c++) {
        ctx.fillStyle = scale.color(vals[c], bad[c]);
        ctx.fillRect(c * cellW, i * rowH, Math.ceil(cellW), Math.ceil(rowH));
      }
    });
    for (const mk of marks || []) {
      ctx.lineWidth = 2;
      ctx.strokeStyle = "#fff";
      ctx.strokeRect(mk.col * cellW - 2, mk.row * rowH - 2, cellW + 4, rowH + 4);
      ctx.strokeStyle = COLORS.marker;
      ctx.strokeRect(mk.col * cellW - 4, mk.row * rowH - 4, cellW + 8, rowH + 8);
    }
  }

  function ticks(lo, hi, n) {
    if (!(hi > lo)) return [lo];
    const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    const k = [1, 2, 5, 10].find(f => (hi - lo) / (step * f) <= n) * step;
    const out = [];             // i * k, not a running sum: no 1e22 of rounding where 0 is meant
    for (let i = Math.ceil(lo / k); i * k <= hi + 1e-9 * k; i++) out.push(i * k);
    return out;
  }

  function short(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    return (a >= 1e4 || a < 1e-3) ? v.toExponential(1) : String(+v.toPrecision(3));
  }

  // Line chart: series [{x: [...], y: [...], color, label}]; opts {title, marker, bad,
  // badLines (the bad steps as pink dotted lines down the plot, not ticks on top)}.
  // Returns the y ticks' labels.
  function lines(canvas, series, opts) {
    if (opts.log) series = series.map(s => ({ ...s, y: s.y.map(v => { const x = num(v); return x > 0 && isFinite(x) ? Math.log10(x) : NaN; }) }));
    const W = opts.width || 300, H = opts.height || 140, L = 52, R = 8, T = 18, B = 20;
    const ctx = fit(canvas, W, H);
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const s of series) s.x.forEach((x, i) => {
      const y = num(s.y[i]);
      x0 = Math.min(x0, x); x1 = Math.max(x1, x);
      if (isFinite(y)) { y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
    });
    if (!isFinite(x0)) { x0 = 0; x1 = 1; }
    if (!isFinite(y0)) { y0 = 0; y1 = 1; }
    if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    if (x1 === x0) x1 = x0 + 1;
    const px = x => L + (x - x0) / (x1 - x0) * (W - L - R);
    const py = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    ctx.font = "11px sans-serif";
    ctx.fillStyle = COLORS.text;
    ctx.fillText((opts.title || "") + (opts.log ? " (log)" : ""), L, 12);
    ctx.strokeStyle = COLORS.grid;
    ctx.lineWidth = 1;
    const yticks = ticks(y0, y1, 4).map(t => [t, opts.log ? short(Math.pow(10, t)) : short(t)]);
    for (const [t, text] of yticks) {
      ctx.beginPath(); ctx.moveTo(L, py(t)); ctx.lineTo(W - R, py(t)); ctx.stroke();
      ctx.fillText(text, 2, py(t) + 4);
    }
    for (const t of ticks(x0, x1, 5)) ctx.fillText(short(t), px(t) - 8, H - 5);
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      s.x.forEach((x, i) => {
        const y = num(s.y[i]);
        if (!isFinite(y)) { pen = false; return; }
        if (pen) ctx.lineTo(px(x), py(y)); else ctx.moveTo(px(x), py(y));
        pen = true;
      });
      ctx.stroke();
      if (s.x.length === 1 && isFinite(num(s.y[0]))) {
        ctx.fillStyle = s.color; ctx.fillRect(px(s.x[0]) - 2, py(num(s.y[0])) - 2, 4, 4);
      }
    }
    ctx.fillStyle = COLORS.nonfinite;      // steps with a NaN or an Inf: a tick on top
    (opts.bad || []).forEach(x => ctx.fillRect(px(x) - 1, T - 4, 3, 4));
    if (opts.badLines) {
      ctx.strokeStyle = COLORS.nonfinite;
      ctx.setLineDash([2, 2]);
      for (const x of opts.bad || []) { ctx.beginPath(); ctx.moveTo(px(x), T); ctx.lineTo(px(x), H - B); ctx.stroke(); }
      ctx.setLineDash([]);
    }
    if (opts.marker !== undefined && opts.marker !== null) {
      ctx.strokeStyle = COLORS.marker;
      ctx.setLineDash([3, 3]);
      ctx.beginPath(); ctx.moveTo(px(opts.marker), T); ctx.lineTo(px(opts.marker), H - B); ctx.stroke();
      ctx.setLineDash([]);
    }
    return yticks.map(t => t[1]);
  }

  // A bin's label: its lower edge, or for an open-ended tail bin "< x" / "> x"
  // (x its one finite edge): never "-Infinity".
  function edge(lo, hi) {
    lo = num(lo); hi = num(hi);
    if (isFinite(lo) && isFinite(hi)) return short(lo);
    return isFinite(hi) ? "< " + short(hi) : isFinite(lo) ? "> " + short(lo) : "all";
  }

  // Bar chart of a histogram over its bins (one bar a bin, the value axis as the
  // bins are: log-spaced), then the NaN, +Inf and -Inf bars; counts on a log axis.
  // Returns the x ticks' labels.
  function bars(canvas, h, opts) {
    const W = opts.width || 600, H = opts.height || 200, L = 52, T = 10, B = 34, side = 120;
    const n = h.counts.length;
    const ctx = fit(canvas, W, H);
    const all = h.counts.concat([h.nan, h.posinf, h.neginf]);
    const top = Math.log10(1 + Math.max(1, ...all));
    const bw = (W - L - side) / Math.max(1, n);
    const py = c => T + (1 - Math.log10(1 + c) / top) * (H - T - B);
    ctx.font = "11px sans-serif";
    ctx.fillStyle = COLORS.text;
    for (let e = 0; e <= top; e++) ctx.fillText(e ? "1e" + e : "0", 2, py(Math.pow(10, e) - (e ? 0 : 1)) + 4);
    ctx.fillStyle = COLORS.lines[0];
    h.counts.forEach((c, i) => { if (c > 0) ctx.fillRect(L + i * bw, py(c), Math.max(1, bw - 0.5), py(0) - py(c)); });
    const names = ["NaN", "+Inf", "-Inf"];
    [h.nan, h.posinf, h.neginf].forEach((c, k) => {
      const x = W - side + 12 + k * 36;
      ctx.fillStyle = COLORS.nonfinite;
      if (c > 0) ctx.fillRect(x, py(c), 24, py(0) - py(c));
      ctx.fillStyle = COLORS.text;
      ctx.fillText(names[k], x, H - 20);
      ctx.fillText(String(c), x, H - 6);
    });
    ctx.fillStyle = COLORS.text;
    const every = Math.max(1, Math.ceil(n / 5));
    const xticks = [];
    for (let i = 0; i < n; i += every) {
      xticks.push(edge(h.bin_lo[i], h.bin_hi[i]));
      ctx.fillText(xticks[xticks.length - 1], L + i * bw, H - 6);
    }
    ctx.fillText("count (log)", L + 4, T + 2);
    ctx.strokeStyle = COLORS.grid;
    ctx.beginPath(); ctx.moveTo(L, py(0)); ctx.lineTo(W - side, py(0)); ctx.stroke();
    return xticks;
  }

  return { COLORS, viridis, num, fit, logScale, heatmap, lines, bars, short, ticks };
})();
