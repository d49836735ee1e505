"""The fine-tune CLI through a real API server and worker: `submit finetune --spec … --wait`, `status`,
`adapters list/show`, and `adapters export --merged`, whose model loads with plain AutoModelForCausalLM and gives
the memorized answers."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, qa_pairs
from tests.test_e2e import jobs


@pytest.fixture
def cli_env(jobs_env, api_server):
    url, token, _ = api_server
    return dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)


def test_submit_finetune_then_list_show_and_export_the_merged_adapter(tmp_path, cli_env, spawn_worker, base_model):
    spawn_worker([])
    submitted = jobs(cli_env, "submit", "finetune", "--spec", str(ROOT / "examples" / "finetune.yaml"), "--model",
                     str(base_model), "--input", str(ROOT / "examples" / "finetune_qa.jsonl"), "--gpus", "0",
                     "--wait")
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
