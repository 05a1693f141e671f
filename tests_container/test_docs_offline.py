"""The interactive docs of the running container work with no internet: headless Chromium (Debian's
chromium + chromium-driver, selenium from the load extra) opens /docs with every host but
loopback unresolvable, runs a prediction through the page, and no request leaves the machine.
Skipped where Chromium or selenium is missing (`make docs-test` installs both); not in CI's run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_container import container, volumes  # noqa: F401  (the fixture is used by name)

pytestmark = pytest.mark.skipif(shutil.which("chromedriver") is None, reason="no chromium-driver")
pytest.importorskip("selenium", reason="the browser extra is not installed")
SCREENSHOT = Path(__file__).resolve().parent.parent / "bench" / "out" / "docs-offline.png"


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1600",
                # Every name resolves to nothing but loopback: a CDN fetch would fail, and show.
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--no-proxy-server"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    # Debian's driver, named: selenium's own manager would look for one on the internet.
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def _requested_urls(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def test_docs_run_a_prediction_without_internet(volumes) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    with container(volumes) as (_name, url):
        driver = _browser()
        try:
            driver.get(f"{url}/docs")
            wait = WebDriverWait(driver, 30)
            operation = wait.until(ec.element_to_be_clickable((By.ID, "operations-default-predict_v1_predict_post")))
            operation.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
            wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, ".try-out__btn"))).click()
            body = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "textarea.body-param__text")))
            body.clear()
            body.send_keys(json.dumps({"text": "network traffic monitor", "k": 5}))
            driver.find_element(By.CSS_SELECTOR, ".execute").click()
            live = ".live-responses-table "
            status_cell = (By.CSS_SELECTOR, live + "tbody .response-col_status")
            status = wait.until(ec.presence_of_element_located(status_cell)).text
            answer = driver.find_element(By.CSS_SELECTOR, live + ".microlight").text
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(SCREENSHOT))
            urls = _requested_urls(driver)
        finally:
            driver.quit()
    assert status.strip().startswith("200"), status
    assert '"results"' in answer
    outside = [u for u in urls if not u.startswith((url, "data:", "blob:"))]
    assert not outside, outside
    assert any(u.endswith("/v1/predict") for u in urls)
