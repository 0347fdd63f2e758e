// multihead attention viewer: head view (lines between query and key tokens, one colour per head,
// a legend of head toggles), a token-labelled heatmap, a model view (thumbnails of every layer x
// head, enlargeable), a neuron view (one query's scores split into q_d * k_d * scale terms) and a
// step slider for generations, the kind switch, the sentence-pair filter and the themes. Inlined
// into the HTML file as one script with viewer_text.js (the text view), viewer_lens.js (the logit
// lens) and viewer_main.js (events and start), in that order; everything is drawn on canvases.
//
// Data (the JSON in #attention-data): {title, sources: [{name, caption, q_tokens, k_tokens,
// layers, heads, lq, lk, weights[layer][head], thumbs[layer][head], thumb_q, thumb_k, highlight,
// [dim, scale, queries[layer][head], keys[layer][head]], [prompt_len, generated], [signed, value_scale],
// [kind], [segments, k_segments], [lens: {layers, tokens, k, names[layer][pos][rank], probs[...]}]}]}.
// weights are base64 uint8 matrices (Lq x Lk, row-major, value = round(255 * weight)), queries and
// keys base64 float32 (L x D); all are decoded only when a head is shown. A signed source (scores,
// differences) stores int8 round(127 * value / value_scale) and is drawn with a diverging palette.
// Only the rows inside a scroll window are drawn, so 1024 tokens stay responsive.
"use strict";
window.__viewerErrors = [];
window.addEventListener("error", (e) => window.__viewerErrors.push(String(e.message)));

const DATA = JSON.parse(document.getElementById("attention-data").textContent);
const ROW = 18;            // px per token row in the head and neuron views
const MIN_WEIGHT = 3;      // lines below 3/255 ~ 0.012 are not drawn: invisible, and costly at 1024 tokens
const HEAT = 320;          // px of the heatmap's longer side
const HEAT_MAX = 640;      // px it may grow to, so that up to 53 tokens keep a label each
const LABEL_ROW = 12;      // px of one 11px label: rows thinner than this label every n-th token
// px between the matrix and its labels: more than half a label's height, so that the first row's
// label and the first column's (rotated) never meet at the corner however thin the cells.
const LABEL_GAP = 6;
const LABEL_CHARS = 12;    // characters of a token label before it is cut with "…" (the status line has it whole)
const LABEL_FONT = "11px ui-monospace, SFMono-Regular, Menlo, monospace";
const HEAD_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                     "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#843c39", "#7b4173", "#3182bd"];
const MONO = "12px ui-monospace, SFMono-Regular, Menlo, monospace";
// Canvas colours of each theme (the page's CSS has the same in its variables). lo is a weight of 0
// (the background), blue a weight of 1, pos / neg the ends of the signed palette.
const THEMES = {
  light: { ink: "#1d1d1f", muted: "#6b6b70", line: "#d9d9de", veil: "rgba(255,255,255,0.8)", hoverRow: "#fff3e0",
           strip: "#f4f4f6", off: [234, 234, 238], lo: [255, 255, 255], blue: [45.9, 109.65, 221.85], pos: [47, 111, 180], neg: [214, 39, 40] },
  dark: { ink: "#e6e6ea", muted: "#a3a3ab", line: "#3b3b42", veil: "rgba(30,30,34,0.82)", hoverRow: "#3d3322",
          strip: "#2a2a30", off: [52, 52, 58], lo: [30, 30, 34], blue: [110, 175, 255], pos: [110, 175, 255], neg: [255, 105, 97] },
};
const state = {
  source: 0, layer: 0, heads: new Set(), focus: 0, view: "head",
  hover: null,         // head view: {side: "q"|"k", index}
  cell: null,          // heatmap: {i, j}
  nkey: null,          // neuron view: hovered key
  pin: { q: null, k: null },
  step: null,          // generation: decode step shown, or null for the whole sequence
  scale: "one",        // heatmap colour scale: full colour at weight 1 ("one") or at the largest shown ("max")
  contrast: 1,         // ... divided by this: weights above top / contrast saturate
  theme: window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light",
  pair: "all",         // sentence-pair filter: "all" or "AB" (queries of A, keys of B), "AA", "BA", "BB"
  textMode: "mean",    // text view: "mean" of the shown heads, or one line per shown "heads"
  textDir: "from",     // text view: the chosen token's row ("from") or its column ("to")
  lensPos: null,       // logit lens: the position whose top tokens are listed (null: the last)
};
// What the last frame drew, for tests and for anyone curious (window.__viewerStats in the console).
const stats = window.__viewerStats = { renders: 0, lastMs: 0, lines: 0, linesByHead: {}, heatmapLabels: { q: [], k: [] },
                                       heatmapBoxes: null, neuron: null, colorScale: null, text: null, lens: null };
const cache = new Map();   // "kind/source/layer/head" -> typed array

const $ = (id) => document.getElementById(id);
const VIEWS = ["head", "model", "neuron", "text", "lens"];
const T = () => THEMES[state.theme];
const src = () => DATA.sources[state.source];
// Up to 16 heads take the palette; more take hues a golden angle apart, so no two heads share a colour.
const color = (head) => src().heads <= HEAD_COLORS.length ? HEAD_COLORS[head]
  : `hsl(${Math.round((head * 137.508) % 360)}, ${head % 2 ? 55 : 75}%, ${head % 3 ? 42 : 52}%)`;
const shown = () => [...state.heads].sort((a, b) => a - b);
const quote = (t) => JSON.stringify(t);
// "layer 1 (blocks.1.attn)", or "layer 1" when the source named its layers by number (the default)
const layerName = (i) => (src().layers[i] === `layer ${i}` ? `layer ${i}` : `layer ${i} (${src().layers[i]})`);

function bytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function cached(kind, layer, head, make) {
  const key = `${kind}/${state.source}/${layer}/${head}`;
  if (!cache.has(key)) {
    if (cache.size >= 256) cache.delete(cache.keys().next().value);  // bounded: 1024 tokens x 72 heads is 72 MB
    cache.set(key, make());
  }
  return cache.get(key);
}

