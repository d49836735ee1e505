"""The fine-tune CLI through a real API server and worker: `submit finetune --spec … --wait`, `status`,
`adapters list/show`, and `adapters export --merged`, whose model loads with plain AutoModelForCausalLM and gives
the memorized answers."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from api.client import Client
from tests.conftest import ROOT, qa_pairs
from tests.test_e2e import jobs


@pytest.fixture
def cli_env(jobs_env, api_server):
    url, token, _ = api_server
    return dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)


def test_submit_finetune_then_list_show_and_export_the_merged_adapter(tmp_path, cli_env, spawn_worker, base_model):
    spawn_worker([])
    submitted = jobs(
        cli_env,
        "submit",
        "finetune",
        "--spec",
        str(ROOT / "examples" / "finetune.yaml"),
        "--model",
        str(base_model),
        "--input",
        str(ROOT / "examples" / "finetune_qa.jsonl"),
        "--gpus",
        "0",
        "--wait",
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    status = jobs(cli_env, "status", job_id, check=True).stdout
    assert "succeeded" in status and "training step 60/60" in status
    listed = json.loads(jobs(cli_env, "adapters", "list", "--json", check=True).stdout)
    assert [a["id"] for a in listed] == [job_id] and listed[0]["lora_config"]["r"] == 16
    assert "trained    60 steps, fp32" in jobs(cli_env, "adapters", "show", job_id, check=True).stdout
    missing = jobs(cli_env, "adapters", "show", "job_000000000000")
    assert missing.returncode != 0 and "no adapter 'job_000000000000'" in missing.stderr

    out = tmp_path / "merged"
    exported = jobs(cli_env, "adapters", "export", job_id, str(out), "--merged")
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.tinymodel import generate_answers

    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    tok.padding_side = "left"
    assert not any("lora" in name for name, _ in model.named_parameters())
    answers = generate_answers(model, tok, [q for q, _ in qa_pairs()], max_new_tokens=16)
    assert sum(got == want for got, (_, want) in zip(answers, qa_pairs())) >= 5, answers


def test_then_generate_with_wait_prints_and_waits_for_both_and_status_shows_training(
    tmp_path, cli_env, spawn_worker, base_model
):
    """`submit finetune --then-generate … --wait` prints the fine-tune's id then the chained job's, returns once
    both ended and exits with the chain's code; `status` of the fine-tune shows step, epoch, loss and training tok/s,
    and none of a generation job's fields (tokens, tok/s of output, first result)."""
    spawn_worker([])
    spec = tmp_path / "ft.yaml"
    spec.write_text(
        json.dumps({"then_generate": {"input": str(ROOT / "examples" / "prompts.jsonl"), "max_new_tokens": 4}})
    )
    submitted = jobs(
        cli_env,
        "submit",
        "finetune",
        "--spec",
        str(spec),
        "--model",
        str(base_model),
        "--input",
        str(ROOT / "examples" / "finetune_qa.jsonl"),
        "--gpus",
        "0",
        "--max-steps",
        "3",
        "--batch-size",
        "12",
        "--wait",
    )
    assert submitted.returncode == 0, submitted.stderr
    ft_id, gen_id = submitted.stdout.split()
    ft = json.loads(jobs(cli_env, "status", ft_id, "--json", check=True).stdout)
    gen = json.loads(jobs(cli_env, "status", gen_id, "--json", check=True).stdout)
    assert ft["metrics"]["then_generate_job"] == gen_id and gen["spec"]["adapter"] == ft_id
    assert ft["state"] == gen["state"] == "succeeded" and gen["rows"]["succeeded"] == gen["rows"]["total"] > 0
    assert "output_tok_s" not in ft["metrics"] and "time_to_first_result_s" not in ft["metrics"]
    status = jobs(cli_env, "status", ft_id, check=True).stdout
    assert "training step 3/3, epoch" in status and "loss " in status and "training tok/s" in status, status
    assert "  tokens " not in status and "first    result" not in status and ", 0.0 tok/s" not in status, status


