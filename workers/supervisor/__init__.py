"""The supervisor of ``shmcache serve`` (in its process): a pool, worker processes, routing."""
