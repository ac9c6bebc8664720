"""The page when a search fails, and searching again (a QA pass in a real browser): nothing
of an earlier answer stays under a failed search, an error that is not duet's JSON is told
by its status, a new re-ranker runs the search on the page again (an image search too), the
address keeps the re-ranker and Back goes to the search before, and the page can be read
aloud (labels, alt text, live regions) and read on weak hits (contrast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Service
from tests.test_answers import NO_FIT
from tests.test_browser import _answered, _search, browser, service  # noqa: F401

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow


def _text(d: Any, element: str) -> str:
    return str(d.find_element(By.ID, element).text)


def _stale_free(d: Any) -> None:
    """No hit, notice, legend or status of the answer before is left on the page."""
    assert d.find_elements(By.CSS_SELECTOR, "#grid .hit") == []
    assert _text(d, "notice") == "" and _text(d, "status") == ""
    assert not d.find_element(By.ID, "legend").is_displayed()


def test_a_search_the_service_does_not_answer_leaves_nothing_of_the_one_before(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    """The red-dog hits, their notice and legend stayed under "two blue squares" with "the
    service did not answer" above them: the page's catch cleared only the status line."""
    d = browser
    d.get(service.url + "/")
    _search(d, "a red dog")
    _answered(d)
    assert "dog" in _text(d, "notice")
    d.execute_script("window.fetch = () => Promise.reject(new TypeError('Failed to fetch'))")
    _search(d, "two blue squares")
    WebDriverWait(d, 10).until(lambda drv: _text(drv, "error"))
    assert "did not answer (Failed to fetch): is it running?" in _text(d, "error")
    _stale_free(d)


