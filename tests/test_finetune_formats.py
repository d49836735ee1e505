"""Fine-tune inputs in every file format (issue 5): JSONL, CSV, Parquet and saved Hugging Face datasets, read by
the reader generation jobs use, with a column mapping onto the fine-tune fields; bad rows named by their line (CSV
counts the header) or 0-based row (Parquet, saved datasets); empty files refused; jobs on CSV, Parquet and a saved
dataset (through the CLI's `--column` and directory packing) train on a real worker.

The row checks run without services; the submit cases use real Redis and SQLite; one test runs a real worker and
API server.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from api import service, views
from core import formats
from core.db import session_scope
from core.errors import InvalidInput
from core.models import Job, JobRow
from core.spec import parse_spec
from core.training_data import parse_training_file
from tests.conftest import qa_pairs, wait_for
from tests.test_e2e import jobs
from tests.test_formats import packed, saved_dataset

LIMITS = dict(max_rows=1000, max_row_bytes=1 << 20)
QA = qa_pairs()
COLUMNS = {"prompt": "question", "completion": "answer"}
CHAT = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]


def qa_csv(path: Path, rows: list[dict]) -> Path:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path.write_text(out.getvalue())
    return path


def qa_table() -> pa.Table:
    return pa.table({"id": list(range(len(QA))), "question": [q for q, _ in QA], "answer": [a for _, a in QA]})


def read(path: Path, fmt: str = "auto", **kw) -> list:
    if fmt == "auto":
        from core.training_data import file_format

        fmt = file_format(formats.detect(path, path.name))
    return parse_training_file(path, fmt, **{**LIMITS, **kw})


def ft_spec(model: Path, data, **extra) -> dict:
    return {
        "kind": "finetune",
        "model": str(model),
        "input": str(data),
        "gpus": 0,
        "max_steps": 2,
        "batch_size": 6,
        "lora_r": 4,
        "lora_alpha": 8,
        "checkpoint_steps": 50,
        **extra,
    }


# --- the row checks (no services) ---------------------------------------------------------------------------------


def test_every_file_format_gives_the_same_training_rows_through_the_column_mapping(tmp_path):
    """question/answer in JSONL, CSV, Parquet and a packed saved dataset (two Arrow files), format auto-detected,
    mapped to prompt/completion: the same stored rows; places are lines (CSV from 2, after the header) or rows
    from 0 (numbered on across the Arrow files)."""
    want = [{"prompt": q, "completion": a} for q, a in QA]
    data = [{"id": i, "question": q, "answer": a} for i, (q, a) in enumerate(QA)]
    jsonl = tmp_path / "qa.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in data))
    table = qa_table()
    pq.write_table(table, tmp_path / "qa.parquet")
    folder = saved_dataset(tmp_path / "saved", table.slice(0, 2), table.slice(2))
    cases = {
        "jsonl": jsonl,
        "csv": qa_csv(tmp_path / "qa.csv", data),
        "parquet": tmp_path / "qa.parquet",
        "hf": packed(folder, tmp_path / "qa.hf.zip"),
    }
    firsts = {"jsonl": 1, "csv": 2, "parquet": 0, "hf": 0}
    for fmt, path in cases.items():
        assert formats.detect(path, path.name) == fmt
        rows = read(path, columns=COLUMNS)
        assert [r.input for r in rows] == want, fmt
        assert [r.line for r in rows] == list(range(firsts[fmt], firsts[fmt] + len(QA))), fmt
        assert {r.where for r in rows} == {formats.location(fmt)}
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"question": "Q"}) + "\n")
    with pytest.raises(
        InvalidInput,
        match=r"line 1: a prompt_completion row needs 'prompt' and 'completion'; "
        r"'completion' \(column 'answer'\) is missing\. Fix",
    ):
        read(one, columns=COLUMNS)


def test_chat_rows_from_a_csv_json_cell_and_a_parquet_list_of_structs_and_mixed_shapes_in_one_table(tmp_path):
    """A `messages` CSV cell holds JSON, a Parquet `messages` column a list of structs; an empty CSV cell or a null
    is missing, so a table mixes chat, prompt/completion and text rows."""
    path = qa_csv(
        tmp_path / "mixed.csv",
        [
            {"messages": json.dumps(CHAT), "prompt": "", "completion": "", "text": ""},
            {"messages": "", "prompt": "Q", "completion": "A", "text": ""},
            {"messages": "", "prompt": "", "completion": "", "text": "plain text"},
        ],
    )
    assert [r.input for r in read(path)] == [
        {"messages": CHAT},
        {"prompt": "Q", "completion": "A"},
        {"text": "plain text"},
    ]
    pq.write_table(pa.table({"conversation": [CHAT, None], "text": [None, "t"]}), tmp_path / "chat.parquet")
    rows = read(tmp_path / "chat.parquet", columns={"messages": "conversation"})
    assert [r.input for r in rows] == [{"messages": CHAT}, {"text": "t"}]


def test_bad_rows_are_named_by_csv_line_counting_the_header_and_by_parquet_and_dataset_row_from_0(tmp_path):
    """One bad row refuses the file: CSV names the physical line (header = line 1, a quoted line break moves the
    next record down), Parquet and a saved dataset the 0-based row; the message says what the row lacks."""
    path = tmp_path / "bad.csv"
    path.write_text('question,answer\n"two\nlines",A\nQ,\nQ,A\n"{not json",x\n')
    with pytest.raises(
        InvalidInput,
        match=r"the fine-tune dataset has 1 bad row\(s\): line 4: a prompt_completion row "
        r"needs 'prompt' and 'completion'; 'completion' \(column 'answer'\) is "
        r"missing or empty\. Fix them",
    ):
        read(path, columns=COLUMNS)
    chat = tmp_path / "chat.csv"
    chat.write_text('messages\n"[]"\nnot json\n')
    with pytest.raises(
        InvalidInput,
        match=r"2 bad row\(s\): line 2: 'messages' must be a non-empty list.*; "
        r"line 3: the messages column must hold a JSON list",
    ):
        read(chat)
    pq.write_table(pa.table({"prompt": ["Q", "Q", "Q"], "completion": ["A", None, ""]}), tmp_path / "bad.parquet")
    with pytest.raises(
        InvalidInput,
        match=r"2 bad row\(s\): row 1: .*'completion' is missing or empty; row 2: "
        r"'completion' must be a non-empty string",
    ):
        read(tmp_path / "bad.parquet")
    table = pa.table({"text": ["a", "b", None]})
    folder = saved_dataset(tmp_path / "saved", table.slice(0, 2), table.slice(2))  # row 2 is in the second file
    with pytest.raises(
        InvalidInput,
        match=r"1 bad row\(s\): row 2: a training row needs 'messages' \(chat\), "
        r"'prompt' and 'completion', or 'text' \(an empty cell or null counts",
    ):
        read(packed(folder, tmp_path / "saved.zip"))


def test_empty_tables_unknown_columns_and_bad_mappings_are_refused_as_a_whole(tmp_path):
    """An empty Parquet file (a schema, no rows), a header-only CSV, an empty CSV, a mapping naming a column the file
    lacks, a spec mapping a field fine-tunes do not have, a CSV read as Parquet: each refused with what to do."""
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "completion": pa.array([], pa.string())}),
        tmp_path / "empty.parquet",
    )
    with pytest.raises(
        InvalidInput,
        match=r"the fine-tune dataset has no rows: expected a parquet file with a "
        r"'messages', 'prompt' and 'completion', or 'text' column",
    ):
        read(tmp_path / "empty.parquet")
    (tmp_path / "header.csv").write_text("prompt,completion\n")
    with pytest.raises(InvalidInput, match="the fine-tune dataset has no rows: expected a csv file"):
        read(tmp_path / "header.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(InvalidInput, match="the CSV file is empty"):
        read(tmp_path / "empty.csv", "csv")
    pq.write_table(qa_table(), tmp_path / "qa.parquet")
    with pytest.raises(
        InvalidInput,
        match=r"input_columns completion=reply: the Parquet file has no such column; its "
        r"columns are 'id', 'question', 'answer'",
    ):
        read(tmp_path / "qa.parquet", columns={"prompt": "question", "completion": "reply"})
    with pytest.raises(InvalidInput, match="the Parquet file cannot be read"):
        read(qa_csv(tmp_path / "qa.csv", [{"prompt": "Q", "completion": "A"}]), "parquet")
    with pytest.raises(
        InvalidInput, match="cannot map 'custom_id': a fine-tune maps messages, prompt, completion or text"
    ):
        parse_spec({"kind": "finetune", "model": "m", "input": "x", "input_columns": {"custom_id": "id"}})
    with pytest.raises(InvalidInput, match="input_columns maps prompt, which input_format text rows do not have"):
        parse_spec(
            {"kind": "finetune", "model": "m", "input": "x", "input_format": "text", "input_columns": {"prompt": "q"}}
        )


# --- submit (real Redis and SQLite, no worker) --------------------------------------------------------------------


def test_submit_stores_parquet_rows_and_csv_validation_rows_with_their_places_and_formats(
    tmp_path, jobs_env, base_model
):
    """A Parquet input and a CSV validation file, both auto-detected and mapped: rows stored with their places
    (`row-0`, `validation-line-2`), the formats resolved in the job's metrics; a bad CSV validation row refuses
    the job (naming line 3) and writes nothing; an explicit file_format that does not fit is refused."""
    pq.write_table(qa_table(), tmp_path / "train.parquet")
    valid = qa_csv(tmp_path / "valid.csv", [{"question": q, "answer": a} for q, a in QA[:2]])
    job = service.submit(
        owner="alice",
        spec_data=ft_spec(base_model, tmp_path / "train.parquet", validation_input=str(valid), input_columns=COLUMNS),
    )
    assert job["rows"]["total"] == len(QA) + 2
    with session_scope() as session:
        stored = session.get(Job, job["id"])
        assert stored.metrics["input"] == {"format": "parquet", "validation_format": "csv"}
        assert stored.spec["file_format"] == "auto" and stored.spec["input_columns"] == COLUMNS
        rows = session.scalars(select(JobRow).where(JobRow.job_id == job["id"]).order_by(JobRow.idx)).all()
    assert [r.custom_id for r in rows] == [f"row-{i}" for i in range(len(QA))] + [
        "validation-line-2",
        "validation-line-3",
    ]
    assert rows[0].input == {"prompt": QA[0][0], "completion": QA[0][1]}
    assert rows[-1].input == {"prompt": QA[1][0], "completion": QA[1][1], "split": "validation"}

    bad = qa_csv(tmp_path / "bad.csv", [{"question": "Q", "answer": "A"}, {"question": "Q", "answer": ""}])
    with pytest.raises(InvalidInput, match=r"the fine-tune validation dataset has 1 bad row\(s\): line 3: "):
        service.submit(
            owner="alice",
            spec_data=ft_spec(base_model, tmp_path / "train.parquet", validation_input=str(bad), input_columns=COLUMNS),
        )
    with pytest.raises(InvalidInput, match="the Parquet file cannot be read"):
        service.submit(owner="alice", spec_data=ft_spec(base_model, valid, file_format="parquet"))
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 1


# --- training on a real worker ------------------------------------------------------------------------------------


def test_csv_parquet_and_a_saved_dataset_submitted_with_the_cli_train_on_a_worker(
    tmp_path, jobs_env, api_server, spawn_worker, base_model
):
    """Two steps each on a real worker: a CSV of chat rows (service), a Parquet of text rows (service), and a
    save_to_disk directory with question/answer columns through `gpujobs submit finetune --input DIR --column
    prompt=question --column completion=answer --validation-input DIR`, which packs and uploads both."""
    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    worker = spawn_worker([])
    chat = qa_csv(
        tmp_path / "chat.csv",
        [
            {"messages": json.dumps([{"role": "user", "content": q}, {"role": "assistant", "content": a}])}
            for q, a in QA
        ],
    )
    pq.write_table(pa.table({"body": [f"{q} {a}" for q, a in QA]}), tmp_path / "text.parquet")
    table = qa_table()
    train = saved_dataset(tmp_path / "train", table.slice(0, 4), table.slice(4))
    valid = saved_dataset(tmp_path / "valid", table.slice(0, 2))
    submitted = [
        service.submit(owner="alice", spec_data=ft_spec(base_model, chat))["id"],
        service.submit(
            owner="alice", spec_data=ft_spec(base_model, tmp_path / "text.parquet", input_columns={"text": "body"})
        )["id"],
    ]
    cli = jobs(
        env,
        "submit",
        "finetune",
        "--model",
        str(base_model),
        "--input",
        str(train),
        "--column",
        "prompt=question",
        "--column",
        "completion=answer",
        "--validation-input",
        str(valid),
        "--gpus",
        "0",
        "--max-steps",
        "2",
        "--batch-size",
        "6",
        "--lora-r",
        "4",
        "--checkpoint-steps",
        "50",
        "--json",
        check=True,
    )
    job = json.loads(cli.stdout)
    assert job["rows"]["total"] == len(QA) + 2
    submitted.append(job["id"])
    for job_id in submitted:
        done = wait_for(
            lambda job_id=job_id: (j := views.get(job_id, owner=None))["state"] in ("succeeded", "failed") and j,
            180,
            f"fine-tune {job_id}",
            procs=[worker],
        )
        assert done["state"] == "succeeded", done["error"]
        assert done["training"]["step"] == 2
    with session_scope() as session:
        assert session.get(Job, submitted[-1]).metrics["input"] == {"format": "hf", "validation_format": "hf"}
        assert session.get(Job, submitted[0]).metrics["input"] == {"format": "csv"}
