"""The web page in headless Chromium (selenium): upload an indexed image, get the grid, top = itself."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest
from api_helpers import ADMIN_TOKEN, ServerThread, png_bytes

from api.app import create_app
from api.config import Settings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _chromium(tmp_path):
    """Headless Chromium with no network and its own profile (the flags the brief names)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager reach the network
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


@contextlib.contextmanager
def page_on(app, tmp_path):
    """`app` served on a loopback port and headless Chromium on its page: yields (driver, a 60 s wait,
    url)."""
    from selenium.webdriver.support.ui import WebDriverWait

    with ServerThread(app) as server:
        driver = _chromium(tmp_path)
        try:
            driver.get(server.url + "/")
            yield driver, WebDriverWait(driver, 60), server.url
        finally:
            driver.quit()


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless browser test needs Debian 'chromium' and 'chromium-driver' (make system-deps)",
)
def test_upload_shows_grid_with_the_item_first(tmp_path, api_index, api_dataset):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    report = tmp_path / "report.html"
    report.write_text("<html><body>evaluation report</body></html>")
    item = 23
    query = tmp_path / "query.png"
    query.write_bytes(png_bytes(api_dataset.image(item)))

    app = create_app(Settings(index_root=api_index["root"], admin_token=ADMIN_TOKEN, report_path=report))
    with page_on(app, tmp_path) as (driver, wait, url):
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#samples img.sample")) == 16)
        wait.until(ec.text_to_be_present_in_element((By.ID, "version"), api_index["version"]))
        link = driver.find_element(By.ID, "report-link")
        assert link.is_displayed() and link.get_attribute("href").endswith("/report")

        driver.find_element(By.ID, "file").send_keys(str(query))
        wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-count") is not None)
        cards = driver.find_elements(By.CSS_SELECTOR, "#results .result")
        assert len(cards) == 12  # the page's default k
        assert cards[0].get_attribute("data-id") == api_dataset.item_id(item)
        assert "similarity 1.0000" in cards[0].text or "similarity 0.9999" in cards[0].text
        assert driver.find_element(By.ID, "results").get_attribute("data-version") == api_index["version"]
        # probability bars are absolute: each bar's width is 100 p % (not scaled to the top hit), and the
        # peakedness line says how far the top hit is above uniform
        widths = driver.execute_script(
            "return Array.from(document.querySelectorAll('#results .bar.prob span')).map(s => s.style.width);"
        )
        probs = driver.execute_script(
            "return Array.from(document.querySelectorAll('#results .result')).map(c => c.innerText);"
        )
        shown = [float(t.split("probability ")[1].split()[0]) for t in probs]
        assert len(widths) == 12
        for w, p in zip(widths, shown):
            assert abs(float(w.rstrip("%")) - 100 * p) <= 0.06 + 0.01 * 100 * p
        assert "as probable as a random item" in driver.find_element(By.ID, "peakedness").text
        # thumbnails of the results actually loaded
        wait.until(
            lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#results img'))"
                ".every(i => i.complete && i.naturalWidth > 0)"
            )
        )

        # picking an indexed thumbnail searches with it: its own id comes first
        sample = driver.find_elements(By.CSS_SELECTOR, "#samples img.sample")[0]
        picked = sample.get_attribute("data-id")
        sample.click()
        first_id = "const c = document.querySelector('#results .result'); return c && c.dataset.id;"
        wait.until(lambda d: d.execute_script(first_id) == picked)  # JS: no stale element races
        # "similar to this" on the third card searches by that stored item: it comes back first
        third = driver.execute_script("return document.querySelectorAll('#results .result')[2].dataset.id;")
        driver.execute_script("document.querySelectorAll('#results .result button.similar')[2].click();")
        wait.until(lambda d: d.execute_script(first_id) == third)
        driver.save_screenshot(str(tmp_path / "web_page.png"))

        # the API docs render from packaged files (no CDN: this browser has no network): Swagger UI
        # lists the search routes, ReDoc renders the title and an operation
        driver.get(url + "/docs")
        wait.until(
            lambda d: d.execute_script("return document.querySelectorAll('.swagger-ui .opblock').length") >= 5
        )
        paths = driver.execute_script(
            "return Array.from(document.querySelectorAll('.opblock-summary-path')).map(e => e.innerText);"
        )
        assert any("/v1/search/item" in p for p in paths), paths
        driver.get(url + "/redoc")
        wait.until(
            lambda d: d.execute_script(
                "return !!document.querySelector('redoc h1') && document.body.innerText.includes('search')"
            )
        )
    assert (tmp_path / "web_page.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless browser test needs Debian 'chromium' and 'chromium-driver' (make system-deps)",
)
def test_filter_threshold_and_pages_on_a_folder_index(tmp_path, folder_index):
    """Class picker (from GET /v1/index), path prefix, probability threshold and pages, in the browser."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    ids_js = "return Array.from(document.querySelectorAll('#results .result')).map(c => c.dataset.id);"
    app = create_app(Settings(index_root=folder_index["root"], admin_token=ADMIN_TOKEN))
    with page_on(app, tmp_path) as (driver, wait, url):
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#filter-class option")) == 4)
        Select(driver.find_element(By.ID, "filter-class")).select_by_value("class1")
        driver.find_element(By.ID, "file").send_keys(str(folder_index["folder"] / folder_index["ids"][0]))
        wait.until(
            lambda d: (
                (ids := d.execute_script(ids_js))
                and len(ids) == 12
                and all(i.startswith("class1/") for i in ids)
            )
        )
        assert "20 match the filter" in driver.find_element(By.ID, "result-meta").text
        first_page = driver.execute_script(ids_js)
        driver.find_element(By.ID, "next-page").click()  # results 13..20 of the 20 in class1
        wait.until(lambda d: (ids := d.execute_script(ids_js)) and ids != first_page and len(ids) == 8)
        assert set(driver.execute_script(ids_js)).isdisjoint(first_page)
        assert driver.find_element(By.ID, "next-page").get_attribute("disabled") is not None
        # a path prefix on top of the class: nothing else matches; then a threshold cuts the page short
        Select(driver.find_element(By.ID, "filter-class")).select_by_value("")
        prefix = driver.find_element(By.ID, "filter-prefix")
        prefix.send_keys("class2/")
        prefix.send_keys("\t")  # change event
        wait.until(
            lambda d: (
                (ids := d.execute_script(ids_js))
                and all(i.startswith("class2/") for i in ids)
                and len(ids) == 12
            )
        )
        texts_js = "return Array.from(document.querySelectorAll('#results .result')).map(c => c.innerText);"
        shown = [float(t.split("probability ")[1].split()[0]) for t in driver.execute_script(texts_js)]
        j = next(j for j in range(2, 11) if shown[j] > shown[j + 1])  # a cut between two distinct values
        threshold = driver.find_element(By.ID, "min-probability")
        threshold.send_keys(f"{(shown[j] + shown[j + 1]) / 2:.6g}")
        threshold.send_keys("\t")
        wait.until(lambda d: len(d.execute_script(ids_js)) == j + 1)
        # one short page: the pager is hidden (and, since the hidden attribute now wins, not shown)
        assert "results 1–%d" % (j + 1) in driver.find_element(By.ID, "page-info").get_attribute(
            "textContent"
        )
        assert not driver.find_element(By.ID, "pager").is_displayed()


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless browser test needs Debian 'chromium' and 'chromium-driver' (make system-deps)",
)
def test_page_hides_what_is_hidden_scales_bars_zero_to_one_and_explains_an_empty_cut_off(
    tmp_path, folder_index
):
    """Before a search no hidden element shows (no broken query-image icon, no page buttons); the similarity
    bar is max(s, 0) on a labelled 0..1 scale; a cut-off that leaves nothing says so and what to do."""
    from selenium.webdriver.common.by import By

    cards_js = (
        "return Array.from(document.querySelectorAll('#results .result')).map(c => ({id: c.dataset.id, "
        "s: parseFloat(c.dataset.similarity), p: parseFloat(c.dataset.probability), "
        "sim: c.querySelector('.bar.sim span').style.width, "
        "prob: c.querySelector('.bar.prob span').style.width}));"
    )
    app = create_app(Settings(index_root=folder_index["root"], admin_token=ADMIN_TOKEN))
    with page_on(app, tmp_path) as (driver, wait, url):
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#samples img.sample")) == 16)
        wait.until(
            lambda d: d.execute_script(
                "return Array.from(document.querySelectorAll('#samples img')).every(i => i.complete)"
            )
        )
        shown = driver.execute_script(
            "return Array.from(document.querySelectorAll('[hidden]'))"
            ".filter(e => getComputedStyle(e).display !== 'none').map(e => e.id || e.tagName);"
        )
        assert shown == [], f"elements with the hidden attribute are displayed: {shown}"
        assert not driver.find_element(By.ID, "query-preview").is_displayed()
        assert not driver.find_element(By.ID, "pager").is_displayed()
        assert not driver.find_element(By.ID, "prev-page").is_displayed()
        broken = driver.execute_script(
            "return Array.from(document.images).filter(i => i.getClientRects().length && "
            "(!i.getAttribute('src') || (i.complete && i.naturalWidth === 0))).map(i => i.id || i.alt);"
        )
        assert broken == [], f"broken images on the page before any search: {broken}"

        k = driver.find_element(By.ID, "k")  # every item: the far ones have the lowest cosines
        k.clear()
        k.send_keys("60")
        driver.find_elements(By.CSS_SELECTOR, "#samples img.sample")[0].click()
        wait.until(lambda d: len(d.execute_script(cards_js)) == 60)
        cards = driver.execute_script(cards_js)
        assert driver.find_element(By.ID, "query-preview").is_displayed()
        # the query is a random sample: any card but its own (s < 0.99) tells (s+1)/2 from max(s, 0) by
        # > 0.5 points
        assert min(c["s"] for c in cards) < 0.99, cards
        for c in cards:  # the bar is the cosine itself on 0..1 (negatives empty), the probability itself
            assert abs(float(c["sim"].rstrip("%")) - 100 * max(c["s"], 0.0)) <= 0.051, c
            assert abs(float(c["prob"].rstrip("%")) - 100 * c["p"]) <= 0.051, c
        legend = driver.find_element(By.ID, "bar-legend")
        assert (
            legend.is_displayed() and "cosine similarity" in legend.text and "0 (empty) to 1" in legend.text
        )

        # a cut-off above every hit's probability: nothing passes, and the page says why and what to do
        top = max(c["p"] for c in cards)
        assert top < 1.0
        cut = f"{(top + 1.0) / 2:.6f}"
        assert float(cut) > top
        box = driver.find_element(By.ID, "min-probability")
        box.send_keys(cut)
        box.send_keys("\t")  # change event
        wait.until(lambda d: d.find_element(By.ID, "results").get_attribute("data-count") == "0")
        note = driver.find_element(By.ID, "no-results").text
        assert f"no result above the cut-off p ≥ {cut}" in note and "lower it" in note, note
        assert "cut-off" in driver.find_element(By.ID, "status").text
        body = driver.find_element(By.TAG_NAME, "body").text
        assert "results 1–0" not in body and not driver.find_element(By.ID, "bar-legend").is_displayed()
        assert not driver.find_element(By.ID, "pager").is_displayed()
