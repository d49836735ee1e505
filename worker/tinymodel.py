"""Tiny Qwen3-style causal LMs, built entirely offline, for tests and the demo.

A randomly initialised model emits arbitrary tokens, so tests could only assert
on exact token ids, and those change whenever torch or transformers change
their initialisation. Instead we overfit a ~100k-parameter model on a handful
of Q&A pairs: tests then assert on *memorized answers* ("Paris."), which hold
across library versions. Both input styles the worker supports are trained:
a plain prompt (question -> answer + <|endoftext|>) and ChatML chat
(template(question) -> answer + <|im_end|>), so either stops generation.
"""

from __future__ import annotations

import argparse
import json
import logging
import string
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

logger = logging.getLogger(__name__)

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Same shape as Qwen's template minus the default system prompt, which would
# only lengthen every sequence the tiny model has to memorize.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_STEPS = 1500
CHECK_EVERY = 25
# Keep training past the first perfect check until loss is this low, so greedy
# answers survive small numeric differences between transformers versions.
TARGET_LOSS = 0.02
# ~150 common words: six Q&A pairs alone give too few BPE merges to
# reach a realistic ~512+ vocabulary, and real prompts in demos tokenize shorter.
SEED_CORPUS = """the of and to in is you that it he was for on are as with his they at be this
have from or one had by word but not what all were we when your can said there use an each which
she do how their if will up other about out many then them these so some her would make like him
into time has look two more write go see number no way could people my than first water been call
who oil its now find long down day did get come made may part answer question capital France Paris
city country world planet color sky blue red green yellow black white four eight legs spider Mars
Earth sun moon star book wrote author name hello thanks please yes good bad big small old new
user assistant system message prompt model token 0 1 2 3 4 5 6 7 8 9 10 100 2024 + - = ? ! . ,"""


def build_tokenizer(texts: list[str], vocab_size: int = 640) -> PreTrainedTokenizerFast:
    """Byte-level BPE: the 256-byte alphabet means any text tokenizes, never <unk>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The byte alphabet already covers any input; the extra texts only add merges.
    tok.train_from_iterator([*texts, string.printable, SEED_CORPUS], trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        extra_special_tokens=[IM_START, IM_END],
        padding_side="left",  # decoder-only batched generation needs left padding
        model_max_length=512,  # = max_position_embeddings
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def chat_prompt(tok: PreTrainedTokenizerFast, question: str) -> str:
    # tokenize=False sidesteps the v5 change where tokenize=True returns a BatchEncoding.
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def _examples(tok: PreTrainedTokenizerFast, qa: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(prompt, answer, stop token) in both the plain and the chat format."""
    return [ex for q, a in qa for ex in ((q, a, EOS), (chat_prompt(tok, q), a, IM_END))]


def _train_batch(tok: PreTrainedTokenizerFast, examples: list[tuple[str, str, str]]) -> dict[str, torch.Tensor]:
    # Prompt and answer are encoded separately so the training tokens are exactly
    # those greedy decoding must produce after the prompt.
    rows = []
    for prompt, answer, stop in examples:
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(answer, add_special_tokens=False) + [tok.convert_tokens_to_ids(stop)]
        rows.append((p + a, [-100] * len(p) + a))
    width = max(len(ids) for ids, _ in rows)
    pad = tok.pad_token_id
    return {  # right padding: positions then start at 0, as in left-padded generate
        "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows]),
    }


