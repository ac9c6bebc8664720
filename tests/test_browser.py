"""The page at / in a real headless browser (Debian's chromium and chromedriver, driven by
Selenium; nothing is downloaded): type a query, wait for the thumbnails and check they
loaded; upload an image, check the caption hits (issue 16). What a person must be able to
trust (issue 37): a query of unknown words says nothing was understood, hits that fit nothing
are marked weak, each hit shows a caption and one line explains the scores, a cached answer
shows its time, and one kind of search clears the other's input."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from models.world import satisfies
from tests.conftest import Service, start_service, stop_service, system_tool
from tests.test_answers import NO_FIT, _scenes

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service as DriverService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
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
        # the CDN the API pages load their scripts from, out of reach whatever the network
        "--host-resolver-rules=MAP cdn.jsdelivr.net ~NOTFOUND",
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


def _search(d: Any, query: str, reranker: str = "") -> None:
    """Search for `query` with the re-ranker picked on the page ("": the service default)."""
    Select(d.find_element(By.ID, "reranker")).select_by_value(reranker)
    box = d.find_element(By.ID, "query")
    box.clear()
    box.send_keys(query)
    d.find_element(By.ID, "search").click()


def _answered(d: Any, before: str = "") -> Any:
    """Wait for the status line to show a new answer (it differs from `before`)."""
    WebDriverWait(d, 30).until(
        lambda drv: (t := drv.find_element(By.ID, "status").text) != before and "hits" in t
    )
    return d.find_element(By.ID, "status").text


def test_a_query_of_unknown_words_says_nothing_was_understood(
    service: Service, browser: Any
) -> None:
    d = browser
    d.get(service.url + "/")
    _search(d, "a red circle")
    _answered(d)
    _search(d, "crimson box")
    WebDriverWait(d, 30).until(lambda drv: drv.find_element(By.ID, "error").text)
    error = d.find_element(By.ID, "error").text
    assert "422" in error and "no words the model can read" in error and "crimson" in error
    assert d.find_elements(By.CSS_SELECTOR, "#grid .hit") == []  # no stale list under it
    assert not d.find_element(By.ID, "legend").is_displayed()


def test_hits_that_fit_nothing_are_marked_weak(
    service: Service, browser: Any, corpus: Path
) -> None:

    assert not any(satisfies(NO_FIT, s) for s in _scenes(corpus))
    d = browser
    d.get(service.url + "/")
    _search(d, NO_FIT)
    _answered(d)
    cards = d.find_elements(By.CSS_SELECTOR, "#grid .hit")
    assert cards and all("weak" in c.get_attribute("class").split() for c in cards)
    assert all("weak" in c.text for c in cards)
    assert "Nothing here fits well" in d.find_element(By.ID, "notice").text
    first = json.loads(corpus.read_text().splitlines()[0])
    _search(d, first["captions"][0])  # its image is in the index: the first hit fits
    _answered(d, d.find_element(By.ID, "status").text)
    top = d.find_element(By.CSS_SELECTOR, "#grid .hit")
    assert "weak" not in top.get_attribute("class").split()
    assert d.find_element(By.ID, "notice").text == ""


def test_hits_show_captions_and_the_scores_are_explained(
    service: Service, browser: Any, corpus: Path
) -> None:
    d = browser
    d.get(service.url + "/")
    assert not d.find_element(By.ID, "legend").is_displayed()
    _search(d, "a red circle")
    _answered(d)
    caps = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#grid .hit .cap")]
    ids = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#grid .hit .id")]
    captions = {c for ln in corpus.read_text().splitlines() for c in json.loads(ln)["captions"]}
    assert len(caps) == 12 and all(c in captions for c in caps), caps
    assert all(i.startswith("img-") for i in ids)
    legend = d.find_element(By.ID, "legend")
    assert legend.is_displayed()
    assert "score" in legend.text and "dot" in legend.text and "fits" in legend.text


@pytest.mark.parametrize("reranker", ["none", "late", "han"])
def test_the_legend_explains_the_scores_the_re_ranker_answered(
    service: Service, browser: Any, reranker: str
) -> None:
    """Only the default re-ranker's score is a probability with a match threshold: for the
    others (`match` null in the answer) the legend says what their score is and neither calls
    it a probability nor talks of weak hits."""
    d = browser
    d.get(service.url + "/")
    _search(d, "a red circle", reranker)
    status = _answered(d)
    legend = d.find_element(By.ID, "legend")
    assert legend.is_displayed()
    text = legend.text
    assert "probability" not in text and "weak" not in text and "likely" not in text, text
    assert "no match threshold" in text and "does not say whether a hit fits" in text, text
    if reranker == "none":
        assert "dot product" in text and "re-ranker none" in text, text
    else:
        assert f"the {reranker} re-ranker's own score" in text and "dot:" in text, text
    cards = d.find_elements(By.CSS_SELECTOR, "#grid .hit")
    assert len(cards) == 12
    assert not any("weak" in c.get_attribute("class").split() for c in cards)
    assert "Nothing here fits" not in d.find_element(By.ID, "notice").text
    _search(d, "a red circle")  # the default (ce): the probability, and its threshold
    _answered(d, status)
    text = d.find_element(By.ID, "legend").text
    assert "probability" in text and "weak" in text and "what you asked" in text, text


@pytest.mark.parametrize("reranker", ["", "none"])
def test_unknown_words_are_not_what_the_scores_judge(
    service: Service, browser: Any, reranker: str
) -> None:
    """The demo answers "a red dog on a beach" with red shapes scored high: the page says the
    scores judge only the words the model read, not "dog" and "beach"."""
    d = browser
    d.get(service.url + "/")
    _search(d, "a red dog on a beach", reranker)
    _answered(d)
    notice = d.find_element(By.ID, "notice").text
    assert "dog, beach" in notice, notice
    assert "The scores judge only the words the model read" in notice, notice
    assert "need not show them" in notice, notice
    legend = d.find_element(By.ID, "legend").text
    assert "what you asked" not in legend, legend
    if not reranker:
        assert "fits the words of your query the model read, not dog, beach" in legend, legend


def test_a_cached_answer_shows_its_time(service: Service, browser: Any) -> None:
    d = browser
    d.get(service.url + "/")
    _search(d, "two green squares above a cross")
    first = _answered(d)
    _search(d, "two green squares above a cross")
    WebDriverWait(d, 30).until(lambda drv: "cached" in drv.find_element(By.ID, "status").text)
    second = d.find_element(By.ID, "status").text
    assert "cached" not in first
    assert re.search(r"\d+(\.\d+)? ms \(cached answer\)", second), second
    assert "?" not in second


def test_one_kind_of_search_clears_the_others_input(
    service: Service, browser: Any, corpus: Path
) -> None:
    d = browser
    d.get(service.url + "/")
    _search(d, "a red circle")
    status = _answered(d)
    d.find_element(By.ID, "file").send_keys(str(corpus.parent / "images" / "0003.png"))
    status = _answered(d, status)
    assert "captions" in status
    assert d.find_element(By.ID, "query").get_attribute("value") == ""
    assert d.find_element(By.ID, "query-image").is_displayed()
    assert "?q=" not in d.current_url  # the address no longer names the text search
    _search(d, "a blue square")
    _answered(d, status)
    assert d.find_element(By.ID, "file").get_attribute("value") == ""
    assert not d.find_element(By.ID, "query-image").is_displayed()


def test_the_page_has_an_icon(service: Service, browser: Any) -> None:
    d = browser
    d.get_log("browser")  # what earlier tests left in the console
    d.get(service.url + "/")
    WebDriverWait(d, 10).until(
        lambda drv: drv.execute_script("return document.readyState") == "complete"
    )
    icon = d.execute_script(
        "return fetch('/favicon.ico').then(r => r.ok && r.headers.get('content-type'))"
    )
    assert icon == "image/png"
    console = [e["message"] for e in d.get_log("browser")]
    assert not [m for m in console if "favicon" in m or "404" in m], console


def test_a_text_search_is_an_address_that_runs_it_again(service: Service, browser: Any) -> None:
    """A text search puts `?q=` in the address bar; opening that address runs the same
    search (a search can be kept and shared); an image search takes it away."""
    d = browser
    d.get(service.url + "/")
    d.find_element(By.ID, "query").send_keys("two blue squares")
    d.find_element(By.ID, "search").click()
    WebDriverWait(d, 30).until(lambda drv: len(drv.find_elements(By.CSS_SELECTOR, "#grid .hit")))
    link = d.current_url
    assert link.endswith("/?q=two%20blue%20squares"), link
    first = d.find_element(By.CSS_SELECTOR, "#grid .hit").text
    d.get(service.url + "/")
    d.get(link)
    WebDriverWait(d, 30).until(lambda drv: len(drv.find_elements(By.CSS_SELECTOR, "#grid .hit")))
    assert d.find_element(By.ID, "query").get_attribute("value") == "two blue squares"
    assert d.find_element(By.CSS_SELECTOR, "#grid .hit").text == first


def test_only_the_latest_search_is_shown_when_an_older_answer_comes_last(
    service: Service, browser: Any
) -> None:
    """Two searches sent one after the other, the first one's answer made to come last (the
    page's fetch held back 1.5 s for it): the grid, the status and the address show the
    second search, never the first one's late answer under the second one's words."""
    d = browser
    d.get(service.url + "/")
    d.execute_script(
        "const real = window.fetch; let n = 0;"
        "window.fetch = (url, init) => { const wait = n++ === 0 ? 1500 : 0;"
        "  return new Promise((ok) => setTimeout(ok, wait)).then(() => real(url, init)); };"
    )
    _search(d, "two green crosses above a red diamond")
    _search(d, "a yellow circle at the top", "none")
    _answered(d)
    time.sleep(2.5)  # past the first search's held-back answer
    with service.client() as c:
        want = c.post(
            "/search/text",
            json={"query": "a yellow circle at the top", "top_k": 12, "reranker": "none"},
        ).json()
    ids = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#grid .hit .id")]
    assert ids == [h["id"] for h in want["hits"]]
    assert "re-ranker none" in d.find_element(By.ID, "legend").text
    assert d.current_url.endswith("?q=a%20yellow%20circle%20at%20the%20top&reranker=none")
    assert d.find_element(By.ID, "error").text == ""


def test_the_api_pages_say_what_to_read_when_their_cdn_is_out_of_reach(
    service: Service, browser: Any
) -> None:
    """/docs and /redoc are FastAPI's pages, whose scripts come from cdn.jsdelivr.net: on an
    offline network (the CDN unresolvable here) each says so and links /openapi.json instead
    of staying blank."""
    d = browser
    for path, drawer in (("/docs", "Swagger UI"), ("/redoc", "ReDoc")):
        d.get(service.url + path)
        note = WebDriverWait(d, 20).until(lambda d: d.find_elements(By.ID, "docs-offline"))
        assert "cdn.jsdelivr.net" in note[0].text and drawer in note[0].text, note[0].text
        link = d.find_element(By.LINK_TEXT, "/openapi.json")
        assert link.get_attribute("href") == service.url + "/openapi.json"
        assert d.title == "duet API: the page's script did not load"
    time.sleep(4.5)  # past the "still waiting" note's time: the page's load has called it off
    assert not d.find_elements(By.ID, "docs-waiting") and d.find_elements(By.ID, "docs-offline")


def test_an_api_page_whose_cdn_does_not_answer_says_so_while_it_waits(
    service: Service, browser: Any
) -> None:
    """A network that drops the packets keeps the CDN script loading for minutes: after a
    few seconds the page says what it waits for and links /openapi.json (the requests to
    the CDN held unanswered through the DevTools protocol)."""
    d = browser
    d.execute_cdp_cmd("Fetch.enable", {"patterns": [{"urlPattern": "*cdn.jsdelivr.net*"}]})
    try:
        d.set_page_load_timeout(2)
        with contextlib.suppress(Exception):  # the page never finishes loading: the point
            d.get(service.url + "/docs")
        note = WebDriverWait(d, 15).until(lambda d: d.find_elements(By.ID, "docs-waiting"))
        assert "Still waiting for Swagger UI's script from cdn.jsdelivr.net" in note[0].text
        link = note[0].find_element(By.LINK_TEXT, "/openapi.json")
        assert link.get_attribute("href") == service.url + "/openapi.json"
    finally:
        d.execute_cdp_cmd("Fetch.disable", {})
        d.set_page_load_timeout(300)
