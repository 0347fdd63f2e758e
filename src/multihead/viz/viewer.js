// multihead attention viewer: head view (lines between query and key tokens), a heatmap of the
// selected head, and a model view (thumbnails of every layer x head). Inlined into the HTML file.
//
// Data (the JSON in #attention-data): {title, sources: [{name, caption, q_tokens, k_tokens,
// layers, heads, lq, lk, weights[layer][head], thumbs[layer][head], thumb_q, thumb_k, highlight}]}.
// weights are base64 uint8 matrices (Lq x Lk, row-major, value = round(255 * weight)); they are
// decoded only when a head is shown, so a 512-token model with 72 heads opens at once.
// Only the rows inside the scroll window are drawn, so 512 tokens stay responsive.
"use strict";
window.__viewerErrors = [];
window.addEventListener("error", (e) => window.__viewerErrors.push(String(e.message)));

const DATA = JSON.parse(document.getElementById("attention-data").textContent);
const ROW = 18;            // px per token row in the head view
const MIN_WEIGHT = 3;      // lines below 3/255 ~ 0.012 are not drawn: invisible, and costly at 512 tokens
const HEAD_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                     "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#843c39", "#7b4173", "#3182bd"];
const state = { source: 0, layer: 0, head: 0, hover: null, view: "head" };  // head: index or "all"
const cache = new Map();   // "source/layer/head" -> Uint8Array

const $ = (id) => document.getElementById(id);
const src = () => DATA.sources[state.source];

function decode(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function matrix(layer, head) {
  const key = `${state.source}/${layer}/${head}`;
  if (!cache.has(key)) cache.set(key, decode(src().weights[layer][head]));
  return cache.get(key);
}

function shownHeads() {
  return state.head === "all" ? [...Array(src().heads).keys()] : [state.head];
}

function color(head) { return HEAD_COLORS[head % HEAD_COLORS.length]; }

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

function setSource(index) {
  state.source = index;
  const s = src();
  const hl = s.highlight || { layer: 0, head: 0 };
  state.layer = hl.layer;
  state.head = hl.head;
  state.hover = null;
  fillSelect($("layer"), s.layers.map((name, i) => [i, `${i}: ${name}`]), state.layer);
  const heads = [...Array(s.heads).keys()].map((h) => [h, `head ${h}`]);
  heads.push(["all", "all heads"]);
  fillSelect($("head"), heads, state.head);
  $("caption").textContent = s.caption || "";
  const rowsHeight = Math.max(s.lq, s.lk) * ROW + 2 * ROW;
  $("spacer").style.height = `${rowsHeight}px`;
  $("scroller").style.height = `min(70vh, ${rowsHeight + 4}px)`;
  $("scroller").scrollTop = 0;
  buildGrid();
  render();
}

function setView(view) {
  state.view = view;
  $("head-panel").hidden = view !== "head";
  $("model-panel").hidden = view !== "model";
  $("tab-head").classList.toggle("active", view === "head");
  $("tab-model").classList.toggle("active", view === "model");
  render();
}

// ------------------------------------------------------------------------------ head view
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
  return ctx;
}

function label(token, max) { return token.length > max ? token.slice(0, max - 1) + "…" : token; }

