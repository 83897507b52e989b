"""Linking built FlashInfer modules into an exported TVM library (the model library).

Each ``BuiltModule`` is one relocatable object; ``attach`` adds it to an IRModule's ``external_mods``
attribute (TVM's own route for prebuilt objects: ``tvm.compile`` of a Relax module imports them into the
executable, ``export_library`` links them into the one shared library). ``export_options`` are the link
flags such a library needs: the FlashInfer objects call the CUDA runtime (``__cudaRegisterFatBinary`` ...),
and gcc's default ``--as-needed`` would drop ``-lcudart`` because TVM puts options before the objects, so
the library would abort on load with an undefined symbol.
"""

from __future__ import annotations

from typing import Iterable

from .build import BuiltModule


def export_options() -> list[str]:
    """``export_library(path, options=...)`` flags for a library holding FlashInfer objects."""
    from ..cuda_build import cudart_path

    return ["-Wl,--no-as-needed", f"-L{cudart_path().parent}", "-lcudart"]


def attach(mod, modules: Iterable[BuiltModule]):
    """``mod`` (a ``tvm.IRModule``) with the modules' objects appended to its ``external_mods``."""
    ext = list(mod.attrs["external_mods"]) if mod.attrs and "external_mods" in mod.attrs else []
    unique = {m.object_path: m for m in modules}  # one object once, however many ops use it
    ext += [m.static_library() for m in unique.values()]
    return mod.with_attr("external_mods", ext)


__all__ = ["attach", "export_options"]
