"""Fine-tune data and checkpoints without a queue (fast; also run under transformers 5.17): which tokens carry the
loss, truncate-or-refuse, packing, the validation split, target-module checks, complete-checkpoint selection."""

from __future__ import annotations

import pytest

from core.errors import CannotTrain, InvalidInput
from core.spec import FinetuneSpec
from worker.training import data, finetune, setup


@pytest.fixture(scope="module")
def tok(base_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


def spec(**extra) -> FinetuneSpec:
    return FinetuneSpec(**{"model": "m", "input": "file_x", **extra})


def learned(tok, ex: data.Example) -> str:
    return tok.decode([t for t, label in zip(ex.input_ids, ex.labels) if label != data.IGNORE])


def test_loss_is_only_on_the_completion_and_the_assistant_turns(tok):
    """prompt/completion: the completion and EOS; chat: each assistant turn and its end token, never the user's or
    the template's generation prompt; text: every token."""
    ex = data.tokenize_row(tok, {"prompt": "What is 2 + 2?", "completion": "Four."})
    assert learned(tok, ex) == "Four.<|endoftext|>"
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Sky?"},
            {"role": "assistant", "content": "Blue."},
        ]
    }
    ex = data.tokenize_row(tok, chat)
    assert learned(tok, ex) == "Hello.<|im_end|>\nBlue.<|im_end|>\n"
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(chat["messages"], tokenize=False)
    ex = data.tokenize_row(tok, {"text": "the sky is blue"})
    assert ex.labels == ex.input_ids


