"""A follower worker: `python -m dpserve.router.workers FD WORKER` (the leader runs it)."""

import sys

import uvloop

from dpserve.router.workers.process import serve_follower

if __name__ == "__main__":
    sys.exit(uvloop.run(serve_follower(int(sys.argv[1]), int(sys.argv[2]))))
