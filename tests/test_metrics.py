"""GET /metrics on a live API (Prometheus text format, metrics/admin scope), the ops/ monitoring files, and Flower
watching a real job through our broker's task events."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from api.client import Client
from api.metrics import parse
from core import auth
from core.db import session_scope
from core.embedded import free_port
from tests.conftest import ROOT, Proc, qa_pairs, wait_for

OPS = ROOT / "ops"
METRIC_NAME = re.compile(r"\b(gpujobs_[a-z0-9_]+)\b")


def token(owner: str, *scopes: str) -> str:
    with session_scope() as session:
        return auth.create_token(session, owner=owner, scopes=list(scopes))


def scrape(url: str, secret: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.get(f"{url}/metrics", headers=headers, timeout=10)


def exported_names(text: str) -> set[str]:
    """Every name a PromQL expression may use: families (HELP/TYPE, even without samples) and their samples."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def ops_expressions() -> dict[str, str]:
    """Every PromQL expression in the alert rules and the Grafana dashboard, by where it is."""
    found = {}
    for group in yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            found[f"alerts.yml {rule['alert']}"] = rule["expr"]
    dashboard = json.loads((OPS / "grafana" / "gpujobs.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            found[f"gpujobs.json {panel['title']!r} {target['refId']}"] = target["expr"]
    return found


def test_metrics_need_the_metrics_or_admin_scope_and_ops_files_use_only_exported_names(
    jobs_env, api_server, redis_server
):
    """No token 401, a user token 403 (with the fix), metrics and admin tokens read it; every gpujobs_* name in
    alerts.yml and the Grafana dashboard is exported; a message waiting in Redis shows as queue depth."""
    url, admin, _ = api_server
    assert scrape(url, None).status_code == 401
    refused = scrape(url, token("bob", "user"))
    assert refused.status_code == 403 and "--scope metrics" in refused.json()["error"]["message"]
    redis_server.client().lpush("gpu2", "a message no worker takes")

    answer = scrape(url, token("prometheus", "metrics"))
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    assert scrape(url, admin).status_code == 200
    samples = parse(answer.text)
    assert samples["gpujobs_queue_depth"] == [({"queue": "cpu"}, 0.0)]  # gpu2 has no worker nor job: not known
    assert ({"state": "running"}, 0.0) in samples["gpujobs_jobs"]
    assert samples["gpujobs_redis_up"] == [({}, 1.0)]

    exported = exported_names(answer.text)
    expressions = ops_expressions()
    assert len(expressions) >= 15
    missing = {where: sorted(set(METRIC_NAME.findall(expr)) - exported) for where, expr in expressions.items()}
    assert not {k: v for k, v in missing.items() if v}, f"not exported by /metrics: {missing}"
    assert all(METRIC_NAME.search(expr) for expr in expressions.values())

    scrape_config = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
    gpujobs = next(c for c in scrape_config["scrape_configs"] if c["job_name"] == "gpujobs")
    assert gpujobs["metrics_path"] == "/metrics" and gpujobs["authorization"]["type"] == "Bearer"
    assert "alerts.yml" in scrape_config["rule_files"]


def start_flower(tmp_path, broker_url: str) -> tuple[str, Proc]:
    port = free_port()
    log = tmp_path / "flower.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "--broker",
                broker_url,
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
                "--basic-auth=ops:secret",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    proc = Proc(popen, log)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/healthcheck", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "Flower", procs=[proc])
    return url, proc


def test_a_finished_job_counts_in_metrics_and_flower_sees_its_task(
    tmp_path, jobs_env, api_server, spawn_worker, tiny_model, redis_server
):
    """A real job on a real worker: /metrics counts its job, rows and tokens and the live worker; `celery flower`
    against our broker lists the job's run_shard task as SUCCESS in /api/tasks."""
    url, admin, _ = api_server
    flower_url, flower = start_flower(tmp_path, jobs_env.redis_url)
    try:
        spawn_worker([])
        client = Client(url, admin)
        rows = tmp_path / "rows.jsonl"
        rows.write_text("".join(json.dumps({"prompt": q}) + "\n" for q, _ in qa_pairs()))
        job = client.submit({"model": str(tiny_model), "input": client.upload(rows)["id"], "max_new_tokens": 8})
        done = client.wait(job["id"], poll=0.3, timeout=120)
        assert done["state"] == "succeeded", done

        samples = parse(scrape(url, token("prometheus", "metrics")).text)
        assert ({"state": "succeeded"}, 1.0) in samples["gpujobs_jobs"]
        assert ({"state": "succeeded"}, float(len(qa_pairs()))) in samples["gpujobs_rows_processed_total"]
        tokens = dict((labels["kind"], value) for labels, value in samples["gpujobs_tokens_processed_total"])
        assert tokens["completion"] == done["tokens"]["completion"] > 0 and tokens["prompt"] > 0
        assert samples["gpujobs_tokens_per_second"][0][1] > 0  # finished within the last minute
        [(labels, up)] = samples["gpujobs_worker_up"]
        assert up == 1.0 and labels["slice"] == ""
        assert samples["gpujobs_worker_heartbeat_age_seconds"][0][1] < 30
        assert ({"state": "online"}, 1.0) in samples["gpujobs_workers"]

        def shard_task_succeeded() -> dict | None:
            tasks = httpx.get(f"{flower_url}/api/tasks", auth=("ops", "secret"), timeout=5).json()
            return next(
                (t for t in tasks.values() if t.get("name") == "gpujobs.run_shard" and t.get("state") == "SUCCESS"),
                None,
            )

        task = wait_for(shard_task_succeeded, 30, "Flower to list the finished run_shard task", procs=[flower])
        assert task["worker"] and time.time() - task["succeeded"] < 300
        assert httpx.get(f"{flower_url}/api/tasks", timeout=5).status_code == 401  # its API is not open
    finally:
        flower.stop()


@pytest.mark.parametrize("path", ["prometheus/prometheus.yml", "prometheus/alerts.yml"])
def test_ops_yaml_files_parse(path):
    """The Prometheus files are valid YAML (promtool is not in CI; the names are checked on a live API above)."""
    assert yaml.safe_load((OPS / path).read_text())
