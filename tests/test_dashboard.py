"""The web dashboard in headless Chromium (Debian `chromium` + `chromium-driver`, driven by selenium) on a running
stack: a real API, a real worker and a real 200-row job."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import httpx
import pytest

from api.client import Client
from tests.conftest import wait_for
from tests.services import require_service

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def start_browser(profile: Path, downloads: Path):
    """Headless Chromium with its own profile folder (its history database is read by a test) that saves downloads
    into `downloads` without asking."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        require_service("chromium", "install the Debian packages chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_experimental_option(
        "prefs",
        {
            "download.default_directory": str(downloads),
            "download.prompt_for_download": False,
            "profile.default_content_setting_values.automatic_downloads": 1,  # several downloads from one page
        },
    )
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    return driver


@pytest.fixture
def browser(tmp_path):
    (tmp_path / "downloads").mkdir()
    driver = start_browser(tmp_path / "chromium", tmp_path / "downloads")
    yield driver
    driver.quit()


def text(driver, css: str) -> str | None:
    """The element's text, or None while there is none."""
    return _read(driver, css, lambda element: element.text)


def attribute(driver, css: str, name: str) -> str | None:
    return _read(driver, css, lambda element: element.get_attribute(name))


def _read(driver, css: str, read):
    """`read` of the element, found again when the page re-rendered between finding it and reading it (the page
    replaces its DOM on every poll: a read right after a wait can meet the element the poll just replaced)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    for _ in range(100):  # each try finds the element anew: only a page re-rendering without pause exhausts this
        try:
            return read(driver.find_element("css selector", css))
        except NoSuchElementException:
            return None
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{css} was replaced 100 times while being read")


GREEN, RED, GREY, BLUE = "rgb(26, 127, 55)", "rgb(207, 34, 46)", "rgb(140, 149, 159)", "rgb(47, 128, 237)"


def colour(driver, css: str) -> str:
    return driver.execute_script(f"return getComputedStyle(document.querySelector({css!r})).backgroundColor")


def width(driver, css: str) -> float:
    return driver.execute_script(f"return document.querySelector({css!r}).getBoundingClientRect().width")


def saved(folder: Path, name: str) -> bytes:
    """The bytes of a file the browser downloaded into `folder`, once it is whole."""
    path = folder / name
    wait_for(lambda: path.exists() and not list(folder.glob("*.crdownload")), 30, f"the download of {name}")
    return path.read_bytes()


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
    row = text(browser, f'tr[data-job="{job["id"]}"]')
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

    # finished: the run's final figures, an ETA that says why it is a dash, a chart whose average is the card's
    metrics = final["metrics"]
    wait_for(lambda: text(browser, "#job-eta") == "— finished", 20, "the ETA of a finished job")
    assert float(text(browser, "#job-rate")) == metrics["output_tok_s"] > 0
    assert float(text(browser, "#job-rows-rate")) == metrics["rows_per_s"] > 0
    assert float(text(browser, "#throughput-average")) == metrics["output_tok_s"]  # the chart's average is the card's
    intervals = httpx.get(f"{url}/jobs/{job['id']}/throughput", headers={"Authorization": f"Bearer {token}"}).json()
    assert int(attribute(browser, "#throughput", "data-intervals")) == len(intervals["points"]) >= 2
    seconds = sum(p["seconds"] for p in intervals["points"])  # every interval, from the start to the end
    assert seconds == pytest.approx(metrics["duration_s"]) and intervals["tokens"] == final["tokens"]["completion"]
    weighted = sum(p["tokens_per_s"] * p["seconds"] for p in intervals["points"]) / seconds
    assert weighted == pytest.approx(metrics["output_tok_s"], rel=1e-3)  # what the steps show averages to the card
    assert colour(browser, ".card .bar .ok-done") == GREEN
    browser.save_screenshot(str(tmp_path / "dashboard.png"))

    # results download from the page exactly as the CLI and the client give them
    downloads = tmp_path / "downloads"
    for button, name, params in (
        ("#download-jsonl", f"{job['id']}.jsonl", {}),
        ("#download-csv", f"{job['id']}.csv", {"format": "csv"}),
        ("#download-errors", f"{job['id']}-errors.jsonl", {"errors": True}),
    ):
        browser.execute_script(f"document.querySelector('{button}').click()")
        assert saved(downloads, name) == b"".join(client.download(job["id"], **params)), name
    browser.execute_script("const box = document.querySelector('#with-input'); box.click();")
    browser.execute_script("document.querySelector('#download-jsonl').click()")
    with_input = saved(downloads, f"{job['id']}-with-input.jsonl")
    assert with_input == b"".join(client.download(job["id"], with_input=True))
    assert json.loads(with_input.splitlines()[0])["prompt"] == "row 0: tell me a story"

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
    assert "training tok/s" in text(browser, f'tr[data-job="{job["id"]}"]')
    browser.get(f"{url}/dashboard#/jobs/{job['id']}")
    wait_for(lambda: text(browser, "#job-step") == "4", 20, "the fine-tune's last step")
    assert float(text(browser, "#job-loss")) > 0 and float(text(browser, "#job-epoch")) > 0
    ended = client.job(job["id"])  # ended: the run's rate, as status and adapters show give it, not the last step's
    assert float(text(browser, "#job-train-rate")) == ended["metrics"]["training"]["train_tokens_per_s"]
    assert text(browser, "#job-eta") == "— finished"
    page = browser.page_source
    assert "Training loss" in page and "<path" in page
    assert "Throughput over time" not in page and "output tokens" not in page and 'id="job-rate"' not in page
    more = wait_for(lambda: text(browser, "#events-more"), 10, "the note that older events exist")
    assert "The newest 200 of this run's" in more and f"gpujobs events {job['id']}" in more
    assert text(browser, "#job-adapter") == job["id"] and "trains adapter" in browser.page_source
    browser.save_screenshot(str(tmp_path / "dashboard-finetune.png"))

    # a generation job on the adapter shows it, on its page and in the jobs list
    prompts = ROOT / "examples" / "prompts.jsonl"
    generate = client.submit(
        {"model": str(base_model), "gpus": 0, "adapter": job["id"], "max_new_tokens": 4}, input=prompts
    )
    browser.get(f"{url}/dashboard#/jobs/{generate['id']}")
    assert wait_for(lambda: text(browser, "#job-adapter"), 20, "the generation job's adapter") == job["id"]
    browser.get(f"{url}/dashboard#/jobs")
    listed = wait_for(lambda: text(browser, f'tr[data-job="{generate["id"]}"]'), 20, "the generation job's row")
    assert f"adapter {job['id']}" in listed


def test_gpujobs_dashboard_signs_in_once_and_no_url_log_or_history_keeps_the_token(tmp_path, jobs_env, api_server):
    """`gpujobs dashboard` prints a link that signs the browser in with the CLI's token; the address bar and the
    browser's history database never hold the token (only the code, which then opens nothing: a second opening is
    refused with what to do), nor does the server's access log hold the token or the code; a code lives in Redis
    for at most 60 s."""
    import redis

    from core.settings import get_settings
    from tests.test_e2e import jobs

    url, token, api = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    printed = jobs(env, "dashboard", check=True)
    link = printed.stdout.strip()
    assert link.startswith(f"{url}/dashboard#code=") and token not in link and "works" not in link
    assert "signs in once, within 60 s" in printed.stderr
    code = link.split("#code=", 1)[1]
    ttl = [redis.Redis.from_url(get_settings().redis_url).ttl(k) for k in _signin_keys()]
    assert len(ttl) == 1 and 0 < ttl[0] <= 60

    (tmp_path / "downloads").mkdir()
    browser = start_browser(tmp_path / "chromium", tmp_path / "downloads")
    try:
        browser.get(link)
        wait_for(lambda: text(browser, "#jobs") is not None, 20, "the jobs list, signed in by the link")
        assert browser.current_url == f"{url}/dashboard#/jobs"
        assert browser.execute_script("return localStorage.getItem('gpujobs.token')") == token
        assert _signin_keys() == []  # redeemed: the code is gone from Redis
        browser.execute_script("localStorage.clear()")  # a browser without the token opens the same link again
        browser.get("about:blank")
        browser.get(link)
        refused = wait_for(lambda: text(browser, "#signin-error"), 20, "the refusal of a used link")
        assert refused == (
            "this sign-in link was used already or has expired (a link works once, within 60 s): run "
            "`gpujobs dashboard` again, or paste a token"
        )
        assert browser.execute_script("return localStorage.getItem('gpujobs.token')") is None
    finally:
        browser.quit()  # writes the history database out
    with sqlite3.connect(tmp_path / "chromium" / "Default" / "History") as history:
        urls = [u for (u,) in history.execute("SELECT url FROM urls")]
    assert any(code in u for u in urls)  # Chromium keeps the URL a page was opened with, replaceState or not ...
    assert not any(token in u for u in urls)  # ... so it holds only the dead code, never the token
    logged = api.log.read_text()
    assert "POST /dashboard/session" in logged and "GET /dashboard " in logged  # the access log is on
    assert token not in logged and code not in logged


def _signin_keys() -> list[bytes]:
    import redis

    from core.settings import get_settings

    return list(redis.Redis.from_url(get_settings().redis_url).scan_iter("gpujobs:signin:*"))


def test_a_finished_jobs_page_shows_its_outcome_and_final_figures(tmp_path, jobs_env, api_server, browser, monkeypatch):
    """Bars take the outcome's colour: a job whose every row failed is red, a success green, a live job blue; a
    finished job shows its run's rows/s and tok/s and an ETA dash saying why; a run shorter than a second draws
    its one interval at the card's rate. (Rows and shards are written as a worker's commits would be.)"""
    from core.db import session_scope
    from core.jobs import maybe_finalize
    from core.models import Job, JobRow, Shard
    from core.store import now
    from tests.test_bad_input import fake_model

    url, token, _ = api_server
    client = Client(url, token)
    model = str(fake_model(tmp_path / "model"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    ids = {name: client.submit({"model": model, "gpus": 0}, input=rows)["id"] for name in ("failed", "short", "live")}
    with session_scope() as session:
        start = now() - 0.5
        for name in ("failed", "short"):
            session.get(Job, ids[name]).started_at = start
            for row in session.query(JobRow).filter_by(job_id=ids[name]):
                row.state, row.worker = ("failed", "w1") if name == "failed" else ("succeeded", "w1")
                row.finished_at, row.completion_tokens = start + 0.1 * (row.idx + 1), 5
                row.output, row.error = ("x", None) if name == "short" else (None, "engine broke")
            for shard in session.query(Shard).filter_by(job_id=ids[name]):
                shard.state = "failed" if name == "failed" else "succeeded"
                shard.error = "engine broke" if name == "failed" else None
    # the runs end 0.5 s after their start, however long the writes above took on a busy machine (the figures
    # below are of that duration: 15 tokens in 0.5 s)
    with monkeypatch.context() as patch, session_scope() as session:
        patch.setattr("core.jobs.now", lambda: start + 0.5)
        assert maybe_finalize(session, ids["failed"]) and maybe_finalize(session, ids["short"])
    failed, short = client.job(ids["failed"]), client.job(ids["short"])
    assert (failed["state"], failed["rows"]["failed"], short["state"]) == ("failed", 3, "succeeded")

    sign_in(browser, url, token)
    wait_for(lambda: all(i in (text(browser, "#jobs") or "") for i in ids.values()), 20, "the jobs in the list")
    bar = 'tr[data-job="{}"] .bar .{}'
    assert colour(browser, bar.format(ids["failed"], "bad")) == RED
    assert width(browser, bar.format(ids["failed"], "bad")) == pytest.approx(140, abs=1)
    assert width(browser, bar.format(ids["failed"], "ok-ended")) == 0
    assert colour(browser, bar.format(ids["short"], "ok-done")) == GREEN
    assert width(browser, bar.format(ids["short"], "ok-done")) == pytest.approx(140, abs=1)
    assert colour(browser, bar.format(ids["live"], "ok-live")) == BLUE

    browser.get(f"{url}/dashboard#/jobs/{ids['short']}")
    wait_for(lambda: text(browser, "#job-eta") == "— finished", 20, "the finished job's ETA")
    assert float(text(browser, "#job-rate")) == short["metrics"]["output_tok_s"] == pytest.approx(15 / 0.5, rel=0.2)
    assert float(text(browser, "#job-rows-rate")) == short["metrics"]["rows_per_s"]
    assert attribute(browser, "#throughput", "data-intervals") == "1"
    assert float(text(browser, "#throughput-average")) == short["metrics"]["output_tok_s"]
    assert text(browser, "#throughput-note") == "one interval: the run was too short to show a change over time"
    browser.save_screenshot(str(tmp_path / "dashboard-short.png"))

    browser.get(f"{url}/dashboard#/jobs/{ids['failed']}")
    wait_for(lambda: text(browser, "#job-state") == "failed", 20, "the failed job's page")
    assert colour(browser, ".card .bar .bad") == RED and text(browser, "#job-eta") == "— failed"
    assert float(text(browser, "#job-rows-rate")) == failed["metrics"]["rows_per_s"] > 0
    browser.get(f"{url}/dashboard#/jobs/{ids['live']}")
    wait_for(lambda: text(browser, "#job-state") == "running", 20, "the live job's page")
    assert text(browser, "#job-eta") == "— not started yet"  # no worker: its shard waits in the queue
    assert text(browser, "#throughput") == "Throughput over time\nno rows finished in this run yet"
