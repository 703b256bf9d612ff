"""A real browser for the UI tests: Debian's Chromium, driven by Selenium through the system's
chromedriver. Nothing here downloads a browser or a driver (Selenium Manager is never asked:
both paths are given)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def browser_skip_reason() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return (f"{CHROMIUM} or {CHROMEDRIVER} is absent (Debian's chromium and chromium-driver; "
                "`make test` installs them)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed in this environment (pip install -e '.[dev]')"
    return None


class Browser:
    """One headless Chromium window; screenshots go to ``shots`` (outside the repository)."""

    def __init__(self, driver: Any, shots: Path) -> None:
        self.driver, self.shots = driver, shots

    def get(self, url: str) -> None:
        self.driver.get(url)

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
        """Poll ``check()`` until it returns something truthy; fail naming ``what`` (with a screenshot)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
            except Exception:  # the element is being re-rendered
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                shot = self.screenshot(f"timeout-{what.replace(' ', '-')[:40]}")
                raise AssertionError(f"the page never showed {what} in {timeout} s (screenshot {shot}); "
                                     f"page text: {self.text()[:1500]}")
            time.sleep(0.3)

    def text(self) -> str:
        return self.js("return document.body ? document.body.innerText : ''")

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def click_text(self, selector: str, text: str, timeout: float = 30) -> None:
        """Click the first visible element matching ``selector`` whose text is ``text``."""
        def find() -> Any:
            return self.js("""
                const [sel, want] = arguments;
                return Array.from(document.querySelectorAll(sel)).find(
                    e => e.innerText.trim() === want && e.offsetParent !== null) || null;""", selector, text)
        element = self.wait(f"{selector} '{text}'", find, timeout)
        self.js("arguments[0].scrollIntoView({block: 'center'});", element)
        element.click()  # a real mouse click (WebDriver's), as a user's

    def open_tab(self, tab: str, what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
        """Open the page's tab ``tab`` and wait until ``check()`` holds, clicking it again while it does not:
        a click made while the run page still renders can be lost (it mounts its tabs again when the run's
        data arrives; seen once: the Logs tab stayed open after the click, and the wait timed out)."""
        def shown() -> Any:
            value = check()
            if not value:
                self.click_text("li.p-tab", tab, timeout=5)
                time.sleep(0.5)
                value = check()
            return value
        return self.wait(what, shown, timeout)

    def images(self) -> list[dict]:
        """Every <img> on the page: whether it loaded and its natural size (0 for a broken image)."""
        return self.js("""return Array.from(document.images).map(i => ({
            src: i.currentSrc.slice(0, 64), complete: i.complete, width: i.naturalWidth, height: i.naturalHeight,
            alt: i.alt}))""")

    def tables(self) -> list[list[list[str]]]:
        """Every rendered <table> as rows of cell texts (header row included)."""
        return self.js("""return Array.from(document.querySelectorAll('table')).map(t =>
            Array.from(t.rows).map(r => Array.from(r.cells).map(c => c.innerText.trim())))""")

    def input_values(self) -> list[str]:
        return self.js("""return Array.from(document.querySelectorAll('input, textarea, select'))
            .map(e => e.value).filter(v => v !== undefined && v !== null)""")

    def screenshot(self, name: str) -> Path:
        """Save a PNG of the window (the UI scrolls inside its own panes, so the window is tall)."""
        path = self.shots / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def dump(self, name: str, value: Any) -> None:
        (self.shots / f"{name}.json").write_text(json.dumps(value, indent=1, default=str))


@contextmanager
def chromium(shots: Path) -> Iterator[Browser]:
    """A headless Chromium (root-safe flags, a fresh profile, no network of its own)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    shots.mkdir(parents=True, exist_ok=True)
    profile = Path(tempfile.mkdtemp(prefix="ktflow-chromium-"))
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--disable-extensions", "--window-size=1400,2000",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield Browser(driver, shots)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
