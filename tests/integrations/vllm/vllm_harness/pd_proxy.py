"""A minimal prefill/decode proxy for the PD tests and benchmark (not a product: see
docs/integrations.md for the routers that drive PD in production).

For each ``POST /v1/completions`` or ``/v1/chat/completions`` it sends the
request to the prefill instance (a ``kv_producer``) with ``max_tokens=1`` and
waits for the answer; by then the producer's connector has stored the
prompt's chunks in the daemon.  Then it sends the original request to the
decode instance (a ``kv_consumer``) and relays that answer, streamed when
the request streams.  A failed prefill (the producer down or dying) is
counted and the request still goes to the consumer, which then waits
``load_wait_s`` for chunks and computes what never came: the user gets a
correct answer either way.

``python -m tests.integrations.vllm.vllm_harness.pd_proxy --prefill URL --decode URL --port N``
runs it in the foreground; :class:`PDProxy` runs it on a thread.
"""

from __future__ import annotations

import argparse
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATHS = ("/v1/completions", "/v1/chat/completions")


class PDProxy:
    """The proxy on ``127.0.0.1:port`` (a free port when 0), serving on a daemon thread."""

    def __init__(self, prefill_url: str, decode_url: str, port: int = 0, *, timeout_s: float = 600):
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.timeout_s = timeout_s
        self.prefills = 0
        self.prefill_failures = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                if self.path not in PATHS:
                    self.send_error(404, f"only {', '.join(PATHS)}")
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                proxy.prefill(self.path, body)
                proxy.relay_decode(self, self.path, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="pd-proxy", daemon=True)

    def start(self) -> PDProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def prefill(self, path: str, body: dict[str, Any]) -> bool:
        """The request on the producer with one output token; False when it failed."""
        request = dict(body, max_tokens=1, stream=False)
        request.pop("max_completion_tokens", None)
        request.pop("min_tokens", None)
        data = json.dumps(request).encode()
        try:
            post = urllib.request.Request(self.prefill_url + path, data, {"Content-Type": "application/json"})
            with urllib.request.urlopen(post, timeout=self.timeout_s) as reply:
                reply.read()
            ok = True
        except (TimeoutError, urllib.error.URLError, OSError):
            ok = False
        with self._lock:
            self.prefills += 1
            self.prefill_failures += not ok
        return ok

    def relay_decode(self, handler: BaseHTTPRequestHandler, path: str, body: dict[str, Any]) -> None:
        """The original request on the consumer, its answer relayed as it comes."""
        post = urllib.request.Request(
            self.decode_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            reply = urllib.request.urlopen(post, timeout=self.timeout_s)
        except urllib.error.HTTPError as err:
            reply = err
        except (urllib.error.URLError, OSError) as err:
            handler.send_error(502, f"decode instance: {err}")
            return
        with reply:
            handler.send_response(reply.status)
            handler.send_header("Content-Type", reply.headers.get("Content-Type", "application/json"))
            handler.end_headers()
            while True:
                data = reply.read1(65536) if hasattr(reply, "read1") else reply.read(65536)
                if not data:
                    break
                handler.wfile.write(data)
                handler.wfile.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="URL of the prefill (kv_producer) instance")
    parser.add_argument("--decode", required=True, help="URL of the decode (kv_consumer) instance")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    proxy = PDProxy(args.prefill, args.decode, args.port)
    print(f"pd proxy on {proxy.url}: prefill {proxy.prefill_url}, decode {proxy.decode_url}", flush=True)
    proxy.server.serve_forever()


if __name__ == "__main__":
    main()
