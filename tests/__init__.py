"""The project's tests. A regular package so that ``tests.support`` (helpers shared by the test folders) is
imported from this checkout, not from the ``tests`` package PyPI verl installs into site-packages."""
