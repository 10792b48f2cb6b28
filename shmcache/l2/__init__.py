"""The L2 tier: full KV blocks in Redis (or Valkey), shared by the pools of many hosts.

One host's shared pool is the L1. With an L2 (``shmcache.create_pool(...,
l2="redis://...")``, ``shmcache.attach(..., l2=...)`` or ``shmcache serve
--l2 redis://...``) a process also writes every block it publishes to Redis
(in a background thread) and, when a prompt's prefix is not all in L1, asks
Redis for the chain's next blocks, loads them into fresh pool blocks,
publishes them in L1 and computes only the rest (``shmcache.models.mlx_lm``).

The modules, from the bottom up:

* :mod:`.codec`: what a block's payload is (:class:`KVLayout`,
  :func:`fingerprint`), chain keys and checked values (:class:`Codec`);
* :mod:`.identity`: the model's identity and the secret, which decide who
  shares an entry;
* :mod:`.client`: the URL, the connection, outages (:class:`Health`) and
  this process's counters;
* :mod:`.store`: :class:`RedisL2`, lookups (pipelined ``MGET`` on a fetch
  thread, each bounded as a whole by a deadline: :class:`Lookup`) and the
  write-back thread;
* :mod:`.tier`: :class:`L2Tier`, the glue to a pool manager.

See docs/design.md, "The Redis tier (L2)", for the consistency argument.
"""

from __future__ import annotations

from ..shm.layout import L2_COUNTERS as COUNTERS
from .client import Counters, Health, check_url, connect, is_timeout, redact
from .codec import (_HDR, _MAC_OFF, DEFAULT_MAX_VALUE,  # noqa: F401  (_HDR, _MAC_OFF: tests)
                    FORMAT_VERSION, HEADER_BYTES, KEY_PREFIX, MAGIC, Codec, KVLayout, Rejected, fingerprint)
from .identity import (SECRET_ENV, model_identity, resolve_model, resolve_secret,
                       runtime_identity)
from .store import (DEFAULT_BATCH_BYTES, DEFAULT_QUEUE_BYTES, DEFAULT_RETRY, DEFAULT_TIMEOUT,
                    FLUSH_S, PROBE_BLOCKS, Lookup, RedisL2)
from .tier import L2Tier, pool_counter_sink, read_blocks, write_blocks

__all__ = ["KVLayout", "Codec", "RedisL2", "Lookup", "L2Tier", "Rejected", "fingerprint", "model_identity",
           "runtime_identity", "resolve_model", "resolve_secret", "check_url", "redact", "connect",
           "read_blocks", "write_blocks", "pool_counter_sink", "COUNTERS", "FORMAT_VERSION",
           "HEADER_BYTES", "DEFAULT_TIMEOUT", "DEFAULT_RETRY", "DEFAULT_QUEUE_BYTES",
           "DEFAULT_MAX_VALUE", "DEFAULT_BATCH_BYTES", "SECRET_ENV", "FLUSH_S", "PROBE_BLOCKS",
           "KEY_PREFIX", "MAGIC", "Counters", "Health", "is_timeout"]
