"""The scheduling core, the same in every worker: requests, KV blocks, scheduler, policies, runner,
sampler."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
