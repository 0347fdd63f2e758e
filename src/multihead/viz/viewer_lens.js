// multihead attention viewer: the logit lens panel. Part of the page's one script (viewer.py joins
// viewer.js, viewer_text.js, viewer_lens.js and viewer_main.js in this order); it uses the state,
// the palettes and the helpers of viewer.js.
"use strict";

// ------------------------------------------------------------------------------ logit lens
// Per layer and position, the top next token read through the model's final norm and
// unembedding (computed in Python when the source was recorded); a column's whole top-k below.
let lensBuilt = null;

function drawLens() {
  const s = src(), lens = s.lens;
  $("lens-empty").hidden = Boolean(lens);
  $("lens-body").hidden = !lens;
  if (!lens) { stats.lens = null; return; }
  const L = lens.tokens.length;
  const pos = state.lensPos === null ? L - 1 : state.lensPos;
  if (lensBuilt !== `${state.source}/${state.theme}`) buildLens(lens);
  for (const el of document.querySelectorAll("#lens-grid .selected")) el.classList.remove("selected");
  for (const el of document.querySelectorAll(`#lens-grid [data-pos="${pos}"]`)) el.classList.add("selected");
  const next = pos + 1 < L ? lens.tokens[pos + 1] : null;
  const detail = $("lens-detail");
  detail.innerHTML = "";
  const head = document.createElement("div");
  head.textContent = `position ${pos} ${quote(lens.tokens[pos])}: the ${lens.k} most likely next tokens per layer` +
    (next === null ? " (the last position: what the model predicts next)" : `; the text goes on with ${quote(next)}`);
  detail.appendChild(head);
  const table = document.createElement("table");
  lens.layers.forEach((name, l) => {
    const row = table.insertRow();
    row.insertCell().textContent = name;
    lens.names[l][pos].forEach((t, r) => {
      const cell = row.insertCell();
      cell.textContent = `${quote(t)} ${lens.probs[l][pos][r].toFixed(2)}`;
      if (t === next) cell.classList.add("hit");
    });
  });
  detail.appendChild(table);
  stats.lens = { pos, top1: lens.names.map((layer) => layer[pos][0]), detail: lens.names.map((layer, l) =>
    layer[pos].map((t, r) => [t, lens.probs[l][pos][r]])) };
  $("status").textContent = `logit lens at position ${pos} ${quote(lens.tokens[pos])}: ` +
    lens.layers.map((name, l) => `${name} → ${quote(lens.names[l][pos][0])} (${lens.probs[l][pos][0].toFixed(2)})`).join(", ");
}

// The grid: a row per layer, a column per position, the top token in each cell (shaded by its
// probability, outlined when it is the text's next token); column labels are written vertically,
// so none overlaps its neighbour however many positions there are.
function buildLens(lens) {
  const table = $("lens-grid");
  table.innerHTML = "";
  const header = table.insertRow();
  const corner = document.createElement("th");
  corner.textContent = "layer \\ position";
  corner.className = "lens-corner";
  header.appendChild(corner);
  lens.tokens.forEach((t, i) => {
    const th = document.createElement("th");
    th.className = "lens-pos";
    th.dataset.pos = i;
    th.title = `${i} ${quote(t)}`;
    const span = document.createElement("span");
    span.textContent = `${i} ${label(t, LABEL_CHARS)}`;
    th.appendChild(span);
    header.appendChild(th);
  });
  lens.layers.forEach((name, l) => {
    const row = table.insertRow();
    const th = document.createElement("th");
    th.textContent = name;
    th.className = "lens-layer";
    row.appendChild(th);
    lens.tokens.forEach((_, i) => {
      const cell = row.insertCell();
      const [t, p] = [lens.names[l][i][0], lens.probs[l][i][0]];
      cell.dataset.pos = i;
      cell.dataset.layer = l;
      cell.textContent = label(t, 8);
      cell.style.background = bluesCSS(p);
      if (p > 0.6) cell.style.color = "#fff";
      if (i + 1 < lens.tokens.length && t === lens.tokens[i + 1]) cell.classList.add("hit");
      cell.title = `${name}, position ${i}: ` + lens.names[l][i].map((n, r) => `${quote(n)} ${lens.probs[l][i][r].toFixed(3)}`).join(", ");
    });
  });
  lensBuilt = `${state.source}/${state.theme}`;
}
