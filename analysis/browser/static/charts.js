// tensortape's line and bar charts: uPlot (vendor/uPlot.iife.min.js, MIT), which draws
// the axes, ticks, lines, fills and the cursor.  This file only says what to draw:
// a statistic over steps, a histogram's densities as the PNG draws them, NaN/Inf bars.
// Every string shown comes from the caller and goes in as text, never HTML.
"use strict";

const Charts = (() => {
  const LINES = ["#1f6feb", "#e36209", "#2da44e", "#8250df"];
  const PINK = Heat.COLORS.nonfinite;
  const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5,
                         2e5, 5e5, 1e6, 2e6, 5e6, 1e7];
  const num = Heat.num;

  // A chart's place: an element holding a title line and the uPlot chart.
  function host(el, title) {
    el.replaceChildren();
    const t = document.createElement("div");
    t.className = "chart-title";
    t.textContent = title;
    el.appendChild(t);
    return el;
  }

  // The tooltip (the page's #tooltip) at the cursor, or hidden.
  function tip(u, text) {
    const t = document.getElementById("tooltip");
    if (!text || u.cursor.left < 0) { t.hidden = true; return; }
    const r = u.over.getBoundingClientRect();
    t.textContent = text;
    t.hidden = false;
    t.style.left = (r.left + u.cursor.left + 14) + "px";
    t.style.top = (r.top + u.cursor.top + 14) + "px";
  }

  // A vertical line at x (dashed, in ``color``) across the plot.
  function vline(u, x, color, dash) {
    const px = u.valToPos(x, "x", true);
    if (!isFinite(px) || px < u.bbox.left - 1 || px > u.bbox.left + u.bbox.width + 1) return;
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = color;
    ctx.lineWidth = Math.max(1, devicePixelRatio);
    ctx.setLineDash(dash.map(d => d * devicePixelRatio));
    ctx.beginPath(); ctx.moveTo(px, u.bbox.top); ctx.lineTo(px, u.bbox.top + u.bbox.height); ctx.stroke();
    ctx.restore();
  }

  // A linear axis' range: the data's, padded; one value alone gets a window around it.
  function flat(u, lo, hi) {
    if (lo === null || hi === null) return [0, 1];
    if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; return [lo - pad, hi + pad]; }
    const pad = (hi - lo) * 0.05;
    return [lo - pad, hi + pad];
  }

  // A log axis' ticks: powers of ten over its range, at most five.
  function decades(u, axis, lo, hi) {
    const a = Math.ceil(Math.log10(lo) - 1e-9), b = Math.floor(Math.log10(hi) + 1e-9);
    const every = Math.max(1, Math.ceil((b - a + 1) / 5)), out = [];
    for (let e = b; e >= a; e -= every) out.unshift(Math.pow(10, e));
    return out;
  }

  // Whether a positive series spans more than a decade: a log axis then (as the PNGs).
  function spansDecades(ys) {
    let lo = Infinity, hi = -Infinity;
    for (const y of ys) for (const v of y) if (v !== null && v > 0) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    return isFinite(lo) && hi > 10 * lo && ys.every(y => y.every(v => v === null || v > 0));
  }

  // Lines over steps.  series: [{x, y, label, color}] (y: the API's numbers; NaN, Inf and the
  // steps in ``opts.bad`` are gaps, never values); opts: {title, width, height, marker (a step:
  // a dashed line), bad (steps with NaN/Inf: a pink tick on top, or with badLines a pink dotted
  // line down the plot), log (log axis where the values span decades), label (y's name)}.
  // The chart's element gets data-yticks, the y axis' labels.
  function lines(el, series, opts) {
    host(el, opts.title || "");
    const xs = [...new Set(series.flatMap(s => s.x))].sort((a, b) => a - b);
    const bad = new Set(opts.bad || []);
    const ys = series.map(s => {
      const at = new Map(s.x.map((x, i) => [x, num(s.y[i])]));
      return xs.map(x => { const v = at.get(x); return v === undefined || !isFinite(v) || bad.has(x) ? null : v; });
    });
    const log = opts.log && spansDecades(ys);
    const shown = ys.map(y => log ? y.map(v => v !== null && v > 0 ? v : null) : y);
    const label = opts.label || "";
    const u = new uPlot({
      width: opts.width || 300, height: opts.height || 140,
      legend: { show: false }, cursor: { drag: { x: false, y: false }, points: { size: 5 } },
      scales: { x: { time: false }, y: log ? { distr: 3 } : { range: flat } },
      axes: [
        { incrs: INTEGER_STEPS, size: 28, font: "11px sans-serif", values: (u, v) => v.map(String) },
        { size: 56, font: "11px sans-serif", ...(log ? { splits: decades } : {}),
          values: (u, v) => { const out = v.map(x => Heat.short(x)); el.dataset.yticks = JSON.stringify(out); return out; } },
      ],
      series: [{}, ...series.map((s, i) => ({ label: s.label || label, stroke: s.color || LINES[i % LINES.length],
                                               width: 1.5, spanGaps: false, points: { show: xs.length < 60 } }))],
      hooks: {
        draw: [u => {
          for (const x of bad) {
            if (opts.badLines) vline(u, x, PINK, [2, 2]);
            else {
              const px = u.valToPos(x, "x", true);
              u.ctx.fillStyle = PINK;
              u.ctx.fillRect(px - devicePixelRatio, u.bbox.top, 3 * devicePixelRatio, 5 * devicePixelRatio);
            }
          }
          if (opts.marker !== null && opts.marker !== undefined) vline(u, opts.marker, "#000", [3, 3]);
        }],
        setCursor: [u => {
          const i = u.cursor.idx;
          if (i === null || i === undefined) return tip(u, null);
          const parts = series.map((s, k) => `${s.label || label}: ${ys[k][i] === null ? (bad.has(xs[i]) ? "NaN/Inf here" : "-") : ys[k][i]}`);
          tip(u, `step ${xs[i]}\n${parts.join("\n")}`);
        }],
      },
    }, [xs, ...shown], el);
    el._u = u;
    u.over.addEventListener("mouseleave", () => tip(u, null));
    el.dataset.log = log ? "1" : "0";
    el.dataset.drawn = JSON.stringify({ x: xs, y: shown });     // null: a gap, not a value
    return u;
  }

  // A histogram as the PNG draws it (``/api/histogram``'s bars): each bar's density on the
  // drawn axis (linear: per unit of value; symlog: per decade of |value|), a filled step
  // line over the bars' edges; exact zeros a dashed line (a point mass: no density).  The
  // element gets data-ticks (the x axis' labels) and data-bars (what is drawn).
  function histogram(el, h, opts) {
    host(el, opts.title || "");
    // a stepped line: each y holds until the next x; a bar's right edge is a 0 that holds
    // until the next bar begins (or is that bar's start, where they touch)
    const b = h.bars, xs = [], ys = [];
    for (let i = 0; i < b.t_lo.length; i++) {
      const lo = num(b.t_lo[i]), hi = num(b.t_hi[i]);
      if (xs.length && xs[xs.length - 1] === lo) { ys[ys.length - 1] = num(b.height[i]); }
      else { xs.push(lo); ys.push(num(b.height[i])); }
      xs.push(hi); ys.push(0);
    }
    const lim = h.t_xlim ? h.t_xlim.map(num) : [-1, 1];
    const ticks = h.ticks;
    el.dataset.bars = JSON.stringify({ lo: b.lo, hi: b.hi, height: b.height });
    const u = new uPlot({
      width: opts.width || 560, height: opts.height || 240,
      legend: { show: false }, cursor: { drag: { x: false, y: false }, points: { show: false } },
      scales: { x: { time: false, range: () => lim }, y: { range: (u, lo, hi) => [0, (hi || 1) * 1.08] } },
      axes: [
        { size: 34, font: "11px sans-serif", label: h.xlabel, labelSize: 14, labelFont: "11px sans-serif",
          ...(ticks ? { splits: () => ticks.map(t => t.t) } : {}),
          values: (u, v) => {
            const out = ticks ? ticks.map(t => t.label) : v.map(x => Heat.short(x));
            el.dataset.ticks = JSON.stringify(out);
            return out;
          } },
        { size: 60, font: "11px sans-serif", label: h.ylabel, labelSize: 14, labelFont: "11px sans-serif",
          values: (u, v) => v.map(x => Heat.short(x)) },
      ],
      series: [{}, { stroke: LINES[0], fill: "rgba(31, 111, 235, 0.45)", width: 1,
                     paths: uPlot.paths.stepped({ align: 1 }), points: { show: false } }],
      hooks: {
        draw: [u => { for (const m of h.masses) vline(u, m.t, "#000", [4, 2]); }],
        setCursor: [u => {
          const x = u.posToVal(u.cursor.left, "x");
          const i = b.t_lo.findIndex((lo, k) => num(lo) <= x && x < num(b.t_hi[k]));
          if (i < 0) return tip(u, null);
          tip(u, `[${Heat.short(num(b.lo[i]))}, ${Heat.short(num(b.hi[i]))})\n` +
                 `${b.count[i].toLocaleString()} values (${(100 * b.count[i] / h.total).toFixed(2)}%)\n` +
                 `density ${Heat.short(num(b.height[i]))}`);
        }],
      },
    }, [xs, ys], el);
    el._u = u;
    u.over.addEventListener("mouseleave", () => tip(u, null));
    return u;
  }

  // NaN, +Inf and -Inf counts as bars of their own (a count axis), never values.
  function nonfinite(el, counts) {
    host(el, "NaN / Inf (counts)");
    const names = ["NaN", "+Inf", "-Inf"];
    const any = counts.some(c => c > 0);
    const u = new uPlot({
      width: 150, height: 240, legend: { show: false }, cursor: { show: false },
      scales: { x: { time: false, range: [-0.6, 2.6] }, y: { range: [0, Math.max(1, ...counts) * 1.15] } },
      axes: [{ splits: () => [0, 1, 2], values: () => names, size: 24, font: "11px sans-serif" },
             { size: 48, font: "11px sans-serif", values: (u, v) => any ? v.map(x => Heat.short(x)) : v.map(() => "") }],
      series: [{}, { stroke: PINK, fill: "rgba(255, 45, 117, 0.6)", paths: uPlot.paths.bars({ size: [0.6, 60] }),
                     points: { show: false } }],
      hooks: { draw: [u => {
        const ctx = u.ctx;
        ctx.save();
        ctx.fillStyle = "#333";
        ctx.font = `${11 * devicePixelRatio}px sans-serif`;
        ctx.textAlign = "center";
        if (!any) ctx.fillText("none", u.bbox.left + u.bbox.width / 2, u.bbox.top + u.bbox.height / 2);
        else counts.forEach((c, i) => ctx.fillText(c.toLocaleString(), u.valToPos(i, "x", true),
                                                   u.valToPos(c, "y", true) - 4 * devicePixelRatio));
        ctx.restore();
      }] },
    }, [[0, 1, 2], counts], el);
    return u;
  }

  return { LINES, lines, histogram, nonfinite };
})();
