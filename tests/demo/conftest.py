"""Shared fixtures of the demo tests: the real MiniLM folder, one loaded encoder, one quick demo run,
and the headless browser of the viewer's tests (Debian's Chromium, driven by Selenium).

Browser tests are skipped when Chromium, its driver or Selenium is missing, and the end of the
run says so, with how to enable them (a skip hidden among hundreds of dots is easy to miss).
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest

from multihead.models import SentenceEncoder, find_minilm


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    return find_minilm()


@pytest.fixture(scope="session")
def encoder(minilm_folder) -> SentenceEncoder:
    return SentenceEncoder.from_pretrained(minilm_folder)


@pytest.fixture()
def model_copy(minilm_folder, tmp_path) -> Path:
    """A writable copy of the MiniLM folder (the 90 MB weights linked, not copied) to break."""
    copy = tmp_path / "model"
    copy.mkdir()
    for item in minilm_folder.iterdir():
        if item.is_dir():
            shutil.copytree(item, copy / item.name)
        elif item.name == "model.safetensors":
            (copy / item.name).symlink_to(item)
        else:
            shutil.copy(item, copy / item.name)
    return copy


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory):
    """``multihead demo --quick`` run once, in process: ``(exit code, stdout, stderr, out folder)``."""
    import contextlib
    import io

    from multihead.apps.cli import main

    out = tmp_path_factory.mktemp("demo-run") / "multihead-demo"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["demo", "--quick", "--out", str(out), "--no-progress"])
    return code, stdout.getvalue(), stderr.getvalue(), out


# ---------------------------------------------------------------------------------------- browser
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
NEVER_DOWNLOADED = "Debian's packages; never a downloaded browser"


def browser_missing() -> list[str]:
    """What the browser tests need and this machine lacks, each with how to install it (``[]``
    when they can run)."""
    missing = []
    if not CHROMIUM.exists():
        missing.append(f"{CHROMIUM} not found: apt-get install chromium ({NEVER_DOWNLOADED})")
    if not CHROMEDRIVER.exists():
        missing.append(f"{CHROMEDRIVER} not found: apt-get install chromium-driver ({NEVER_DOWNLOADED})")
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium is not installed: make setup (the test-demo extra)")
    return missing


def pytest_collection_modifyitems(config, items):
    missing = browser_missing()
    if missing:
        skip = pytest.mark.skip(reason="browser test: " + "; ".join(missing))
        for item in items:
            if "browser" in item.keywords:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    missing = browser_missing()
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "browser" in getattr(r, "keywords", {})]
    if missing and skipped:
        terminalreporter.section("browser tests skipped")
        terminalreporter.line(f"{len(skipped)} browser test(s) of the attention viewer did not run; missing:")
        for line in missing:
            terminalreporter.line(f"  {line}")


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session: the system's chromium and chromedriver, a fresh
    profile, no network services, a 1280 x 900 window, the console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="multihead-chromium-")
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
