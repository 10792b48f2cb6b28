"""The generation workers of ``shmcache serve`` and the supervisor that launches them.

* :mod:`workers.protocol`: what the HTTP front (:mod:`shmcache.server`) and
  the supervisor say to each other (requests' sampling, typed events);
* :mod:`workers.wire`: the messages between the supervisor and its worker
  processes;
* :mod:`workers.supervisor`: runs in the ``shmcache serve`` process: the
  pool, the worker processes, the routing of requests;
* :mod:`workers.worker`: one worker process (``python -m
  workers.worker.main``): its generation engine over the shared pool.

The two processes share only the messages (``tests/test_layers.py``).
"""
