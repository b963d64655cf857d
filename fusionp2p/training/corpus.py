"""Text the data owner trains on, as token batches that never leave its process.

The tokenizer is byte-level (token = byte, vocabulary 256): it works on any text, needs
nothing downloaded, and is the same on every machine. The default corpus is the Python
standard library's own source, found on every machine that runs fusionp2p.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fusionp2p.errors import ConfigError
from fusionp2p.training.batches import Batch, seeded_batches

__all__ = ["BYTE_VOCAB", "TextCorpus", "stdlib_source_dir"]

BYTE_VOCAB = 256
_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h", ".html")


def stdlib_source_dir() -> Path:
    """Where this interpreter's standard library sources are."""
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    found = [
        p
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in _TEXT_SUFFIXES and "site-packages" not in p.parts
    ]
    if not found:
        raise ConfigError(f"[data] path: {root} holds no text files ({', '.join(_TEXT_SUFFIXES)})")
    return found


@dataclass
class TextCorpus:
    """Byte tokens of a text file or directory, cut into samples of ``seq_len`` tokens."""

    tokens: torch.Tensor  # uint8, the whole corpus
    seq_len: int
    source: str

    @classmethod
    def load(cls, path: str, *, seq_len: int, max_bytes: int) -> TextCorpus:
        """Reads up to ``max_bytes`` of text from ``path`` ("" = the stdlib's source).

        Raises:
            ConfigError: the path is missing, holds no text, or too little for one sample.
        """
        root = Path(path) if path else stdlib_source_dir()
        if not root.exists():
            raise ConfigError(f"[data] path: {root} does not exist")
        chunks: list[bytes] = []
        total = 0
        for file in _files(root):
            try:
                data = file.read_bytes()
            except OSError:
                continue
            chunks.append(data[: max_bytes - total])
            total += len(chunks[-1])
            if total >= max_bytes:
                break
        if total < 2 * (seq_len + 1):
            raise ConfigError(
                f"[data] path: {root} holds {total} bytes, too few for samples of {seq_len} tokens"
            )
        tokens = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        return cls(tokens, seq_len, str(root))

    @property
    def n_samples(self) -> int:
        return len(self.tokens) // self.seq_len

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index``: ``seq_len`` token ids (int64)."""
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len].long()

    @property
    def unit(self) -> str:
        return "tokens"

    @property
    def units_per_sample(self) -> int:
        return self.seq_len

    def describe(self) -> str:
        return f"{len(self.tokens) / 1e6:.1f} MB of text from {self.source} ({self.n_samples} samples)"

    def batches(self, micro_batch_size: int, n_micro_batches: int, *, seed: int) -> Iterator[Batch]:
        """Endless iterations, each ``n_micro_batches`` of ``(inputs, labels)`` pairs of shape
        ``[micro_batch_size, seq_len]``, drawn without replacement in a seeded order. The
        labels are the inputs: the ``lm`` loss predicts each next token."""

        def micro_batch(picks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.stack([self.sample(i) for i in picks])
            return x, x

        return seeded_batches(self.n_samples, micro_batch, micro_batch_size, n_micro_batches, seed=seed)
