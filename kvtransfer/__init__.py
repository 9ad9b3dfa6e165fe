"""KV in motion: the prefill and decode KV connectors, payload checks and the transports."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
