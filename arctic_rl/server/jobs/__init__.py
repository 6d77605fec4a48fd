"""The server's jobs: the registry of created jobs, what each endpoint does to one, and checkpoint layout.

==========================  =====================================================================
module                      what it is
==========================  =====================================================================
:mod:`.registry`            :class:`~.registry.Job` (config, engine, lock, state) and the registry
:mod:`.service`             :class:`~.service.ServerState`: what each endpoint does, on which job
:mod:`.checkpoint`          where a training job's checkpoints live on disk, and their names
==========================  =====================================================================
"""
