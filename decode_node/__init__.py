"""The decode worker: KV arrivals become running requests; decode-only continuous batching."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
