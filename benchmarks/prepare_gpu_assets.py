"""Converts Mistral's tekken tokenizer into an ordinary Hugging Face tokenizer folder.

The GPU machine has no ``mistral_common``; run this here and carry the output folder over:

    python benchmarks/prepare_gpu_assets.py --out benchmarks/assets/tekken

The source is ``mistral_common/data/tekken_240718.json`` (Apache-2.0, 131072 tokens; 1000
special tokens first, raw bytes at ids 1000-1255). transformers converts it when it finds a
``tekken.json`` in a folder; the result is saved as ``tokenizer.json`` +
``tokenizer_config.json``, which any transformers 5 loads with ``AutoTokenizer``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path


def convert(out: Path) -> Path:
    import mistral_common
    from transformers import AutoTokenizer

    source = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(source, Path(tmp) / "tekken.json")
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    (out / "LICENSE.txt").write_text("tekken_240718.json from mistral_common: Apache-2.0\n")
    reloaded = AutoTokenizer.from_pretrained(str(out))
    if len(reloaded) != 131072:
        raise SystemExit(f"converted tokenizer has {len(reloaded)} tokens, expected 131072")
    ids = reloaded.encode("Hello, world!", add_special_tokens=False)
    if reloaded.decode(ids) != "Hello, world!":
        raise SystemExit("converted tokenizer does not round-trip text")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "assets" / "tekken")
    args = parser.parse_args()
    path = convert(args.out)
    print(f"wrote {path} ({sum(f.stat().st_size for f in path.iterdir()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
