"""The prefill worker: chunked prefill capped at one output token, KV saved for the decode side."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
