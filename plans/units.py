"""Units of the files and messages mmplan writes: bytes as people read them."""
from __future__ import annotations


def format_bytes(n: float) -> str:
    """Bytes in SI units, as datasheets and the cluster files count them (1 kB = 1000 B): "512 B", "1.5 kB",
    "23.4 GB", "3.8 TB". The one byte formatter of the CLI's tables and of every error message."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def short_by(need: float, have: float) -> str:
    """"(3.2 MB short)": the shortfall in a unit that shows it (a fixed 0.00 GB hid small ones)."""
    return f"({format_bytes(need - have)} short)"
