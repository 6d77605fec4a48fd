"""Fixtures of the conformance tests: the vendor's own Arctic RL servers (v2 and v1), served on CPU.

They are defined in ``tests/_helpers_vendor.py`` (shared with other tests that run against the vendor) and
exposed here by name.
"""

from _helpers_vendor import (  # noqa: F401  (fixtures: pytest finds them by name here)
    vendor_kit,
    vendor_server,
    vendor_src,
    vendor_v1_server,
    vendor_v1_src,
)
