"""Options defined once: flag tables, builders and argv for the engine, the workers and the router
(torch-free)."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
