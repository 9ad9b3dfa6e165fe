"""A headless Chromium under selenium, from the system's packages (Debian's `chromium` and
`chromium-driver`, which .ci/run installs): nothing is downloaded at test time."""

from __future__ import annotations

import shutil

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


def find_chromium() -> tuple[str, str] | str:
    """(browser, driver) paths, or why there are none (a skip reason)."""
    import selenium  # noqa: F401  (a test extra: missing, the set-up is broken, which must fail)
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = next((p for p in map(shutil.which, DRIVERS) if p), None)
    if browser is None or driver is None:
        return ("no Chromium here: install Debian's chromium and chromium-driver "
                "(`apt-get install chromium chromium-driver`, as .ci/run does)")
    return browser, driver


def headless_chromium(browser: str, driver: str, width: int = 1000, height: int = 900):
    """A selenium Chrome driver on `browser` through `driver`, with the console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: selenium's manager has nothing to look up or download.
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))
