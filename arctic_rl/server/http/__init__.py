"""The reference server's HTTP layer: request bodies, checks, auth, replay and the vendor's control routes.

==========================  =====================================================================
module                      what it is
==========================  =====================================================================
:mod:`.bodies`              reading a request body (JSON or DSSST1) under a size and time limit
:mod:`.validation`          a ``/forward-backward`` or ``/forward`` body checked into a batch
:mod:`.auth`                the bearer-token middleware
:mod:`.idempotency`         the request-id cache that replays a repeated call's answer
:mod:`.connection`          the connection-level limit on how long a request head may take
:mod:`.control`             the vendor's v2 control routes (sleep/wake, ``/operation``, ...)
==========================  =====================================================================

The routes of the protocol itself are built in :mod:`arctic_rl.server.app`.
"""
