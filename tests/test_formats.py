"""Inputs and outputs of generation jobs: every input format (JSONL, OpenAI batch lines, CSV, Parquet, a saved
Hugging Face dataset) with its bad-input paths, the token pre-flight check, and results in every output format
(JSONL, OpenAI batch output and error files, CSV, Parquet) in input or finishing order.

Most cases run the FastAPI app in-process on real Redis and SQLite (the `api` fixture of test_bad_input); one test
runs a real worker and the CLI, and reads two different `gpujobs status --json` values during one job.
"""

from __future__ import annotations

import csv
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select, update

from core import formats
from core.dataset import ParsedRow, parse_dataset
from core.db import session_scope
from core.errors import InvalidInput
from core.models import File, Job, JobRow
from core.preflight import TokenCheck
from core.spec import parse_spec
from tests.conftest import wait_for
from tests.test_bad_input import api, error_of, fake_model, lines, model, refused  # noqa: F401  (fixtures)
from tests.test_e2e import jobs

CHAT = "/v1/chat/completions"
DUP = "custom_ids must be unique within a dataset"


def write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def parse(path: Path, fmt: str, columns: dict[str, str] | None = None, **spec: Any) -> list[ParsedRow]:
    job_spec = parse_spec({"model": "m", "input": "x", **spec})
    return list(parse_dataset(path, fmt, spec=job_spec, columns=columns))


def openai_line(custom_id: str, body: dict[str, Any], url: str = CHAT, **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def parquet_file(path: Path, data: dict[str, list]) -> Path:
    pq.write_table(pa.table(data), path)
    return path


def saved_dataset(folder: Path, *tables: pa.Table) -> Path:
    """The layout `Dataset.save_to_disk` writes: Arrow IPC stream files listed in state.json, plus dataset_info.json."""
    folder.mkdir(parents=True)
    names = []
    for i, table in enumerate(tables):
        name = f"data-{i:05d}-of-{len(tables):05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        names.append({"filename": name})
    (folder / "state.json").write_text(
        json.dumps(
            {
                "_data_files": names,
                "_fingerprint": "f",
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_split": None,
            }
        )
    )
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def packed(folder: Path, dest: Path) -> Path:
    """The zip `gpujobs submit --input DIR` uploads."""
    from api.packing import pack_saved_dataset

    with pack_saved_dataset(folder) as path:
        dest.write_bytes(path.read_bytes())
    return dest


# --- detection ------------------------------------------------------------------------------------------------


def test_the_format_is_detected_by_content_then_by_file_name(tmp_path):
    """Parquet and zip by their magic bytes, OpenAI lines by url+body, JSON objects as JSONL, a .csv name or a comma
    header as CSV."""
    cases = {
        "a.jsonl": (lines({"prompt": "x"}), "jsonl"),
        "b.jsonl": (lines(openai_line("a", {"messages": []})), "openai"),
        "c.txt": (b"question,id\nhi,1\n", "csv"),
        "d.csv": (b"question\nhi\n", "csv"),
        "e": (b"\xef\xbb\xbf\n" + lines({"prompt": "x"}), "jsonl"),
    }
    for name, (data, fmt) in cases.items():
        assert formats.detect(write(tmp_path / name, data), name) == fmt, name
    assert formats.detect(parquet_file(tmp_path / "f.bin", {"prompt": ["x"]})) == "parquet"
    assert formats.detect(packed(saved_dataset(tmp_path / "ds", pa.table({"prompt": ["x"]})), tmp_path / "g")) == "hf"


# --- OpenAI batch lines ---------------------------------------------------------------------------------------


def test_openai_lines_map_body_parameters_onto_row_parameters(tmp_path):
    """Chat and completions lines become messages / prompt rows; max_tokens and max_completion_tokens →
    max_new_tokens, n → num_return_sequences, stop string → list; url and body.model are kept for the response."""
    data = lines(
        openai_line(
            "chat-1",
            {
                "model": "qwen",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
                ],
                "max_completion_tokens": 7,
                "temperature": 0.5,
                "top_p": 0.9,
                "seed": 3,
                "stop": "END",
                "n": 2,
                "stream": False,
            },
        ),
        openai_line("comp-1", {"model": "qwen", "prompt": "Once", "max_tokens": 5}, url="/v1/completions"),
    )
    rows = parse(write(tmp_path / "b.jsonl", data), "openai")
    assert [(r.idx, r.line, r.custom_id, r.error) for r in rows] == [(0, 1, "chat-1", None), (1, 2, "comp-1", None)]
    assert rows[0].input == {
        "messages": [{"role": "user", "content": "Hi there"}],
        "params": {
            "max_new_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": ["END"],
            "num_return_sequences": 2,
        },
        "extra": {},
        "openai": {"url": CHAT, "model": "qwen"},
    }
    assert rows[1].input == {
        "prompt": "Once",
        "params": {"max_new_tokens": 5},
        "extra": {},
        "openai": {"url": "/v1/completions", "model": "qwen"},
    }


