"""The shared segment: its byte map and the structures that live in it.

A pool is one file in /dev/shm. ``layout`` is its byte map: every region's
offset, size and dtype is computed there once, from the pool's parameters,
and nothing else in the package computes an offset. ``segment`` creates,
sizes (with the pages reserved up front, so a full /dev/shm fails at
creation instead of with SIGBUS later) and maps the file; ``lock`` is the
pool mutex with its dirty mark and turns.

The other modules are each one shared structure, written only under the
pool lock (or with the single-word atomics their docstrings name), each
with its invariants and commit point stated at the top:

* ``blocks``: the block records and the seed's containers' value types;
* ``freelist``: the LRU free queue threaded through the block records;
* ``index``: the prefix-hash index (hash -> block), chained buckets;
* ``chunks`` and ``refs``: per-request block tables as chunked lists, and
  who references which block;
* ``claims``: "this process is computing that block", for waiters;
* ``slots``: one slot per attached process (its liveness lock byte);
* ``loosemap``, ``table_chains``: a process's loose blocks, the seed's
  per-block registration chains;
* ``counters``: the header's counter words by name (a ``ctypes.Structure``
  laid over them, its fields from ``layout.COUNTER_WORDS``).

``hot_ops`` puts the hot operations behind one interface with two
implementations: ``NativeOps`` (the compiled ``shmcache._hot``, whose
parameters are the rows of ``layout.HOT_PARAMS``; ``hot_params_gen``
writes their C header) and ``ReferenceOps`` (Python, the reference the
differential tests compare against, and the path under
``SHMCACHE_PURE=1``), chosen once when a pool is mapped.

Nothing here knows about managers, models or servers. A structure never
calls another one's internals: the layers above compose them.
"""
