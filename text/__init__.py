"""Text in and out without torch: tokenizer, detokenizer, chat template, grammars, tool calls, model
files."""

from pdserve._bare_name import refuse_bare_import

refuse_bare_import(__name__)
