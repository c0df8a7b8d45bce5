#!/usr/bin/env bash
# flash-attn-4 on a GPU machine, from the wheels that ../shared/tools/fa4-wheels.sh splits into
# .fa4p00/ and .fa4p01/ (one device call carries at most 64 MiB, so they take two calls, back to
# back while the machine is warm; files under /tmp persist between them):
#   call 1, carrying .fa4p00:            bash benchmarks/fa4_install.sh
#   call 2, carrying .fa4p01 (and .whl): bash benchmarks/fa4_install.sh install && ...
# Each call adds the parts it carries to /tmp/fa4; `install` then unpacks them into /tmp/fa4site,
# one `pip --target` per wheel: nvidia-cutlass-dsl's four wheels all write into the folder
# nvidia_cutlass_dsl/, and `pip install --target` skips a folder that exists, silently leaving
# `cutlass.cute` missing. gpu_run.sh puts /tmp/fa4site on PYTHONPATH when it exists, with the
# folder that the cutlass wheel's .pth file would add (PYTHONPATH does not read .pth files).
set -euo pipefail
mkdir -p /tmp/fa4
cp .fa4p*/p* /tmp/fa4/
[ "${1:-}" = install ] || exit 0
rm -rf /tmp/fa4/wh /tmp/fa4site && mkdir -p /tmp/fa4/wh /tmp/fa4site
cat /tmp/fa4/p* | tar -xf - -C /tmp/fa4/wh
for w in /tmp/fa4/wh/*.whl; do
  t=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$t" "$w"
  cp -r "$t"/. /tmp/fa4site/
  rm -rf "$t"
done
ls /tmp/fa4site
