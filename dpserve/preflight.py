"""What `dpserve serve` and `dpserve router` check before they start anything.

A wrong model path found here costs a second and one line naming the flag; found by
vLLM, it costs every replica's start-up (~45 s on CPU) and a 40-line traceback ending
in `OSError: Repo id must be in the form 'repo_name'`. Each check returns problems
(the command refuses to start: exit 2) and notes (logged, the command goes on), each
one line that starts with the flag it is about.

The checks read the file system and the environment only; then `listen_or_refuse`
binds the router's ports (the port check) and reports everything found at once.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dpserve.config import RouterConfig, ServeConfig
from dpserve.replicas.launcher import DEFAULT_CPU_REPLICAS

log = logging.getLogger("dpserve.preflight")

MODEL_FILES = ("config.json", "params.json")
"""What makes a directory a model vLLM loads: Hugging Face's config, or the
`params.json` of Mistral's own layout (`--config-format mistral`)."""

# A Hugging Face repository id: `name` or `namespace/name`, letters, digits, `-_.`.
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]{0,95}(/[A-Za-z0-9_][\w.-]{0,95})?")
_TRUE = ("1", "true", "yes", "on")


class PreflightError(Exception):
    """The command cannot start; `problems` holds one line per reason."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    """Reasons not to start, one line each."""
    notes: list[str] = field(default_factory=list)
    """Worth telling before a long wait, not worth refusing."""

    def add(self, other: Findings) -> None:
        self.problems += other.problems
        self.notes += other.notes


def check_serve(cfg: ServeConfig, *, visible: Sequence[int], cores: Sequence[int],
                environ: Mapping[str, str] | None = None) -> Findings:
    """Everything `dpserve serve` can check before a replica starts, given the GPUs
    (`launcher.visible_gpus`) and cores (`launcher.usable_cores`) this process has."""
    environ = os.environ if environ is None else environ
    found = check_model(cfg.model, flag="--model", environ=environ, vllm_args=cfg.vllm_args)
    found.add(check_gpus(cfg.gpus, visible, environ))
    if cfg.gpus is None and not visible:  # CPU replicas
        found.add(check_cores(cfg, cores))
    return found


def check_router(base_model: str | None, *, tokenizer: str | None = None,
                 environ: Mapping[str, str] | None = None) -> Findings:
    """What `dpserve router` can check: the `--base-model` deploys compare checkpoints
    with, and the `--tokenizer` `kv-aware` reads prompts with, are local model
    directories (read, never fetched)."""
    environ = os.environ if environ is None else environ
    found = Findings()
    if base_model is not None:
        found.add(check_model(base_model, flag="--base-model", environ=environ, hub=False))
    if tokenizer is not None and tokenizer != "sim":
        found.add(check_model(tokenizer, flag="--tokenizer", environ=environ, hub=False))
    return found


def check_model(model: str, *, flag: str, environ: Mapping[str, str],
                vllm_args: Sequence[str] = (), hub: bool = True) -> Findings:
    """A local path must be a model directory; a hub id is noted (vLLM fetches it), and
    with HF_HUB_OFFLINE set it must be in the local cache. Anything with a scheme
    (`s3://...`) is left to vLLM. `hub=False`: only a local directory will do."""
    if "://" in model and hub:
        return Findings()
    where = f"{flag} {model}"
    path = Path(os.path.expanduser(model))
    if hub and not _looks_local(model, path):
        return _check_hub_id(model, where, environ, vllm_args)
    if not path.exists():
        return Findings(problems=[f"{where}: no such directory{_did_you_mean(path)}"])
    if path.is_file():
        if path.suffix == ".gguf":  # vLLM loads a single GGUF file too
            return Findings()
        return Findings(problems=[f"{where}: is a file; give the model's directory"])
    if not os.access(path, os.R_OK | os.X_OK):
        return Findings(problems=[f"{where}: cannot read this directory (permission denied)"])
    if not any((path / name).is_file() for name in MODEL_FILES):
        return Findings(problems=[f"{where}: no config.json in it (not a Hugging Face model "
                                  "directory)"])
    return Findings()


def check_gpus(requested: Sequence[int] | None, visible: Sequence[int],
               environ: Mapping[str, str]) -> Findings:
    """Every `--gpus` index names a GPU this process can see."""
    if requested is None:
        return Findings()
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and not all(x.strip().isdigit() for x in listed.split(",")
                                      if x.strip()):
        return Findings()  # UUIDs or MIG instances: indices cannot be matched here
    missing = [g for g in requested if g not in visible]
    if not missing:
        return Findings()
    where = f"--gpus {','.join(map(str, requested))}"
    if not visible:
        source = ("CUDA_VISIBLE_DEVICES is empty" if listed is not None
                  else "nvidia-smi finds none")
        return Findings(problems=[f"{where}: no GPU is visible here ({source}); leave "
                                  "--gpus out to serve on CPU replicas"])
    return Findings(problems=[f"{where}: no GPU {','.join(map(str, missing))} here "
                              f"(visible: {','.join(map(str, visible))})"])


def check_cores(cfg: ServeConfig, cores: Sequence[int]) -> Findings:
    """CPU replicas: `--cpu-binds` names usable cores; more replicas than cores is noted
    (they share cores, each runs slower)."""
    usable = set(cores)
    if cfg.cpu_binds is not None:
        outside = sorted({c for bind in cfg.cpu_binds.split("|") for c in _core_ids(bind)}
                         - usable)
        if outside:
            return Findings(problems=[
                f"--cpu-binds {cfg.cpu_binds}: core(s) {','.join(map(str, outside))} not "
                f"usable by this process (usable: {_ranges(sorted(usable))})"])
        return Findings()
    replicas = cfg.replicas or DEFAULT_CPU_REPLICAS
    if replicas > len(usable):
        return Findings(notes=[f"--replicas {replicas}: only {len(usable)} usable core(s); "
                               "the CPU replicas share them and each runs slower"])
    return Findings()


def hub_cache(environ: Mapping[str, str], vllm_args: Sequence[str] = ()) -> Path:
    """Where vLLM looks for hub models: its `--download-dir`, else Hugging Face's cache
    (HF_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/...)."""
    download_dir = _option(vllm_args, "--download-dir")
    if download_dir is not None:
        return Path(download_dir).expanduser()
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


# -- helpers --------------------------------------------------------------------------------


def _looks_local(model: str, path: Path) -> bool:
    """A path the user typed (absolute, `./`, `../`, `~`), one that exists, or one whose
    parent folder exists (`build/tiny-lama`: a typo, not a hub id)."""
    if model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        return True
    if path.exists():
        return True
    return any(parent.is_dir() for parent in path.parents if str(parent) != ".")


def _check_hub_id(model: str, where: str, environ: Mapping[str, str],
                  vllm_args: Sequence[str]) -> Findings:
    if not _HUB_ID.fullmatch(model) or ".." in model or "--" in model:
        return Findings(problems=[f"{where}: no such directory, and not a Hugging Face "
                                  "id (NAME or ORG/NAME)"])
    if environ.get("HF_HUB_OFFLINE", "").strip().lower() not in _TRUE:
        return Findings(notes=[f"{where}: not a local directory; vLLM will fetch it from "
                               "the Hugging Face hub (or its cache)"])
    cache = hub_cache(environ, vllm_args)
    snapshots = cache / f"models--{model.replace('/', '--')}" / "snapshots"
    if any((s / name).is_file() for s in _subdirs(snapshots) for name in MODEL_FILES):
        return Findings(notes=[f"{where}: HF_HUB_OFFLINE is set; vLLM loads it from the "
                               f"local cache ({cache})"])
    return Findings(problems=[f"{where}: not a local directory, and HF_HUB_OFFLINE is set "
                              f"but it is not in the local Hugging Face cache ({cache})"])


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []


def _did_you_mean(path: Path) -> str:
    """`; did you mean build/tiny-llama?` when a sibling's name is close."""
    try:
        names = [p.name for p in path.parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1)
    return f"; did you mean {path.parent / close[0]}?" if close else ""


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of `name` in an argument list (`--name V` or `--name=V`), or None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _core_ids(bind: str) -> set[int]:
    """The cores of one vLLM id list (`0-3`, `5,7`), validated by the config already."""
    ids: set[int] = set()
    for part in bind.split(","):
        lo, _, hi = part.strip().partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return ids


def _ranges(cores: Sequence[int]) -> str:
    """`0-3,6` for [0, 1, 2, 3, 6]."""
    out: list[str] = []
    for c in cores:
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def listen_or_refuse(found: Findings, config: RouterConfig) -> list[socket.socket]:
    """Bind the router's sockets (the port check: a bind, not a guess) and raise
    PreflightError with every problem found; else log the notes and return the sockets,
    for the router to serve on."""
    from dpserve.router.http.server import PortInUseError, listen  # the serving stack: only now

    problems = list(found.problems)
    sockets: list[socket.socket] = []
    try:
        sockets = listen(config)
    except PortInUseError as exc:
        problems.append(str(exc))
    if problems:
        for sock in sockets:
            sock.close()
        raise PreflightError(problems)
    for note in found.notes:
        log.info("%s", note)
    return sockets
