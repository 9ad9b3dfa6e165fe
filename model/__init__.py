"""The network: model configs, weight loaders (GGUF, safetensors) and the decoder over packed
steps."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
