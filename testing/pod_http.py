"""Plain HTTP servers standing in for what a pod serves, at the pod's IP (KWOK gives pods loopback
IPs, testing/cluster.py): fixed answers per path and a record of what was asked. With the metrics
pages below, the operator's planner reads a router and a decode worker without running either."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class PodHTTP:
    """An HTTP server at `ip`:`port` answering 200 with `routes[path]`, 404 otherwise (or, given
    `redirect_to`, a 302 to the same path there, as a hostile pod would); `hits` lists every path
    asked, in order. Stop it with close()."""

    def __init__(self, ip: str, port: int, routes: dict[str, bytes], redirect_to: str | None = None) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hits.append(self.path)
                if redirect_to is not None:
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = routes.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, port), Handler)
        threading.Thread(target=self.server.serve_forever, name=f"pod-http-{ip}", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _histogram(name: str) -> list[str]:
    return [f'{name}_bucket{{le="0.1"}} 0', f'{name}_bucket{{le="+Inf"}} 0', f"{name}_sum 0", f"{name}_count 0"]


def router_metrics(in_flight: float = 4.0) -> bytes:
    """A router's /metrics with what the planner reads: no requests finished, `in_flight` running."""
    lines = [*_histogram("tandem_time_to_first_token_seconds"), *_histogram("tandem_inter_token_latency_seconds"),
             f"tandem_requests_in_flight {in_flight}", "tandem_requests_total 0"]
    return ("\n".join(lines) + "\n").encode()


def worker_metrics(running: float = 4.0, kv_used: float = 99.0, kv_total: float = 100.0) -> bytes:
    """A worker's /metrics with every engine series the planner needs (default: KV 99% used)."""
    lines = [f"tandem_worker_running_sequences {running}", "tandem_worker_waiting_sequences 0",
             "tandem_worker_leased_sequences 0", f"tandem_worker_kv_blocks_used {kv_used}",
             f"tandem_worker_kv_blocks_total {kv_total}", "tandem_worker_prompt_tokens_total 0",
             "tandem_worker_generation_tokens_total 0", "tandem_worker_step_seconds_sum 0",
             "tandem_worker_step_seconds_count 0", "tandem_worker_step_tokens_sum 0"]
    return ("\n".join(lines) + "\n").encode()
