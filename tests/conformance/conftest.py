"""Fixtures of the conformance tests: the vendor's own Arctic RL servers (v2 and v1), served on CPU, one per module,
and the small reverse-text task the end-to-end runs against the vendor train on.

Where the vendor's code is found (``vendor_src``, ``vendor_kit``, ``vendor_v1_src``) is a fixture of
``tests/conftest.py``; the launchers are in ``tests/support/vendor.py``. Tests destroy the jobs they create
(a server holds one job per type at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.scripts import REPO_ROOT, load_script
from tests.support.vendor import VendorServer, running_vendor_server, running_vendor_v1_server

REVERSE_TEXT = REPO_ROOT / "examples" / "reverse_text"


@pytest.fixture(scope="module")
def vendor_server(vendor_kit: Path, vendor_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VendorServer]:
    """The vendor's v2 server (Arctic-Platform) for this module."""
    with running_vendor_server(vendor_kit, vendor_src, tmp_path_factory.mktemp("vendor")) as server:
        yield server


@pytest.fixture(scope="module")
def vendor_v1_server(vendor_kit: Path, vendor_v1_src: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[VendorServer]:
    """The vendor's v1 server (PyPI ``arctic-platform==0.1.2``) for this module."""
    with running_vendor_v1_server(vendor_kit, vendor_v1_src, tmp_path_factory.mktemp("vendor_v1")) as server:
        yield server


@pytest.fixture(scope="module")
def reverse_text_task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reverse-text example's task, small: its untrained model, 8 training and 4 validation prompts."""
    root = tmp_path_factory.mktemp("reverse_text_task")
    model = load_script(REVERSE_TEXT / "make_model.py").make_model(root / "model", seed=0)
    load_script(REVERSE_TEXT / "make_data.py").write_dataset(root / "data", n_train=8, n_val=4, seed=0)
    return {"model": Path(model), "train": root / "data" / "train.parquet", "val": root / "data" / "val.parquet",
            "reward": REVERSE_TEXT / "reward.py"}
