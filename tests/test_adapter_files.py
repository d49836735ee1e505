"""LoRA adapters from a stored file (`adapter: file_…`): a real adapter, made by a fine-tune job, zipped, uploaded
and run by a generation job on a real worker (and packed by the CLI from its directory); every refusal at submit."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path

import pytest
from sqlalchemy import func, select

from api import results, service, views
from core import adapters
from core.db import session_scope
from core.errors import InvalidInput, NotFound
from core.models import Job
from tests.conftest import qa_pairs
from tests.test_e2e import jobs
from tests.test_finetune import PROMPTS, finished, ft_spec, qa_prompts


def upload(owner: str, name: str, data: bytes) -> str:
    return service.store_upload(owner=owner, filename=name, stream=io.BytesIO(data))["id"]


def zipped(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buf.getvalue()


def right_answers(job_id: str) -> int:
    outputs = [r["output"] for r in results.results(job_id, owner=None)]
    return sum(o == a for o, (_, a) in zip(outputs, qa_pairs()))


def load_events(job_ids: list[str]) -> list[dict]:
    return [e for j in job_ids for e in views.events(j, owner=None) if " loaded " in e["message"]]


def test_an_uploaded_adapter_zip_reproduces_its_answers_reuses_the_resident_model_and_the_cli_packs_a_directory(
    tmp_path, jobs_env, api_server, spawn_worker, base_model
):
    """A fine-tune job's adapter folder, zipped (in one folder, tokenizer files included) and uploaded, runs on a
    real worker: >= 5 of 6 memorized answers, the file id and its source in load_options, extracted once into the
    artifacts store; a second job with the same file reuses the resident model; an adapter that does not fit the
    base fails its job on the worker; `gpujobs submit generate --adapter DIR` packs the directory, uploads it and
    gets the answers too."""
    worker = spawn_worker([])
    ft = finished(service.submit(owner="alice", spec_data=ft_spec(base_model))["id"], 120, [worker])
    assert ft["state"] == "succeeded", ft["error"]
    folder = adapters.adapter_dir(ft["id"])
    data = zipped({f"my-adapter/{p.name}": p.read_bytes() for p in folder.iterdir() if p.is_file()})
    file_id = upload("alice", "my-adapter.zip", data)

    prompts = qa_prompts(tmp_path)
    spec = {"model": str(base_model), "input": str(prompts), "adapter": file_id, "gpus": 0, "max_new_tokens": 16}
    gens = [service.submit(owner="alice", spec_data=spec)["id"] for _ in range(2)]
    for job_id in gens:
        job = finished(job_id, 60, [worker])
        assert job["state"] == "succeeded", job["error"]
        assert right_answers(job_id) >= 5, results.results(job_id, owner=None)
        ran = job["load_options"]["adapter"]
        assert ran["id"] == file_id and ran["source"] == "file" and ran["merged"] is True
        assert ran["sha256"] == adapters.digest(folder)[1]  # the very weights the fine-tune saved
    assert len(load_events(gens)) == 1  # the second job reused the resident model
    notes = [e["message"] for e in views.events(gens[0], owner=None) if e["message"].startswith("adapter ")]
    assert notes and "matched by name" in notes[0], notes
    extracted = adapters.file_dir(file_id)
    assert sorted(p.name for p in extracted.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not list(extracted.parent.glob(".*.tmp"))

    # An adapter that names no base passes submit; one that does not fit the model fails on the worker, not silently.
    unfit = upload("alice", "unfit.zip", zipped(fake_adapter(base=None)))
    job = finished(service.submit(owner="alice", spec_data={**spec, "adapter": unfit})["id"], 60, [worker])
    assert job["state"] == "failed" and f"adapter {unfit} does not fit" in job["error"], job["error"]

    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    cli = jobs(
        env,
        "submit",
        "generate",
        "--model",
        str(base_model),
        "--input",
        str(prompts),
        "--adapter",
        str(folder),
        "--gpus",
        "0",
        "--max-new-tokens",
        "16",
        "--wait",
        "--json",
    )
    assert cli.returncode == 0, cli.stderr
    job = json.loads(cli.stdout)
    packed = job["spec"]["adapter"]
    assert packed.startswith("file_") and packed != file_id
    assert job["load_options"]["adapter"]["id"] == packed and right_answers(job["id"]) >= 5


def fake_adapter(base: str | None = "tiny-base", **config) -> dict[str, bytes]:
    """The two files of a LoRA adapter, small and made by hand (the API never loads them; the worker does)."""
    header = json.dumps(
        {"base_model.model.lm_head.lora_A.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}
    ).encode()
    weights = struct.pack("<Q", len(header)) + header + b"\0" * 4
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": base,
        **config,
    }
    return {"adapter_config.json": json.dumps(cfg).encode(), "adapter_model.safetensors": weights}


def test_adapter_files_are_refused_at_submit_with_what_is_wrong_and_nothing_is_stored(jobs_env, base_model):
    """Another owner's file (404), not a zip, no config, pickle weights, path traversal, nested or several folders,
    foreign files, a config that is no JSON object, not LoRA or base-rewriting (PiSSA), weights that are not
    safetensors, and a base
    mismatch naming both models are refused; a base matched by name, an unnamed base (with an event) and an admin
    using another owner's file are accepted."""

    def submit(file_id: str, owner: str = "alice", admin: bool = False) -> dict:
        return service.submit(
            owner=owner,
            admin=admin,
            spec_data={"model": str(base_model), "input": str(PROMPTS), "adapter": file_id, "gpus": 0},
        )

    def refused(members_or_bytes, match: str, error=InvalidInput) -> None:
        data = members_or_bytes if isinstance(members_or_bytes, bytes) else zipped(members_or_bytes)
        with pytest.raises(error, match=match):
            submit(upload("alice", "a.zip", data))

    good = fake_adapter()
    with pytest.raises(NotFound, match="no file") as caught:
        submit(upload("bob", "a.zip", zipped(good)))
    assert caught.value.http_status == 404
    refused(b"adapter_config.json", "is not a zip archive")
    refused({"adapter_model.safetensors": good["adapter_model.safetensors"]}, "has no adapter_config.json")
    refused({**good, "adapter_model.bin": b"pickle"}, r"pickle weights \(adapter_model.bin\)")
    refused({"adapter_config.json": good["adapter_config.json"], "adapter_model.bin": b"x"}, "pickle weights")
    refused({**good, "../evil.sh": b"x"}, "not a plain file name")
    refused({**good, "/etc/cron.d/x": b"x"}, "not a plain file name")
    refused({f"a/b/{k}": v for k, v in good.items()}, "not a plain file name")
    refused(
        {"a/adapter_config.json": good["adapter_config.json"], "b/adapter_model.safetensors": b"x"},
        "more than one adapter directory",
    )
    refused({**good, "train.py": b"print()"}, r"not part of a LoRA adapter \(train.py\)")
    refused({**good, "adapter_config.json": b"[1, 2]"}, "is not a JSON object")
    refused({**good, "adapter_config.json": b"{nope"}, "is not valid JSON")
    refused(fake_adapter(peft_type="PREFIX_TUNING"), "'PREFIX_TUNING' is not a LoRA adapter")
    refused(fake_adapter(init_lora_weights="pissa_niter_4"), "changes the base model's weights")
    refused({**good, "adapter_model.safetensors": b"\x10\0\0\0\0\0\0\0not json at all!"}, "not a safetensors file")
    refused(
        fake_adapter(base="Qwen/Qwen3-0.6B"),
        rf"trained on 'Qwen/Qwen3-0.6B', not on '{base_model.resolve()}': submit with --model",
    )
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0

    # Accepted: the base by its last name, in one folder with a model card; no base named (an event says so); an
    # admin's job using alice's file.
    by_name = submit(upload("alice", "a.zip", zipped({f"x/{k}": v for k, v in {**good, "README.md": b"#"}.items()})))
    unnamed = submit(upload("alice", "a.zip", zipped(fake_adapter(base=None))))
    admin = submit(upload("alice", "a.zip", zipped(fake_adapter(base=str(base_model)))), owner="root", admin=True)
    assert {by_name["state"], unnamed["state"], admin["state"]} == {"running"}
    assert any("names no base model" in e["message"] for e in views.events(unnamed["id"], owner=None))


