"""The viewer's pictures in docs/demo.md, taken in headless Chromium from a real demo page.

    .venv/bin/multihead demo --quick --out /tmp/demo
    .venv/bin/python docs/figures/viewer_figures.py /tmp/demo/viewer.html   # writes docs/img/viewer_*.png

Each picture is the page after the clicks and mouse moves a reader would make (the same
interactions tests/demo/test_browser.py checks), so it shows what the viewer does, not a mock-up.
Needs Debian's chromium and chromium-driver, and selenium (the test-demo extra).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "img"
ROW = 18  # px per token row, as in viewer.js


def main(page: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                f"--user-data-dir={tempfile.mkdtemp(prefix='multihead-chromium-')}", "--window-size=1240,860"):
        options.add_argument(arg)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)

    def settle():
        d.execute_async_script("const done = arguments[0]; requestAnimationFrame(() => requestAnimationFrame(done));")
        time.sleep(0.1)

    def move(element_id, x, y):
        el = d.find_element("id", element_id)
        ActionChains(d).move_to_element_with_offset(el, int(x - el.size["width"] / 2),
                                                    int(y - el.size["height"] / 2)).perform()
        settle()

    def click(css, double=False):
        el = d.find_element("css selector", css)
        (ActionChains(d).double_click(el) if double else ActionChains(d).click(el)).perform()
        settle()

    def token_index(name):
        return d.execute_script("return DATA.sources[state.source].q_tokens").index(name)

    d.get(page.resolve().as_uri())
    while not d.execute_script("return window.__viewerReady === true"):
        time.sleep(0.05)

    # Head view: three heads of one layer, the mouse on the query "it".
    Select(d.find_element("id", "layer")).select_by_value("2")
    click(".head-toggle[data-head='0']", double=True)
    for h in (2, 3):
        click(f".head-toggle[data-head='{h}']")
    it = token_index("it")
    move("lines", d.find_element("id", "lines").size["width"] * 0.2, ROW + it * ROW + ROW / 2)
    d.save_screenshot(str(OUT / "viewer_heads.png"))

    # Neuron view: head 3 of the same layer (focused: toggled last), query "it", the mouse on key "tired".
    click("#tab-neuron")
    Select(d.find_element("id", "neuron-query")).select_by_value(str(it))
    settle()
    move("neuron", 300, (token_index("tired") + 1) * ROW + ROW / 2)
    d.save_screenshot(str(OUT / "viewer_neuron.png"))

    # Generation: the recall decoder (it opens on its lookup head), stepped to its third answer.
    click("#tab-head")
    Select(d.find_element("id", "source")).select_by_value("1")
    settle()
    for _ in range(4):
        click("#step-next")
    move("step-label", 5, 5)
    d.save_screenshot(str(OUT / "viewer_generation.png"))

    # Model view of the recall decoder: thumbnails enlarged to 160 px, the mouse on the lookup head.
    click("#tab-model")
    d.execute_script("const s = document.getElementById('thumb-size'); s.value = 160;"
                     "s.dispatchEvent(new Event('input'))")
    settle()
    ActionChains(d).move_to_element(d.find_element("css selector", "#grid canvas.highlight")).perform()
    settle()
    d.save_screenshot(str(OUT / "viewer_model.png"))

    # Logit lens of the recall decoder: the column of its third asked key, every layer's top tokens.
    click("#tab-lens")
    prompt = d.execute_script("return DATA.sources[1].prompt_len")
    click(f"#lens-grid th[data-pos='{prompt - 1 + 4}']")
    move("lens-detail", 5, 5)
    d.save_screenshot(str(OUT / "viewer_lens.png"))

    # Text view of the encoder: layer 5, head 11 alone, the query "it" chosen (docs/demo.md's finding).
    Select(d.find_element("id", "source")).select_by_value("0")
    settle()
    Select(d.find_element("id", "layer")).select_by_value("5")
    click(".head-toggle[data-head='11']", double=True)
    click("#tab-text")
    click(f'.text-line[data-row="mean"] .tok[data-index="{token_index("it")}"]')
    move("text-body", 5, 5)
    d.save_screenshot(str(OUT / "viewer_text.png"))

    # Dark mode: the head view of layer 0, head 2 (the previous-token head), the mouse on "it".
    click("#tab-head")
    Select(d.find_element("id", "layer")).select_by_value("0")
    click(".head-toggle[data-head='2']", double=True)
    click("#theme")
    move("lines", d.find_element("id", "lines").size["width"] * 0.2, ROW + token_index("it") * ROW + ROW / 2)
    d.save_screenshot(str(OUT / "viewer_dark.png"))
    d.quit()
    for name in ("viewer_heads", "viewer_neuron", "viewer_generation", "viewer_model", "viewer_lens", "viewer_text",
                 "viewer_dark"):
        print(OUT / f"{name}.png")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: viewer_figures.py DEMO_FOLDER/viewer.html (from multihead demo --quick --out DEMO_FOLDER)")
    main(Path(sys.argv[1]))
