"""What every remote adapter uses, whatever its vendor: the verl fields an adapter reads
(``verl_settings``) and the strict conversion of a ``remote_backend`` mapping into frozen dataclasses
(``strict_config``). Nothing here names a vendor; importing the package imports neither module."""
