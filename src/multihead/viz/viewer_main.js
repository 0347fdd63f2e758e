// multihead attention viewer: the render loop, the controls' events and the start. The last part
// of the page's one script (viewer.py joins viewer.js, viewer_text.js, viewer_lens.js and this
// file in this order): everything it calls is declared before it runs.
"use strict";

// ------------------------------------------------------------------------------ render loop
let pending = false;
function render() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    const t0 = performance.now();
    markSelected();
    syncLegend();
    if (state.view === "head") {
      drawHeadView();
      drawHeatmap();
      $("status").textContent = describe();
    } else if (state.view === "neuron") {
      drawNeuron();
      if (!src().queries) $("status").textContent = describe();
    } else if (state.view === "text") {
      drawText();
    } else if (state.view === "lens") {
      drawLens();
    } else if (state.view === "model") {
      drawPreview(Number($("preview").dataset.layer || state.layer), Number($("preview").dataset.head || state.focus));
    }
    stats.lastMs = performance.now() - t0;
    stats.renders++;
  });
}

function same(a, b) { return JSON.stringify(a) === JSON.stringify(b); }

$("lines").addEventListener("mousemove", (event) => {
  const next = hoverAt(event);
  if (!same(next, state.hover)) { state.hover = next; state.cell = null; render(); }
});
$("lines").addEventListener("mouseleave", () => { state.hover = null; render(); });
$("lines").addEventListener("click", (event) => {
  const at = hoverAt(event);
  if (at) { state.pin[at.side] = state.pin[at.side] === at.index ? null : at.index; render(); }
});
$("heatmap").addEventListener("mousemove", (event) => {
  const next = cellAt(event);
  if (!same(next, state.cell)) { state.cell = next; state.hover = null; render(); }
});
$("heatmap").addEventListener("mouseleave", () => { state.cell = null; render(); });
$("heatmap").addEventListener("click", (event) => {
  const at = cellAt(event);
  if (at) { state.pin = { q: at.i, k: at.j }; $("neuron-query").value = String(at.i); render(); }
});
$("neuron").addEventListener("mousemove", (event) => {
  const j = neuronRowAt(event);
  if (j !== state.nkey) { state.nkey = j; render(); }
});
$("neuron").addEventListener("mouseleave", () => { state.nkey = null; render(); });
$("neuron").addEventListener("click", (event) => {
  const j = neuronRowAt(event);
  if (j !== null) { state.pin.k = j; render(); }
});
$("neuron-query").addEventListener("change", (e) => {
  const i = Number(e.target.value);
  state.pin.q = i;
  if (isGeneration()) {  // a query of the generated part is a step; one of the prompt shows the whole sequence
    const step = i - (src().prompt_len - 1);
    setStep(step >= 0 ? step : null);
    state.pin.q = i;
  }
  render();
});
$("scroller").addEventListener("scroll", render, { passive: true });
$("neuron-scroller").addEventListener("scroll", render, { passive: true });
window.addEventListener("resize", render);
// The scrollers' heights are in vh: a page inside a notebook's frame can get its viewport only after
// its first frame was drawn (Chromium gives a sandboxed frame its size late), and the window's resize
// event does not always follow. Redraw whenever either scroller's box changes size.
if (window.ResizeObserver) {
  const resized = new ResizeObserver(render);
  resized.observe($("scroller"));
  resized.observe($("neuron-scroller"));
}
$("source").addEventListener("change", (e) => setSource(Number(e.target.value)));
$("layer").addEventListener("change", (e) => { state.layer = Number(e.target.value); render(); });
$("heads-all").addEventListener("click", () => showHeads([...Array(src().heads).keys()], state.focus));
$("heads-none").addEventListener("click", () => showHeads([], state.focus));
$("step").addEventListener("input", (e) => setStep(Number(e.target.value)));
$("step-prev").addEventListener("click", () => setStep(Math.max(0, (state.step === null ? 1 : state.step) - 1)));
$("step-next").addEventListener("click", () =>
  setStep(Math.min(src().lq - src().prompt_len, state.step === null ? 0 : state.step + 1)));
$("step-all").addEventListener("click", () => setStep(null));
$("scale").addEventListener("change", (e) => { state.scale = e.target.value; render(); });
$("contrast").addEventListener("input", (e) => { state.contrast = Number(e.target.value); render(); });
$("thumb-size").addEventListener("input", (e) => document.documentElement.style.setProperty("--thumb", `${e.target.value}px`));
for (const v of VIEWS) $(`tab-${v}`).addEventListener("click", () => setView(v));
$("pair-filter").addEventListener("change", (e) => { state.pair = e.target.value; render(); });
$("text-mode").addEventListener("change", (e) => { state.textMode = e.target.value; render(); });
$("text-dir").addEventListener("change", (e) => { state.textDir = e.target.value; render(); });
$("text-body").addEventListener("click", (event) => {
  const span = event.target.closest(".tok.pick");
  if (!span) return;
  state.pin[state.textDir === "from" ? "q" : "k"] = Number(span.dataset.index);
  render();
});
$("lens-grid").addEventListener("click", (event) => {
  const cell = event.target.closest("[data-pos]");
  if (cell) { state.lensPos = Number(cell.dataset.pos); render(); }
});
$("theme").addEventListener("click", () => setTheme(state.theme === "dark" ? "light" : "dark"));

fillSelect($("source"), MODELS.map((m) => [m.first, m.name]), 0);
setTheme(state.theme, false);
setSource(0);
window.__viewerReady = true;
