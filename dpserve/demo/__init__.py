"""`dpserve demo`: serve, fine-tune and hot-deploy the built-in tiny model, offline.

    run.py        the demo itself, step by step (`run_demo`)
    tiny.py       `dpserve serve` on the tiny model and waiting for it; the
                  integration tests start their deployments the same way
    processes.py  stopping what the demo started, checking nothing is left

The dataset it trains on is `dpserve.demo_data`. Only what is light is imported
here (every `dpserve` command's parser reads DEFAULT_STEPS); the demo itself is
`dpserve.demo.run`, which imports the load test.
"""

from dpserve.demo.tiny import DEFAULT_STEPS, TINY_VLLM_ARGS, printable, serve_command, wait_ready

__all__ = ["DEFAULT_STEPS", "TINY_VLLM_ARGS", "printable", "serve_command", "wait_ready"]
