"""The OpenAI-compatible HTTP edge: request checks, routing over workers, the control socket, the
chat page."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