def test_results_of_a_finetune_are_refused_naming_its_adapter_chained_job_and_error(cli_env, api_server, base_model):
    """A fine-tune generates no rows: `results` (HTTP 409) names its adapter and its then_generate job, exits 2 and
    writes nothing; `--errors` of a failed one gives its error once, not once per training row; its OpenAI output
    file does not exist (404), as it is no batch."""
    import httpx

    from core import leases
    from core.db import session_scope
    from core.models import Shard

    url, token, _ = api_server
    client = Client(url, token)
    prompts = str(ROOT / "examples" / "prompts.jsonl")
    spec = {"kind": "finetune", "model": str(base_model), "gpus": 0, "max_steps": 3, "then_generate": prompts}
    ft = client.submit(spec, input=ROOT / "examples" / "finetune_qa.jsonl")  # no worker: it stays queued
    chained = ft["metrics"]["then_generate_job"]
    refused = jobs(cli_env, "results", ft["id"])
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert refused.stderr.splitlines() == [
        f"Error: job {ft['id']} is a fine-tune: it has no generated rows (its then_generate job {chained} holds the "
        f"generations: `gpujobs results {chained}`); once it succeeds, its adapter is GET /adapters/{ft['id']} "
        f"(`gpujobs adapters show {ft['id']}`)"
    ]
    headers = {"Authorization": f"Bearer {token}"}
    answer = httpx.get(f"{url}/jobs/{ft['id']}/results", params={"format": "openai"}, headers=headers)
    assert answer.status_code == 409 and answer.json()["error"]["type"] == "WrongKind"
    for path in (
        f"/v1/files/{ft['id']}-output",
        f"/v1/files/{ft['id']}-output/content",
        f"/v1/files/{ft['id']}-errors",
    ):
        answer = httpx.get(url + path, headers=headers)
        assert answer.status_code == 404 and "not an OpenAI batch" in answer.json()["error"]["message"], path

    reason = "12 row(s) are longer than max_seq_length=8 tokens: raise max_seq_length"
    with session_scope() as session:  # as a worker that refuses the training data does (core/leases.py)
        [shard_id] = session.scalars(select(Shard.id).where(Shard.job_id == ft["id"])).all()
    leases.fail(shard_id, reason)
    assert client.job(ft["id"])["state"] == "failed"
    errors = jobs(cli_env, "results", ft["id"], "--errors")
    assert errors.returncode == 2 and errors.stdout == "", errors.stderr
    assert errors.stderr.count(reason) == 1 and "failed and registered no adapter" in errors.stderr


def test_a_finetune_refused_for_its_spec_is_not_retried_but_one_out_of_memory_is(cli_env, api_server, base_model):
    """A fine-tune the worker refused for its spec and input (`core.errors.CannotTrain`, as worker/training/ raises
    it: test_finetune.py runs each on a real worker) is not retried: `retry` exits 2 (HTTP 409) saying why the same
    spec fails again and to submit a new job, and the job stays failed; one that ran out of memory is retried."""
    import httpx

    from core import leases
    from core.db import session_scope
    from core.errors import CannotTrain
    from core.models import Shard

    url, token, _ = api_server
    client = Client(url, token)

    def failed(reason: str) -> str:  # no worker: the job stays queued until its shard fails as a worker's would
        ft = client.submit(
            {"kind": "finetune", "model": str(base_model), "gpus": 0}, input=ROOT / "examples" / "finetune_qa.jsonl"
        )
        with session_scope() as session:
            [shard_id] = session.scalars(select(Shard.id).where(Shard.job_id == ft["id"])).all()
        leases.fail(shard_id, reason)
        assert client.job(ft["id"])["state"] == "failed"
        return ft["id"]

    refusal = str(CannotTrain("target_modules ['w_nope'] do not exist in M: its linear layers are ['q_proj']"))
    refused = failed(refusal)
    retried = jobs(cli_env, "retry", refused)
    assert retried.returncode == 2 and retried.stdout == "", retried.stderr
    assert retried.stderr.splitlines() == [
        f"Error: fine-tune {refused} cannot be retried: the worker refused its spec and input before training "
        "(target_modules ['w_nope'] do not exist in M: its linear layers are ['q_proj']), and a retry runs the same "
        "spec on the same rows, so it would be refused the same way. Submit a new fine-tune with the change the "
        f"error names (`gpujobs status {refused} --json` shows this one's spec)"
    ]
    answer = httpx.post(f"{url}/jobs/{refused}/retry", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 409 and answer.json()["error"]["type"] == "NothingToRetry"
    assert client.job(refused)["state"] == "failed" and client.job(refused)["retries"] == 0

    out_of_memory = failed("failed 3 times; last error: torch.OutOfMemoryError: CUDA out of memory")
    retried = jobs(cli_env, "retry", out_of_memory)
    assert retried.returncode == 0 and retried.stdout.strip() == out_of_memory, retried.stderr
    assert client.job(out_of_memory)["state"] == "running" and client.job(out_of_memory)["retries"] == 1