function drawHeadView() {
  const s = src();
  const scroller = $("scroller");
  const width = scroller.clientWidth, height = scroller.clientHeight;
  const ctx = sizeCanvas($("lines"), width, height);
  ctx.clearRect(0, 0, width, height);
  const top = scroller.scrollTop;
  const xLeft = Math.round(width * 0.32), xRight = Math.round(width * 0.68);
  const y = (i) => ROW + i * ROW - top + ROW / 2;      // row centre in canvas coordinates
  const first = Math.max(0, Math.floor(top / ROW) - 1);
  const last = Math.ceil((top + height) / ROW) + 1;

  // Lines: from each visible query row (or, when a key is hovered, from every query to it).
  const hover = state.hover;
  ctx.lineCap = "round";
  for (const head of shownHeads()) {
    const m = matrix(state.layer, head);
    ctx.strokeStyle = color(head);
    const rows = [];
    if (hover && hover.side === "q") rows.push(hover.index);
    else if (hover && hover.side === "k") for (let i = 0; i < s.lq; i++) rows.push(i);
    else for (let i = first; i < Math.min(last, s.lq); i++) rows.push(i);
    for (const i of rows) {
      const base = i * s.lk;
      const cols = hover && hover.side === "k" ? [hover.index] : null;
      const n = cols ? 1 : s.lk;
      for (let c = 0; c < n; c++) {
        const j = cols ? cols[0] : c;
        const w = m[base + j];
        if (w < MIN_WEIGHT) continue;
        ctx.globalAlpha = Math.min(1, (w / 255) * (state.head === "all" ? 0.8 : 1.0));
        ctx.lineWidth = 0.5 + 2.5 * (w / 255);
        ctx.beginPath();
        ctx.moveTo(xLeft + 6, y(i));
        ctx.lineTo(xRight - 6, y(j));
        ctx.stroke();
      }
    }
  }
  ctx.globalAlpha = 1;

  // Tokens: only the visible ones.
  ctx.font = "12px ui-monospace, SFMono-Regular, Menlo, monospace";
  ctx.textBaseline = "middle";
  const maxChars = Math.max(4, Math.floor((xLeft - 12) / 7.2));
  for (const [tokens, x, align, side] of [[s.q_tokens, xLeft, "right", "q"], [s.k_tokens, xRight, "left", "k"]]) {
    ctx.textAlign = align;
    for (let i = first; i < Math.min(last, tokens.length); i++) {
      const focused = hover && hover.side === side && hover.index === i;
      ctx.fillStyle = focused ? "#2f6fde" : "#1d1d1f";
      ctx.font = (focused ? "bold " : "") + "12px ui-monospace, SFMono-Regular, Menlo, monospace";
      ctx.fillText(label(tokens[i], maxChars), x, y(i));
    }
  }
  ctx.fillStyle = "#6b6b70";
  ctx.textAlign = "center";
  ctx.font = "11px system-ui, sans-serif";
  if (top < ROW) {
    ctx.fillText("queries", xLeft - 30, ROW / 2 - top);
    ctx.fillText("keys", xRight + 20, ROW / 2 - top);
  }
}

function drawHeatmap() {
  const s = src();
  const canvas = $("heatmap");
  const size = 280;
  const ctx = sizeCanvas(canvas, size, size);
  ctx.clearRect(0, 0, size, size);
  // One pixel per weight in an offscreen canvas, scaled up (or down, for 512 tokens) when drawn.
  const off = document.createElement("canvas");
  off.width = s.lk;
  off.height = s.lq;
  const octx = off.getContext("2d");
  const img = octx.createImageData(s.lk, s.lq);
  const heads = shownHeads();
  const mats = heads.map((h) => matrix(state.layer, h));
  for (let p = 0; p < s.lq * s.lk; p++) {
    let w = 0;
    for (const m of mats) w += m[p];
    w = Math.min(255, w / mats.length);
    img.data[4 * p] = 255 - w * 0.82;
    img.data[4 * p + 1] = 255 - w * 0.57;
    img.data[4 * p + 2] = 255 - w * 0.13;
    img.data[4 * p + 3] = 255;
  }
  octx.putImageData(img, 0, 0);
  const scale = Math.min(size / s.lk, size / s.lq);
  ctx.imageSmoothingEnabled = scale < 1;
  ctx.drawImage(off, 0, 0, s.lk * scale, s.lq * scale);
  if (state.hover) {  // outline the hovered row or column
    ctx.strokeStyle = "#e0892b";
    ctx.lineWidth = 1.5;
    if (state.hover.side === "q") ctx.strokeRect(0, state.hover.index * scale, s.lk * scale, Math.max(1, scale));
    else ctx.strokeRect(state.hover.index * scale, 0, Math.max(1, scale), s.lq * scale);
  }
}

