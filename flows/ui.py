"""The Prefect quickstart in one command (`make ui`): a local Prefect server with its UI, waited for until
it answers, then batchgen's deployments served against it from the repository root. Ctrl-C stops both.

    .venv/bin/python -m flows.ui              # UI at http://127.0.0.1:4200 -> Deployments -> on-demand -> Run

Paths typed into the form (input, output) are relative to the repository root, where this serves from.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wait_for(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    """Until `url` answers 200; an error naming the server's exit if it died first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"flows.ui: the Prefect server exited with {server.returncode} before it answered")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"flows.ui: the Prefect server did not answer {url} within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    """Start the server, wait for it, serve the deployments; stop both on Ctrl-C or SIGTERM."""
    ap = argparse.ArgumentParser(prog="python -m flows.ui", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="the address the server listens on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=4200, help="its port (default 4200)")
    args = ap.parse_args(argv)
    api = f"http://{args.host}:{args.port}/api"
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", args.host, "--port",
                               str(args.port)], env=env, cwd=REPO)
    served = None
    try:
        wait_for(f"{api}/health", server, 180)
        print(f"flows.ui: Prefect UI at http://{args.host}:{args.port}; serving batchgen's deployments from {REPO} "
              f"(Ctrl-C stops both)", flush=True)
        served = subprocess.Popen([sys.executable, "-m", "flows.serve"], env=env, cwd=REPO)
        return served.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in (served, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _stop(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops both processes as Ctrl-C does


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
