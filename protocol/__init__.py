"""The wire shared by every process: messages, codec, sampling parameters, frame authentication
(msgspec only)."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
