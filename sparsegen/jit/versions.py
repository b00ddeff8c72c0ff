"""The toolchain versions that enter every cache key: a different compiler means a different key."""

from __future__ import annotations

import functools

CACHE_FORMAT_VERSION = 1  # the entry layout's own version; bumping it retires every entry
NVRTC_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12")


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> dict[str, str]:
    """Versions that change what a build produces; all of them enter every key."""
    import torch
    import triton

    return {  # read-only: lru_cache hands every caller the same dict
        "cache_format": str(CACHE_FORMAT_VERSION),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "nvrtc": nvrtc_version(),
    }


def nvrtc_version() -> str:
    """The NVRTC that cuda-core compiles with. Read from the installed NVRTC wheel of the same CUDA
    major as cuda-bindings (the library cuda-core loads first) without loading it: loading the
    library took about half a second of a warm `sparsegen compile` on the H200. Without such a
    wheel, the library is loaded and asked."""
    from importlib import metadata

    try:
        major = metadata.version("cuda-bindings").split(".")[0]
        for dist in NVRTC_WHEELS:
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            if version.split(".")[0] == major:
                return version
    except metadata.PackageNotFoundError:
        pass
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}" if int(err) == 0 else "unavailable"
    except Exception:  # noqa: BLE001 - any failure to load NVRTC means "no NVRTC"
        return "unavailable"
