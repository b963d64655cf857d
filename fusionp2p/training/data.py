"""What a data owner trains on, by the job's ``[data] kind``: text for causal LMs, images
for classifiers. Either way the samples never leave the data owner's process.
"""

from __future__ import annotations

from fusionp2p.errors import ConfigError
from fusionp2p.training.batches import TrainingData
from fusionp2p.training.corpus import TextCorpus
from fusionp2p.training.images import DigitImages

__all__ = ["DATA_KINDS", "load_data"]

DATA_KINDS = ("text", "digits")  # what a job's ``[data] kind`` may name


def load_data(
    kind: str,
    *,
    path: str = "",
    seq_len: int = 64,
    max_bytes: int = 4_000_000,
    image_size: int = 8,
    channels: int = 1,
) -> TrainingData:
    """A job's data by its ``kind``: ``"text"`` (a byte-level corpus of ``path`` cut into
    samples of ``seq_len`` tokens, "" = the stdlib's source, at most ``max_bytes``) or
    ``"digits"`` (scikit-learn's bundled digits as ``channels`` x ``image_size``² images).

    Raises:
        ConfigError: a missing path, too little text, or an unknown kind.
    """
    if kind == "text":
        return TextCorpus.load(path, seq_len=seq_len, max_bytes=max_bytes)
    if kind == "digits":
        return DigitImages.load(image_size=image_size, channels=channels)
    raise ConfigError(f"[data] kind: must be one of {list(DATA_KINDS)}, got {kind!r:.40}")
