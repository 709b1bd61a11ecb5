"""Units of the files and messages mmplan writes: bytes as people read them."""
from __future__ import annotations


def format_bytes(n: float) -> str:
    """Bytes in SI units, as datasheets and the cluster files count them (1 kB = 1000 B): "512 B", "1.5 kB",
    "23.4 GB", "3.8 TB". The one byte formatter of the CLI's tables and of every error message."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_capacity(n: float) -> str:
    """A device's memory as its datasheet and nvidia-smi state it: SI bytes with the binary figure beside them, so an
    H100's 81,559 MiB reads "85.5 GB (79.6 GiB)" -- the "80 GB" of the catalog's name is GiB."""
    return f"{format_bytes(n)} ({n / 2**30:.1f} GiB)" if n >= 2**30 else format_bytes(n)


def plural(count: float, word: str, words: str | None = None) -> str:
    """"1 GPU", "2 GPUs", "1 micro-batch", "4 micro-batches": the count and the word in its number."""
    return f"{count:,} {word if count == 1 else (words or word + 's')}"


def short_by(need: float, have: float) -> str:
    """"(3.2 MB short)": the shortfall in a unit that shows it (a fixed 0.00 GB hid small ones)."""
    return f"({format_bytes(need - have)} short)"
