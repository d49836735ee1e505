"""Export a registered LoRA adapter merged into its base (`merge_and_unload`): a plain transformers model directory
that loads with `AutoModelForCausalLM.from_pretrained` alone, with no peft needed.

Run by `gpujobs adapters export ID --merged DIR` as `python -m worker.export` (the CLI never imports torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export_merged(base: str | Path, adapter: str | Path, out: str | Path, *, revision: str | None = None) -> Path:
    """Load the base in fp32 on the CPU, apply the adapter, merge, and save model + tokenizer as safetensors."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(base), revision=revision, dtype=torch.float32, local_files_only=True, use_safetensors=True
    )
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base), revision=revision, local_files_only=True).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.export", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the adapter's base model directory")
    parser.add_argument("--revision", help="the base model's revision")
    parser.add_argument("--adapter", required=True, help="the adapter directory")
    parser.add_argument("--out", required=True, help="where to write the merged model")
    args = parser.parse_args(argv)
    print(export_merged(args.base, args.adapter, args.out, revision=args.revision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
