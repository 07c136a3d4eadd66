# Sourced by the GPU scripts (needs PY): fla-core's GatedDeltaNet kernels need Triton >= 3.7.1 on Hopper.
triton_path() {  # fla-core needs Triton >= 3.7.1 on Hopper GPUs (fla issue 640). Prints a PYTHONPATH that
  # provides it: the installed Triton when new enough, else the .triton/ tarball that benchmarks/pack_triton.sh
  # builds (for a machine without network), unpacked once into a temporary folder.
  if $PY -c "import sys, triton; from packaging.version import Version
sys.exit(Version(triton.__version__.split('+')[0]) < Version('3.7.1'))" 2>/dev/null; then
    echo "${PYTHONPATH:-}"; return; fi
  local tarball=.triton/triton-3.7.1-stripped.tar.xz site=${TMPDIR:-/tmp}/triton-3.7.1-site
  [ -f $tarball ] || { echo "Triton < 3.7.1 and no $tarball: pip install 'triton>=3.7.1' (or run" \
    "benchmarks/pack_triton.sh on a machine with network); GDN skipped" >&2; return 1; }
  [ -d $site/triton ] || { mkdir -p $site && tar -C $site -xJf $tarball; } || return 1
  echo "$site${PYTHONPATH:+:$PYTHONPATH}"; }
