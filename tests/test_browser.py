"""The page at / in a real headless browser (Debian's chromium and chromedriver, driven by
Selenium; nothing is downloaded): type a query, wait for the thumbnails and check they
loaded; upload an image, check the caption hits (issue 16)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Service, start_service, stop_service, system_tool

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service as DriverService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow


def _tools() -> tuple[str, str]:
    return (
        system_tool("chromium", "apt-get install chromium"),
        system_tool("chromedriver", "apt-get install chromium-driver"),
    )


@pytest.fixture(scope="module")
def service(
    index_dir: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    svc = start_service(
        index_dir,
        tmp_path_factory.mktemp("browser") / "serve.log",
        DUET_IMAGES_DIR=str(corpus.parent),  # the thumbnails
    )
    yield svc
    stop_service(svc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    binary, driver_path = _tools()
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1200,900",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=DriverService(executable_path=driver_path), options=opts)
    yield driver
    driver.quit()


def _loaded_thumbnails(driver: Any) -> int:
    return int(
        driver.execute_script(
            "return [...document.querySelectorAll('#grid img')]"
            ".filter(i => i.complete && i.naturalWidth > 0).length"
        )
    )


def test_typed_query_shows_thumbnails(service: Service, browser: Any) -> None:
    d = browser
    d.get(service.url + "/")
    box = d.find_element(By.ID, "query")
    box.send_keys("a red circle")
    d.find_element(By.ID, "search").click()
    WebDriverWait(d, 30).until(lambda drv: _loaded_thumbnails(drv) >= 5)
    cards = d.find_elements(By.CSS_SELECTOR, "#grid .hit")
    assert len(cards) == 12
    status = d.find_element(By.ID, "status").text
    assert "hits" in status and "ms" in status and "index" in status
    if shot := os.environ.get("DUET_SCREENSHOT"):  # docs/demo.png is made this way
        d.save_screenshot(shot)


def test_unknown_words_are_pointed_out(service: Service, browser: Any) -> None:
    d = browser
    d.get(service.url + "/")
    d.find_element(By.ID, "query").send_keys("a red dog")
    d.find_element(By.ID, "search").click()
    WebDriverWait(d, 30).until(lambda drv: "dog" in drv.find_element(By.ID, "notice").text)


def test_uploaded_image_shows_caption_hits(service: Service, browser: Any, corpus: Path) -> None:
    d = browser
    d.get(service.url + "/")
    upload = d.find_element(By.ID, "file")
    upload.send_keys(str(corpus.parent / "images" / "0003.png"))
    WebDriverWait(d, 30).until(lambda drv: _loaded_thumbnails(drv) >= 3)
    captions = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#grid .hit .cap")]
    assert len(captions) == 12 and all(captions)
    assert "captions" in d.find_element(By.ID, "status").text
