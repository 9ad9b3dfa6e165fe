"""Make docs/chat_page.png: a real deployment with the default model (SmolLM2-135M-Instruct), the
chat page in headless Chromium, two questions answered at temperature 0.

    PYTHONPATH=$PWD .venv/bin/python -m tests.helpers.chat_screenshot [OUT.png]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from selenium.webdriver.support.ui import WebDriverWait

from tests.helpers.browser import find_chromium, headless_chromium
from tests.helpers.service_harness import Cluster

QUESTIONS = ("What is the capital of France?", "And of Italy?")


def main(out: Path) -> None:
    found = find_chromium()
    if isinstance(found, str):
        raise SystemExit(found)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), "default").start()
        driver = headless_chromium(*found, width=1000, height=820)
        try:
            driver.get(cluster.base_url + "/")
            until = WebDriverWait(driver, 120, poll_frequency=0.1).until
            until(lambda d: d.find_element("id", "status").text == "ready")
            for field, value in (("temperature", "0"), ("max-tokens", "48")):
                driver.find_element("id", field).clear()
                driver.find_element("id", field).send_keys(value)
            for n, question in enumerate(QUESTIONS, 1):
                driver.find_element("id", "prompt").send_keys(question)
                driver.find_element("id", "send").click()
                until(lambda d, n=n: d.execute_script(
                    "const a = document.querySelectorAll('.message.assistant');"
                    f"return a.length >= {n} && a[{n - 1}].dataset.state !== 'streaming';"))
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
            cluster.stop()
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/chat_page.png"))
