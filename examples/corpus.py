"""Offline text for the examples and benchmarks: this Python's standard-library sources, as bytes.

The same on every machine with the same Python, nothing downloaded: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` in sorted path order (test suites and vendored packages
skipped), concatenated, vocabulary 256.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

_SKIPPED = ("test", "tests", "idlelib", "site-packages", "lib2to3")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Up to ``max_bytes`` bytes of the stdlib's ``.py`` files (sorted paths, test suites skipped), uint8."""
    root = stdlib_root()
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if any(part in _SKIPPED for part in path.relative_to(root).parts):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise SystemExit(f"no Python sources found under {root}")
    corpus = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8).clone()


def random_windows(data: torch.Tensor, size: int, context: int, generator: torch.Generator,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random windows of ``context + 1`` bytes: (inputs, next-byte targets), int64 on ``device``."""
    starts = torch.randint(0, data.numel() - context - 1, (size,), generator=generator)
    windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].to(device), windows[:, 1:].to(device)
