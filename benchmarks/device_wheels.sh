# Download, on a machine with PyPI, the wheels the device tool's GPU image lacks, into .whl/
# (ignored by git; carry [".whl"] with the call; benchmarks/device_env.sh installs them there).
#
#   bash benchmarks/device_wheels.sh            # the runtime's: diffusers, msgspec, pyzmq, ...
#   bash benchmarks/device_wheels.sh --cudnn    # and cuDNN's Python frontend (attention_probe;
#                                             # 1.21: the plain binding, no CUTLASS DSL needed)
#
# Versions are uv.lock's; the image's Python is 3.12 on x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
locked() {  # the version uv.lock pins for package $1
    awk -v n="$1" '$0 == "name = \"" n "\"" {getline; gsub(/version = |"/, ""); print; exit}' uv.lock
}
packages=(diffusers msgspec pyzmq omegaconf torchdata)
specs=()
for name in "${packages[@]}"; do
    version=$(locked "$name")
    [ -n "$version" ] || { echo "uv.lock pins no $name" >&2; exit 1; }
    specs+=("$name==$version")
done
if [ "${1:-}" = "--cudnn" ]; then specs+=("nvidia-cudnn-frontend==${CUDNN_FRONTEND_VERSION:-1.21.0}"); fi
platforms=()
for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
ls -la .whl