// A head's matrix in "byte units": 0..255 for weights (255 = 1); for a signed source -255..255
// (255 = value_scale, the source's largest magnitude), so thresholds and line strengths read alike.
const matrix = (layer, head) => cached("w", layer, head, () => {
  const raw = bytes(src().weights[layer][head]);
  if (!src().signed) return raw;
  const signed = new Int8Array(raw.buffer), out = new Float32Array(signed.length);
  for (let p = 0; p < out.length; p++) out[p] = (signed[p] * 255) / 127;
  return out;
});
// A matrix entry (byte units) as the value it stands for.
const real = (b) => (b / 255) * (src().signed ? src().value_scale : 1);
const vectors = (kind, layer, head) =>
  cached(kind, layer, head, () => new Float32Array(bytes(src()[kind][layer][head]).buffer));

// Sentence pairs: whether query i and key j pass the A→B filter (all pass without segments).
const SENTENCE = { A: 0, B: 1 };
const qPasses = (i) => state.pair === "all" || !src().segments || src().segments[i] === SENTENCE[state.pair[0]];
const kPasses = (j) => state.pair === "all" || !src().k_segments || src().k_segments[j] === SENTENCE[state.pair[1]];
const pairPasses = (i, j) => qPasses(i) && kPasses(j);

// Generation: the row of the shown step (null: the whole sequence), and how many keys exist then.
const isGeneration = () => src().prompt_len !== undefined;
const stepRow = () => (isGeneration() && state.step !== null ? src().prompt_len - 1 + state.step : null);
const keyCount = () => (stepRow() === null ? src().lk : stepRow() + 1);
const queryCount = () => (stepRow() === null ? src().lq : stepRow() + 1);

// ------------------------------------------------------------------------------ controls
function fillSelect(select, items, value) {
  select.innerHTML = "";
  for (const [val, label] of items) {
    const opt = document.createElement("option");
    opt.value = String(val);
    opt.textContent = label;
    select.appendChild(opt);
  }
  select.value = String(value);
}

// Models on the page: sources of one name with a kind are one model, its attention kinds
// (encoder, decoder, cross) switched by the kind bar; every other source is a model of its own.
const KINDS = { encoder: "Encoder (self)", decoder: "Decoder (self)", cross: "Cross (decoder → encoder)" };
const MODELS = [];
DATA.sources.forEach((s, i) => {
  const model = s.kind !== undefined ? MODELS.find((m) => m.kinds && m.name === s.name) : undefined;
  if (model) model.kinds[s.kind] = i;
  else MODELS.push({ name: s.name, first: i, kinds: s.kind !== undefined ? { [s.kind]: i } : null });
});
const modelOf = (index) => MODELS.find((m) => m.first === index || (m.kinds && Object.values(m.kinds).includes(index)));

// Show source `index`. A switch of attention kind (keep: true) keeps the layer and heads where the
// other kind has them, as bertviz does; a new model opens on its highlight or every head.
function setSource(index, keep = false) {
  const before = { layer: state.layer, heads: shown(), focus: state.focus };
  state.source = index;
  const s = src();
  const hl = s.highlight;
  state.layer = hl ? hl.layer : 0;
  state.heads = new Set(hl ? [hl.head] : [...Array(s.heads).keys()]);  // bertviz opens on every head
  state.focus = hl ? hl.head : 0;
  if (keep && before.layer < s.layers.length && before.heads.every((h) => h < s.heads)) {
    Object.assign(state, { layer: before.layer, heads: new Set(before.heads), focus: before.focus });
  }
  const model = modelOf(index);
  $("source").value = String(model.first);
  const kinds = model.kinds ? Object.keys(KINDS).filter((k) => k in model.kinds) : [];
  $("kindbar").hidden = kinds.length < 2;
  $("kinds").innerHTML = "";
  for (const kind of kinds) {
    const button = document.createElement("button");
    button.dataset.kind = kind;
    button.textContent = KINDS[kind];
    button.classList.toggle("active", s.kind === kind);
    button.setAttribute("aria-pressed", String(s.kind === kind));
    button.addEventListener("click", () => setSource(model.kinds[kind], true));
    $("kinds").appendChild(button);
  }
  $("pairbar").hidden = !s.segments;
  if (!s.segments) state.pair = "all";
  $("pair-filter").value = state.pair;
  state.lensPos = null;
  state.hover = state.cell = state.nkey = null;
  state.pin = { q: null, k: null };
  state.step = isGeneration() ? 0 : null;
  fillSelect($("layer"), s.layers.map((name, i) => [i, `${i}: ${name}`]), state.layer);
  fillSelect($("neuron-query"), s.q_tokens.map((t, i) => [i, `${i}: ${t}`]), 0);
  $("caption").textContent = s.caption || "";
  $("scale").options[0].text = s.signed ? "± the source's largest" : "0 to 1";
  $("scale").options[1].text = s.signed ? "± the largest shown" : "0 to the largest shown";
  const rowsHeight = Math.max(s.lq, s.lk) * ROW + 2 * ROW;
  $("spacer").style.height = `${rowsHeight}px`;
  $("scroller").style.height = `min(68vh, ${rowsHeight + 4}px)`;
  $("scroller").scrollTop = 0;
  $("neuron-spacer").style.height = `${(s.lk + 2) * ROW}px`;
  $("neuron-scroller").style.height = `min(46vh, ${(s.lk + 2) * ROW + 4}px)`;
  $("stepbar").hidden = !isGeneration();
  if (isGeneration()) {
    $("step").max = String(s.lq - s.prompt_len);
    $("step").value = "0";
  }
  buildLegend();
  buildGrid();
  setStep(state.step);
}

