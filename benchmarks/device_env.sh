# Source from the repository root on a machine without `uv sync` (the device tool's GPU
# image): makes `python3` import omnirl from this checkout.
#
#   . benchmarks/device_env.sh
#
# - the wheels in .whl/ ($OMNIRL_WHEELS; diffusers, msgspec, pyzmq, omegaconf, torchdata:
#   what the image lacks; carry [".whl"]) go into /tmp/site ($OMNIRL_SITE) once;
# - every workspace package's src/ goes on PYTHONPATH;
# - each package gets a metadata-only *.dist-info in /tmp/site with its entry points, as an
#   editable install would write, so `importlib.metadata` finds the model families
#   (`omnirl.models`), the scorers and the console scripts exactly as under `uv run`.
SITE=${OMNIRL_SITE:-/tmp/site}
WHEELS=${OMNIRL_WHEELS:-.whl}
mkdir -p "$SITE"
export PYTHONPATH=${PYTHONPATH:-}
if [ -d "$WHEELS" ] && ! python3 -c "import diffusers, msgspec, zmq, omegaconf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
fi
PYTHONPATH=$SITE:$PYTHONPATH
for p in packages/*/ tools/; do
    if [ -f "$p/pyproject.toml" ]; then PYTHONPATH=$PWD/${p%/}/src:$PYTHONPATH; fi
done
export PYTHONPATH
python3 - "$SITE" <<'EOF'
import pathlib, sys, tomllib

site = pathlib.Path(sys.argv[1])
for pyproject in sorted(pathlib.Path(".").glob("packages/*/pyproject.toml")) + [
    pathlib.Path("tools/pyproject.toml")
]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name = project["name"].replace("-", "_")
    info = site / f"{name}-{project.get('version', '0.0.0')}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project.get('version', '0.0.0')}\n"
    )
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    text = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in groups.items()
    )
    (info / "entry_points.txt").write_text(text)
EOF