def test_rows_encoded_in_batches_are_what_each_row_gives_alone(tok, monkeypatch):
    """build_examples encodes every row's texts in batched tokenizer calls (data.ENCODE_BATCH texts each; 3 here, so
    batches end inside rows): each row's ids and labels are those of encoding its texts one by one."""
    monkeypatch.setattr(data, "ENCODE_BATCH", 3)
    eos = [tok.eos_token_id]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rows = [
        {"text": "the sky is blue"},
        {"prompt": "What is 2 + 2?", "completion": "Four."},
        {"messages": chat},
        {"prompt": "Say nothing.", "completion": ""},
        {"text": "ok"},
        {"messages": [*chat, {"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}]},
    ]
    examples, _ = data.build_examples(tok, list(enumerate(rows, 1)), spec())
    assert [e.input_ids for e in examples] == [data.tokenize_row(tok, r).input_ids for r in rows]
    assert [e.labels for e in examples] == [data.tokenize_row(tok, r).labels for r in rows]

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    assert examples[0].input_ids == examples[0].labels == encode("the sky is blue") + eos
    assert examples[1].input_ids == encode("What is 2 + 2?") + encode("Four.") + eos
    assert examples[3].labels == [data.IGNORE] * len(encode("Say nothing.")) + eos  # only EOS to learn
    for ex, row in ((examples[2], rows[2]), (examples[5], rows[5])):
        assert tok.decode(ex.input_ids) == tok.apply_chat_template(row["messages"], tokenize=False)
    assert learned(tok, examples[5]) == "Hello.<|im_end|>\nBlue.<|im_end|>\n"


def test_long_rows_are_refused_by_line_or_truncated_by_choice_and_packing_splits_them(tok):
    rows = [(1, {"text": "short"}), (2, {"text": "the sky is blue " * 20}), (3, {"text": "ok"})]
    with pytest.raises(CannotTrain, match=r"1 row\(s\) are longer than max_seq_length=16 tokens: line 2 \("):
        data.build_examples(tok, rows, spec(max_seq_length=16))
    examples, truncated = data.build_examples(tok, rows, spec(max_seq_length=16, truncation="truncate"))
    assert truncated == 1 and max(len(e.input_ids) for e in examples) == 16
    examples, truncated = data.build_examples(tok, rows, spec(max_seq_length=16, packing=True))
    blocks = data.pack(examples, 16)
    assert truncated == 0 and sum(b.real_tokens for b in blocks) == sum(len(e.input_ids) for e in examples)
    assert all(len(b.input_ids) == 16 for b in blocks)  # padded to full blocks (worker/training/data.py pack)


def test_validation_split_is_seeded_and_validation_rows_are_kept_apart():
    rows = [(i, {"text": f"row {i}"}) for i in range(1, 11)]
    train, valid = data.split_validation(rows, 0.2, seed=3)
    assert len(valid) == 2 and len(train) == 8
    assert data.split_validation(rows, 0.2, seed=3) == (train, valid)
    marked = rows + [(1, {"text": "v", "split": "validation"})]
    assert data.split_validation(marked, None, seed=0) == (rows, [(1, {"text": "v", "split": "validation"})])
    # holding out every row is refused at submit, and by the worker (a job stored before that check) for good
    with pytest.raises(CannotTrain, match=r"^cannot train as submitted: validation_split=0.75 leaves no training"):
        data.split_validation(rows[:2], 0.75, seed=0)


def test_unknown_target_modules_are_refused_naming_the_models_linear_layers(base_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model)
    with pytest.raises(CannotTrain, match=r"target_modules \['qkv'\] do not exist.*'q_proj'"):
        setup.check_target_modules(model, spec(target_modules=["q_proj", "qkv"]))
    with pytest.raises(InvalidInput, match="modules_to_save"):
        setup.check_target_modules(model, spec(modules_to_save=["wte"]))
    setup.check_target_modules(model, spec(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))


def test_resume_takes_the_newest_complete_checkpoint_and_removes_half_written_ones(tmp_path):
    for step, complete in ((10, True), (20, True), (30, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / finetune.COMPLETE).write_text(str(step))
    assert finetune.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-20"
    assert not (tmp_path / "checkpoint-30").exists()
    assert finetune.latest_checkpoint(tmp_path / "missing") is None


def test_finetune_spec_refuses_untrainable_settings_with_a_reason():
    from core.spec import parse_spec

    for extra, match in (
        ({"lr_scheduler": "cosinus"}, "unknown lr_scheduler"),
        ({"quantization": "torchao-int8"}, "bnb-4bit"),
        ({"adapter": "job_x"}, "continuing an adapter"),
        ({"truncation": "cut"}, "truncation"),
        ({"then_generate": {"max_new_tokens": 3}}, "then_generate needs an input"),
        # a comma string (as --set gives it) or a misspelt all-linear: what to give, not the type checks' internals
        ({"target_modules": "q_proj,v_proj"}, r"^invalid finetune spec: target_modules: 'q_proj,v_proj': give a list"),
        ({"target_modules": "all_linear"}, r"'all_linear': give a list of module names .* or 'all-linear'$"),
    ):
        with pytest.raises(InvalidInput, match=match):
            parse_spec({"kind": "finetune", "model": "m", "input": "file_x", **extra})


def test_a_short_run_without_a_queue_logs_eval_loss_and_saves_the_adapter(tmp_path, base_model):
    """finetune() runs as a plain function: a validation split is evaluated at each checkpoint (eval_loss logged),
    checkpoints are marked complete, and the adapter is saved in safetensors."""
    from core.spec import LoadOptions

    rows = [(i, {"prompt": f"Q{i}?", "completion": f"A{i}."}) for i in range(1, 9)]
    logs: list[dict] = []
    result = finetune.finetune(
        LoadOptions(model=str(base_model)),
        spec(model=str(base_model), max_steps=4, checkpoint_steps=2, validation_split=0.25, batch_size=2),
        rows,
        tmp_path,
        on_log=logs.append,
    )
    assert [e["step"] for e in logs if "eval_loss" in e] == [2, 4]
    assert [s for s, _ in finetune.complete_checkpoints(tmp_path / "checkpoints")] == [2, 4]
    assert (result.adapter_dir / "adapter_model.safetensors").is_file() and not result.stopped
    assert result.metrics["validation_examples"] == 2 and result.metrics["examples"] == 6


def test_the_finetune_data_benchmark_times_both_ways_and_finds_them_equal(base_model, tmp_path):
    """ops/bench/finetune_data.py on a few rows of the tiny base's tokenizer: a table, JSON, equal examples."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "data.json"
    proc = subprocess.run(
        [sys.executable, "ops/bench/finetune_data.py", "--model", str(base_model), "--steps", "2", "--repeat", "2"]
        + ["--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["finetune_data"]
    assert report["same_examples"] and report["rows"] > 0 and report["blocks"] > 0
    assert len(report["seconds"]["one call per text"]["runs"]) == 2 and "batched over" in proc.stdout
