// multihead attention viewer: the text view. Part of the page's one script (viewer.py joins
// viewer.js, viewer_text.js, viewer_lens.js and viewer_main.js in this order); it uses the state,
// the palettes and the helpers of viewer.js.
"use strict";

// ------------------------------------------------------------------------------ text view
// The tokens as text, coloured by the attention of a chosen token: its row ("from": what it reads)
// or its column ("to": who reads it), for the mean of the shown heads or one line per shown head.
function textRows() {
  const s = src(), from = state.textDir === "from";
  const n = from ? s.lq : s.lk;
  const pinned = state.pin[from ? "q" : "k"];
  const chosen = pinned !== null && pinned < n ? pinned : from ? (stepRow() ?? n - 1) : 0;
  const m = (h) => matrix(state.layer, h);
  const value = from ? (h, t) => real(m(h)[chosen * s.lk + t]) : (h, t) => real(m(h)[t * s.lk + chosen]);
  const count = from ? s.lk : s.lq, heads = shown();
  const passes = from ? kPasses : qPasses;
  const ok = (from ? qPasses : kPasses)(chosen);
  const rows = state.textMode === "heads" ? heads.map((h) => [h, [...Array(count).keys()].map((t) => value(h, t))])
    : [["mean", [...Array(count).keys()].map((t) => heads.reduce((a, h) => a + value(h, t), 0) / Math.max(1, heads.length))]];
  for (const [, values] of rows) for (let t = 0; t < count; t++) if (!ok || !passes(t)) values[t] = null;
  return { from, chosen, rows, heads };
}

function drawText() {
  const s = src();
  const { from, chosen, rows, heads } = textRows();
  const chosenTokens = from ? s.q_tokens : s.k_tokens, shownTokens = from ? s.k_tokens : s.q_tokens;
  const same = s.lq === s.lk && s.q_tokens.every((t, i) => t === s.k_tokens[i]);
  const body = $("text-body");
  body.innerHTML = "";
  stats.text = { mode: state.textMode, dir: state.textDir, chosen, rows: {} };
  if (!heads.length) { body.textContent = "no head shown: pick one in the legend"; return; }
  // One colour scale for every line: 1 (signed: the source's largest magnitude), or the largest
  // value shown; the contrast divides it, as in the heatmap.
  let largest = 0;
  for (const [, values] of rows) for (const v of values) if (v !== null) largest = Math.max(largest, Math.abs(v));
  const top = s.signed ? s.value_scale : 1;
  const full = Math.max(1e-9, (state.scale === "max" ? largest || top : top) / state.contrast);
  const line = (tokens, key, values, pick) => {
    const div = document.createElement("div");
    div.className = "text-line";
    div.dataset.row = key;
    const name = document.createElement("span");
    name.className = "text-name";
    name.textContent = key === "pick" ? (from ? "query" : "key") : key === "mean" ? (heads.length > 1 ? `mean of ${heads.length}` : `head ${heads[0]}`) : `head ${key}`;
    if (key !== "mean" && key !== "pick") name.style.color = color(key);
    div.appendChild(name);
    tokens.forEach((t, i) => {
      const span = document.createElement("span");
      span.className = "tok" + (pick ? " pick" : "") + (pick && i === chosen ? " chosen" : "");
      span.dataset.index = i;
      span.textContent = t;
      const v = values ? values[i] : null;
      if (values && v === null) span.classList.add("off");
      else if (values) {
        const a = Math.min(1, Math.abs(v) / full);
        span.dataset.value = v.toFixed(4);
        span.style.background = key === "mean" ? (s.signed ? diverging(v / full) : bluesCSS(v / full))
          : `color-mix(in srgb, ${v < 0 ? "#d62728" : color(key)} ${Math.round(100 * a)}%, transparent)`;
        if (a > 0.6) span.style.color = "#fff";
        span.title = `${i} ${quote(t)}: ${s.signed ? "value" : "weight"} ${v.toFixed(3)}`;
      }
      div.appendChild(span);
    });
    body.appendChild(div);
  };
  // Self-attention: the coloured tokens are the clickable ones; otherwise a line to pick from first.
  if (!same) line(chosenTokens, "pick", null, true);
  for (const [key, values] of rows) {
    line(shownTokens, key, values, same);
    stats.text.rows[key] = values;
  }
  const [key, values] = rows[0];
  let best = -1;
  values.forEach((v, t) => { if (v !== null && (best < 0 || v > values[best])) best = t; });
  const what = key === "mean" && heads.length > 1 ? `the mean of heads ${heads.join(", ")}` : `head ${heads[0]}`;
  $("status").textContent = `${layerName(state.layer)}: ${from ? "query" : "key"} ${chosen} ${quote(chosenTokens[chosen])}` +
    (from ? " reads " : " is read by ") + (best < 0 ? "nothing in the sentence filter"
      : `${quote(shownTokens[best])} most (${values[best].toFixed(2)}, ${state.textMode === "heads" ? `head ${heads[0]}; a line per head` : what})`);
}
