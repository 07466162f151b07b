"""Follower processes: started, watched and stopped by the leader (`Workers`), and a
follower's own main (`serve_follower`, run as `python -m dpserve.worker FD N`).

A follower shares the leader's fate: it exits once the leader closes the socket pair
(the leader stopped, or died), after finishing its own in-flight requests, so a
killed leader leaves no worker serving on its port. A follower that dies is started
again (with backoff); what it had in flight stops counting at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

import prometheus_client

from dpserve.config import RouterConfig
from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.heap import freeze_long_lived
from dpserve.router.http.app import Router
from dpserve.router.http.server import bind_socket, uvicorn_server
from dpserve.router.kv.routing import PromptTokens
from dpserve.router.workers.follower import Follower, follower_app
from dpserve.router.workers.kv_share import follower_config
from dpserve.router.workers.leader import Leader
from dpserve.router.workers.wire import Channel, config_from, config_message
from dpserve.router.workers.work_table import WorkTable

log = logging.getLogger("dpserve.serve")

FOLLOWER_MAIN = "dpserve.worker"
"""The module a follower runs: `serve_follower`, given the composition the router's
own package cannot import (the prompt tokenizer, `dpserve.prompt_tokens`)."""
RESTART_BACKOFF_S = 1.0
"""First delay before starting a follower that died again; doubles up to 30 s."""
STOP_MARGIN_S = 5.0
"""Past the graceful-shutdown time, how long a follower gets before SIGKILL."""


class Workers:
    """The leader's followers, worker 1 to `count - 1` (the leader is worker 0)."""

    def __init__(self, leader: Leader, config: RouterConfig, port: int, count: int,
                 work: WorkTable | None = None) -> None:
        self.leader = leader
        self._work = work
        self._config = config
        self._port = port
        self._count = count
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values() if p.returncode is None]

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep(w), name=f"dpserve-worker-{w}")
                       for w in range(1, self._count)]

    async def stop(self, within_s: float) -> None:
        """SIGTERM every follower (each stops accepting and finishes what it has), SIGKILL
        those still running `within_s` + STOP_MARGIN_S later."""
        self._stopping = True
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.terminate()
        waits = [asyncio.create_task(p.wait()) for p in self._procs.values()]
        if waits:
            _, late = await asyncio.wait(waits, timeout=within_s + STOP_MARGIN_S)
            if late:
                log.warning("%d router worker(s) did not stop in time: killed", len(late))
                for proc in self._procs.values():
                    if proc.returncode is None:
                        proc.kill()
                await asyncio.wait(late)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.leader.aclose()
        if self._work is not None:
            self._work.close()
            os.close(self._work.fd)
            self._work = None

    async def _keep(self, worker: int) -> None:
        backoff = RESTART_BACKOFF_S
        while not self._stopping:
            ours, theirs = socket.socketpair()
            work_fd = self._work.fd if self._work is not None else None
            fds = (theirs.fileno(),) + ((work_fd,) if work_fd is not None else ())
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", FOLLOWER_MAIN, str(theirs.fileno()),
                str(worker), pass_fds=fds)
            theirs.close()
            self._procs[worker] = proc
            channel = await Channel.open(ours)
            channel.send({**config_message(follower_config(self._config)), "port": self._port,
                          "work_fd": work_fd, "workers": self._count})
            self.leader.attach(worker, channel)
            code = await proc.wait()
            await self.leader.detach(worker)
            if self._stopping:
                return
            log.warning("router worker %d exited (code %s); starting it again in %.0f s",
                        worker, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(30.0, backoff * 2)


async def serve_follower(fd: int, worker: int, *,
                         open_tokenizer: Callable[[str], PromptTokens] | None = None) -> int:
    """A follower's life: the config from the leader, then serve until told to stop.
    `open_tokenizer`: as the leader's `Router` was given it (`kv-aware`'s prompts)."""
    channel = await Channel.open(socket.socket(fileno=fd))
    hello = await channel.recv()
    if hello is None or hello.get("op") != "config":
        return 1
    config = config_from(hello)
    logging.basicConfig(level=config.log_level.upper(), datefmt="%H:%M:%S",
                        format=f"%(asctime)s %(levelname)-7s %(name)s[worker {worker}]: "
                               "%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("dpserve.pool").setLevel(logging.ERROR)  # the leader logs the table
    prometheus_client.disable_created_metrics()  # as the leader's: the series must match
    router = Router(ReplicaPool([]), config, open_tokenizer=open_tokenizer)
    if router.kv is not None:  # its own subscriptions, to the replicas the table has ready
        await router.kv.start()  # and its tokenizer, loaded before it takes a connection:
        await router.kv.tokenizer_settled.wait()  # the import holds the GIL for seconds
    work = (WorkTable(hello["work_fd"], workers=hello["workers"], me=worker)
            if hello["work_fd"] is not None else None)
    follower = Follower(router, channel, work)
    router.watch_loop()
    freeze_long_lived()  # as the leader's Router.start does: see dpserve.router.heap
    sock = bind_socket(config.host, hello["port"], reuse_port=True)
    server = uvicorn_server(router, config, app=follower_app(router, follower),
                            announce=False)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # a terminal's ^C: the leader decides
    following = asyncio.create_task(follower.run(), name="dpserve-follow")
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="dpserve-router")
    leader_gone = asyncio.create_task(follower.closed.wait())
    await asyncio.wait({serving, leader_gone}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    await serving
    for task in (following, leader_gone):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await router.aclose()
    channel.close()
    if work is not None:
        work.close()
    return 0


def start_workers(router: Router, app: object, config: RouterConfig,
                  sock: socket.socket) -> Workers:
    """Start `config.workers - 1` followers beside this process, on `sock`'s port."""
    work = WorkTable.create(config.workers)
    workers = Workers(Leader(router, app, work), config, sock.getsockname()[1], config.workers,
                      work)
    workers.start()
    return workers
