"""Run a simulated fleet until SIGINT or SIGTERM; print one replica URL per line.

    python -m dpserve.sim --replicas 8 [--base-port 0] [--config sim.yaml] [--control]
                          [--processes 1] [--max-num-seqs 64 --step-base-s 0.015 ...]
                          [--kv-events [--kv-events-port 0]] [--lora NAME[=PATH] ...]

Every SimConfig field is a flag (`--max-num-seqs`, `--prefill-per-token-s`, ...);
flags override the YAML file, which overrides the defaults. `--kv-events` makes every
replica publish its KV-cache events as vLLM does; each replica's `GET /kv_event_sources`
names its endpoints, which are also logged. Put a router in front:

    python -m dpserve.sim --replicas 8 > urls.txt &
    dpserve router $(sed 's/^/--replica /' urls.txt)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import typing
from collections.abc import Sequence

from dpserve.config import ConfigError, load_yaml
from dpserve.sim import processes
from dpserve.sim.config import SimConfig, build_sim_config
from dpserve.sim.fleet import Fleet

log = logging.getLogger("dpserve.sim")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=1,
                   help="number of simulated replicas (default 1)")
    p.add_argument("--base-port", type=int, default=0,
                   help="port of replica 0, then +1 each; 0 picks free ports")
    p.add_argument("--kv-events-port", type=int, default=0,
                   help="with --kv-events: replica i publishes on this port + 2i and replays "
                        "on the next; 0 (default): right after the HTTP ports if --base-port "
                        "is given, else free ports")
    p.add_argument("--config", help="YAML file of SimConfig fields")
    p.add_argument("--control", action="store_true",
                   help="serve GET/PUT/DELETE /sim/fault on every replica (fault injection)")
    p.add_argument("--processes", type=int, default=1,
                   help="spread the replicas over this many processes, to use more cores "
                        "(default 1)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop: asyncio (default) keeps step times within about 0.5 ms; "
                        "uvloop serves HTTP a little faster with millisecond timers")
    p.add_argument("--first-index", type=int, default=0, help=argparse.SUPPRESS)
    g = p.add_argument_group("engine model and KV events (SimConfig; defaults and meaning "
                             "in dpserve/sim/config.py)")
    hints = typing.get_type_hints(SimConfig)
    for f in dataclasses.fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=f"(default {f.default})")
        elif typing.get_origin(kind) is list:  # --lora NAME[=PATH], repeated
            g.add_argument(flag, dest=f.name, action="append", default=None,
                           metavar="NAME[=PATH]", help="(repeatable)")
        else:
            g.add_argument(flag, dest=f.name, type=kind, default=None,
                           metavar=kind.__name__.upper(), help=f"(default {f.default})")
    return p


async def serve(fleet: Fleet) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with fleet:
        for url in fleet.urls:
            print(url, flush=True)
        for r in fleet:
            if r.kv_events is not None:
                log.info("replica %d (%s) publishes KV events on %s, replays on %s",
                         r.index, r.url, r.kv_events.endpoint, r.kv_events.replay_endpoint)
        cfg = fleet[0].config
        log.info("%d simulated replica(s) of %r ready; SIGINT or SIGTERM stops them",
                 len(fleet), cfg.model)
        await stop.wait()
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)}
    for name in ("replicas", "processes"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        config = build_sim_config(flags, load_yaml(args.config))
        fleet = Fleet(args.replicas, config, base_port=args.base_port,
                      kv_events_port=args.kv_events_port, control=args.control,
                      first_index=args.first_index)
    except ConfigError as exc:
        print(f"error: {_with_flag(str(exc), {'base_port', 'kv_events_port', *flags})}",
              file=sys.stderr)
        return 2
    if args.processes > 1:
        extra = ["--loop", args.loop, *(["--control"] if args.control else [])]
        return processes.run(config, args.replicas, args.processes,
                             base_port=args.base_port, kv_events_port=fleet.kv_events_port,
                             extra_args=extra)
    try:
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(serve(fleet))
        else:
            asyncio.run(serve(fleet))
    except OSError as exc:  # a port in use
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _with_flag(message: str, names: set[str]) -> str:
    """A settings error about one of `names` naming its flag too, since the value may
    come from the flag or the YAML file: "max_num_seqs (--max-num-seqs): ..."."""
    name, sep, rest = message.partition(": ")
    if not sep or name not in names:
        return message
    return f"{name} (--{name.replace('_', '-')}): {rest}"


if __name__ == "__main__":
    sys.exit(main())
