"""A router's follower worker: `python -m dpserve.worker FD WORKER` (the leader runs it,
`dpserve.router.workers.process`).

Here, beside `dpserve.serve`, rather than in the router's package: like the leader's
`Router`, a follower is given the prompt tokenizer `kv-aware` reads prompts with
(`dpserve.prompt_tokens`), which the router does not import.
"""

import sys

import uvloop

from dpserve.prompt_tokens import open_named
from dpserve.router.workers.process import serve_follower

if __name__ == "__main__":
    sys.exit(uvloop.run(serve_follower(int(sys.argv[1]), int(sys.argv[2]),
                                       open_tokenizer=open_named)))
