"""`pdserve up` for end-to-end tests (bench/up_process.py), with optional injected faults."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.bench.up_process import UpProcess
from tests.helpers.paths import REPO

FAULTS = Path(__file__).parent / "faults"  # sitecustomize.py: PDSERVE_TEST_FAULTS


class Up(UpProcess):
    """`pdserve up` with the tiny model; `faults` is PDSERVE_TEST_FAULTS (tests/helpers/faults)."""

    def __init__(self, model: str, log_path: Path, *, faults: str = "", timeout: float = 150.0, **kw) -> None:
        super().__init__(model, log_path, **kw)
        self.timeout = timeout
        if faults:
            root = str(REPO)
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(FAULTS), root, self.env.get("PYTHONPATH"))))
            self.env["PDSERVE_TEST_FAULTS"] = faults

    def start(self, timeout: float | None = None) -> Up:
        super().start(timeout or self.timeout)
        return self
