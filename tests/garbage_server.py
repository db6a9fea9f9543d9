"""A "single-user server" that answers garbage at every path (for the hub service's tests):
started by JupyterHub's spawner in place of jupyterhub-singleuser, on the port it is given."""

from __future__ import annotations

import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class Garbage(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b"\x00{not json at all]]" * 3
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    ThreadingHTTPServer((url.hostname or "127.0.0.1", url.port or 8888), Garbage).serve_forever()