function buildLegend() {
  const legend = $("legend");
  legend.innerHTML = "";
  for (let h = 0; h < src().heads; h++) {
    const button = document.createElement("button");
    button.className = "head-toggle";
    button.dataset.head = h;
    button.title = `head ${h}: click to show or hide, double-click to show only this head`;
    button.innerHTML = `<span class="swatch" style="background:${color(h)}"></span>${h}`;
    button.addEventListener("click", () => toggleHead(h));
    button.addEventListener("dblclick", () => showHeads([h], h));
    legend.appendChild(button);
  }
  syncLegend();
}

function syncLegend() {
  for (const b of document.querySelectorAll(".head-toggle")) {
    const h = Number(b.dataset.head);
    b.setAttribute("aria-pressed", String(state.heads.has(h)));
    b.classList.toggle("focus", h === state.focus);
  }
}

function toggleHead(h) {
  if (state.heads.has(h)) {
    state.heads.delete(h);
    if (state.focus === h && state.heads.size) state.focus = shown()[0];
  } else {
    state.heads.add(h);
    state.focus = h;
  }
  syncLegend();
  render();
}

function showHeads(heads, focus) {
  state.heads = new Set(heads);
  state.focus = focus;
  syncLegend();
  render();
}

function setStep(step) {
  state.step = isGeneration() ? step : null;
  const row = stepRow();
  if (row !== null) {
    $("step").value = String(state.step);
    state.pin.q = row;
    $("neuron-query").value = String(row);
    const scroller = $("scroller");  // keep the step's row in the scroll window
    if (row * ROW < scroller.scrollTop || (row + 3) * ROW > scroller.scrollTop + scroller.clientHeight) {
      scroller.scrollTop = Math.max(0, (row - 4) * ROW);
    }
  }
  if (isGeneration()) {
    const s = src();
    $("step-label").textContent = row === null ? `whole sequence (${s.lq} tokens, prompt ${s.prompt_len})`
      : `step ${state.step + 1}/${s.lq - s.prompt_len + 1}: ${quote(s.q_tokens[row])} ` +
        `reads ${row + 1} keys → next ${s.generated[state.step] ? quote(s.generated[state.step]) : "(none: the last step)"}`;
  }
  render();
}

function setView(view) {
  state.view = view;
  for (const v of VIEWS) {
    $(`${v}-panel`).hidden = view !== v;
    $(`tab-${v}`).classList.toggle("active", view === v);
  }
  render();
}

// ------------------------------------------------------------------------------ drawing helpers
function sizeCanvas(canvas, width, height) {
  const dpr = window.devicePixelRatio || 1;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return ctx;
}

function label(token, max) { return token.length > max ? token.slice(0, max - 1) + "…" : token; }

// Palettes run from the theme's background (lo: a weight of 0) to a full colour, so that 0 is the
// page's own background in either theme.
const mix = (lo, hi, t) => [0, 1, 2].map((c) => lo[c] + (hi[c] - lo[c]) * t);

function blues(img, p, w) {  // weight 0..255 -> background..blue
  const [r, g, b] = mix(T().lo, T().blue, Math.min(1, w / 255));
  img.data[4 * p] = r;
  img.data[4 * p + 1] = g;
  img.data[4 * p + 2] = b;
  img.data[4 * p + 3] = 255;
}

function divergingRGB(v) {  // -1..1 -> red..background..blue
  const a = Math.min(1, Math.abs(v));
  return mix(T().lo, v >= 0 ? T().pos : T().neg, a);
}

function diverging(v) { const [r, g, b] = divergingRGB(v); return `rgb(${r},${g},${b})`; }

function bluesCSS(w) { const [r, g, b] = mix(T().lo, T().blue, Math.min(1, Math.max(0, w))); return `rgb(${r},${g},${b})`; }

function divergingPixel(img, p, v) {  // the same palette into an ImageData, v clamped to -1..1
  const [r, g, b] = divergingRGB(v);
  img.data[4 * p] = r;
  img.data[4 * p + 1] = g;
  img.data[4 * p + 2] = b;
  img.data[4 * p + 3] = 255;
}

// The best entry of row i (over keys < nk) or of column j (over queries < nq) of one head.
function best(m, lk, along, index, n) {
  let arg = -1, top = -Infinity;
  for (let t = 0; t < n; t++) {
    if (!(along === "row" ? kPasses(t) : qPasses(t))) continue;  // outside the sentence-pair filter
    const w = along === "row" ? m[index * lk + t] : m[t * lk + index];
    if (w > top) { top = w; arg = t; }
  }
  return [arg, real(top)];
}

