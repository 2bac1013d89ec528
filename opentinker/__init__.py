"""OpenTinker: RL for LLM agents in multi-agent dialogue games (see README.md).

Importing the package sets one default before torch loads (a value already in the environment
wins): ``GOMP_SPINCOUNT=1000``. Torch's CPU wheels run their thread pool on GNU OpenMP, whose
idle threads spin about 300,000 times before they sleep. On a small machine every process of a
job shares the cores, and a thread spinning for a partner that the OS has descheduled wastes
the core that partner needs: with one busy process beside it, a 2-thread ``[32, 576] x
[576, 1536]`` linear ran 1.5-20x slower than with 1 thread; with 1,000 spins it runs as fast as
with 1 thread under load and as fast as the default on an idle machine (``tests/test_threads.py``
checks the variable reaches the library; the figures are in README's "On a small machine").
Processes that import torch before this package keep libgomp's default.

``opentinker.run(config)`` starts a job from Python as ``opentinker run`` does from a shell
(:func:`opentinker.run.start`; the module itself is callable, so the name works however it was
imported).

It also puts the escaping handler of :mod:`opentinker.logs` on the ``opentinker`` logger, so
in every process of a job (the driver and each actor import this package) a log record is one
line whatever text it carries.
"""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from opentinker.logs import setup_logging  # stdlib only: torch is not loaded

setup_logging()  # every record of the package's loggers is one line (control characters escaped)


def __getattr__(name: str):  # PEP 562: ``opentinker.run(...)`` before anything imported the module
    if name == "run":
        import importlib

        return importlib.import_module("opentinker.run")
    raise AttributeError(f"module 'opentinker' has no attribute {name!r}")
