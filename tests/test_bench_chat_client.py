"""``tools.bench.serve_client.run_chat``'s turn order, against a small
stdlib HTTP server in this process that streams a canned reply (a unit test
of the benchmark's client: the server here stands in for a real one only to
observe what the client sends and when).

With fewer client threads than sessions, at most that many turns are in
flight at once; the sessions start in order; a session's turns run in order,
each resending the conversation so far with the previous reply; and a
session that has finished a turn goes to the back of the queue (it "thinks"
while the others' turns run)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tools.bench.serve_client import build_chat, run_chat


class _Server:
    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.seen: list = []             # the messages of every request, in arrival order
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):   # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.in_flight += 1
                    outer.peak = max(outer.peak, outer.in_flight)
                    outer.seen.append(body["messages"])
                    n = len(outer.seen)
                time.sleep(0.3)          # long enough for every client thread to arrive
                chunks = [{"choices": [{"delta": {"content": f"r{n} "}}]},
                          {"choices": [], "usage": {"completion_tokens": 1,
                                                    "prompt_tokens": 5}}]
                payload = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
                payload += "data: [DONE]\n\n"
                with outer.lock:
                    outer.in_flight -= 1
                data = payload.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _run(sessions: int, turns: int, concurrency=None):
    """run_chat against a fresh _Server: (server, chat, records, wall)."""
    srv = _Server()
    try:
        chat = build_chat(sessions=sessions, turns=turns, seed=1, system_chars=20,
                          user_chars=(5, 10))
        with httpx.Client(trust_env=False) as client:
            recs, wall = run_chat(client, [srv.url], chat, max_tokens=1, timeout=10,
                                  concurrency=concurrency)
    finally:
        srv.close()
    return srv, chat, recs, wall


@pytest.mark.timeout(30)
def test_fewer_threads_than_sessions_interleave_sessions_in_order():
    srv, chat, recs, wall = _run(4, 2, concurrency=2)
    assert wall > 0 and len(recs) == 8 and not any("error" in r for r in recs)
    assert srv.peak <= 2
    firsts = [[m["content"] for m in msgs if m["role"] == "user"] for msgs in srv.seen]
    # turn 1 of every session before any turn 2: sessions 0,1 start, and 2,3
    # go before a finished session's next turn
    assert [len(f) for f in firsts] == [1, 1, 1, 1, 2, 2, 2, 2]
    # (the two threads' requests of one pair reach the server in either order)
    first_turns = [chat.user_turns[s][0] for s in range(4)]
    assert {f[0] for f in firsts[:2]} == set(first_turns[:2])
    assert {f[0] for f in firsts[2:4]} == set(first_turns[2:])
    # a later turn resends the conversation with the reply it got
    by_session = {r["session"]: r for r in recs if r["turn"] == 0}
    for msgs in srv.seen[4:]:
        s = next(s for s in range(4) if msgs[1]["content"] == chat.user_turns[s][0])
        assert msgs[2] == {"role": "assistant", "content": by_session[s]["text"]}
        assert msgs[3]["content"] == chat.user_turns[s][1]


@pytest.mark.timeout(30)
def test_default_runs_every_session_at_once():
    srv, _, recs, _ = _run(3, 1)
    assert len(recs) == 3 and srv.peak == 3
