"""Hugging Face tests need transformers (pip install -e ".[hf]"); without it they are skipped."""
import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e \".[hf]\")")
