"""A fake vLLM server *process* for supervisor tests (named as a fake).

Speaks `/health`, `/v1/models` and enough of `/v1/completions` for the router's
warm-up request before it admits a replica (one token, its logprob), and like vLLM
keeps a child process (its "engine core") in its process group, so tests can check
that stopping a replica leaves nothing behind. `--fail-after-s` makes it exit with an error
before it becomes healthy. Separate from tests/fakes.py because it is a process
(what the supervisor starts, watches, signals and kills), not an in-process server.

    python tests/fake_vllm_server.py --port P [--fail-after-s S] [--startup-delay-s S]
        [--ignore-sigterm]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys

from aiohttp import web


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default="fake-model")
    p.add_argument("--fail-after-s", type=float)
    p.add_argument("--startup-delay-s", type=float, default=0.0)
    p.add_argument("--ignore-sigterm", action="store_true",
                   help="like an engine busy loading: SIGTERM does nothing")
    args, _ = p.parse_known_args()

    child = subprocess.Popen(  # noqa: ASYNC220 (a fake; blocking for a moment is fine)
        [sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"fake engine core pid {child.pid}", flush=True)

    def shutdown() -> None:  # like vLLM: SIGTERM stops the engine core too
        child.terminate()
        sys.exit(0)

    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, (lambda: None) if args.ignore_sigterm else shutdown)
    if args.fail_after_s is not None:
        await asyncio.sleep(args.fail_after_s)
        print("RuntimeError: fake engine failed to load the model", flush=True)
        sys.exit(3)
    await asyncio.sleep(args.startup_delay_s)

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response())
    app.router.add_get("/v1/models", lambda r: web.json_response(
        {"object": "list", "data": [{"id": args.served_model_name}]}))
    app.router.add_post("/v1/completions", lambda r: web.json_response(
        {"object": "text_completion", "model": args.served_model_name, "choices": [
            {"index": 0, "text": " x", "finish_reason": "length",
             "logprobs": {"tokens": [" x"], "token_logprobs": [-0.5]}}]}))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    print(f"fake replica listening on {args.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