@torch.no_grad()
def generate_answers(
    model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, prompts: list[str], max_new_tokens: int = 24
) -> list[str]:
    """Batched, left-padded greedy decoding: the same path the worker takes."""
    was_training = model.training
    model.eval()
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    model.train(was_training)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def _train(
    model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, qa: list[tuple[str, str]], steps: int | None
) -> tuple[int, float]:
    """Train all parameters until every answer is reproduced; returns (steps, accuracy)."""
    examples = _examples(tok, qa)
    batch = _train_batch(tok, examples)
    longest = max(len(tok.encode(a, add_special_tokens=False)) for _, a, _ in examples)  # room for EOS too
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    cap, accuracy, step = steps or MAX_STEPS, 0.0, 0
    while step < cap:
        step += 1
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % CHECK_EVERY == 0 or step == cap:
            got = generate_answers(model, tok, [p for p, _, _ in examples], max_new_tokens=max(24, longest + 1))
            accuracy = sum(g == a for g, (_, a, _) in zip(got, examples)) / len(examples)
            logger.info("step %d loss %.4f memorized %.0f%%", step, loss.item(), 100 * accuracy)
            # An explicit step count means "train exactly this long" (reproducible runs).
            if accuracy == 1.0 and loss.item() < TARGET_LOSS and steps is None:
                break
    return step, accuracy


def build_model(
    out_dir: str | Path,
    *,
    qa: list[tuple[str, str]] | None = None,
    seed: int = 0,
    steps: int | None = None,
    memorize: bool = True,
    tok: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Build (and optionally memorize ``qa`` into) a tiny Qwen3 model saved at ``out_dir``.

    ``memorize=False`` builds a *base* model: the tokenizer knows the words of ``qa`` but the random weights have
    learnt nothing, so a LoRA fine-tune is what teaches it the answers (tests of fine-tuning, the demo). ``tok``: a
    tokenizer of ``build_tokenizer``'s kind to use instead of one trained on ``qa`` (benchmarks: a larger one).
    """
    out = Path(out_dir)
    t0 = time.monotonic()
    torch.manual_seed(seed)
    tok = tok or build_tokenizer([t for pair in qa or [] for t in pair])
    eos, im_end = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(IM_END)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = Qwen3ForCausalLM(config)
    if not memorize:
        # The embedding's padding_idx row (pad = EOS here) starts at zero and, tied to lm_head, pins EOS's logit at
        # 0: a LoRA could never learn to stop. A real base model has a trained EOS row; give ours a random one.
        with torch.no_grad():
            model.get_input_embeddings().weight[eos].normal_(0.0, config.initializer_range)
    # Stop on either terminator so plain prompts and chat both end cleanly.
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, eos], pad_token_id=eos, bos_token_id=eos, do_sample=False, max_new_tokens=32
    )
    trained, accuracy = _train(model, tok, qa, steps) if qa and memorize else (0, None)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    meta = {
        "seed": seed,
        "steps": trained,
        "qa_pairs": len(qa or []) if memorize else 0,
        "memorized": accuracy == 1.0,
        "accuracy": accuracy,
        "params": sum(p.numel() for p in model.parameters()),
        "build_seconds": round(time.monotonic() - t0, 2),
    }
    (out / "gpujobs_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("saved %s: %s", out, meta)
    return out


# Workload G1's architecture (DESIGN.md): Qwen3-0.6B shapes with random bf16 weights, for GPU checks and benchmarks.
QWEN3_06B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)


def build_random(out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Qwen3-0.6B-shaped model with random weights and our small tokenizer (ids it never emits decode to "")."""
    out = Path(out_dir)
    torch.manual_seed(seed)
    tok = build_tokenizer([])
    eos = tok.convert_tokens_to_ids(EOS)
    config = Qwen3Config(
        **QWEN3_06B, initializer_range=0.02, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, dtype=dtype
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _read_qa(path: Path) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["question"], r["answer"]) for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.tinymodel", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--qa", type=Path, help="jsonl with {'question', 'answer'} rows to memorize")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps")
    parser.add_argument(
        "--base",
        action="store_true",
        help="a base model: tokenizer from --qa's words, weights untrained (for fine-tunes)",
    )
    parser.add_argument(
        "--arch",
        choices=["tiny", "qwen3-0.6b"],
        default="tiny",
        help="qwen3-0.6b: random bf16 weights of that shape (GPU checks, benchmarks)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if args.arch == "qwen3-0.6b":
        print(build_random(args.out_dir, seed=args.seed))
        return 0
    qa = _read_qa(args.qa) if args.qa else None
    print(build_model(args.out_dir, qa=qa, seed=args.seed, steps=args.steps, memorize=not args.base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
