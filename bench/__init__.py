"""The TTFT/TBT SLO benchmark and the engine, kernel, KV-transfer and structured-output micro-
benchmarks."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
