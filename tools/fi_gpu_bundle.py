"""``python tools/fi_gpu_bundle.py`` (build host, after ``make gpu-bundle BUNDLE_ARGS=--no-flashinfer``): a small
FlashInfer GPU-test bundle (.gpu-fi/, one carry): the runtime bundle and lib of .gpu/, the FlashInfer
libraries of the FlashInfer GPU shapes whose modules are cached (fp16 without options, MLA fp16), and the TIR
libraries of the same shapes (the tests compare the two). On the GPU host: ``source .gpu-fi/bundle/activate.sh`` and
``PYTHONPATH=$PWD/python:$PYTHONPATH PAGEDKV_RUNTIME_LIB=$PWD/.gpu-fi/lib/libpagedkv_runtime.so
PAGEDKV_KERNEL_DIR=$PWD/.gpu-fi/kernels python3 -m pytest tests/gpu/test_flashinfer_gpu.py``; the shapes whose
modules are not cached (bf16, windows, soft caps: cold fa3 builds of 10-20 minutes) skip."""
import shutil
from pathlib import Path

from pagedkv.apps.gpu_bundle import build_flashinfer_kernels
from pagedkv.cache import kernel_library_path
from pagedkv.testing.shapes import MLAShape, flashinfer_gpu_shapes

out = Path(".gpu-fi")
shutil.rmtree(out, ignore_errors=True)
shutil.copytree(".gpu/bundle", out / "bundle")
shutil.copytree(".gpu/lib", out / "lib")
(out / "kernels").mkdir(parents=True)
target = {"kind": "cuda", "arch": "sm_90a"}
shapes = [s for s in flashinfer_gpu_shapes()
          if s.dtype == "float16" and (isinstance(s, MLAShape) or not (s.window or s.cap))]
cfgs = [s.config() for s in shapes]
for cfg in cfgs:
    p = kernel_library_path(cfg, Path(".gpu/kernels"), target=target, backend="tir")
    for suffix in (".so", ".json"):
        shutil.copy2(p.with_suffix(suffix), out / "kernels" / p.with_suffix(suffix).name)
print(len(cfgs), "shapes")
build_flashinfer_kernels(out, cfgs, target)
print(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6, "MB")
