"""The accuracy study's corpus: the Python standard library's `.py` sources, read as bytes.

The split is by file and fixed: a file is held out when the first eight bytes of the SHA-256 of
its path relative to the library root, read as a big-endian integer, fall below
HELDOUT_PERCENT percent of 2**64. It depends on the path alone, so the same file lands on the same
side on every machine and Python version that has it, and adding or removing files never moves
another file across.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

HELDOUT_PERCENT = 5
# Installed packages live under the standard library's directory on some builds; they are not
# part of the corpus.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def add_root_argument(parser) -> None:
    """The scripts' --corpus-root option; `resolve_root(args.corpus_root)` resolves it."""
    parser.add_argument("--corpus-root", default=None,
                        help="directory of the .py files (default: this Python's standard library)")


def resolve_root(option: "str | None") -> Path:
    return Path(option) if option else stdlib_root()


def list_sources(root: Path) -> list[str]:
    """Sorted paths (relative to root, '/'-separated) of every `.py` file under root."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        for name in files:
            if name.endswith(".py"):
                found.append(Path(directory, name).relative_to(root).as_posix())
    return sorted(found)


def is_heldout(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < HELDOUT_PERCENT * 2**64 // 100


def split(paths: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout), each in the order of `paths`."""
    train = [p for p in paths if not is_heldout(p)]
    heldout = [p for p in paths if is_heldout(p)]
    return train, heldout


def read_concatenated(root: Path, paths: list[str]) -> bytes:
    """The files' bytes back to back, in the given order (files end in a newline already)."""
    return b"".join(Path(root, p).read_bytes() for p in paths)


def make_streams(root: Path, paths: list[str], length: int, count: int) -> list[bytes]:
    """`count` streams of exactly `length` bytes: the files are concatenated in order and the
    result cut into consecutive pieces, so a stream runs across file boundaries."""
    if length <= 0 or count <= 0:
        raise ValueError(f"need length > 0 and count > 0, got length={length}, count={count}")
    data = read_concatenated(root, paths)
    if len(data) < length * count:
        raise ValueError(
            f"{len(paths)} files hold {len(data)} bytes, fewer than {count} streams of {length}")
    return [data[i * length:(i + 1) * length] for i in range(count)]


def write_list(path: Path, paths: list[str]) -> None:
    Path(path).write_text("".join(p + "\n" for p in paths))


def read_list(path: Path) -> list[str]:
    return [line for line in Path(path).read_text().splitlines() if line]
