"""torch's inductor cache directory ($TMPDIR/torchinductor_USER), which merely importing torch._dynamo creates (fake
tensors and tracing import it): removed at exit when this process made it and nothing was cached in it."""
from __future__ import annotations

import atexit
import getpass
import os
import re
import tempfile

_REGISTERED: list[str] = []


def default_cache_dir() -> str:
    """Where torch puts it when TORCHINDUCTOR_CACHE_DIR is unset (torch/_inductor/runtime/cache_dir_utils.py, 2.13)."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def remove_at_exit_if_made_here() -> None:
    """Once per process: unless the user chose a cache directory or it already exists, remove torch's default one
    at exit if it was made meanwhile and is empty (empty subdirectories included; anything cached is kept)."""
    if _REGISTERED or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    path = default_cache_dir()
    _REGISTERED.append(path)
    if not os.path.lexists(path):
        atexit.register(remove_if_empty, path)


def remove_if_empty(path: str) -> None:
    """Remove `path` and its subdirectories bottom-up where they hold no file; a file anywhere keeps its parents."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    for top, _dirs, _files in os.walk(path, topdown=False):
        try:
            os.rmdir(top)
        except OSError:  # not empty: a file cached here (or another process's)
            pass
