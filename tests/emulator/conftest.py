"""The SIMT emulator's tests need a C++17 compiler (the emulator builds the kernels with it)."""

from __future__ import annotations

import shutil

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"):
        return
    skip = pytest.mark.skip(reason="no C++ compiler for the SIMT emulator")
    for item in items:
        if "tests/emulator" in str(item.fspath):
            item.add_marker(skip)
