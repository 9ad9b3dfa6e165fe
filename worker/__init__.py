"""The worker runtime every node kind shares: loop, router links, probes, the colocated worker."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
