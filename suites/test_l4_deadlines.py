"""L4's waits are bounded: a request must come whole (a stream to its end)
within --request-timeout, and an L4 schedule run's servers and requests
within --run-timeout; a server that answers nothing, or drips a stream that
never ends, is the server's FAIL naming the request and the bound. Its log
is kept in the report directory, where the failure points."""

import asyncio
import json
import sys
import textwrap
import time

import httpx
import pytest

from kvparity.reports.cli import EXIT_BROKEN, main
from kvparity.suites.l3.engines import EngineRequest
from kvparity.suites.l4.client import Dialect, Sent, ask
from kvparity.suites.l4.traffic import Visit, traffic
from kvparity.suites.runners import L4_CATALOG

# argv: MODE PORT. Modes: drip (streams an event every 20 ms and never ends; a whole answer never comes),
# dies (exits on the first request it is sent).
FAKE_SERVER = textwrap.dedent('''
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    mode, port = sys.argv[1], int(sys.argv[2])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if mode == "dies":
                print("fake server: cannot serve this request", flush=True)
                os._exit(3)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"choices": [{"text": "t1 ", "logprobs": None}]}
            while True:
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.flush()
                time.sleep(0.02)

    print(f"fake server: listening on {port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def dripping(request: httpx.Request) -> httpx.Response:
    """A server whose answer is a stream of events that never ends."""

    class Drip(httpx.AsyncByteStream):
        async def __aiter__(self):
            while True:
                yield b'data: {"choices": [{"text": "t1 "}]}\n\n'
                await asyncio.sleep(0.01)

    return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, stream=Drip())


def sent(stream: bool, rid: str = "a") -> Sent:
    request = EngineRequest(rid, (1, 2), arrival=0, max_tokens=4, bits=None, group_size=64, quantized_kv_start=None,
                            prefill_step_size=2048)
    return Sent(request, "t1 t2", "completions", 0, stream=stream)


def test_a_stream_that_drips_forever_ends_at_the_request_timeout():
    async def one():
        async with httpx.AsyncClient(transport=httpx.MockTransport(dripping), base_url="http://server") as client:
            return await ask(client, None, sent(stream=True), 0.0, Dialect(None), limit=(0.3, "--request-timeout"))

    answer = asyncio.run(one())
    assert answer.error == "/v1/completions: no whole answer within 0.3 s (--request-timeout)", answer.error
    assert not answer.tokens


def test_past_the_run_deadline_a_request_waits_for_nothing(monkeypatch):
    """A request due after the run's deadline (its arrival_ms far off) is not waited for."""
    late = Sent(sent(stream=False).request, "t1 t2", "completions", 10**9)
    models = httpx.MockTransport(lambda request: httpx.Response(200, json={"data": [{"id": "m"}]}))
    plain = httpx.AsyncClient

    class Served(plain):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "transport": models})

    monkeypatch.setattr(httpx, "AsyncClient", Served)
    started = time.monotonic()
    answers = asyncio.run(traffic("http://server", [late], 1, Dialect(None), Visit("late", time.monotonic() + 0.3)))
    assert answers["a"].error == "/v1/completions: no whole answer within 0 s (--run-timeout)", answers
    assert time.monotonic() - started < 60  # not the 10**6 s it was due after


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drip", "dies"])
def test_a_server_that_drips_or_dies_fails_and_its_log_is_in_the_report(tmp_path, capsys, mode):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    server = f"{sys.executable} {script} {mode} {{port}}"
    status = main(["run", "--level", "L4", "--schedule", str(L4_CATALOG / "streamed.json"), "--server", server,
                   "--request-timeout", "2", "--prompt-cache-off=--alone", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert status == EXIT_BROKEN, out
    (report,) = (tmp_path / "out").iterdir()
    (run,) = json.loads((report / "report.json").read_text())["results"]
    logs = run["server"]["log_files"]
    assert logs and all((report / log).is_file() for log in logs), logs
    assert any("fake server: listening on" in (report / log).read_text() for log in logs)
    if mode == "drip":
        failed = [d["detail"] for row in run["rows"] for d in row["divergences"]]
        assert all(row["verdict"] == "FAIL" for row in run["rows"]), run["rows"]
        assert any("no whole answer within 2 s (--request-timeout)" in said for said in failed), failed
    else:
        assert "the server died" in run["reason"], run["reason"]
        pointed = run["reason"].split("log: ")[1].split(" in the report directory")[0]
        assert (report / pointed).is_file() and "cannot serve this request" in (report / pointed).read_text()
