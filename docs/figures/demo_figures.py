"""The demo's pictures in the README and docs/demo.md, drawn by the demo's own code.

    .venv/bin/python docs/figures/demo_figures.py     # writes docs/img/encoder_heads.png and viewer.png

* ``encoder_heads.png``: :func:`multihead.apps.findings.plot_findings` on the measured findings,
  the same figure ``multihead demo`` writes; the numbers it prints are the ones the docs quote.
* ``viewer.png``: the encoder part of ``multihead demo`` (``apps.demo._encoder_part``) writes
  the viewer's source, the page is opened in Debian's headless Chromium (as the browser tests
  do), set to the claim the picture illustrates (layer 0, head 2, the previous-token head, with
  every query's line drawn), and captured. The script first hovers the query "it" and checks the
  page says what the caption says (it attends most to the token before it, "because").
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from multihead.apps.demo import DemoOptions, DemoResult, _encoder_part
from multihead.apps.findings import measure_heads, plot_findings
from multihead.models import SentenceEncoder, find_minilm
from multihead.viz.viewer import write_viewer

OUT = Path(__file__).resolve().parents[1] / "img"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ROW = 18  # px per token row of the head view (viewer.js)


def encoder_heads() -> None:
    encoder = SentenceEncoder.from_pretrained(find_minilm())
    findings = measure_heads(encoder)
    p = findings.previous
    assert (p.layer, p.head) == (0, 2), "the docs' claim moved: update docs/demo.md and the README first"
    print(f"wrote {plot_findings(encoder, findings, OUT / 'encoder_heads.png')}")


def viewer_screenshot() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    work = Path(tempfile.mkdtemp(prefix="multihead-figures-"))
    try:
        options = DemoOptions(out=work / "out")
        view = _encoder_part(options, torch.device("cpu"), work, DemoResult(work), say=lambda line: None)
        page = write_viewer(work / "viewer.html", [view], title="multihead demo: attention of every layer and head")
        chrome = webdriver.ChromeOptions()
        chrome.binary_location = str(CHROMIUM)
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
                    "--disable-background-networking", f"--user-data-dir={work / 'profile'}", "--window-size=1100,900",
                    "--hide-scrollbars"):
            chrome.add_argument(arg)
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=chrome)
        try:
            driver.get(page.as_uri())
            deadline = time.time() + 30
            while not driver.execute_script("return window.__viewerReady === true"):
                if time.time() > deadline:
                    raise RuntimeError("the viewer did not start")
                time.sleep(0.05)
            Select(driver.find_element("id", "layer")).select_by_value("0")
            head = driver.find_element("css selector", ".head-toggle[data-head='2']")
            ActionChains(driver).double_click(head).perform()  # only head 2
            lines = driver.find_element("id", "lines")
            it = view.q_tokens.index("it")
            size = lines.size
            ActionChains(driver).move_to_element_with_offset(
                lines, int(size["width"] * 0.2 - size["width"] / 2),
                int(ROW + it * ROW + ROW / 2 - size["height"] / 2)).perform()
            time.sleep(0.3)
            status = driver.find_element("id", "status").text
            layer = Select(driver.find_element("id", "layer")).first_selected_option.get_attribute("value")
            if layer != "0" or "head 2" not in status or '"it" attends most to key 7 "because"' not in status:
                raise RuntimeError(f"the page does not show the claim (layer 0, head 2, 'it' -> 'because'): {status!r}")
            # The picture shows every query's line (each to the token before it), not the hovered one.
            ActionChains(driver).move_to_element(driver.find_element("tag name", "h1")).perform()
            time.sleep(0.3)
            driver.save_screenshot(str(OUT / "viewer.png"))
            print(f"wrote {OUT / 'viewer.png'} ({status})")
        finally:
            driver.quit()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    encoder_heads()
    viewer_screenshot()