OPENAI_BAD = [
    (openai_line("", {"messages": []}), "line-2", "an OpenAI batch line needs a 'custom_id' (a non-empty string)"),
    (openai_line("a", {"messages": []}, method="GET"), "a", "method 'GET': OpenAI batch lines use POST"),
    (
        openai_line("a", {"prompt": "x"}, url="/v1/embeddings"),
        "a",
        "url '/v1/embeddings' is not supported: use /v1/chat/completions or /v1/completions",
    ),
    (openai_line("a", "hi"), "a", "'body' must be an object with the request (messages or prompt, max_tokens, …)"),
    (openai_line("a", {"prompt": "x"}), "a", f"body.prompt does not belong to {CHAT}: use body.messages"),
    (
        openai_line("a", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}),
        "a",
        "body.max_tokens and body.max_completion_tokens differ: give one of them",
    ),
    (
        openai_line("a", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
        "a",
        "body.stream = true is not supported by this server: leave it out",
    ),
    (
        openai_line("a", {"messages": [{"role": "user", "content": "x"}], "tools": []}),
        "a",
        "body key(s) 'tools' are not supported by this server: leave them out",
    ),
    (
        openai_line("a", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        "a",
        "body.messages[0].content: only text parts are supported here",
    ),
    (
        openai_line("a", {"messages": []}, extra=1),
        "a",
        "unknown key(s) 'extra': an OpenAI batch line has custom_id, method, url and body",
    ),
    (
        openai_line("a", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
        "a",
        "invalid per-row parameter: temperature: Input should be greater than or equal to 0 (in body)",
    ),
    (
        openai_line("a", {"messages": []}),
        "a",
        "'messages' must be a non-empty list of {role, content} objects (in body)",
    ),
    (
        openai_line("a", {"messages": [{"role": "user", "content": "x"}], "model": 5}),
        "a",
        "body.model must be a non-empty string",
    ),
]


@pytest.mark.parametrize(("line", "custom_id", "reason"), OPENAI_BAD, ids=[c[2][:40] for c in OPENAI_BAD])
def test_a_bad_openai_line_fails_alone_with_its_line(tmp_path, line, custom_id, reason):
    """A malformed OpenAI line becomes a failed row 'line N: reason' (under its custom_id when it has one)."""
    good = openai_line("ok", {"messages": [{"role": "user", "content": "x"}]})
    rows = parse(write(tmp_path / "b.jsonl", lines(good, line)), "openai")
    assert rows[0].error is None
    assert (rows[1].custom_id, rows[1].error) == (custom_id, f"line 2: {reason}")


def test_duplicate_openai_custom_ids_are_refused_naming_both_lines(tmp_path):
    line = openai_line("same", {"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(InvalidInput, match=f"duplicate custom_id 'same' on lines 1 and 3: {DUP}"):
        parse(write(tmp_path / "b.jsonl", lines(line, "", line)), "openai")


def test_body_model_chooses_the_model_when_the_job_names_none(api, tmp_path):
    """With JOBS_MODEL_ROOTS set, body.model names a directory under a root; the job records it and every
    response echoes the line's name. Lines naming different models, a line naming none, or a name outside the
    roots are refused and write nothing."""
    root = tmp_path / "roots"
    fake_model(root / "qwen-mini")
    api.setenv(JOBS_MODEL_ROOTS=str(root))
    line = lambda cid, **body: openai_line(cid, {"messages": [{"role": "user", "content": "x"}], **body})  # noqa: E731
    job = api.submit(
        {"input": api.upload(lines(line("a", model="qwen-mini"), line("b", model="qwen-mini"))), "gpus": 0}
    )
    assert job.status_code == 201, job.text
    assert job.json()["model"] == str(root / "qwen-mini") and job.json()["spec"]["input_format"] == "openai"
    same = "when the job names no model every line must name the same one; or name the model in the job (--model)"
    refused(
        api,
        {"input": api.upload(lines(line("a", model="qwen-mini"), line("b", model="other"))), "gpus": 0},
        422,
        f"lines 1 and 2 name different models ('qwen-mini' and 'other') in body.model: {same}",
    )
    refused(
        api,
        {"input": api.upload(lines(line("a", model="qwen-mini"), line("b"))), "gpus": 0},
        422,
        f"line 2 names no body.model while line 1 names 'qwen-mini': {same}",
    )
    refused(
        api,
        {"input": api.upload(lines(line("a", model="../qwen-mini"))), "gpus": 0},
        422,
        f"body.model '../qwen-mini' is not a model directory under the model roots ({root}): name one of those "
        "directories, or name the model in the job (--model)",
    )
    refused(
        api,
        {"input": api.upload(lines(line("a"))), "gpus": 0},
        422,
        "model is missing: the job names none and no OpenAI batch line names one in body.model: name one "
        "(--model, or `model:` in the spec)",
    )
    for data in (b"", b"\xe9t\xe9\n", b'{"prompt": "hi"}\n'):  # no line to name a model: say what the file lacks
        refused(
            api,
            {"input": api.upload(data, name="batch.jsonl"), "input_format": "openai", "gpus": 0},
            422,
            "'batch.jsonl' holds no OpenAI batch line: each line must be a JSON object with custom_id, method, url "
            "and body, the model in body.model",
        )


# --- CSV ------------------------------------------------------------------------------------------------------


def test_csv_rows_with_a_column_mapping(tmp_path):
    """--column prompt=question custom_id=id: lines count the header and a quoted line break; parameter cells are
    read as JSON (an empty one takes the job's value); other columns come back unchanged; bad rows fail alone."""
    data = (
        "question,id,max_new_tokens,stop,topic\n"
        "What is 2+2?,q1,12,END,math\n"
        '"A prompt\nover two lines",q2,,"[""a"", ""b""]",poetry\n'
        "\n"
        "too,many,fields,here,x,y\n"
        ",q5,,,empty\n"
        "Hi,q6,many,,bad number\n"
        "Hi,,,,no id\n"
    )
    rows = parse(write(tmp_path / "d.csv", data), "csv", {"prompt": "question", "custom_id": "id"})
    assert [(r.idx, r.line, r.custom_id) for r in rows] == [
        (0, 2, "q1"),
        (1, 3, "q2"),
        (2, 6, "line-6"),
        (3, 7, "q5"),
        (4, 8, "q6"),
        (5, 9, "line-9"),
    ]
    assert rows[0].input == {
        "prompt": "What is 2+2?",
        "params": {"max_new_tokens": 12, "stop": ["END"]},
        "extra": {"topic": "math"},
    }
    assert rows[1].input["prompt"] == "A prompt\nover two lines" and rows[1].input["params"] == {"stop": ["a", "b"]}
    assert [r.error for r in rows[2:5]] == [
        "line 6: has 6 fields, the header has 5: quote fields that hold commas or line breaks",
        "line 7: a row needs exactly one of 'prompt' (a string) or 'messages' (a list of messages); this row's "
        "'prompt' is empty",
        "line 8: invalid per-row parameter: max_new_tokens: Input should be a valid integer, not 'many'",
    ]
    assert rows[5].error is None and rows[5].input["extra"] == {"topic": "no id"}


def test_csv_messages_column_and_bad_utf8(tmp_path):
    """A messages column holds JSON; a cell that is not UTF-8 fails its row only."""
    data = b'messages\n"[{""role"": ""user"", ""content"": ""hi""}]"\nnot json\n\xff\xfe\n'
    rows = parse(write(tmp_path / "m.csv", data), "csv")
    assert rows[0].input["messages"] == [{"role": "user", "content": "hi"}]
    assert [r.error for r in rows[1:]] == [
        "line 3: the messages column must hold a JSON list of {role, content} objects",
        "line 4: not valid UTF-8: save the file as UTF-8",
    ]


@pytest.mark.parametrize(
    ("data", "columns", "message"),
    [
        (
            b"",
            None,
            "the CSV file is empty: expected a header row naming the columns (e.g. prompt), then one row per record",
        ),
        (
            b"question\nhi\n",
            {"prompt": "q"},
            "input_columns prompt=q: the CSV header (line 1) has no such column; its columns are 'question'",
        ),
        (
            b"prompt,prompt\nhi,ho\n",
            None,
            "the CSV header (line 1) must name each column once in UTF-8 text; repeated: 'prompt'",
        ),
        (
            b'prompt\n"never closed\nhi\n',
            None,
            "the CSV file cannot be read at line 3: unexpected end of data (a quote that is never closed swallows the rest "
            "of the file): fix the quoting",
        ),
        (b"prompt,custom_id\na,x\nb,y\nc,x\n", None, f"duplicate custom_id 'x' on lines 2 and 4: {DUP}"),
        (b"prompt\n\n", None, "the dataset has no rows: expected a csv file with one record per row"),
    ],
)
def test_a_csv_refused_as_a_whole(tmp_path, data, columns, message):
    """Whole-file problems refuse the CSV with what to do."""
    with pytest.raises(InvalidInput) as info:
        parse(write(tmp_path / "x.csv", data), "csv", columns)
    assert str(info.value) == message


# --- Parquet and saved datasets -------------------------------------------------------------------------------


def test_parquet_rows_are_numbered_from_0_and_typed_cells_kept(tmp_path):
    """Parquet: 0-based `row`, integer ids become text, a null parameter takes the job's value, a list-of-structs
    messages column works, other columns keep their JSON types; bad rows say `row N:`."""
    path = parquet_file(
        tmp_path / "p.parquet",
        {
            "q": ["Hi", None, "Yo"],
            "id": [10, 11, 12],
            "temperature": [0.5, None, -1.0],
            "score": [1.5, 2.0, float("nan")],
        },
    )
    rows = parse(path, "parquet", {"prompt": "q", "custom_id": "id"})
    assert [(r.line, r.custom_id) for r in rows] == [(0, "10"), (1, "11"), (2, "12")]
    assert rows[0].input == {"prompt": "Hi", "params": {"temperature": 0.5}, "extra": {"score": 1.5}}
    assert rows[1].error == (
        "row 1: a row needs exactly one of 'prompt' (a string) or 'messages' (a list of messages); this row's "
        "'prompt' is empty"
    )
    assert rows[2].error == "row 2: invalid per-row parameter: temperature: Input should be greater than or equal to 0"
    floats = parse(parquet_file(tmp_path / "f.parquet", {"prompt": ["a"], "custom_id": [1.0]}), "parquet")
    assert floats[0].error == (  # pandas stores an integer column with a null as floats
        "row 0: custom_id must be a non-empty string of at most 255 printable characters, not a number"
    )
    messages = parquet_file(tmp_path / "m.parquet", {"messages": [[{"role": "user", "content": "hi"}]]})
    assert parse(messages, "parquet")[0].input["messages"] == [{"role": "user", "content": "hi"}]


def test_parquet_refusals(tmp_path):
    """A mapped column the file lacks, duplicate ids (naming both rows) and a damaged file refuse the submission;
    a row over JOBS_MAX_ROW_BYTES fails alone."""
    path = parquet_file(tmp_path / "p.parquet", {"prompt": ["a", "b", "c"], "custom_id": ["x", "y", "x"]})
    with pytest.raises(
        InvalidInput,
        match=r"input_columns prompt=question: the Parquet file has no such column; "
        r"its columns are 'prompt', 'custom_id'",
    ):
        parse(path, "parquet", {"prompt": "question"})
    with pytest.raises(InvalidInput, match=f"duplicate custom_id 'x' on rows 0 and 2: {DUP}"):
        parse(path, "parquet")
    big = parquet_file(tmp_path / "big.parquet", {"prompt": ["x", "y" * 300]})
    rows = list(parse_dataset(big, "parquet", spec=parse_spec({"model": "m", "input": "x"}), max_row_bytes=200))
    assert [r.error for r in rows] == [
        None,
        "row 1: row of 314 bytes exceeds the limit of 200 bytes (JOBS_MAX_ROW_BYTES): shorten the row or split it",
    ]
    broken = write(tmp_path / "broken.parquet", path.read_bytes()[:40])
    with pytest.raises(InvalidInput, match="the Parquet file cannot be read .*: write it again with pyarrow or pandas"):
        parse(broken, "parquet")


LIMIT = "exceeds the limit of 200 bytes (JOBS_MAX_ROW_BYTES): shorten the row or split it"


@pytest.mark.parametrize(
    ("fmt", "size"),
    [("jsonl", 314), ("csv", 300), ("parquet", 314), ("hf", 314)],  # JSONL and tables: {"prompt": "…"}, 14 more
)
def test_every_format_counts_the_row_limit_in_utf8_bytes(tmp_path, fmt, size):
    """JOBS_MAX_ROW_BYTES is bytes in every format: a prompt of 150 'é' (150 characters, 300 UTF-8 bytes) is over
    a limit of 200 as a JSONL line, a CSV record (its bytes in the file) and a Parquet or saved-dataset row (as a
    JSON line), and the error gives its place, its size and the limit; 60 'é' (120 bytes) is under it."""
    prompts = ["é" * 60, "é" * 150]
    path = {
        "jsonl": lambda: write(
            tmp_path / "r.jsonl", "".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts)
        ),
        "csv": lambda: write(tmp_path / "r.csv", "prompt\n" + "".join(p + "\n" for p in prompts)),
        "parquet": lambda: parquet_file(tmp_path / "r.parquet", {"prompt": prompts}),
        "hf": lambda: packed(saved_dataset(tmp_path / "ds", pa.table({"prompt": prompts})), tmp_path / "r.zip"),
    }[fmt]()
    rows = list(parse_dataset(path, fmt, spec=parse_spec({"model": "m", "input": "x"}), max_row_bytes=200))
    place = {"jsonl": "line 2", "csv": "line 3"}.get(fmt, "row 1")
    assert [r.error for r in rows] == [None, f"{place}: row of {size} bytes {LIMIT}"]


def test_a_csv_row_limit_counts_its_bytes_in_the_file_and_a_field_over_it_refuses_the_file(tmp_path):
    """A quoted CSV record over two lines counts its quotes and inner line break, not its line ending (as a JSONL
    line); a single field longer than the CSV reader can hold refuses the file saying so, not as bad quoting only."""
    data = 'prompt,id\r\n"a\r\nb ""q""",1\r\n\r\nxyz,2'
    rows = list(parse_dataset(write(tmp_path / "q.csv", data), "csv", max_row_bytes=13))
    assert [(r.line, r.error) for r in rows] == [
        (2, "line 2: row of 14 bytes exceeds the limit of 13 bytes (JOBS_MAX_ROW_BYTES): shorten the row or split it"),
        (5, None),
    ]
    big = write(tmp_path / "big.csv", "prompt\nok\n" + "x" * (csv.field_size_limit() + 1) + "\nfine\n")
    with pytest.raises(InvalidInput) as info:
        list(parse_dataset(big, "csv", max_row_bytes=1000))
    assert str(info.value) == (
        "the CSV file cannot be read at line 3: a field there is longer than the row limit of 1000 bytes "
        "(JOBS_MAX_ROW_BYTES), or a quote that is never closed swallows the rest of the file: shorten the row, or fix "
        "the quoting"
    )


def test_a_saved_dataset_is_packed_and_read_across_its_arrow_files(tmp_path):
    """A save_to_disk directory with two Arrow files: packed by the CLI, read in order, rows numbered on across
    files; a DatasetDict or a directory without state.json is refused with what to do."""
    folder = saved_dataset(tmp_path / "ds", pa.table({"question": ["a", "b"]}), pa.table({"question": ["c"]}))
    rows = parse(packed(folder, tmp_path / "ds.zip"), "hf", {"prompt": "question"})
    assert [(r.line, r.custom_id, r.input["prompt"]) for r in rows] == [
        (0, "row-0", "a"),
        (1, "row-1", "b"),
        (2, "row-2", "c"),
    ]
    from api.packing import pack_saved_dataset

    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(InvalidInput, match="is a DatasetDict .*: save one split"):
        with pack_saved_dataset(tmp_path / "dd"):
            pass
    with pytest.raises(InvalidInput, match="not a dataset saved with save_to_disk"):
        with pack_saved_dataset(tmp_path):
            pass
    bare = tmp_path / "bare.zip"
    with zipfile.ZipFile(bare, "w") as archive:
        archive.writestr("x.txt", "hi")
    with pytest.raises(InvalidInput, match="the archive is not a dataset saved with save_to_disk"):
        parse(bare, "hf")


def test_table_inputs_through_the_api(api, model, tmp_path):
    """CSV, Parquet and a packed dataset submit with input_columns; the stored format and `row` numbers show
    in results; a mapping key that is not ours, or one on OpenAI lines, is refused."""
    csv_id = api.upload(b"question,id\nhi,a\n,b\n", "d.csv")
    job = api.submit(
        {"model": str(model), "input": csv_id, "gpus": 0, "input_columns": {"prompt": "question", "custom_id": "id"}}
    ).json()
    assert job["spec"]["input_format"] == "csv" and job["rows"]["total"] == 2 and job["rows"]["failed"] == 1
    pq_path = parquet_file(tmp_path / "p.parquet", {"prompt": ["x", ""]})
    job = api.submit({"model": str(model), "input": api.upload(pq_path.read_bytes(), "p.parquet"), "gpus": 0}).json()
    errors = api.client.get(f"/jobs/{job['id']}/results", params={"errors": True}, headers=api.admin).text
    assert json.loads(errors) == {"custom_id": "row-1", "row": 1, "error": "row 1: 'prompt' must be a non-empty string"}
    hf = packed(saved_dataset(tmp_path / "ds", pa.table({"prompt": ["x"]})), tmp_path / "ds.zip")
    job = api.submit({"model": str(model), "input": api.upload(hf.read_bytes(), "ds.hf.zip"), "gpus": 0}).json()
    assert job["spec"]["input_format"] == "hf" and job["rows"]["pending"] == 1
    refused(
        api,
        {"model": str(model), "input": csv_id, "gpus": 0, "input_columns": {"question": "prompt"}},
        422,
        "input_columns 'question': map one of prompt, messages, custom_id or a sampling parameter (do_sample, "
        "guided_choice, guided_regex, ignore_eos, logprobs, max_new_tokens, num_return_sequences, "
        "repetition_penalty, response_format, seed, stop, temperature, top_k, top_logprobs, top_p) to a column of "
        "the file",
    )
    refused(
        api,
        {
            "model": str(model),
            "input": api.upload(lines(openai_line("a", {"messages": []}))),
            "gpus": 0,
            "input_columns": {"prompt": "q"},
        },
        422,
        "input_columns does not apply to OpenAI batch lines (their keys are fixed): leave it out",
    )


CLASH = (
    "input_columns prompt=question: the {what} also has a {col} named 'prompt', which the mapping would drop (a row "
    "takes its prompt from one column): rename or drop 'prompt' or 'question' in the file, or leave the mapping out "
    "to use 'prompt'"
)


@pytest.mark.parametrize("fmt", ["csv", "parquet", "hf"])
def test_mapping_prompt_to_a_column_beside_the_files_own_prompt_column_is_refused(tmp_path, fmt):
    """--column prompt=question on a table that also has a `prompt` column refuses the file naming both columns,
    instead of silently dropping the file's own `prompt`; a mapping that uses that `prompt` column is fine."""
    data = {"prompt": ["You are terse."], "question": ["What is 2+2?"]}
    path = {
        "csv": lambda: write(tmp_path / "q.csv", "prompt,question\nYou are terse.,What is 2+2?\n"),
        "parquet": lambda: parquet_file(tmp_path / "q.parquet", data),
        "hf": lambda: packed(saved_dataset(tmp_path / "ds", pa.table(data)), tmp_path / "q.zip"),
    }[fmt]()
    with pytest.raises(InvalidInput) as info:
        parse(path, fmt, {"prompt": "question"})
    what = {"csv": "CSV header (line 1)", "parquet": "Parquet file", "hf": "saved dataset"}[fmt]
    assert str(info.value) == CLASH.format(what=what, col="column")
    rows = parse(path, fmt, {"prompt": "question", "custom_id": "prompt"})
    assert rows[0].custom_id == "You are terse." and rows[0].input["prompt"] == "What is 2+2?"


def test_a_jsonl_row_with_its_own_prompt_beside_the_mapped_key_fails_alone(tmp_path):
    """JSONL keys vary by row: a row with both `prompt` and the mapped `question` fails naming both; the others
    run."""
    path = write(tmp_path / "q.jsonl", lines({"prompt": "You are terse.", "question": "Hi?"}, {"question": "Yo?"}))
    rows = parse(path, "jsonl", {"prompt": "question"})
    assert [r.error for r in rows] == ["line 1: " + CLASH.format(what="row", col="key"), None]
    assert rows[1].input["prompt"] == "Yo?"


def test_the_cli_refuses_a_column_mapping_beside_the_files_own_column(tmp_path, jobs_env, api_server, model):
    """`gpujobs submit generate --column prompt=question` on a CSV that also has a `prompt` column exits 2 with
    the reason on stderr, nothing on stdout, and no job."""
    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    path = write(tmp_path / "q.csv", "prompt,question\nYou are terse.,What is 2+2?\n")
    args = ("--model", str(model), "--input", str(path), "--column", "prompt=question", "--gpus", "0")
    result = jobs(env, "submit", "generate", *args)
    message = CLASH.format(what="CSV header (line 1)", col="column")
    assert (result.returncode, result.stderr, result.stdout) == (2, f"Error: {message}\n", "")
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0


HINT = (
    'map the column that holds the prompt with --column prompt=question (spec: "input_columns": {"prompt": '
    '"question"}), or messages=COLUMN for chat messages'
)
NO_PROMPT = "the {what} has no 'prompt' or 'messages' column, so no row can run; its columns are 'question', 'tag': "
WHAT = {"csv": "CSV file", "parquet": "Parquet file", "hf": "saved dataset"}


def table_without_prompt(tmp_path: Path, fmt: str) -> Path:
    """The issue's q.csv (columns question, tag) as CSV, Parquet or a save_to_disk directory."""
    data = {"question": ["What is 2+2?", "Name a colour"], "tag": ['a, "quoted"', "b"]}
    if fmt == "csv":
        return write(tmp_path / "q.csv", 'question,tag\nWhat is 2+2?,"a, ""quoted"""\nName a colour,b\n')
    if fmt == "parquet":
        return parquet_file(tmp_path / "q.parquet", data)
    return saved_dataset(tmp_path / "q_ds", pa.table(data))


@pytest.mark.parametrize("fmt", ["csv", "parquet", "hf"])
def test_a_table_without_a_prompt_column_is_refused_at_submit_naming_its_columns(api, model, tmp_path, fmt):
    """A CSV, Parquet file or saved dataset with columns question and tag: the HTTP submit is refused (422) naming
    the columns and the mapping, with an uploaded file and with a server path (nothing copied into the store);
    with input_columns {prompt: question} the same file is accepted."""
    path = table_without_prompt(tmp_path, fmt)
    if fmt == "hf":
        path = packed(path, tmp_path / "q.hf.zip")
    message = NO_PROMPT.format(what=WHAT[fmt]) + HINT
    file_id = api.upload(path.read_bytes(), path.name)
    refused(api, {"model": str(model), "input": file_id, "gpus": 0}, 422, message)
    refused(api, {"model": str(model), "input": str(path), "gpus": 0}, 422, message)  # an admin's server path
    ok = api.submit({"model": str(model), "input": file_id, "gpus": 0, "input_columns": {"prompt": "question"}})
    assert ok.status_code == 201 and ok.json()["rows"] == {"total": 2, "succeeded": 0, "failed": 0, "pending": 2}


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        (
            "q.csv",
            "prompt;id\r\nWhat is 2+2?;a\r\n",
            "the CSV header (line 1) is one column, 'prompt;id': the file looks separated by semicolons, not commas",
        ),
        (
            "q.csv",
            "question\tid\nWhat is 2+2?\ta\n",
            "the CSV header (line 1) is one column, 'question\\tid': the file looks separated by tabs, not commas",
        ),
        ("q.tsv", "prompt\tid\nWhat is 2+2?\ta\n", "a tab-separated (.tsv) file is not read"),
    ],
)
def test_a_table_separated_by_semicolons_or_tabs_is_refused_saying_so(api, model, tmp_path, name, data, message):
    """A spreadsheet's CSV saved with semicolons or tabs reads as one column: the submit says the file is not
    comma separated and how to save it, instead of offering a mapping to that one column (or reading a .tsv as
    JSONL lines that all fail); a mapping does not hide it."""
    file_id = api.upload(data.encode(), name)
    for columns in ({}, {"input_columns": {"prompt": "question"}}):
        response = api.submit({"model": str(model), "input": file_id, "gpus": 0, **columns})
        assert response.status_code == 422, response.text
        assert message in error_of(response)[1] and "save it with commas" in error_of(response)[1], response.text


def test_the_cli_and_the_client_refuse_a_dataset_no_row_can_run_and_leave_no_upload(
    tmp_path, jobs_env, api_server, model
):
    """`gpujobs submit generate` (exit 2, one line, nothing on stdout) and `Client.submit` (InvalidInput) refuse a
    CSV, a Parquet file and a saved dataset without a prompt column, naming the columns and `--column`, and a
    JSONL whose rows all lack a prompt; no job is made and the files they uploaded are deleted again. The option
    the message names makes the CSV run."""
    from api.client import Client

    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    jsonl = write(tmp_path / "q.jsonl", lines({"question": "q1", "tag": "a"}, {"question": "q2", "tag": "b"}))
    cases = [(table_without_prompt(tmp_path, fmt), NO_PROMPT.format(what=WHAT[fmt]) + HINT) for fmt in WHAT]
    cases.append(
        (
            jsonl,
            "no row of the dataset can run (2 rows, every one invalid); the first: line 1: a row needs exactly one "
            "of 'prompt' (a string) or 'messages' (a list of messages); the rows' keys are 'question', 'tag': " + HINT,
        )
    )
    artifacts = Path(jobs_env.env["JOBS_ARTIFACTS"])
    with Client(url, token) as client:
        for path, message in cases:
            result = jobs(env, "submit", "generate", "--model", str(model), "--input", str(path), "--gpus", "0")
            assert (result.returncode, result.stderr, result.stdout) == (2, f"Error: {message}\n", ""), path
            with pytest.raises(InvalidInput) as refusal:
                client.submit({"model": str(model), "gpus": 0}, input=path)
            assert str(refusal.value) == message
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
        assert session.scalar(select(func.count()).select_from(File)) == 0
    assert not list(artifacts.glob("files/*"))
    ok = jobs(
        env,
        "submit",
        "generate",
        "--model",
        str(model),
        "--input",
        str(cases[0][0]),
        "--column",
        "prompt=question",
        "--gpus",
        "0",
    )
    assert ok.returncode == 0 and ok.stdout.startswith("job_"), ok.stderr


# --- the token pre-flight check -------------------------------------------------------------------------------


def test_the_token_check_counts_as_the_worker_does(tiny_model):
    """Without torch: a prompt row and a chat row are counted exactly as transformers counts them on the worker
    (tokenizer.json + the chat template rendered with jinja2), against max_position_embeddings."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    check = TokenCheck.for_model(tiny_model)
    assert check is not None and check.context == 512
    prompt = "What is the capital of France? " * 30
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    n_prompt = len(tok(prompt)["input_ids"])
    n_chat = len(
        tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
    )
    spec = parse_spec({"model": str(tiny_model), "input": "x"})
    fits = {"prompt": prompt, "params": {"max_new_tokens": 512 - n_prompt}}
    over = {"prompt": prompt, "params": {"max_new_tokens": 513 - n_prompt}}
    chat_fits = {"messages": messages, "params": {"max_new_tokens": 512 - n_chat}}
    chat_over = {"messages": messages, "params": {"max_new_tokens": 513 - n_chat}}
    assert check.problems([fits, over, chat_fits, chat_over], spec) == [
        None,
        f"prompt of {n_prompt} tokens + max_new_tokens {513 - n_prompt} exceeds the model's context of 512 tokens: "
        "shorten the prompt or lower max_new_tokens",
        None,
        f"prompt of {n_chat} tokens + max_new_tokens {513 - n_chat} exceeds the model's context of 512 tokens: "
        "shorten the prompt or lower max_new_tokens",
    ]


def test_rows_too_long_fail_in_validating_and_all_too_long_fails_before_any_shard(api, tiny_model):
    """Rows whose prompt + max_new_tokens exceed the context become failed rows with their line; the others stay
    pending. A dataset where every row is too long is refused at submit, and no job, row or shard is stored."""
    long = "What is the capital of France? " * 200
    job = api.submit(
        {
            "model": str(tiny_model),
            "gpus": 0,
            "max_new_tokens": 16,
            "input": api.upload(lines({"prompt": "hi"}, {"prompt": long, "custom_id": "long"})),
        }
    ).json()
    assert job["rows"] == {"total": 2, "succeeded": 0, "failed": 1, "pending": 1}
    errors = api.client.get(f"/jobs/{job['id']}/results", params={"errors": True}, headers=api.admin).text
    assert json.loads(errors)["error"].startswith("line 2: prompt of ")
    assert job["metrics"]["input"]["too_long"] == 1
    before = api.stored()
    response = api.submit(
        {
            "model": str(tiny_model),
            "gpus": 0,
            "max_new_tokens": 500,
            "input": api.upload(lines({"prompt": long}, {"prompt": long + "!"})),
        }
    )
    status, message = error_of(response)
    assert status == 422 and message.startswith(
        "no row of the dataset can run (2 rows, every one invalid); the first: line 1: prompt of"
    )
    assert message.endswith("shorten the prompt or lower max_new_tokens: fix the dataset and submit it again")
    assert {k: v for k, v in api.stored().items() if k != "on disk"} == {
        **{k: v for k, v in before.items() if k != "on disk"},
        "files": before["files"] + 1,  # the upload, the user's to submit again
    }


# --- outputs --------------------------------------------------------------------------------------------------


def finish_rows(job_id: str, outputs: dict[int, Any]) -> None:
    """Write results as a worker's commit would: later rows finish first (to test --order finished)."""
    with session_scope() as session:
        for idx, output in outputs.items():
            several = isinstance(output, list)
            session.execute(
                update(JobRow)
                .where(JobRow.job_id == job_id, JobRow.idx == idx)
                .values(
                    state="succeeded",
                    output=output,
                    finish_reason=["stop"] * len(output) if several else "length",
                    prompt_tokens=3,
                    completion_tokens=4,
                    worker="w1",
                    finished_at=1000.0 - idx,
                )
            )


def get(api, job_id: str, **params: Any):
    response = api.client.get(f"/jobs/{job_id}/results", params=params, headers=api.admin)
    assert response.status_code == 200, response.text
    return response


def test_results_in_every_format_and_order(api, model):
    """JSONL, OpenAI output and error files, CSV and Parquet, in input and finishing order; a row with two outputs
    is a list in JSONL and Parquet, two choices in OpenAI, a JSON list in a CSV cell; pass-through keys are
    columns; an unknown format is refused."""
    data = lines(
        openai_line("c1", {"model": "echo-me", "messages": [{"role": "user", "content": "a"}]}),
        openai_line("c2", {"prompt": "b", "n": 2, "temperature": 1.0}, url="/v1/completions"),
        openai_line("c3", {"messages": []}),
    )
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    finish_rows(job["id"], {0: "A", 1: ["B1", "B2"]})

    jsonl = [json.loads(x) for x in get(api, job["id"]).text.splitlines()]
    assert [(r["custom_id"], r["line"], r["output"]) for r in jsonl] == [("c1", 1, "A"), ("c2", 2, ["B1", "B2"])]
    assert jsonl[1]["finish_reason"] == ["stop", "stop"]
    finished = [json.loads(x)["custom_id"] for x in get(api, job["id"], order="finished").text.splitlines()]
    assert finished == ["c2", "c1"]

    out = [json.loads(x) for x in get(api, job["id"], format="openai").text.splitlines()]
    chat, comp = out[0]["response"]["body"], out[1]["response"]["body"]
    assert out[0]["custom_id"] == "c1" and out[0]["error"] is None and out[0]["response"]["status_code"] == 200
    assert chat["object"] == "chat.completion" and chat["model"] == "echo-me"
    assert chat["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "A", "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert comp["object"] == "text_completion" and comp["model"] == str(model)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in comp["choices"]] == [
        (0, "B1", "stop"),
        (1, "B2", "stop"),
    ]
    (err,) = [json.loads(x) for x in get(api, job["id"], format="openai", errors=True).text.splitlines()]
    assert err["custom_id"] == "c3" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert err["response"]["body"]["error"]["message"].startswith("line 3: 'messages' must be a non-empty list")

    table = list(csv.reader(io.StringIO(get(api, job["id"], format="csv").text)))
    assert table[0] == ["custom_id", "line", "output", "finish_reason", "prompt_tokens", "completion_tokens"]
    assert table[1:] == [
        ["c1", "1", "A", "length", "3", "4"],
        ["c2", "2", '["B1", "B2"]', '["stop", "stop"]', "3", "4"],
    ]
    errors_csv = list(csv.reader(io.StringIO(get(api, job["id"], format="csv", errors=True).text)))
    assert errors_csv[0] == ["custom_id", "line", "error"] and errors_csv[1][:2] == ["c3", "3"]

    response = get(api, job["id"], format="parquet", order="finished")
    assert response.headers["content-disposition"] == f'attachment; filename="{job["id"]}.parquet"'
    parquet = pq.read_table(io.BytesIO(response.content)).to_pylist()
    assert [(r["custom_id"], r["line"], r["output"]) for r in parquet] == [("c2", 2, ["B1", "B2"]), ("c1", 1, ["A"])]

    bad = api.client.get(f"/jobs/{job['id']}/results", params={"format": "xml"}, headers=api.admin)
    assert bad.status_code == 422 and "format" in error_of(bad)[1]


def test_the_openai_error_file_tells_rows_refused_at_submit_from_rows_failed_with_their_shard(api, model):
    """A row refused at submit is a 400 invalid_request_error; rows a failed shard left (they never reached a
    worker either: the worker was lost on every attempt) are a 500 server_error, as a row failed in the engine, so
    an OpenAI client retries them instead of taking its request for invalid."""
    from core.store import fail_pending_rows

    data = lines({"prompt": "a"}, {"prompt": "b"}, {"prompt": 7})
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    with session_scope() as session:
        fail_pending_rows(session, job["id"], 0, 3, "gave up after 3 attempts: the worker was lost each time")
    out = [json.loads(x) for x in get(api, job["id"], format="openai", errors=True).text.splitlines()]
    assert [(r["custom_id"], r["response"]["status_code"], r["response"]["body"]["error"]["type"]) for r in out] == [
        ("line-1", 500, "server_error"),
        ("line-2", 500, "server_error"),
        ("line-3", 400, "invalid_request_error"),
    ]


def test_with_input_puts_the_prompt_or_messages_beside_the_output_in_every_format(api, model):
    """`with_input=true` adds each row's prompt (or messages) to JSONL records, OpenAI output and error lines, and
    as columns after `line` to CSV and Parquet (messages as JSON text); without it no format carries them."""
    chat = [{"role": "user", "content": "Hi, there"}]
    data = lines({"prompt": "p, one", "topic": "t"}, {"messages": chat}, {"prompt": "p3", "max_new_tokens": 2})
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    finish_rows(job["id"], {0: "A", 1: "B"})
    with session_scope() as session:  # row 2 failed in the engine: its error record carries its prompt too
        session.execute(
            update(JobRow)
            .where(JobRow.job_id == job["id"], JobRow.idx == 2)
            .values(state="failed", error="engine broke", worker="w1")
        )

    jsonl = [json.loads(x) for x in get(api, job["id"], with_input=True).text.splitlines()]
    assert jsonl == [
        {"topic": "t", "custom_id": "line-1", "line": 1, "prompt": "p, one", "output": "A", "finish_reason": "length",
         "prompt_tokens": 3, "completion_tokens": 4},
        {"custom_id": "line-2", "line": 2, "messages": chat, "output": "B", "finish_reason": "length",
         "prompt_tokens": 3, "completion_tokens": 4},
    ]  # fmt: skip
    errors = [json.loads(x) for x in get(api, job["id"], errors=True, with_input=True).text.splitlines()]
    assert errors == [{"custom_id": "line-3", "line": 3, "prompt": "p3", "error": "engine broke"}]
    openai = [json.loads(x) for x in get(api, job["id"], format="openai", with_input=True).text.splitlines()]
    assert [(r["custom_id"], r.get("prompt"), r.get("messages")) for r in openai] == [
        ("line-1", "p, one", None),
        ("line-2", None, chat),
    ]
    openai_errors = get(api, job["id"], format="openai", errors=True, with_input=True).text
    assert json.loads(openai_errors)["prompt"] == "p3"
    table = list(csv.reader(io.StringIO(get(api, job["id"], format="csv", with_input=True).text)))
    assert table[0][:4] == ["custom_id", "line", "prompt", "messages"]
    assert [r[:5] for r in table[1:]] == [
        ["line-1", "1", "p, one", "", "A"],
        ["line-2", "2", "", json.dumps(chat), "B"],
    ]
    parquet = pq.read_table(io.BytesIO(get(api, job["id"], format="parquet", with_input=True).content)).to_pylist()
    assert [(r["prompt"], r["messages"] and json.loads(r["messages"]), r["output"]) for r in parquet] == [
        ("p, one", None, "A"),
        (None, chat, "B"),
    ]
    for fmt in ("jsonl", "openai", "csv"):  # off by default: no prompt, no messages in any format
        text = get(api, job["id"], format=fmt).text
        assert "p, one" not in text and "Hi, there" not in text, fmt
    plain = pq.read_table(io.BytesIO(get(api, job["id"], format="parquet").content))
    assert "prompt" not in plain.column_names and "messages" not in plain.column_names


def test_table_results_keep_pass_through_columns_and_parquet_rows(api, model, tmp_path):
    """A Parquet input's other columns come back as columns (text), under `row`, in CSV and Parquet results."""
    path = parquet_file(tmp_path / "p.parquet", {"prompt": ["x", "y"], "topic": ["a", "b"], "n": [1, 2]})
    job = api.submit({"model": str(model), "input": api.upload(path.read_bytes(), "p.parquet"), "gpus": 0}).json()
    finish_rows(job["id"], {0: "X", 1: "Y"})
    table = list(csv.reader(io.StringIO(get(api, job["id"], format="csv").text)))
    assert table == [
        ["custom_id", "row", "output", "finish_reason", "prompt_tokens", "completion_tokens", "topic", "n"],
        ["row-0", "0", "X", "length", "3", "4", "a", "1"],
        ["row-1", "1", "Y", "length", "3", "4", "b", "2"],
    ]
    parquet = pq.read_table(io.BytesIO(get(api, job["id"], format="parquet").content)).to_pylist()
    assert parquet[1] == {
        "custom_id": "row-1",
        "row": 1,
        "output": "Y",
        "finish_reason": "length",
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "topic": "b",
        "n": "2",
    }


def test_pass_through_keys_named_like_result_keys_come_back_under_extra_in_every_format(api, model):
    """A row's own `output`, `error`, `extra` and (in a line-numbered input) `row` keys are neither overwritten nor
    dropped: JSONL keeps the result's keys and puts the row's colliding ones under `extra`; CSV and Parquet have one
    `extra` column (a readable Parquet file) and `row` as a plain column."""
    data = lines(
        {"prompt": "p", "output": "gold", "error": "none", "extra": "mine", "row": 5, "topic": "t"},
        {"prompt": "q", "extra": {"k": 1}},
    )
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    finish_rows(job["id"], {0: "A", 1: "B"})
    jsonl = [json.loads(x) for x in get(api, job["id"]).text.splitlines()]
    assert [(r["output"], r["extra"], r["row"] if "row" in r else None) for r in jsonl] == [
        ("A", {"output": "gold", "error": "none", "extra": "mine"}, 5),
        ("B", {"extra": {"k": 1}}, None),
    ]
    table = list(csv.DictReader(io.StringIO(get(api, job["id"], format="csv").text)))
    header = next(csv.reader(io.StringIO(get(api, job["id"], format="csv").text)))
    assert header.count("extra") == 1 and "row" in header
    assert [(r["output"], json.loads(r["extra"]), r["row"], r["topic"]) for r in table] == [
        ("A", {"output": "gold", "error": "none", "extra": "mine"}, "5", "t"),
        ("B", {"extra": {"k": 1}}, "", ""),
    ]
    parquet = pq.read_table(io.BytesIO(get(api, job["id"], format="parquet").content)).to_pylist()
    assert [(r["output"], json.loads(r["extra"]), r["row"]) for r in parquet] == [
        ("A", {"output": "gold", "error": "none", "extra": "mine"}, "5"),
        ("B", {"extra": {"k": 1}}, None),
    ]


def test_boolean_pass_through_values_are_json_text_in_csv_and_parquet(api, model, tmp_path):
    """A JSONL row's `true` and a Parquet input's boolean column come back as `true`/`false` (JSON, like the lists
    and objects beside them), not Python's `True`; numbers stay as written and a null is an empty cell."""
    data = lines({"prompt": "p", "flag": True, "n": 3, "x": 1.5, "nil": None}, {"prompt": "q", "flag": False})
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    finish_rows(job["id"], {0: "A", 1: "B"})
    table = list(csv.DictReader(io.StringIO(get(api, job["id"], format="csv").text)))
    assert [(r["flag"], r["n"], r["x"], r["nil"]) for r in table] == [("true", "3", "1.5", ""), ("false", "", "", "")]
    parquet = pq.read_table(io.BytesIO(get(api, job["id"], format="parquet").content)).to_pylist()
    assert [(r["flag"], r["n"], r["nil"]) for r in parquet] == [("true", "3", None), ("false", None, None)]

    path = parquet_file(tmp_path / "b.parquet", {"prompt": ["x", "y"], "ok": [True, None]})
    job = api.submit({"model": str(model), "input": api.upload(path.read_bytes(), "b.parquet"), "gpus": 0}).json()
    finish_rows(job["id"], {0: "X", 1: "Y"})
    assert [r["ok"] for r in csv.DictReader(io.StringIO(get(api, job["id"], format="csv").text))] == ["true", ""]


def test_csv_results_keep_a_lone_carriage_return_inside_its_cell(api, model, tmp_path):
    """An output, prompt or pass-through value holding a lone \\r (old Mac line ends, terminal output) is quoted in
    CSV results: read back, every row is one record with its text unchanged, as in JSONL."""
    data = lines(
        {"prompt": "a\rb", "v": "cr\ronly"},
        {"prompt": "c", "v": "crlf\r\nend"},
        {"prompt": "d", "v": "plain"},
    )
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    finish_rows(job["id"], {0: "out\r", 1: "x", 2: "y"})
    text = get(api, job["id"], format="csv", with_input=True).text
    table = list(csv.DictReader(io.StringIO(text, newline="")))
    assert [(r["custom_id"], r["prompt"], r["output"], r["v"]) for r in table] == [
        ("line-1", "a\rb", "out\r", "cr\ronly"),
        ("line-2", "c", "x", "crlf\r\nend"),
        ("line-3", "d", "y", "plain"),
    ]
    assert text.splitlines()[-1] == "line-3,3,d,y,length,3,4,plain"  # other rows as before: quoted only where needed


# Every character str.splitlines() splits on besides \n and \r; JSON escapes the control ones but not these three.
BREAKS = "a\u2028b\u2029c\x85d\x0be\x0cf\x1cg"


def test_jsonl_results_escape_unicode_line_separators(api, model):
    """An output, prompt or pass-through value holding U+2028, U+2029 or U+0085 (valid JSON, but a line break to
    str.splitlines(), JavaScript and httpx's iter_lines) is escaped in JSONL results and the OpenAI output and error
    files: each row is one line, and json.loads gives the text back unchanged."""
    data = lines({"prompt": "p" + BREAKS, "v": BREAKS}, {"prompt": "q"}, {"prompt": BREAKS, "max_new_tokens": 2})
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    finish_rows(job["id"], {0: "out" + BREAKS, 1: ["x" + BREAKS, "y"]})
    with session_scope() as session:  # a row failed in the engine, its error holding them too
        session.execute(
            update(JobRow)
            .where(JobRow.job_id == job["id"], JobRow.idx == 2)
            .values(state="failed", error="engine broke: " + BREAKS, worker="w1")
        )
    for params in ({}, {"format": "openai"}, {"errors": True}, {"format": "openai", "errors": True}):
        text = get(api, job["id"], with_input=True, **params).text
        assert "\\u2028" in text and "\\u2029" in text and "\\u0085" in text, params
        assert len(text.splitlines()) == (1 if params.get("errors") else 2), params
        assert [json.loads(line) for line in text.splitlines()] == [json.loads(line) for line in text.split("\n")[:-1]]
    ours = [json.loads(line) for line in get(api, job["id"], with_input=True).text.splitlines()]
    assert [(r["prompt"], r.get("v"), r["output"]) for r in ours] == [
        ("p" + BREAKS, BREAKS, "out" + BREAKS),
        ("q", None, ["x" + BREAKS, "y"]),
    ]
    (error,) = [json.loads(line) for line in get(api, job["id"], errors=True, with_input=True).text.splitlines()]
    assert (error["prompt"], error["error"]) == (BREAKS, "engine broke: " + BREAKS)
    openai = [json.loads(line) for line in get(api, job["id"], format="openai").text.splitlines()]
    assert [c["text"] for r in openai for c in r["response"]["body"]["choices"]] == ["out" + BREAKS, "x" + BREAKS, "y"]


# --- through a real worker and the CLI ------------------------------------------------------------------------


def test_a_running_job_shows_progress_and_its_csv_results_download_in_every_format(
    tmp_path, jobs_env, api_server, spawn_worker, tiny_model
):
    """A CSV job on a real worker, slowed to one row per 0.8 s: `gpujobs status --json` read during the run shows
    two different rows-done values, results download while it runs; at the end status shows the time to first
    result (job and shard), and `results` writes Parquet and the OpenAI output file."""
    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    spawn_worker([], JOBS_TEST_FAULTS="sleep_0.8@batch")
    rows = 30  # 24 s or more: each `gpujobs status` below is a process of its own, seconds each on a loaded machine
    data = write(
        tmp_path / "q.csv", "question,id\n" + "".join(f"What is the capital of France? {i},q{i}\n" for i in range(rows))
    )
    sub = jobs(
        env,
        "submit",
        "generate",
        "--model",
        str(tiny_model),
        "--input",
        str(data),
        "--column",
        "prompt=question",
        "--column",
        "custom_id=id",
        "--max-new-tokens",
        "4",
        "--batch-rows",
        "1",
        "--gpus",
        "0",
        check=True,
    )
    job_id = sub.stdout.strip()
    seen: list[int] = []

    def status() -> dict[str, Any]:
        return json.loads(jobs(env, "status", job_id, "--json", check=True).stdout)

    def two_values() -> bool:
        job = status()
        if job["state"] == "running":
            seen.append(job["rows"]["succeeded"])
        return len({v for v in seen if 0 < v < rows}) >= 2 or job["state"] not in ("queued", "validating", "running")

    wait_for(two_values, 120, "two progress values", interval=0.1)
    assert len({v for v in seen if 0 < v < rows}) >= 2, seen
    partial = jobs(env, "results", job_id, "--format", "csv", check=True).stdout.splitlines()
    assert partial[0].startswith("custom_id,line,output") and 1 <= len(partial) - 1 <= rows

    final = json.loads(jobs(env, "wait", job_id, "--json", check=True).stdout)
    assert final["rows"]["succeeded"] == rows
    assert 0 < final["metrics"]["time_to_first_result_s"] < final["metrics"]["duration_s"]
    assert final["metrics"]["shard_time_to_first_result_s"]["shards"] == 1
    text = jobs(env, "status", job_id, check=True).stdout
    assert "first    result" in text and "per shard" in text

    out = tmp_path / "r.parquet"
    jobs(env, "results", job_id, "--format", "parquet", "--order", "finished", "-o", str(out), check=True)
    table = pq.read_table(out).to_pylist()
    assert sorted(r["custom_id"] for r in table) == sorted(f"q{i}" for i in range(rows))
    assert [r["line"] for r in table] == list(range(2, rows + 2))  # one row per batch: finishing order = input order
    openai = [json.loads(x) for x in jobs(env, "results", job_id, "--format", "openai", check=True).stdout.splitlines()]
    assert openai[0]["response"]["body"]["object"] == "text_completion"
    assert openai[0]["response"]["body"]["choices"][0]["text"] == table[0]["output"]