// ------------------------------------------------------------------------------ head view
function drawHeadView() {
  const s = src();
  const scroller = $("scroller");
  const width = scroller.clientWidth, height = scroller.clientHeight;
  const ctx = sizeCanvas($("lines"), width, height);
  const top = scroller.scrollTop;
  const xLeft = Math.round(width * 0.32), xRight = Math.round(width * 0.68);
  const y = (i) => ROW + i * ROW - top + ROW / 2;      // row centre in canvas coordinates
  const first = Math.max(0, Math.floor(top / ROW) - 1);
  const last = Math.ceil((top + height) / ROW) + 1;
  const nq = queryCount(), nk = keyCount(), row = stepRow(), hover = state.hover;

  // Which rows and columns get lines: a hovered query's row; every row into a hovered key (the
  // step's row only, in a generation); otherwise the step's row or the rows in the window.
  let rows, cols = null;
  if (hover && hover.side === "q") rows = hover.index < nq ? [hover.index] : [];
  else if (hover && hover.side === "k") {
    cols = hover.index < nk ? [hover.index] : [];
    rows = row !== null ? [row] : [...Array(nq).keys()];
  } else if (row !== null) rows = [row];
  else rows = [...Array(Math.max(0, Math.min(last, nq) - first)).keys()].map((i) => i + first);

  ctx.lineCap = "round";
  const heads = shown();
  stats.lines = 0;
  stats.linesByHead = {};
  for (const head of heads) {
    const m = matrix(state.layer, head);
    let count = 0;
    ctx.strokeStyle = color(head);
    for (const i of rows) {
      if (!qPasses(i)) continue;
      const base = i * s.lk;
      const n = cols ? cols.length : nk;
      for (let c = 0; c < n; c++) {
        const j = cols ? cols[c] : c;
        const w = Math.abs(m[base + j]);
        if (w < MIN_WEIGHT || !kPasses(j)) continue;
        ctx.globalAlpha = Math.min(1, (w / 255) * (heads.length > 1 ? 0.8 : 1.0));
        ctx.lineWidth = 0.5 + 2.5 * (w / 255);
        ctx.setLineDash(m[base + j] < 0 ? [4, 3] : []);  // a negative value (signed sources): dashed
        ctx.beginPath();
        ctx.moveTo(xLeft + 6, y(i));
        ctx.lineTo(xRight - 6, y(j));
        ctx.stroke();
        count++;
      }
    }
    stats.linesByHead[head] = count;
    stats.lines += count;
  }
  ctx.globalAlpha = 1;
  ctx.setLineDash([]);

  // Tokens: only the visible ones (and in a generation only those that exist at the step).
  ctx.textBaseline = "middle";
  const maxChars = Math.max(4, Math.floor((xLeft - 12) / 7.2));
  for (const [tokens, x, align, side, n] of [[s.q_tokens, xLeft, "right", "q", nq], [s.k_tokens, xRight, "left", "k", nk]]) {
    ctx.textAlign = align;
    for (let i = first; i < Math.min(last, n); i++) {
      const focused = (hover && hover.side === side && hover.index === i) || (row === i && side === "q");
      const pinned = state.pin[side] === i;
      ctx.fillStyle = focused ? "#2f6fde" : pinned ? "#e0892b" : T().ink;
      ctx.font = (focused || pinned ? "bold " : "") + MONO;
      ctx.fillText(label(tokens[i], maxChars), x, y(i));
    }
  }
  ctx.fillStyle = T().muted;
  ctx.textAlign = "center";
  ctx.font = "11px system-ui, sans-serif";
  if (top < ROW) {
    ctx.fillText("queries", xLeft - 30, ROW / 2 - top);
    ctx.fillText("keys", xRight + 20, ROW / 2 - top);
  }
  if (!heads.length) {
    ctx.fillText("no head shown: pick one in the legend", width / 2, height / 2);
  }
}

function hoverAt(event) {
  const rect = $("lines").getBoundingClientRect();
  const x = event.clientX - rect.left, yy = event.clientY - rect.top + $("scroller").scrollTop;
  const index = Math.floor((yy - ROW) / ROW);
  const side = x < rect.width / 2 ? "q" : "k";
  const n = side === "q" ? queryCount() : keyCount();
  return index >= 0 && index < n ? { side, index } : null;
}

// ------------------------------------------------------------------------------ heatmap
const heatImages = new Map();  // "source/layer/heads" -> canvas of one pixel per weight

function heatImage() {
  const s = src();
  const heads = shown();
  const key = `${state.source}/${state.layer}/${heads.join(",")}/${state.scale}/${state.contrast}/${state.theme}/${state.pair}`;
  if (heatImages.has(key)) return heatImages.get(key);
  const canvas = document.createElement("canvas");
  canvas.width = s.lk;
  canvas.height = s.lq;
  const octx = canvas.getContext("2d");
  const img = octx.createImageData(s.lk, s.lq);
  const mats = heads.map((h) => matrix(state.layer, h));
  const mean = new Float32Array(s.lq * s.lk);  // byte units, the shown heads' mean
  for (const m of mats) for (let p = 0; p < mean.length; p++) mean[p] += m[p] / mats.length;
  const passes = new Uint8Array(mean.length);  // the sentence-pair filter: cells outside it are greyed
  let lo = Infinity, hi = -Infinity;
  for (let p = 0; p < mean.length; p++) {
    passes[p] = pairPasses(Math.floor(p / s.lk), p % s.lk) ? 1 : 0;
    if (passes[p]) { lo = Math.min(lo, mean[p]); hi = Math.max(hi, mean[p]); }
  }
  if (lo > hi) lo = hi = 0;  // nothing shown
  // The value drawn in full colour: 1 (signed: the source's largest magnitude), or the largest
  // shown; the contrast divides it. Signed values take the diverging palette, from -full to +full.
  const largest = s.signed ? Math.max(Math.abs(lo), Math.abs(hi)) : hi;
  const full = Math.max(1e-6, (state.scale === "max" ? Math.max(largest, 1) : 255) / state.contrast);
  const off = T().off;
  for (let p = 0; p < mean.length; p++) {
    if (!passes[p]) { img.data.set([off[0], off[1], off[2], 255], 4 * p); continue; }
    if (s.signed) divergingPixel(img, p, mean[p] / full);
    else blues(img, p, Math.min(255, (mean[p] * 255) / full));
  }
  octx.putImageData(img, 0, 0);
  const out = { canvas, min: real(lo), max: real(hi), full: real(full), signed: Boolean(s.signed) };
  if (heatImages.size > 24) heatImages.delete(heatImages.keys().next().value);
  heatImages.set(key, out);
  return out;
}