def test_the_worker_extracts_an_adapter_file_once_and_rechecks_it(jobs_env):
    """Extraction writes only the two adapter files under our names into `adapters/<file id>`, leaves no temporary
    folder, and returns the same folder the second time; a stored file that fails the check is not extracted."""
    from core.models import File

    def stored(data: bytes) -> File:
        file_id = upload("alice", "a.zip", data)
        with session_scope() as session:
            return session.get(File, file_id)

    file = stored(zipped({f"dir/{k}": v for k, v in fake_adapter().items()}))
    first = adapters.extract_file(file)
    assert first == adapters.file_dir(file.id)
    assert sorted(p.name for p in first.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (first / "adapter_model.safetensors").read_bytes() == fake_adapter()["adapter_model.safetensors"]
    (first / "marker").write_text("kept")
    assert adapters.extract_file(file) == first and (first / "marker").exists()  # not extracted twice
    assert [p.name for p in first.parent.iterdir()] == [file.id]
    bad = stored(zipped({**fake_adapter(), "../../x": b"x"}))
    with pytest.raises(InvalidInput, match="not a plain file name"):
        adapters.extract_file(bad)
    assert not adapters.file_dir(bad.id).exists()


def test_the_cli_packs_only_the_two_adapter_files_and_refuses_pickle_weights(tmp_path):
    """`--adapter DIR` zips adapter_config.json and adapter_model.safetensors (nothing else of the folder); a folder
    with only adapter_model.bin, or without a config, is refused before anything is uploaded."""
    from api.cli_submit import pack_adapter

    folder = tmp_path / "ad"
    folder.mkdir()
    for name, data in {**fake_adapter(), "tokenizer.json": b"{}", "notes.txt": b"x"}.items():
        (folder / name).write_bytes(data)
    with pack_adapter(folder) as packed:
        assert sorted(zipfile.ZipFile(packed).namelist()) == ["adapter_config.json", "adapter_model.safetensors"]
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(InvalidInput, match="pickle weights"):
        with pack_adapter(folder):
            pass
    (folder / "adapter_model.bin").unlink()
    (folder / "adapter_config.json").unlink()
    with pytest.raises(InvalidInput, match="has no adapter_config.json"):
        with pack_adapter(folder):
            pass
    assert not Path(packed).exists()  # the temporary zip is removed after the upload


def test_a_file_a_live_job_needs_is_not_deleted_until_the_job_has_ended(jobs_env, base_model):
    """DELETE /v1/files/{id} answers 409 naming the job for a file that a live job names as its adapter, its input,
    its validation_input or (its chained job's input) its then_generate input; once the job ended it deletes."""
    from fastapi.testclient import TestClient

    from api.app import app
    from core import auth
    from tests.test_finetune import FT_DATA

    with session_scope() as session:
        headers = {"Authorization": f"Bearer {auth.create_token(session, owner='alice', scopes=['user'])}"}
    client = TestClient(app)
    adapter = upload("alice", "a.zip", zipped(fake_adapter()))
    prompts, then_input = (upload("alice", "p.jsonl", PROMPTS.read_bytes()) for _ in range(2))
    train, validation = (upload("alice", "t.jsonl", FT_DATA.read_bytes()) for _ in range(2))
    gen = service.submit(
        owner="alice",
        spec_data={"model": str(base_model), "input": prompts, "adapter": adapter, "gpus": 0},
    )
    ft = service.submit(
        owner="alice",
        spec_data={
            "kind": "finetune",
            "model": str(base_model),
            "input": train,
            "validation_input": validation,
            "then_generate": then_input,
            "gpus": 0,
        },
    )
    chained = ft["metrics"]["then_generate_job"]
    assert gen["state"] == ft["state"] == "running"  # no worker: they stay live
    for file_id, role, job_id in (
        (adapter, "adapter", gen["id"]),
        (prompts, "input", gen["id"]),
        (train, "input", ft["id"]),
        (validation, "validation_input", ft["id"]),
        (then_input, "input", chained),
    ):
        answer = client.delete(f"/v1/files/{file_id}", headers=headers)
        assert answer.status_code == 409, (file_id, answer.text)
        assert f"file {file_id} is the {role} of job {job_id}, which is still " in answer.json()["error"]["message"]
    for job_id in (gen["id"], ft["id"], chained):
        assert service.cancel(job_id, owner=None, by="alice")["state"] == "cancelled"
    for file_id in (adapter, prompts, train, validation, then_input):
        answer = client.delete(f"/v1/files/{file_id}", headers=headers)
        assert answer.status_code == 200 and answer.json()["deleted"], answer.text


def test_a_worker_that_does_not_see_a_stored_adapter_blames_its_artifacts_setting_not_the_job(
    jobs_env, tmp_path, monkeypatch
):
    """A worker host whose JOBS_ARTIFACTS is not the shared directory (docs/cluster.md) cannot find an adapter the
    store lists, a fine-tune's or an uploaded file's: the error names its artifacts directory and the setting to fix,
    and is not InvalidInput (which would fail the job's rows at once): the attempt is retried, perhaps on a worker
    that sees the adapter."""
    from core.errors import JobsError
    from core.models import Adapter
    from core.settings import reset
    from core.store import new_id, now
    from worker.loader import adapter_path

    file_id = upload("alice", "a.zip", zipped(fake_adapter()))
    with session_scope() as session:
        job = Job(
            id=new_id("job"),
            kind="finetune",
            state="succeeded",
            owner="alice",
            spec={},
            queue="cpu",
            gpus=0,
            rows_total=1,
            created_at=now(),
        )
        session.add(job)
        session.flush()
        session.add(
            Adapter(
                id=job.id,
                job_id=job.id,
                owner="alice",
                base_model="m",
                tokenizer="m",
                path=f"adapters/{job.id}",
                bytes=1,
                sha256="0" * 64,
                lora_config={},
                load_options={},
                created_at=now(),
            )
        )
    adapters.adapter_dir(job.id).mkdir(parents=True)
    assert adapter_path(job.id) == adapters.adapter_dir(job.id)  # seen where it is stored

    elsewhere = tmp_path / "another-hosts-artifacts"
    monkeypatch.setenv("JOBS_ARTIFACTS", str(elsewhere))
    reset()
    for ref in (job.id, file_id):
        with pytest.raises(JobsError) as caught:
            adapter_path(ref)
        assert not isinstance(caught.value, InvalidInput), caught.value
        message = str(caught.value)
        assert f"adapter {'file ' if ref == file_id else ''}{ref} is stored" in message, message
        assert str(elsewhere) in message and "JOBS_ARTIFACTS" in message and "docs/cluster.md" in message, message