def test_an_error_page_that_is_not_json_is_told_by_its_status(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    """A proxy's 502 HTML page was parsed as JSON first: the page said "the service did not
    answer: SyntaxError: Unexpected token '<'" and kept the answer before."""
    d = browser
    d.get(service.url + "/")
    _search(d, "a red circle")
    _answered(d)
    d.execute_script(
        "window.fetch = () => Promise.resolve(new Response('<html>bad gateway</html>',"
        " {status: 502, statusText: 'Bad Gateway', headers: {'content-type': 'text/html'}}))"
    )
    _search(d, "two blue squares")
    WebDriverWait(d, 10).until(lambda drv: _text(drv, "error"))
    error = _text(d, "error")
    assert "502 Bad Gateway" in error and "SyntaxError" not in error, error
    _stale_free(d)


def test_a_new_re_ranker_searches_again_and_the_address_keeps_it(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    """Picking "none" after a ce search left the ce answer under it until Search was pressed;
    the address did not name the re-ranker, so a kept link came back with the default's."""
    d = browser
    d.get(service.url + "/")
    _search(d, "a green circle")
    before = _answered(d)
    Select(d.find_element(By.ID, "reranker")).select_by_value("none")
    _answered(d, before)
    assert "re-ranker none" in _text(d, "legend")
    link = d.current_url
    assert link.endswith("?q=a%20green%20circle&reranker=none"), link
    d.get(service.url + "/")
    d.get(link)
    _answered(d)
    assert Select(d.find_element(By.ID, "reranker")).first_selected_option.text.startswith("none")
    assert "re-ranker none" in _text(d, "legend")


def test_back_goes_to_the_search_before_and_past_the_first(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    """Each search replaced the address, so Back left the page. An address in another form
    than the page writes (`+` for a space, as people type it) must not trap Back either: the
    page pushed a new entry whenever it ran the search an address named, Back included."""
    d = browser
    d.get("about:blank")
    d.get(service.url + "/?q=a+yellow+square")
    first = _answered(d)
    ids = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#grid .hit .id")]
    _search(d, "two purple crosses")
    _answered(d, first)
    d.back()
    WebDriverWait(d, 10).until(
        lambda drv: drv.find_element(By.ID, "query").get_attribute("value") == "a yellow square"
    )
    WebDriverWait(d, 30).until(
        lambda drv: [e.text for e in drv.find_elements(By.CSS_SELECTOR, "#grid .hit .id")] == ids
    )
    d.back()
    WebDriverWait(d, 10).until(lambda drv: drv.current_url == "about:blank")


def test_back_to_the_bare_page_leaves_nothing_of_a_later_search(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    d = browser
    d.get(service.url + "/")
    _search(d, "a red circle", "none")
    _answered(d)
    d.back()
    WebDriverWait(d, 10).until(lambda drv: not drv.find_elements(By.CSS_SELECTOR, "#grid .hit"))
    assert d.find_element(By.ID, "query").get_attribute("value") == ""
    assert _text(d, "status") == "" and not d.find_element(By.ID, "legend").is_displayed()
    assert (
        Select(d.find_element(By.ID, "reranker")).first_selected_option.get_attribute("value") == ""
    )


def test_a_new_re_ranker_searches_what_was_searched_not_words_typed_since(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    d = browser
    d.get(service.url + "/")
    _search(d, "a red square")
    before = _answered(d)
    d.find_element(By.ID, "query").send_keys(" and more words never searched")
    Select(d.find_element(By.ID, "reranker")).select_by_value("none")
    _answered(d, before)
    assert d.find_element(By.ID, "query").get_attribute("value") == "a red square"
    assert d.current_url.endswith("?q=a%20red%20square&reranker=none"), d.current_url


def test_an_image_search_runs_again_with_a_new_re_ranker_or_the_same_file(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
    corpus: Path,
) -> None:
    """The same file chosen again sent nothing (the input kept its value, so no change
    event), and Search with the box empty was blocked by the box's `required`."""
    d = browser
    d.get(service.url + "/")
    d.execute_script(
        "window.sent = []; const real = window.fetch;"
        "window.fetch = (url, init) => { window.sent.push(url); return real(url, init); };"
    )
    image = str(corpus.parent / "images" / "0003.png")
    d.find_element(By.ID, "file").send_keys(image)
    status = _answered(d)
    entries = d.execute_script("return history.length")
    Select(d.find_element(By.ID, "reranker")).select_by_value("han")
    status = _answered(d, status)
    assert "the han re-ranker's own score" in _text(d, "legend")
    assert d.execute_script("return history.length") == entries  # in place of its entry
    d.find_element(By.ID, "file").send_keys(image)
    WebDriverWait(d, 30).until(lambda drv: len(drv.execute_script("return window.sent")) == 3)
    status = _answered(d, "searching…")
    d.find_element(By.ID, "search").click()
    WebDriverWait(d, 30).until(lambda drv: len(drv.execute_script("return window.sent")) == 4)
    assert d.execute_script("return window.sent") == ["/search/image"] * 4
    _answered(d, "searching…")
    assert d.execute_script("return history.length") == entries + 1  # the file chosen anew
    assert "captions" in _text(d, "status") and _text(d, "error") == ""


def test_a_refused_upload_hides_its_preview(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """It showed a broken-image icon above the 400."""
    fake = tmp_path / "notimg.png"
    fake.write_text("this is not a picture")
    d = browser
    d.get(service.url + "/")
    d.find_element(By.ID, "file").send_keys(str(fake))
    WebDriverWait(d, 30).until(lambda drv: _text(drv, "error"))
    assert "(400 invalid_image)" in _text(d, "error")
    assert not d.find_element(By.ID, "query-image").is_displayed()
    d.find_element(By.ID, "search").click()  # it uploaded the refused file again
    WebDriverWait(d, 10).until(lambda drv: "Type a sentence" in _text(drv, "error"))


def test_the_page_reads_aloud_and_weak_hits_keep_their_contrast(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    """The query box was named by its placeholder, results and errors were not announced,
    a thumbnail's alt was its id, and a weak card's text was faded to about 2:1."""
    d = browser
    d.get(service.url + "/")
    label = d.find_element(By.CSS_SELECTOR, "label[for=query]")
    assert "sentence" in label.get_attribute("textContent")
    assert d.find_element(By.ID, "status").get_attribute("aria-live") == "polite"
    assert d.find_element(By.ID, "error").get_attribute("role") == "alert"
    assert d.find_element(By.ID, "file").get_attribute("aria-label")
    _search(d, NO_FIT)  # fits nothing in the corpus: every hit weak
    _answered(d)
    card = d.find_element(By.CSS_SELECTOR, "#grid .hit.weak")
    caption = card.find_element(By.CSS_SELECTOR, ".cap").text
    assert card.find_element(By.TAG_NAME, "img").get_attribute("alt") == caption
    faded = d.execute_script(
        "const c = arguments[0]; return [c, c.querySelector('.cap')]"
        ".map((e) => getComputedStyle(e).opacity)",
        card,
    )
    assert faded == ["1", "1"], faded


def test_an_empty_or_blank_search_stays_refused_and_menu_keys_add_no_history(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
) -> None:
    """A search still in flight filled the page after "Type a sentence..." was shown for
    an emptied box; a box of spaces was sent (the service's 422); each arrow key on the
    re-ranker menu added an entry Back had to pass."""
    import time

    from selenium.webdriver.common.keys import Keys

    d = browser
    d.get(service.url + "/")
    _search(d, "two red circles")
    _answered(d)
    d.execute_script(
        "window.sent = 0; const real = window.fetch;"
        "window.fetch = (url, init) => { window.sent++;"
        "  return new Promise((ok) => setTimeout(ok, 1500)).then(() => real(url, init)); };"
    )
    _search(d, "two blue squares")
    box = d.find_element(By.ID, "query")
    box.clear()
    d.find_element(By.ID, "search").click()
    time.sleep(2.5)  # past the held-back answer
    assert "Type a sentence" in _text(d, "error")
    assert d.find_elements(By.CSS_SELECTOR, "#grid .hit") == []
    box.send_keys("   ")
    d.find_element(By.ID, "search").click()
    assert "Type a sentence" in _text(d, "error") and d.execute_script("return window.sent") == 1
    _search(d, "a small orange diamond")
    before = _answered(d, "searching…")
    entries = d.execute_script("return history.length")
    menu = d.find_element(By.ID, "reranker")
    menu.send_keys(Keys.DOWN)
    menu.send_keys(Keys.DOWN)
    _answered(d, before)
    time.sleep(2)
    assert d.execute_script("return history.length") == entries


def test_back_to_an_image_search_says_what_it_was(
    service: Service,  # noqa: F811
    browser: Any,  # noqa: F811
    corpus: Path,
) -> None:
    """It showed the bare page with no word of the search that stood there."""
    d = browser
    d.get(service.url + "/")
    d.find_element(By.ID, "file").send_keys(str(corpus.parent / "images" / "0005.png"))
    status = _answered(d)
    _search(d, "three small yellow circles")
    _answered(d, status)
    d.back()
    WebDriverWait(d, 10).until(lambda drv: "searched with an image" in _text(drv, "status"))
    assert "(0005.png)" in _text(d, "status") and not d.find_elements(By.CSS_SELECTOR, ".hit")


def test_the_menu_offers_the_deployments_re_rankers_and_names_its_default(
    index_dir: Path,
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The menu listed ce, late, han and none whatever the deployment offered: a CLIP + BLIP
    one (ce, none) answered late and han with a 422. It follows /readyz now."""
    from tests.conftest import start_service, stop_service

    svc = start_service(index_dir, tmp_path / "serve.log", DUET_RERANKER="none")
    try:
        d = browser
        d.get(svc.url + "/")
        menu = Select(d.find_element(By.ID, "reranker"))
        WebDriverWait(d, 10).until(lambda _: len(menu.options) == 2)
        assert [o.get_attribute("value") for o in menu.options] == ["", "none"]
        assert menu.options[0].text == "re-ranker: service default (none)"
    finally:
        stop_service(svc)