function describeHover() {
  const s = src();
  const hover = state.hover;
  if (!hover || state.head === "all") {
    $("status").textContent = `layer ${state.layer} (${s.layers[state.layer]}), ` +
      (state.head === "all" ? "all heads" : `head ${state.head}`) + `: ${s.lq} queries x ${s.lk} keys`;
    return;
  }
  const m = matrix(state.layer, state.head);
  let best = -1, bestW = -1;
  if (hover.side === "q") {
    for (let j = 0; j < s.lk; j++) if (m[hover.index * s.lk + j] > bestW) { bestW = m[hover.index * s.lk + j]; best = j; }
    $("status").textContent = `query ${hover.index} "${s.q_tokens[hover.index]}" attends most to key ${best} "${s.k_tokens[best]}" (${(bestW / 255).toFixed(2)})`;
  } else {
    for (let i = 0; i < s.lq; i++) if (m[i * s.lk + hover.index] > bestW) { bestW = m[i * s.lk + hover.index]; best = i; }
    $("status").textContent = `key ${hover.index} "${s.k_tokens[hover.index]}" is read most by query ${best} "${s.q_tokens[best]}" (${(bestW / 255).toFixed(2)})`;
  }
}

// ------------------------------------------------------------------------------ model view
function buildGrid() {
  const s = src();
  const table = $("grid");
  table.innerHTML = "";
  const head = table.insertRow();
  head.appendChild(document.createElement("th"));
  for (let h = 0; h < s.heads; h++) {
    const th = document.createElement("th");
    th.textContent = `head ${h}`;
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
      const ctx = canvas.getContext("2d");
      const pix = decode(s.thumbs[l][h]);
      const img = ctx.createImageData(s.thumb_k, s.thumb_q);
      for (let p = 0; p < pix.length; p++) {
        img.data[4 * p] = 255 - pix[p] * 0.82;
        img.data[4 * p + 1] = 255 - pix[p] * 0.57;
        img.data[4 * p + 2] = 255 - pix[p] * 0.13;
        img.data[4 * p + 3] = 255;
      }
      ctx.putImageData(img, 0, 0);
      canvas.addEventListener("click", () => {
        state.layer = l;
        state.head = h;
        $("layer").value = String(l);
        $("head").value = String(h);
        setView("head");
      });
      row.insertCell().appendChild(canvas);
    }
  });
}

function markSelected() {
  for (const c of document.querySelectorAll("#grid canvas")) {
    c.classList.toggle("selected", Number(c.dataset.layer) === state.layer &&
      (state.head === "all" || Number(c.dataset.head) === state.head));
  }
}

// ------------------------------------------------------------------------------ events
let pending = false;
function render() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    markSelected();
    if (state.view === "head") {
      drawHeadView();
      drawHeatmap();
      describeHover();
    }
  });
}

function hoverAt(event) {
  const s = src();
  const scroller = $("scroller");
  const rect = $("lines").getBoundingClientRect();
  const x = event.clientX - rect.left, yy = event.clientY - rect.top + scroller.scrollTop;
  const index = Math.floor((yy - ROW) / ROW);
  const side = x < rect.width / 2 ? "q" : "k";
  const n = side === "q" ? s.lq : s.lk;
  return index >= 0 && index < n ? { side, index } : null;
}

$("lines").addEventListener("mousemove", (event) => {
  const next = hoverAt(event);
  const same = (next === null && state.hover === null) ||
    (next && state.hover && next.side === state.hover.side && next.index === state.hover.index);
  if (!same) { state.hover = next; render(); }
});
$("lines").addEventListener("mouseleave", () => { state.hover = null; render(); });
$("scroller").addEventListener("scroll", render, { passive: true });
window.addEventListener("resize", render);
$("source").addEventListener("change", (e) => setSource(Number(e.target.value)));
$("layer").addEventListener("change", (e) => { state.layer = Number(e.target.value); render(); });
$("head").addEventListener("change", (e) => {
  state.head = e.target.value === "all" ? "all" : Number(e.target.value);
  render();
});
$("tab-head").addEventListener("click", () => setView("head"));
$("tab-model").addEventListener("click", () => setView("model"));

fillSelect($("source"), DATA.sources.map((s, i) => [i, s.name]), 0);
setSource(0);
window.__viewerReady = true;
