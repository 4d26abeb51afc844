// tensortape's heat maps on <canvas>: the layer x step map and a layer's histograms
// over steps (step x value).  Hand-written: uPlot has no heat map, and a heat map is
// a grid of filled rectangles; the line and bar charts are uPlot's (charts.js).
// Every string drawn or shown comes from the caller and goes in as text, never HTML.
"use strict";

const Heat = (() => {
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const COLORS = { nonfinite: "#ff2d75", absent: "#e8e8e8", zero: "#2a0e3a", marker: "#000",
                   empty: "#f7f7f7" };

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

  // A log colour scale over the positive finite values of a matrix; ``fixed``:
  // {lo, hi} instead of the data's range (the difference map: 1 is always dark).
  function logScale(rows, fixed) {
    let lo = Infinity, hi = -Infinity;
    for (const row of rows) for (const v of row) {
      const x = num(v);
      if (isFinite(x) && x > 0) { lo = Math.min(lo, x); hi = Math.max(hi, x); }
    }
    const any = isFinite(lo);
    if (fixed) { lo = fixed.lo; hi = Math.max(fixed.hi, any ? hi : fixed.hi); }
    else if (!any) { lo = 1; hi = 1; }
    const a = Math.log10(lo), b = Math.log10(hi);
    return { lo, hi, any, color(v, bad) {
      const x = num(v);
      if (bad) return COLORS.nonfinite;
      if (Number.isNaN(x)) return COLORS.absent;
      if (!isFinite(x)) return COLORS.nonfinite;
      if (x <= 0) return COLORS.zero;
      return viridis(b > a ? (Math.log10(Math.max(x, lo)) - a) / (b - a) : 0.5);
    } };
  }

  // Round tick values over [lo, hi]: about ``n`` multiples of 1, 2 or 5 x 10^k (integers
  // when ``integer``), each i * k, never a running sum (no 1e22 of rounding where 0 is meant).
  function ticks(lo, hi, n, integer) {
    if (!(hi > lo)) return [lo];
    let k = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    k = [1, 2, 5, 10].map(f => f * k).find(x => (hi - lo) / x <= n);
    if (integer) k = Math.max(1, Math.round(k));
    const out = [];
    for (let i = Math.ceil(lo / k); i * k <= hi + 1e-9 * k; i++) out.push(i * k);
    return out;
  }

  function short(v) {
    if (v === null || v === undefined || !isFinite(v)) return "";
    if (v === 0) return "0";
    const a = Math.abs(v);
    return (a >= 1e5 || a < 1e-3) ? v.toExponential(1) : String(+v.toPrecision(3));
  }

  // A layer's name in ``chars`` characters: whole, or its inner words (between dots)
  // left out from the left, numbers kept (…31.post_attention_layernorm), and past that
  // its last word cut in its middle.
  function fitName(name, chars) {
    if (name.length <= chars) return name;
    const parts = name.split("."), keep = parts.map(() => true);
    const joined = (ps, ks) => {
      let out = "";
      ps.forEach((p, i) => {
        if (ks[i]) out += (!out || out.endsWith("…")) ? p : "." + p;
        else if (!out.endsWith("…")) out += "…";
      });
      return out;
    };
    for (let i = 0; i < parts.length - 1; i++) {
      if (/^\d+$/.test(parts[i])) continue;
      keep[i] = false;
      const t = joined(parts, keep);
      if (t.length <= chars) return t;
    }
    let head = joined(parts.slice(0, -1), keep.slice(0, -1));
    if (head && !head.endsWith("…")) head += ".";
    const last = parts[parts.length - 1], room = Math.max(chars - head.length, 3);
    const tail = Math.floor((room - 1) / 2);
    return head + last.slice(0, room - 1 - tail) + "…" + last.slice(last.length - tail);
  }

  // The column of a map that holds ``step`` (-1: none).
  function colOf(m, step) {
    for (let c = 0; c < m.step_lo.length; c++) if (m.step_lo[c] <= step && step <= m.step_hi[c]) return c;
    return -1;
  }

  // Where ``step`` lies along a map of columns ``cellW`` wide: inside its column, in
  // proportion (a column of steps 0-99 puts step 50 at its middle); null: outside.
  function stepX(m, step, cellW) {
    const n = m.step_lo.length;
    if (!n || step < m.step_lo[0] || step > m.step_hi[n - 1]) return null;
    let c = colOf(m, step);
    if (c < 0) c = m.step_lo.findIndex(s => s > step) - 1;
    const lo = m.step_lo[c], hi = m.step_hi[c];
    return (c + (hi > lo ? (step - lo) / (hi - lo + 1) : 0) + 0.5 / (hi - lo + 1)) * cellW;
  }

  // The step axis under a map: round step numbers where they fall.
  function stepAxis(axis, m, cellW) {
    axis.replaceChildren();
    const n = m.step_lo.length;
    if (!n) return [];
    const lo = m.step_lo[0], hi = m.step_hi[n - 1];
    const shown = ticks(lo, hi, Math.max(2, Math.floor(n * cellW / 90)), true);
    for (const t of shown) {
      const x = stepX(m, t, cellW);
      if (x === null) continue;
      const s = document.createElement("span");
      s.textContent = String(t);
      s.style.left = x + "px";
      axis.appendChild(s);
    }
    return shown;
  }

  // The layer x step map: rows x cols cells of cellW x rowH; marks: [{row, col}] outlined.
  function map(canvas, m, rows, cellW, rowH, scale, marks) {
    const cols = m.step_lo.length;
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

  // A layer's histograms over steps (``/api/distribution``): a column per column of
  // steps, value rows at their place on the drawn axis (rows of unequal height), the
  // density's colour on a log scale; under it a strip each for exact zeros, NaN, +Inf
  // and -Inf, coloured by their share of the column's values.  Returns the geometry.
  function distribution(canvas, d, W, H, selected) {
    const STRIP = 12, names = ["zeros", "nan", "posinf", "neginf"];
    const cols = d.step_lo.length, cellW = cols ? W / cols : W;
    const tLo = Math.min(...d.row_t_lo.map(num)), tHi = Math.max(...d.row_t_hi.map(num));
    const top = H - STRIP * names.length - 4;
    const y = t => (tHi > tLo ? (tHi - t) / (tHi - tLo) : 0.5) * top;
    const ctx = fit(canvas, W, H);
    const scale = logScale(d.density);
    ctx.fillStyle = COLORS.empty;
    ctx.fillRect(0, 0, W, top);
    d.row_t_lo.forEach((lo, r) => {
      const y0 = y(num(d.row_t_hi[r])), y1 = y(num(lo));
      for (let c = 0; c < cols; c++) {
        const v = num(d.density[r][c]);
        if (!(v > 0)) continue;
        ctx.fillStyle = scale.color(v, false);
        ctx.fillRect(c * cellW, y0, Math.ceil(cellW), Math.max(1, y1 - y0));
      }
    });
    names.forEach((k, i) => {
      const y0 = top + 4 + i * STRIP;
      for (let c = 0; c < cols; c++) {
        const all = d.finite[c] + d.nan[c] + d.posinf[c] + d.neginf[c], n = d[k][c];
        if (!n) continue;
        const share = n / Math.max(1, all);
        ctx.fillStyle = k === "zeros" ? viridis(0.15 + 0.85 * share) : COLORS.nonfinite;
        ctx.globalAlpha = k === "zeros" ? 1 : 0.35 + 0.65 * share;
        ctx.fillRect(c * cellW, y0, Math.ceil(cellW), STRIP - 2);
        ctx.globalAlpha = 1;
      }
    });
    const at = selected === null || selected === undefined ? null : stepX(d, selected, cellW);
    if (at !== null) {
      ctx.strokeStyle = COLORS.marker;
      ctx.setLineDash([3, 3]);
      ctx.beginPath(); ctx.moveTo(at, 0); ctx.lineTo(at, H); ctx.stroke();
      ctx.setLineDash([]);
    }
    return { cols, cellW, top, tLo, tHi, y, strip: STRIP, names, scale, selectedX: at };
  }

  return { COLORS, viridis, num, fit, logScale, ticks, short, fitName, colOf, stepX, stepAxis,
           map, distribution };
})();
