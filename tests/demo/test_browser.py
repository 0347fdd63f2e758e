"""The HTML viewer in a real browser: Debian's headless Chromium driven by Selenium.

Selenium must not download a driver or a browser: it gets the system chromedriver and chromium.
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path

import pytest
import torch

from multihead.viz import ViewerSource, write_viewer

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists() or not CHROMEDRIVER.exists(),
                       reason="needs Debian's chromium and chromium-driver "
                              "(apt-get install chromium chromium-driver; .ci/run installs them)"),
]


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium drives the browser (test-demo extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="multihead-chromium-")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def _pixel_spread(png: bytes) -> float:
    """Standard deviation of the screenshot's grey levels: 0 for a blank page."""
    from matplotlib import image

    pixels = torch.from_numpy(image.imread(io.BytesIO(png), format="png").copy())  # (H, W, 3 or 4) in [0, 1]
    return float(pixels[..., :3].mean(-1).std())


def _region_spread(driver, element_id: str) -> float:
    element = driver.find_element("id", element_id)
    return _pixel_spread(element.screenshot_as_png)


def _load(driver, path: Path):
    driver.get_log("browser")  # drop earlier messages
    driver.get(path.as_uri())
    deadline = time.time() + 20
    while not driver.execute_script("return window.__viewerReady === true"):
        if time.time() > deadline:
            raise AssertionError(f"viewer did not start; console: {driver.get_log('browser')}")
        time.sleep(0.05)


def _errors(driver) -> list:
    severe = [m for m in driver.get_log("browser") if m.get("level") == "SEVERE"]
    return severe + driver.execute_script("return window.__viewerErrors")


def _select(driver, element_id: str, value: str):
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", element_id)).select_by_value(value)


def test_demo_viewer_switches_heads_layers_and_models(browser, quick_demo, tmp_path):
    code, _, _, out = quick_demo
    assert code == 0
    _load(browser, out / "viewer.html")
    assert browser.find_element("id", "head").get_attribute("value") == "0"
    _select(browser, "layer", "3")
    _select(browser, "head", "7")
    time.sleep(0.2)  # one animation frame
    assert "layer 3 (layers.3.attention), head 7" in browser.find_element("id", "status").text
    shot = tmp_path / "head-view.png"
    browser.save_screenshot(str(shot))
    assert _pixel_spread(shot.read_bytes()) > 0.02, "screenshot is blank"
    assert _region_spread(browser, "lines") > 0.02, "the head view drew nothing"
    assert _region_spread(browser, "heatmap") > 0.01, "the heatmap is blank"

    # Hover a query token: the status names the key it attends to most.
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = browser.find_element("id", "lines")
    ActionChains(browser).move_to_element_with_offset(canvas, -canvas.size["width"] // 4,
                                                      -canvas.size["height"] // 2 + 18 + 9 + 18).perform()
    time.sleep(0.2)
    assert "attends most to key" in browser.find_element("id", "status").text

    # The recall decoder opens on its lookup head; the model view has a thumbnail per layer x head.
    _select(browser, "source", "1")
    time.sleep(0.2)
    assert "lookup" in browser.find_element("css selector", "#grid canvas.highlight").get_attribute("title")
    browser.find_element("id", "tab-model").click()
    time.sleep(0.2)
    assert len(browser.find_elements("css selector", "#grid canvas")) == 2 * 4
    assert _region_spread(browser, "grid") > 0.02, "the model view is blank"
    browser.find_element("css selector", "#grid canvas[data-layer='1'][data-head='3']").click()
    time.sleep(0.2)
    assert browser.find_element("id", "head").get_attribute("value") == "3"
    assert browser.find_element("id", "head-panel").is_displayed()
    assert _errors(browser) == []


def test_viewer_handles_512_tokens(browser, tmp_path):
    torch.manual_seed(0)
    L = 512
    w = torch.softmax(3 * torch.randn(2, 4, L, L), dim=-1)
    tokens = [f"t{i}" for i in range(L)]
    path = write_viewer(tmp_path / "long.html", [ViewerSource("long", tokens, tokens, w)])
    _load(browser, path)
    _select(browser, "head", "all")
    browser.execute_script("document.getElementById('scroller').scrollTop = 4000")
    time.sleep(0.2)
    assert _region_spread(browser, "lines") > 0.02
    # Only the rows in the scroll window are drawn: the canvas stays the size of the window.
    height = browser.execute_script("return document.getElementById('lines').clientHeight")
    assert height < 1000
    _select(browser, "layer", "1")
    browser.find_element("id", "tab-model").click()
    time.sleep(0.2)
    assert _region_spread(browser, "grid") > 0.02
    assert _errors(browser) == []
