"""Fixtures of the conformance tests: the vendor's own Arctic RL servers (v2 and v1), served on CPU, one per module.

Where the vendor's code is found (``vendor_src``, ``vendor_kit``, ``vendor_v1_src``) is a fixture of
``tests/conftest.py``; the launchers are in ``tests/support/vendor.py``. Tests destroy the jobs they create
(a server holds one job per type at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.vendor import VendorServer, running_vendor_server, running_vendor_v1_server


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
