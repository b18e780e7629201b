"""Markers shared by every test file, skipped here in one place:

- `gpu`: needs a CUDA device (the bf16 / full-size tier, run on the GPU machine);
- `triton`: runs a Triton kernel, so it needs CUDA or the interpreter (`TRITON_INTERPRET=1`,
  which must be set before Python starts; `make test` does).

the Hugging Face libraries' offline mode for the whole suite, and under the interpreter the memory checks of
kernel_memory.py on every Triton launch.
"""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# The suite never reaches the network. huggingface_hub reads these once, at its first import, so they are
# set before any test imports datasets (a test that does so online left the hub test waiting 23 s).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
TRITON_RUNS = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
if os.environ.get("PYTEST_XDIST_WORKER") and not HAS_CUDA:
    # one intra-op thread per xdist worker: with a worker per core, more threads spin against each other
    torch.set_num_threads(1)
if os.environ.get("TRITON_INTERPRET") == "1":   # loaded by path: the suite imports test modules by path too
    _spec = importlib.util.spec_from_file_location("kernel_memory", Path(__file__).with_name("kernel_memory.py"))
    kernel_memory = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(kernel_memory)
    kernel_memory.install()


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs a Triton kernel (CUDA or TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_triton = pytest.mark.skip(reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before Python starts")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(no_gpu)
        elif "triton" in item.keywords and not TRITON_RUNS:
            item.add_marker(no_triton)
