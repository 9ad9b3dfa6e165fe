"""Attention and the CPU linear kernels shared by both node kinds: the PyTorch reference, the
compiled CPU ops, Triton."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
