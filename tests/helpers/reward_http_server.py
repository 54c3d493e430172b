"""A tiny OpenRLHF-style remote reward server for the reward-service tests (stdlib only).

``python tests/helpers/reward_http_server.py [--mode ok|error|slow]`` binds 127.0.0.1 on a free
port, prints ``PORT <n>`` on stdout, and answers ``POST /get_reward`` with
``{"rewards": [...], "scores": [...]}`` where a sample's reward is ``len(query) / 100`` (easy to
check by hand). ``error`` answers HTTP 500; ``slow`` never answers within a test's timeout.
"""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ok", choices=("ok", "error", "slow"))
    args = p.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if args.mode == "slow":
                time.sleep(60)
            if args.mode == "error":
                self.send_error(500, "deliberate failure")
                return
            rewards = [len(q) / 100 for q in body["query"]]
            assert len(body["prompts"]) == len(body["labels"]) == len(rewards)
            out = json.dumps({"rewards": rewards, "scores": [r * 2 for r in rewards]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    print(f"PORT {srv.server_address[1]}", flush=True)
    sys.stdout.close()
    srv.serve_forever()


if __name__ == "__main__":
    main()
