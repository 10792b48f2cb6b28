"""One worker process of ``shmcache serve`` (``python -m workers.worker.main``) and its engine."""