// The colour bar under the heatmap: white to blue from 0 to the weight in full colour, with the
// shown matrix's smallest and largest weight marked on it.
function drawColorbar(heat, width) {
  const h = 30, bar = 10, pad = 8;
  const ctx = sizeCanvas($("colorbar"), width, h);
  const w = width - 2 * pad;
  const img = ctx.createImageData(Math.max(1, Math.round(w)), 1);
  for (let x = 0; x < img.width; x++) {
    const t = x / Math.max(1, img.width - 1);  // 0..1 along the bar
    if (heat.signed) divergingPixel(img, x, 2 * t - 1);
    else blues(img, x, 255 * t);
  }
  const strip = document.createElement("canvas");
  strip.width = img.width;
  strip.height = 1;
  strip.getContext("2d").putImageData(img, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(strip, pad, 0, w, bar);
  ctx.strokeStyle = T().line;
  ctx.strokeRect(pad, 0, w, bar);
  ctx.font = LABEL_FONT;
  ctx.fillStyle = T().ink;
  ctx.textBaseline = "top";
  const at = heat.signed ? (v) => pad + (0.5 + Math.max(-0.5, Math.min(0.5, v / heat.full / 2))) * w
    : (v) => pad + Math.min(1, v / heat.full) * w;
  for (const v of [heat.min, heat.max]) ctx.fillRect(at(v) - 0.5, 0, 1.5, bar + 3);  // ticks at the shown extremes
  const saturated = Math.max(heat.max, heat.signed ? -heat.min : 0) > heat.full * 1.0001;
  const end = `${saturated ? "≥ " : ""}${heat.full.toPrecision(3)}`;
  ctx.textAlign = "left";
  ctx.fillText(heat.signed ? `-${end.replace("≥ ", "≤ ")}` : "0", pad, bar + 5);
  ctx.textAlign = "right";
  ctx.fillText(heat.signed ? `+${end}` : end, pad + w, bar + 5);
  if (heat.signed) { ctx.textAlign = "center"; ctx.fillText("0", pad + w / 2, bar + 5); }
  const range = heat.signed ? `-${heat.full.toPrecision(3)} (full red), 0 (${state.theme === "dark" ? "background" : "white"}) to +${heat.full.toPrecision(3)} (full blue)`
    : `0 (${state.theme === "dark" ? "background" : "white"}) to ${heat.full.toFixed(2)} (full blue)`;
  const fmt = (v) => (heat.signed ? v.toPrecision(3) : v.toFixed(2));
  $("scale-label").textContent = `colour: ${range}${saturated ? ", stronger values saturate" : ""}; ` +
    `shown min ${fmt(heat.min)}, max ${fmt(heat.max)}`;
  stats.colorScale = { min: heat.min, max: heat.max, full: heat.full, scale: state.scale, contrast: state.contrast,
                       signed: heat.signed };
}

const measurer = document.createElement("canvas").getContext("2d");

// Cells, label steps and margins of the heatmap. Each axis sizes its own cells (square when
// Lq = Lk): they grow (up to HEAT_MAX px in all) before labels are dropped, every n-th token is
// labelled when cells are thinner than a label, and the margins are the labels' measured widths,
// so no label runs into another, into the matrix or off the canvas at any length.
function heatGeometry() {
  const s = src();
  const fit = (n) => {
    let c = Math.min(HEAT / n, 28);
    return c < LABEL_ROW ? Math.max(c, Math.min(LABEL_ROW, HEAT_MAX / n)) : c;
  };
  let cw = fit(s.lk), ch = fit(s.lq);
  if (s.lq === s.lk) cw = ch = Math.min(cw, ch);
  const everyQ = Math.max(1, Math.ceil(LABEL_ROW / ch)), everyK = Math.max(1, Math.ceil(LABEL_ROW / cw));
  const labels = (tokens, every) =>
    tokens.map((t, i) => (i % every ? null : every > 1 ? `${i} ${label(t, LABEL_CHARS)}` : label(t, LABEL_CHARS)));
  const q = labels(s.q_tokens, everyQ), k = labels(s.k_tokens, everyK);
  measurer.font = LABEL_FONT;
  const widest = (texts) => Math.max(0, ...texts.filter((t) => t !== null).map((t) => measurer.measureText(t).width));
  const left = Math.ceil(widest(q)) + LABEL_GAP + 6, top = Math.ceil(widest(k)) + LABEL_GAP + 6;
  return { cw, ch, cell: cw === ch ? cw : null, everyQ, everyK, left, top, qLabels: q, kLabels: k,
           width: left + s.lk * cw + 6, height: top + s.lq * ch + 6 };
}

function drawHeatmap() {
  const s = src();
  const g = heatGeometry();
  const ctx = sizeCanvas($("heatmap"), g.width, g.height);
  const pw = s.lk * g.cw, ph = s.lq * g.ch;
  ctx.imageSmoothingEnabled = g.cw < 1 || g.ch < 1;
  const heat = heatImage();
  ctx.drawImage(heat.canvas, g.left, g.top, pw, ph);
  const row = stepRow();
  if (row !== null) {  // keys and queries that do not exist yet at this step
    ctx.fillStyle = T().veil;
    ctx.fillRect(g.left, g.top + (row + 1) * g.ch, pw, ph - (row + 1) * g.ch);
    ctx.fillRect(g.left + (row + 1) * g.cw, g.top, pw - (row + 1) * g.cw, (row + 1) * g.ch);
  }
  // Token labels: every token when cells are tall enough for text, else every n-th, numbered. Each
  // label's box is kept (stats.heatmapBoxes) so that a test can check that none overlaps another.
  stats.heatmapLabels = { q: [], k: [] };
  stats.heatmapEvery = { q: g.everyQ, k: g.everyK };
  const boxes = stats.heatmapBoxes = { q: [], k: [], matrix: [g.left, g.top, g.left + pw, g.top + ph],
                                       canvas: [0, 0, g.width, g.height] };
  const half = LABEL_ROW / 2 - 1;  // an 11px label's half height, drawn centred on its row
  ctx.fillStyle = T().ink;
  ctx.font = LABEL_FONT;
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  for (let i = 0; i < s.lq; i += g.everyQ) {
    const y = g.top + (i + 0.5) * g.ch, w = ctx.measureText(g.qLabels[i]).width;
    ctx.fillText(g.qLabels[i], g.left - LABEL_GAP, y);
    stats.heatmapLabels.q.push(g.qLabels[i]);
    boxes.q.push([g.left - LABEL_GAP - w, y - half, g.left - LABEL_GAP, y + half]);
  }
  ctx.save();
  ctx.textAlign = "left";
  for (let j = 0; j < s.lk; j += g.everyK) {
    const dpr = window.devicePixelRatio || 1, x = g.left + (j + 0.5) * g.cw, w = ctx.measureText(g.kLabels[j]).width;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.translate(x, g.top - LABEL_GAP);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(g.kLabels[j], 0, 0);
    stats.heatmapLabels.k.push(g.kLabels[j]);
    boxes.k.push([x - half, g.top - LABEL_GAP - w, x + half, g.top - LABEL_GAP]);
  }
  ctx.restore();
  drawColorbar(heat, g.width);
  // Outlines: the hovered token's row or column, the hovered cell, the step's row.
  ctx.strokeStyle = "#e0892b";
  ctx.lineWidth = 1.5;
  const cw = Math.max(1, g.cw), ch = Math.max(1, g.ch);
  if (state.hover && state.view === "head") {
    if (state.hover.side === "q") ctx.strokeRect(g.left, g.top + state.hover.index * g.ch, pw, ch);
    else ctx.strokeRect(g.left + state.hover.index * g.cw, g.top, cw, ph);
  }
  if (row !== null) { ctx.strokeStyle = "#2f6fde"; ctx.strokeRect(g.left, g.top + row * g.ch, (row + 1) * g.cw, ch); }
  if (state.cell) {
    ctx.strokeStyle = "#d62728";
    ctx.strokeRect(g.left + state.cell.j * g.cw, g.top + state.cell.i * g.ch, cw, ch);
  }
}

function cellAt(event) {
  const s = src();
  const g = heatGeometry();
  const rect = $("heatmap").getBoundingClientRect();
  const j = Math.floor((event.clientX - rect.left - g.left) / g.cw);
  const i = Math.floor((event.clientY - rect.top - g.top) / g.ch);
  return i >= 0 && i < queryCount() && j >= 0 && j < Math.min(s.lk, keyCount()) ? { i, j } : null;
}

// ------------------------------------------------------------------------------ status line
function describe() {
  const s = src();
  const heads = shown();
  const row = stepRow();
  const layer = layerName(state.layer);
  const which = heads.length === 1 ? `head ${heads[0]}` : heads.length === s.heads ? `all ${s.heads} heads`
    : `heads ${heads.join(", ")} (${heads.length} of ${s.heads})`;
  if (!heads.length) return `${layer}: no head shown; click a head in the legend`;
  const perHead = (fn) => heads.map((h) => fn(h, matrix(state.layer, h)));
  const one = heads.length === 1;
  if (state.view === "head" && state.cell) {
    const { i, j } = state.cell;
    const ws = perHead((h, m) => [h, real(m[i * s.lk + j])]);
    const mean = ws.reduce((a, [, w]) => a + w, 0) / ws.length;
    return `query ${i} ${quote(s.q_tokens[i])} → key ${j} ${quote(s.k_tokens[j])}: ${s.signed ? "value" : "weight"} ${mean.toFixed(2)} ` +
      (one ? `(${which})` : `(mean of ${heads.length} heads; ${ws.map(([h, w]) => `head ${h} ${w.toFixed(2)}`).join(", ")})`);
  }
  const hover = state.hover;
  if (state.view === "head" && hover && hover.side === "q") {
    const i = hover.index;
    const parts = perHead((h, m) => { const [j, w] = best(m, s.lk, "row", i, keyCount()); return [h, j, w]; });
    if (one) { const [, j, w] = parts[0]; return `query ${i} ${quote(s.q_tokens[i])} attends most to key ${j} ${quote(s.k_tokens[j])} (${w.toFixed(2)}), ${which}`; }
    return `query ${i} ${quote(s.q_tokens[i])} attends most to: ` +
      parts.map(([h, j, w]) => `head ${h} → ${j} ${quote(s.k_tokens[j])} (${w.toFixed(2)})`).join("; ");
  }
  if (state.view === "head" && hover && hover.side === "k") {
    const j = hover.index;
    if (row !== null) {
      const parts = perHead((h, m) => [h, real(m[row * s.lk + j])]);
      return `step ${state.step + 1}: query ${row} ${quote(s.q_tokens[row])} gives key ${j} ${quote(s.k_tokens[j])} weight ` +
        parts.map(([h, w]) => (one ? w.toFixed(2) : `${w.toFixed(2)} (head ${h})`)).join(", ");
    }
    const parts = perHead((h, m) => { const [i, w] = best(m, s.lk, "col", j, queryCount()); return [h, i, w]; });
    if (one) { const [, i, w] = parts[0]; return `key ${j} ${quote(s.k_tokens[j])} is read most by query ${i} ${quote(s.q_tokens[i])} (${w.toFixed(2)}), ${which}`; }
    return `key ${j} ${quote(s.k_tokens[j])} is read most by: ` +
      parts.map(([h, i, w]) => `head ${h} ← ${i} ${quote(s.q_tokens[i])} (${w.toFixed(2)})`).join("; ");
  }
  let text = `${layer}, ${which}: ${s.lq} queries x ${s.lk} keys`;
  if (row !== null) {
    const parts = perHead((h, m) => { const [j, w] = best(m, s.lk, "row", row, row + 1); return [h, j, w]; });
    text += `\nstep ${state.step + 1}: ${quote(s.q_tokens[row])} attends most to ` +
      parts.map(([h, j, w]) => `${quote(s.k_tokens[j])} (${w.toFixed(2)}${one ? "" : `, head ${h}`})`).join(", ") +
      (s.generated[state.step] ? ` → next ${quote(s.generated[state.step])}` : "");
  }
  return text;
}

// ------------------------------------------------------------------------------ model view
function paintThumb(canvas, pix) {
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(canvas.width, canvas.height);
  if (src().signed) {  // int8, each thumbnail scaled to its own largest magnitude
    const v = new Int8Array(pix.buffer);
    for (let p = 0; p < v.length; p++) divergingPixel(img, p, v[p] / 127);
  } else for (let p = 0; p < pix.length; p++) blues(img, p, pix[p]);
  ctx.putImageData(img, 0, 0);
}

function buildGrid() {
  const s = src();
  const table = $("grid");
  table.innerHTML = "";
  const head = table.insertRow();
  head.appendChild(document.createElement("th"));
  for (let h = 0; h < s.heads; h++) {
    const th = document.createElement("th");
    th.textContent = `head ${h}`;
    th.style.color = color(h);
    head.appendChild(th);
  }
  s.layers.forEach((name, l) => {
    const row = table.insertRow();
    const th = document.createElement("th");
    th.textContent = `layer ${l}`;
    th.title = name;
    row.appendChild(th);
    for (let h = 0; h < s.heads; h++) {
      const canvas = document.createElement("canvas");
      canvas.width = s.thumb_k;
      canvas.height = s.thumb_q;
      canvas.dataset.layer = l;
      canvas.dataset.head = h;
      canvas.title = `layer ${l}, head ${h}`;
      if (s.highlight && s.highlight.layer === l && s.highlight.head === h) {
        canvas.classList.add("highlight");
        canvas.title += ` (${s.highlight.label})`;
      }
      paintThumb(canvas, bytes(s.thumbs[l][h]));
      canvas.addEventListener("mouseenter", () => drawPreview(l, h));
      canvas.addEventListener("click", () => {
        state.layer = l;
        $("layer").value = String(l);
        showHeads([h], h);
        setView("head");
      });
      row.insertCell().appendChild(canvas);
    }
  });
  drawPreview(state.layer, state.focus);
}

// The full-resolution matrix of one head, as large as the preview allows (thumbnails are pooled).
function drawPreview(layer, head) {
  const s = src();
  const canvas = $("preview");
  const cell = Math.max(1, Math.min(Math.floor(360 / Math.max(s.lq, s.lk)), 30));
  const fit = Math.min(360 / s.lk, 360 / s.lq);
  const w = Math.round(s.lk * (s.lk * cell > 360 ? fit : cell)), h = Math.round(s.lq * (s.lq * cell > 360 ? fit : cell));
  const ctx = sizeCanvas(canvas, w, h);
  const off = document.createElement("canvas");
  off.width = s.lk;
  off.height = s.lq;
  const octx = off.getContext("2d");
  const img = octx.createImageData(s.lk, s.lq);
  const m = matrix(layer, head);
  let top = 1;
  for (let p = 0; p < m.length; p++) top = Math.max(top, Math.abs(m[p]));
  for (let p = 0; p < m.length; p++) {  // scaled like the thumbnails
    if (src().signed) divergingPixel(img, p, m[p] / top);
    else blues(img, p, (m[p] * 255) / top);
  }
  octx.putImageData(img, 0, 0);
  ctx.imageSmoothingEnabled = w < s.lk;
  ctx.drawImage(off, 0, 0, w, h);
  canvas.dataset.layer = layer;
  canvas.dataset.head = head;
  $("preview-label").textContent = `${layerName(layer)}, head ${head}: ${s.lq} x ${s.lk}, full resolution`;
  if (state.view === "model") $("status").textContent = `layer ${layer}, head ${head}: click to open it in the head view`;
}

function markSelected() {
  for (const c of document.querySelectorAll("#grid canvas")) {
    c.classList.toggle("selected", Number(c.dataset.layer) === state.layer && state.heads.has(Number(c.dataset.head)));
  }
}

// ------------------------------------------------------------------------------ neuron view
function neuronQuery() {
  const row = stepRow();
  return row !== null ? row : state.pin.q !== null ? state.pin.q : 0;
}

function neuronKey(terms) {
  if (state.nkey !== null && state.nkey < terms.nk) return state.nkey;
  if (state.pin.k !== null && state.pin.k < terms.nk) return state.pin.k;
  return terms.top;
}

// Every key's terms q_d * k_d * scale for the query, the scores, and the head's weights.
function neuronTerms() {
  const s = src();
  const head = state.focus, D = s.dim, i = neuronQuery();
  const q = vectors("queries", state.layer, head).subarray(i * D, (i + 1) * D);
  const k = vectors("keys", state.layer, head);
  const m = matrix(state.layer, head);
  const nk = isGeneration() ? Math.min(s.lk, i + 1) : s.lk;  // a generation is causal
  const terms = new Float32Array(nk * D), scores = new Float32Array(nk);
  let maxTerm = 1e-12, top = 0;
  for (let j = 0; j < nk; j++) {
    let sum = 0;
    for (let d = 0; d < D; d++) {
      const t = q[d] * k[j * D + d] * s.scale;
      terms[j * D + d] = t;
      sum += t;
      maxTerm = Math.max(maxTerm, Math.abs(t));
    }
    scores[j] = sum;
    if (m[i * s.lk + j] > m[i * s.lk + top]) top = j;
  }
  return { head, i, q, k, m, nk, D, terms, scores, maxTerm, top };
}

function drawNeuron() {
  const s = src();
  const has = s.queries !== undefined;
  const noHead = has && state.heads.size === 0;  // "none" toggled: no head to split
  $("neuron-empty").hidden = has;
  $("neuron-nohead").hidden = !noHead;
  $("neuron-body").hidden = !has || noHead;
  if (!has || noHead) { stats.neuron = null; return; }
  const t = neuronTerms();
  const scroller = $("neuron-scroller");
  const width = scroller.clientWidth, height = scroller.clientHeight;
  const ctx = sizeCanvas($("neuron"), width, height);
  const top = scroller.scrollTop;
  const labelW = 110, numW = 70, barW = 90;
  const cw = Math.max(2, Math.min(14, Math.floor((width - labelW - numW - barW - 20) / t.D)));
  const x0 = labelW, xNum = x0 + cw * t.D + 8, xBar = xNum + numW;
  const key = neuronKey(t);
  ctx.textBaseline = "middle";
  ctx.font = MONO;
  const first = Math.max(0, Math.floor(top / ROW) - 2), last = Math.min(t.nk, Math.ceil((top + height) / ROW));
  for (let j = first; j < last; j++) {
    const y = (j + 1) * ROW - top;   // row 0 of the canvas is the query's strip
    if (y < ROW - 1 || y > height) continue;
    if (j === key) { ctx.fillStyle = T().hoverRow; ctx.fillRect(0, y, width, ROW); }
    ctx.fillStyle = T().ink;
    ctx.textAlign = "right";
    ctx.fillText(label(`${j} ${s.k_tokens[j]}`, 14), labelW - 6, y + ROW / 2);
    for (let d = 0; d < t.D; d++) {
      ctx.fillStyle = diverging(t.terms[j * t.D + d] / t.maxTerm);
      ctx.fillRect(x0 + d * cw, y + 2, cw - (cw > 3 ? 1 : 0), ROW - 4);
    }
    ctx.fillStyle = T().ink;
    ctx.textAlign = "right";
    ctx.fillText(t.scores[j].toFixed(2), xNum + numW - 10, y + ROW / 2);
    const w = t.m[t.i * s.lk + j] / 255;
    ctx.fillStyle = color(t.head);
    ctx.fillRect(xBar, y + 4, Math.max(0.5, w * barW), ROW - 8);
  }
  // The query's own vector on top (sticky), scaled to its largest |q_d|.
  ctx.fillStyle = T().strip;
  ctx.fillRect(0, 0, width, ROW);
  let qmax = 1e-12;
  for (let d = 0; d < t.D; d++) qmax = Math.max(qmax, Math.abs(t.q[d]));
  ctx.fillStyle = "#2f6fde";
  ctx.textAlign = "right";
  ctx.fillText(label(`q ${t.i} ${s.q_tokens[t.i]}`, 14), labelW - 6, ROW / 2);
  for (let d = 0; d < t.D; d++) { ctx.fillStyle = diverging(t.q[d] / qmax); ctx.fillRect(x0 + d * cw, 2, cw - (cw > 3 ? 1 : 0), ROW - 4); }
  ctx.fillStyle = T().muted;
  ctx.textAlign = "left";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText("score", xNum + 8, ROW / 2);
  ctx.fillText("weight", xBar, ROW / 2);
  drawPair(t, key);
}

// One query-key pair: q_d, k_d and their scaled product for every dimension d, as bars.
function drawPair(t, j) {
  const s = src();
  const D = t.D;
  const bw = Math.max(2, Math.min(16, Math.floor(760 / D)));
  const width = Math.max(640, 130 + bw * D + 10), band = 46;
  const ctx = sizeCanvas($("pair"), width, band * 3 + 30);
  const kj = t.k.subarray(j * D, (j + 1) * D), prod = t.terms.subarray(j * D, (j + 1) * D);
  const rows = [["q (query " + t.i + ")", t.q], ["k (key " + j + ")", kj], ["q·k·scale", prod]];
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  rows.forEach(([name, vec], r) => {
    const mid = 10 + r * band + band / 2;
    let vmax = 1e-12;
    for (let d = 0; d < D; d++) vmax = Math.max(vmax, Math.abs(vec[d]));
    ctx.fillStyle = T().ink;
    ctx.textAlign = "right";
    ctx.fillText(name, 122, mid);
    ctx.strokeStyle = T().line;
    ctx.beginPath(); ctx.moveTo(130, mid); ctx.lineTo(130 + bw * D, mid); ctx.stroke();
    for (let d = 0; d < D; d++) {
      const h = (vec[d] / vmax) * (band / 2 - 4);
      ctx.fillStyle = vec[d] >= 0 ? "#2f6fde" : "#d62728";
      ctx.fillRect(130 + d * bw, Math.min(mid, mid - h), Math.max(1, bw - 1), Math.abs(h));
    }
  });
  const weight = t.m[t.i * s.lk + j] / 255;
  const order = [...prod.keys()].sort((a, b) => Math.abs(prod[b]) - Math.abs(prod[a])).slice(0, 3);
  ctx.fillStyle = T().ink;
  ctx.textAlign = "left";
  ctx.fillText(`score = Σ_d q_d k_d · scale = ${t.scores[j].toFixed(3)}   weight ${weight.toFixed(2)}   ` +
    `(head ${t.head}, D = ${D}, scale = ${s.scale.toPrecision(3)})`, 8, 10 + 3 * band + 10);
  stats.neuron = { head: t.head, query: t.i, key: j, score: t.scores[j], weight, dim: D, keys: t.nk,
                   terms: Array.from(prod) };
  $("status").textContent = `head ${t.head}, query ${t.i} ${quote(s.q_tokens[t.i])} · key ${j} ${quote(s.k_tokens[j])}: ` +
    `score ${t.scores[j].toFixed(3)} = sum of ${D} terms q_d·k_d·scale, weight ${weight.toFixed(2)}; largest terms ` +
    order.map((d) => `d${d} ${prod[d] >= 0 ? "+" : ""}${prod[d].toFixed(3)}`).join(", ");
}

function neuronRowAt(event) {
  const rect = $("neuron").getBoundingClientRect();
  const j = Math.floor((event.clientY - rect.top + $("neuron-scroller").scrollTop) / ROW) - 1;
  const nk = isGeneration() ? Math.min(src().lk, neuronQuery() + 1) : src().lk;
  return j >= 0 && j < nk ? j : null;
}

// ------------------------------------------------------------------------------ theme
function setTheme(theme, redraw = true) {
  state.theme = theme;
  document.documentElement.dataset.theme = theme;
  $("theme").setAttribute("aria-pressed", String(theme === "dark"));
  $("theme").textContent = theme === "dark" ? "Light mode" : "Dark mode";
  if (!redraw) return;
  heatImages.clear();
  lensBuilt = null;
  buildGrid();  // thumbnails are painted once per source
  render();
}
