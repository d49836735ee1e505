"""The web dashboard in headless Chromium (Debian `chromium` + `chromium-driver`, driven by selenium) on a running
stack: a real API, a real worker and a real 200-row job."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from api.client import Client
from tests.conftest import wait_for
from tests.services import require_service

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        require_service("chromium", "install the Debian packages chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def text(driver, css: str) -> str | None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        return driver.find_element("css selector", css).text
    except (NoSuchElementException, StaleElementReferenceException):
        return None


def sign_in(driver, url: str, token: str) -> None:
    driver.get(f"{url}/dashboard")
    wait_for(lambda: text(driver, "#signin") is not None, 20, "the sign-in form")
    driver.find_element("css selector", "#token").send_keys(token)
    driver.find_element("css selector", "#signin").click()


def test_dashboard_shows_a_running_job_live_and_matches_the_api(
    tmp_path, jobs_env, api_server, spawn_worker, tiny_model, browser
):
    """Signed in with a token, the job page's done-count rises from one read to the next, always within what
    the API said just before and just after; at the end it equals the API's; the jobs list shows state and owner,
    the workers page the live worker; a bad token is refused with a message. Screenshots in the test's tmp dir."""
    url, token, _ = api_server
    sign_in(browser, url, "jt_wrong")
    assert wait_for(lambda: text(browser, "#signin-error"), 20, "the refusal of a bad token").startswith("the token")

    spawn_worker([], JOBS_TEST_FAULTS="sleep_0.2@batch")  # >= 10 s for 50 commits, whatever the engine's speed
    client = Client(url, token)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"row {i}: tell me a story"}) + "\n" for i in range(200)))
    job = client.submit(
        {"model": str(tiny_model), "max_new_tokens": 16, "ignore_eos": True, "batch_rows": 4}, input=data
    )
    sign_in(browser, url, token)
    wait_for(lambda: job["id"] in (text(browser, "#jobs") or ""), 20, "the job in the jobs list")
    row = browser.find_element("css selector", f'tr[data-job="{job["id"]}"]').text
    assert "alice" in row and any(s in row for s in ("queued", "validating", "running"))

    browser.get(f"{url}/dashboard#/jobs/{job['id']}")
    api_done = lambda: (lambda j: j["rows"]["succeeded"] + j["rows"]["failed"])(client.job(job["id"]))  # noqa: E731
    wait_for(lambda: int(text(browser, "#job-done") or 0) > 0, 120, "the first finished rows on the job page")

    def shown() -> int | None:  # None while the page redraws the element
        value = text(browser, "#job-done")
        return int(value) if value and value.isdigit() else None

    def bracketed_read(above: int) -> int:
        """The first count the page draws that is at least the API's just before and above `above`; it never exceeds
        the API's just after (the page shows what the API said, never more)."""
        before = api_done()
        value = wait_for(
            lambda: (v := shown()) is not None and v >= before and v > above and v,
            120,
            f"the page to draw a count of at least {before} and above {above}",
        )
        after = api_done()
        assert before <= value <= after, (before, value, after)
        return value

    first = bracketed_read(0)
    assert first < 200, "the job ended before the page showed it running"  # >= 10 s of commits (the fault's sleeps)
    second = bracketed_read(first)
    assert 0 < first < second <= 200, (first, second)
    browser.save_screenshot(str(tmp_path / "dashboard-running.png"))

    final = client.wait(job["id"], poll=0.5, timeout=180)
    assert final["state"] == "succeeded"
    wait_for(lambda: text(browser, "#job-state") == "succeeded", 60, "the page to show the finished job")
    assert int(text(browser, "#job-done")) == api_done() == 200 == int(text(browser, "#job-total"))
    assert "Throughput over time" in browser.page_source and "<path" in browser.page_source
    assert "loaded" in text(browser, "#events")  # the model-load event
    browser.save_screenshot(str(tmp_path / "dashboard.png"))

    browser.get(f"{url}/dashboard#/workers")
    workers = wait_for(lambda: text(browser, "#workers"), 10, "the workers table")
    assert "online" in workers and "CPU" in workers
    assert httpx.get(f"{url}/jobs/{job['id']}/throughput", headers={"Authorization": f"Bearer {token}"}).json()[
        "points"
    ]


def test_a_finetune_page_shows_training_not_generation(
    tmp_path, jobs_env, api_server, spawn_worker, base_model, browser
):
    """A fine-tune's page shows step, epoch, loss, training tok/s and ETA cards and its loss curve, not a generation
    job's output tokens, tok/s and throughput chart; the jobs list gives its training tok/s; an events table cut
    at 200 says so."""
    from tests.conftest import ROOT

    url, token, _ = api_server
    spawn_worker([])
    client = Client(url, token)
    job = client.submit(
        {
            "kind": "finetune",
            "model": str(base_model),
            "gpus": 0,
            "max_steps": 4,
            "batch_size": 12,
            "learning_rate": 1e-2,
            "lr_scheduler": "constant",
        },
        input=ROOT / "examples" / "finetune_qa.jsonl",
    )
    assert client.wait(job["id"], poll=0.5, timeout=300)["state"] == "succeeded"
    from core.db import session_scope
    from core.store import add_event

    with session_scope() as session:  # more events than the page's table holds: it says so
        for i in range(210):
            add_event(session, job["id"], f"note {i}")
    sign_in(browser, url, token)
    wait_for(lambda: job["id"] in (text(browser, "#jobs") or ""), 20, "the job in the jobs list")
    assert "training tok/s" in browser.find_element("css selector", f'tr[data-job="{job["id"]}"]').text
    browser.get(f"{url}/dashboard#/jobs/{job['id']}")
    wait_for(lambda: text(browser, "#job-step") == "4", 20, "the fine-tune's last step")
    assert float(text(browser, "#job-loss")) > 0 and float(text(browser, "#job-epoch")) > 0
    assert float(text(browser, "#job-train-rate")) > 0
    page = browser.page_source
    assert "Training loss" in page and "<path" in page
    assert "Throughput over time" not in page and "output tokens" not in page and 'id="job-rate"' not in page
    more = wait_for(lambda: text(browser, "#events-more"), 10, "the note that older events exist")
    assert "The newest 200 of this run's" in more and f"gpujobs events {job['id']}" in more
    browser.save_screenshot(str(tmp_path / "dashboard-finetune.png"))
